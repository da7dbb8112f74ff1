"""Frozen, typed job specs and the checks of their fields.

:mod:`parabench.jobs` builds a JobSpec from the composed config (validating everything that can be
checked before a process starts: these checks and the chosen adapter's), the runner writes it to
``spec.json`` in the run directory, and each worker reads that file back (``jobs.load_job``).
Adapters and the training loop only ever see these dataclasses, never a DictConfig.

Every validation error names the dotted key the user can override, e.g.
``data.global_batch_size: 6 is not divisible by micro_batch_size x data-parallel size = 4 x 2``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parabench.errors import SpecError

# --------------------------------------------------------------------------------------------
# Generic conversion: mapping -> frozen dataclass, with the offending key named on error.
# --------------------------------------------------------------------------------------------
if typing.TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Spec = typing.TypeVar("_Spec", bound="DataclassInstance")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except SpecError as exc:
                errors.append(exc.message)
        raise SpecError(key, errors[0] if errors else f"invalid value {value!r}")
    if origin is typing.Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise SpecError(key, f"{value!r} is not one of {choices}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise SpecError(key, f"expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise SpecError(key, f"expected {len(args)} values, got {len(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return build(tp, value, key)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise SpecError(key, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(key, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(key, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(key, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported spec field type {tp!r} at {key}")  # a bug in a spec class


def build(cls: type[_Spec], node: Mapping[str, Any] | None, prefix: str) -> _Spec:
    """Build dataclass ``cls`` from ``node``; unknown or ill-typed keys raise SpecError(prefix.key)."""
    node = dict(node or {})
    hints = typing.get_type_hints(cls)
    kwargs = {}
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.metadata.get("key", f.name) for f in fields]  # the config key (e.g. async for async_)
    for f, name in zip(fields, names, strict=True):
        if name in node:
            kwargs[f.name] = _coerce(node.pop(name), hints[f.name], f"{prefix}.{name}")
    if node:
        unknown = sorted(node)[0]
        raise SpecError(f"{prefix}.{unknown}", f"unknown key (valid keys: {', '.join(names)})")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        missing = [n for f, n in zip(fields, names, strict=True) if f.name not in kwargs]
        raise SpecError(f"{prefix}.{missing[0] if missing else ''}", f"required ({exc})") from None


def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        fields = [f for f in dataclasses.fields(obj) if f.metadata.get("in_json", True)]
        return {f.metadata.get("key", f.name): to_dict(getattr(obj, f.name)) for f in fields}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj


# --------------------------------------------------------------------------------------------
# The specs.
# --------------------------------------------------------------------------------------------
# Optional parts of the canonical model a backend must implement to run it (Capabilities.model_features).
MODEL_FEATURES = frozenset({"qkv_bias", "rope_scaling"})


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (Hugging Face ``rope_scaling`` with ``rope_type: llama3``)."""

    rope_type: typing.Literal["llama3"]
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-architecture decoder. Field names follow Hugging Face's Llama ``config.json``."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02  # std of the normal init (HF name)
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2); o_proj and the MLP stay bias-free
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None  # attention window (Mistral); the canonical model needs seq_len <= it
    # Sparse Mixture-of-Experts MLP (docs/moe.md), Hugging Face's Mixtral / Qwen2-MoE config.json names.
    # 0 experts = the dense SwiGLU MLP (and every other MoE field unused).
    num_local_experts: int = 0  # routed experts per layer (Mixtral); Qwen2-MoE calls it num_experts
    num_experts_per_tok: int = 2  # top-k: experts each token is routed to (dropless: no capacity factor)
    router_aux_loss_coef: float = 0.001  # load-balancing loss weight (MixtralConfig's default)
    moe_intermediate_size: int | None = None  # routed expert width (Qwen2-MoE); None = intermediate_size (Mixtral)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0 = none
    # the top-k softmax weights renormalised to sum to 1 (Mixtral; Qwen2MoeConfig.norm_topk_prob) or
    # left as the softmax over all experts gives them (false: Qwen1.5-MoE, Qwen2-MoE's default)
    norm_topk_prob: bool = True
    source: str | None = None  # the Hugging Face config.json this spec was read from (+model=hf)
    weights: str | None = None  # safetensors file or its .index.json: the initial weights; None = generated

    def features(self) -> frozenset[str]:
        """The optional parts of MODEL_FEATURES this model uses."""
        return frozenset(n for n, on in (("qkv_bias", self.qkv_bias), ("rope_scaling", self.rope_scaling)) if on)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def _moe_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """One sparse MoE block: Mixtral's checkpoint names for the router and the w1/w2/w3 experts,
        Qwen2-MoE's for the shared expert and its gate."""
        h, i, s = self.hidden_size, self.expert_intermediate_size, self.shared_expert_intermediate_size
        p = prefix + "block_sparse_moe."
        shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (self.num_local_experts, h)}
        for e in range(self.num_local_experts):
            shapes[f"{p}experts.{e}.w1.weight"] = (i, h)
            shapes[f"{p}experts.{e}.w2.weight"] = (h, i)
            shapes[f"{p}experts.{e}.w3.weight"] = (i, h)
        if s:
            shapes[p + "shared_expert.gate_proj.weight"] = (s, h)
            shapes[p + "shared_expert.up_proj.weight"] = (s, h)
            shapes[p + "shared_expert.down_proj.weight"] = (h, s)
            shapes[p + "shared_expert_gate.weight"] = (1, h)
        return shapes

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical (Hugging Face) parameter names and full, unsharded shapes."""
        h, i, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        kv = self.num_key_value_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (self.num_attention_heads * d, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            if self.qkv_bias:
                shapes[p + "self_attn.q_proj.bias"] = (self.num_attention_heads * d,)
                shapes[p + "self_attn.k_proj.bias"] = (kv,)
                shapes[p + "self_attn.v_proj.bias"] = (kv,)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.num_attention_heads * d)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if self.is_moe:
                shapes.update(self._moe_shapes(p))
                continue
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (v, h)
        return shapes

    def num_params(self) -> int:
        return sum(math.prod(s) for s in self.parameter_shapes().values())

    def num_matmul_params(self) -> int:
        """Parameters that take part in matrix multiplies: all but the input embedding lookup
        (a gather, no FLOPs). With tied embeddings the shared matrix is the lm_head matmul."""
        if self.tie_word_embeddings:
            return self.num_params()
        return self.num_params() - self.vocab_size * self.hidden_size

    def num_active_matmul_params(self) -> int:
        """Matmul parameters one token passes through: with MoE, the router, its top-k routed experts
        and the shared expert, not the other experts ("active parameters": Jiang et al. 2024, Mixtral
        of Experts, arXiv 2401.04088 sec. 2; docs/sources.md#moe). Dense: num_matmul_params."""
        idle = max(self.num_local_experts - self.num_experts_per_tok, 0)
        per_expert = 3 * self.hidden_size * self.expert_intermediate_size
        return self.num_matmul_params() - self.num_hidden_layers * idle * per_expert


@dataclass(frozen=True)
class DataSpec:
    """Token source and batch geometry (sequence length and batch sizes live here, not in model)."""

    source: typing.Literal["synthetic", "text", "indexed"] = "synthetic"
    path: str | None = None  # text: a local file; indexed: the .bin/.idx prefix (Megatron's --data-path)
    seq_len: int = 256
    global_batch_size: int = 4  # sequences per optimizer step, all data-parallel ranks together
    micro_batch_size: int = 2  # sequences per forward/backward on one rank
    seed: int = 1234  # synthetic and text sources (the indexed source reads its samples in file order)
    tokenizer: str | None = None  # text: a local Hugging Face tokenizer.json; None = bytes (token id = byte)
    reader: typing.Literal["auto", "megatron", "numpy"] = (
        "auto"  # indexed: auto = megatron-core's IndexedDataset where installed, else NumPy
    )


@dataclass(frozen=True)
class OptimSpec:
    """AdamW, identical algorithm and hyper-parameters on every backend."""

    name: typing.Literal["adamw"] = "adamw"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to 2-D weights only (Megatron/nanoGPT convention)
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass(frozen=True)
class DeviceSpec:
    type: typing.Literal["auto", "cpu", "cuda", "npu"] = "auto"
    peak_tflops: float | None = None  # override of the per-device peak used for MFU (logged as user-supplied)
    threads_per_rank: int = 0  # CPU: intra-op threads per rank; 0 = cores / local ranks


@dataclass(frozen=True)
class K8sSpec:
    """``launcher.k8s.*``: with ``launcher.dry_run=true``, also write a Kubeflow PyTorchJob manifest
    (``pytorchjob.yaml``, parabench.k8s; docs/kubernetes.md)."""

    pytorchjob: bool = False  # write pytorchjob.yaml (a ConfigMap with the bundle + the PyTorchJob) beside launch.sh
    image: str | None = None  # container image with parabench and the backend installed (required with pytorchjob)
    namespace: str = "default"
    name: str | None = None  # the PyTorchJob's name (a DNS-1035 label); None: parabench-<backend>-<model>
    volume_claim: str | None = None  # PersistentVolumeClaim for the run directory; None: emptyDir (lost with the pod)
    mount_path: str = "/parabench"  # where the run directories live in the container


@dataclass(frozen=True)
class LaunchSpec:
    """torchrun-style launch; names follow torchrun's flags."""

    nnodes: int = 1
    nproc_per_node: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 = pick a free port (single node)
    rdzv_backend: typing.Literal["static", "c10d"] = (
        "static"  # static: master_addr/port + node_rank; c10d: elastic rendezvous
    )
    rdzv_id: str = "parabench"  # c10d rendezvous id, the same on every node
    slurm: bool = False  # take nnodes, node_rank and master_addr from the Slurm allocation (one task per node)
    dry_run: bool = False  # write the launch bundle (script + env + resolved config) and stop
    collective_timeout_s: float = 180.0  # process-group timeout: a hung collective fails after this
    setup_timeout_s: float = 1800.0  # runner watchdog until the first step (imports, JIT op builds)
    hang_timeout_s: float = 600.0  # runner watchdog: no progress for this long -> kill, FAILED
    max_restarts: int = 0  # restart failed workers this often (torchrun --max-restarts); they resume
    # a local start of one node without restarts: fork the ranks from one process that imported torch
    # once (parabench.localrun), or start them through torchrun's agent as fresh interpreters
    start: typing.Literal["fork", "torchrun"] = "fork"
    k8s: K8sSpec = K8sSpec()  # launcher.k8s.*: a Kubeflow PyTorchJob manifest in the dry-run bundle

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


@dataclass(frozen=True)
class CheckpointSpec:
    """``run.checkpoint.*``: step-level checkpoints in the backend's native format (docs/resilience.md)."""

    every: int = 0  # save after every N-th step; 0 = off
    dir: str | None = None  # None: <run dir>/checkpoints
    keep: int = 2  # complete checkpoints kept (older ones pruned once a newer one is complete); 0 = all
    # ``async`` is a Python keyword: the config key run.checkpoint.async maps to this field
    async_: bool = dataclasses.field(default=False, metadata={"key": "async"})
    on_signal: bool = False  # SIGINT/SIGTERM to `bench run`: write a last checkpoint before stopping


@dataclass(frozen=True)
class FaultSpec:
    """``fault.*``: one injected failure per run directory, to measure recovery (parabench.resilience.faults)."""

    kind: typing.Literal["none", "kill", "hang", "exception"] = "none"
    rank: int = 0
    step: int = 0  # fires before this 0-based step runs, i.e. after `step` completed steps
    # step: before that step; save: inside the checkpoint save after `step` completed steps, once
    # the native files are written and before the harness state and the marker (a half-written save)
    at: typing.Literal["step", "save"] = "step"


@dataclass(frozen=True)
class RunSpec:
    name: str = "run"
    seed: int = 1234  # weight-initialisation seed
    warmup_steps: int = 2  # not measured
    steps: int = 10  # measured
    precision: typing.Literal["fp32", "bf16", "fp16"] = "fp32"
    checksum: bool = True  # gather the loaded weights and checksum them (identical start proof)
    repeats: int = 1  # run the job this many times (separate MLflow runs, tag `repeat`) for noise bands
    results_dir: str = "results"
    checkpoint: CheckpointSpec = CheckpointSpec()
    resume: str = "auto"  # auto: newest complete checkpoint of run.checkpoint.dir | never | a checkpoint path
    # unpickle the resumed checkpoint with code allowed, for one whose source you trust that needs
    # globals beyond parabench's allowlist (docs/security.md); false: every pickle is checked first
    trust_checkpoint: bool = False


@dataclass(frozen=True)
class TrackingSpec:
    enabled: bool = True
    uri: str | None = None  # None: sqlite:///<results_dir>/mlflow.db
    experiment: str = "parabench"
    # a server that does not answer when the run starts: spool (run, record in the run directory,
    # `bench sync` later) | refuse (exit 2 before launch)
    on_unreachable: typing.Literal["spool", "refuse"] = "spool"


@dataclass(frozen=True)
class ParallelDims:
    """How the world is split. dp is derived: world / (tp * pp * cp)."""

    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp_shard: int = 1  # ranks a data-parallel replica's model states are sharded over (ZeRO/FSDP)


@dataclass(frozen=True)
class BackendSpec:
    name: str
    options: Any  # the adapter's own frozen Options dataclass
    # the backend's Adapter class (parabench.adapters), resolved once where the job is composed
    # (parabench.jobs); everything else reads it here. Not part of spec.json: the name is.
    adapter: Any = dataclasses.field(compare=False, repr=False, metadata={"in_json": False})


@dataclass(frozen=True)
class JobSpec:
    model: ModelSpec
    data: DataSpec
    optim: OptimSpec
    device: DeviceSpec
    launch: LaunchSpec
    run: RunSpec
    tracking: TrackingSpec
    backend: BackendSpec
    parallel: ParallelDims
    experiment: str | None = None  # +experiment=NAME, when one was used
    fault: FaultSpec = FaultSpec()

    @property
    def grad_accum(self) -> int:
        return self.data.global_batch_size // (self.data.micro_batch_size * self.parallel.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.data.global_batch_size * self.data.seq_len

    # -- serialisation for workers ----------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(to_dict(self), indent=2, sort_keys=True)


# --------------------------------------------------------------------------------------------
# Validation of the fields (parabench.jobs builds the JobSpec from the config and calls these).
# --------------------------------------------------------------------------------------------
def _positive(key: str, value: int | float) -> None:
    if value <= 0:
        raise SpecError(key, f"must be > 0, got {value}")


def validate_moe(model: ModelSpec) -> None:
    """The Mixture-of-Experts fields: unused (and unchecked) while num_local_experts is 0."""
    if model.num_local_experts < 0:
        raise SpecError("model.num_local_experts", f"must be >= 0 (0 = dense MLP), got {model.num_local_experts}")
    if not model.is_moe:
        if not model.norm_topk_prob:
            raise SpecError(
                "model.norm_topk_prob",
                "false weighs a MoE router's top-k experts; the model is dense (num_local_experts=0)",
            )
        return
    if not 1 <= model.num_experts_per_tok <= model.num_local_experts:
        raise SpecError(
            "model.num_experts_per_tok",
            f"must be between 1 and num_local_experts={model.num_local_experts}, got {model.num_experts_per_tok}",
        )
    if model.router_aux_loss_coef < 0:
        raise SpecError("model.router_aux_loss_coef", f"must be >= 0, got {model.router_aux_loss_coef}")
    if model.moe_intermediate_size is not None and model.moe_intermediate_size <= 0:
        raise SpecError("model.moe_intermediate_size", f"must be > 0, got {model.moe_intermediate_size}")
    if model.shared_expert_intermediate_size < 0:
        raise SpecError(
            "model.shared_expert_intermediate_size",
            f"must be >= 0 (0 = none), got {model.shared_expert_intermediate_size}",
        )


# Precisions a user may ask for that no parabench backend runs, each with the real reason (the
# Literal of RunSpec.precision lists the ones they run). docs/sources.md#fp8-training.
UNRUN_PRECISIONS = {
    "fp8": (
        "fp8 training needs Transformer Engine's fp8 GEMMs on a device with fp8 tensor cores (CUDA compute "
        "capability 8.9+: H100/H200-class, Ada); no parabench backend runs fp8 yet (megatron's Transformer "
        "Engine fp8 recipe is not wired), and a CPU has no fp8 GEMMs: use bf16"
    ),
}


def check_precision(node: Any) -> None:
    """``run.precision`` (the raw config node ``run``) naming a precision no backend runs: refused with why."""
    value = node.get("precision") if isinstance(node, Mapping) else None
    if isinstance(value, str) and value in UNRUN_PRECISIONS:
        raise SpecError("run.precision", UNRUN_PRECISIONS[value])


def validate_common(
    model: ModelSpec, data: DataSpec, optim: OptimSpec, device: DeviceSpec, launch: LaunchSpec, run: RunSpec
) -> None:
    """Every check of the job's fields that needs neither the backend nor this machine."""
    for key, value in [
        ("model.hidden_size", model.hidden_size),
        ("model.intermediate_size", model.intermediate_size),
        ("model.num_hidden_layers", model.num_hidden_layers),
        ("model.num_attention_heads", model.num_attention_heads),
        ("model.num_key_value_heads", model.num_key_value_heads),
        ("model.vocab_size", model.vocab_size),
        ("model.rope_theta", model.rope_theta),
        ("model.rms_norm_eps", model.rms_norm_eps),
        ("model.initializer_range", model.initializer_range),
        ("data.seq_len", data.seq_len),
        ("data.global_batch_size", data.global_batch_size),
        ("data.micro_batch_size", data.micro_batch_size),
        ("optim.lr", optim.lr),
        ("optim.eps", optim.eps),
        ("launcher.nnodes", launch.nnodes),
        ("launcher.nproc_per_node", launch.nproc_per_node),
        ("launcher.collective_timeout_s", launch.collective_timeout_s),
        ("launcher.hang_timeout_s", launch.hang_timeout_s),
        ("launcher.setup_timeout_s", launch.setup_timeout_s),
        ("run.steps", run.steps),
        ("run.repeats", run.repeats),
    ]:
        _positive(key, value)
    _validate_model_shapes(model, data)
    _validate_data(data, model)
    _validate_optim(optim, run)
    _validate_launch(launch, device)
    validate_k8s(launch)


def _validate_model_shapes(model: ModelSpec, data: DataSpec) -> None:
    """Head counts that divide, rotary-friendly heads, and a sequence the positions cover."""
    if model.hidden_size % model.num_attention_heads:
        raise SpecError(
            "model.num_attention_heads",
            f"hidden_size {model.hidden_size} is not divisible by {model.num_attention_heads} heads",
        )
    if model.head_dim % 2:
        raise SpecError("model.num_attention_heads", f"head_dim {model.head_dim} must be even for rotary embeddings")
    if model.num_attention_heads % model.num_key_value_heads:
        raise SpecError(
            "model.num_key_value_heads",
            f"{model.num_attention_heads} attention heads are not divisible by {model.num_key_value_heads} key/value heads",
        )
    if data.seq_len > model.max_position_embeddings:
        raise SpecError(
            "data.seq_len", f"{data.seq_len} exceeds model.max_position_embeddings={model.max_position_embeddings}"
        )
    if model.sliding_window is not None and data.seq_len > model.sliding_window:
        raise SpecError(
            "data.seq_len",
            f"{data.seq_len} exceeds model.sliding_window={model.sliding_window}: the canonical "
            "model attends over the whole causal context, which is sliding-window attention "
            "only while seq_len <= the window",
        )
    rs = model.rope_scaling
    if rs is not None and not (
        rs.factor > 0 and 0 < rs.low_freq_factor < rs.high_freq_factor and rs.original_max_position_embeddings > 0
    ):
        raise SpecError(
            "model.rope_scaling",
            f"needs factor > 0, 0 < low_freq_factor < high_freq_factor, "
            f"original_max_position_embeddings > 0; got {to_dict(rs)}",
        )


def _validate_optim(optim: OptimSpec, run: RunSpec) -> None:
    if not (0.0 <= optim.betas[0] < 1.0 and 0.0 <= optim.betas[1] < 1.0):
        raise SpecError("optim.betas", f"each beta must be in [0, 1), got {list(optim.betas)}")
    if optim.weight_decay < 0:
        raise SpecError("optim.weight_decay", f"must be >= 0, got {optim.weight_decay}")
    if optim.grad_clip < 0:
        raise SpecError("optim.grad_clip", f"must be >= 0 (0 disables), got {optim.grad_clip}")
    if run.warmup_steps < 0:
        raise SpecError("run.warmup_steps", f"must be >= 0, got {run.warmup_steps}")


def _validate_launch(launch: LaunchSpec, device: DeviceSpec) -> None:
    if not 0 <= launch.node_rank < launch.nnodes:
        raise SpecError("launcher.node_rank", f"{launch.node_rank} is not in [0, nnodes={launch.nnodes})")
    if not 0 <= launch.master_port < 65536:
        raise SpecError("launcher.master_port", f"{launch.master_port} is not a TCP port")
    if launch.nnodes > 1 and launch.master_port == 0:
        raise SpecError("launcher.master_port", "multi-node runs need an explicit port shared by all nodes")
    if device.threads_per_rank < 0:
        raise SpecError("device.threads_per_rank", f"must be >= 0 (0 = automatic), got {device.threads_per_rank}")
    if device.peak_tflops is not None and device.peak_tflops <= 0:
        raise SpecError("device.peak_tflops", f"must be > 0 or null, got {device.peak_tflops}")


# A host name, an IPv4 or a bracketed IPv6 address (with a %zone), and torchrun's rendezvous id: the
# launch bundle and the Kubernetes command line put both into a shell line, where anything else (a
# `$(...)`, a quote, a space) would run or split when the bundle runs.
HOST = re.compile(r"[A-Za-z0-9._:%\[\]-]+")
RDZV_ID = re.compile(r"[A-Za-z0-9._-]+")


def validate_launch_words(launch: LaunchSpec) -> None:
    """launcher.master_addr and launcher.rdzv_id hold only the characters a host or an id has."""
    if not HOST.fullmatch(launch.master_addr):
        raise SpecError("launcher.master_addr", f"{launch.master_addr!r} is not a host name or an IP address")
    if not RDZV_ID.fullmatch(launch.rdzv_id):
        raise SpecError("launcher.rdzv_id", f"{launch.rdzv_id!r} may hold only letters, digits, '.', '_' and '-'")


# Kubernetes object names (kubernetes.io/docs/concepts/overview/working-with-objects/names; docs/sources.md#kubernetes-names):
# a DNS-1123 label (namespaces, claims) and a DNS-1035 label (PyTorchJob names: the operator's webhook checks that).
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def validate_k8s(launch: LaunchSpec) -> None:
    """``launcher.k8s.*``: what a cluster would refuse, refused here before anything is written."""
    k8s = launch.k8s
    if not k8s.pytorchjob:
        return
    if not launch.dry_run:
        raise SpecError(
            "launcher.k8s.pytorchjob",
            "the manifest is part of the launch bundle: add launcher.dry_run=true (then kubectl apply -f pytorchjob.yaml)",
        )
    if not k8s.image or not k8s.image.strip() or any(c.isspace() for c in k8s.image):
        raise SpecError(
            "launcher.k8s.image", "required with launcher.k8s.pytorchjob=true: an image with parabench installed"
        )
    # The operator names pods and services <name>-worker-<i>, a DNS-1035 label of at most 63 characters too.
    longest = 63 - len(f"-worker-{launch.nnodes}")
    names = [
        ("namespace", k8s.namespace, DNS1123_LABEL, 63, "a DNS-1123 label"),
        ("volume_claim", k8s.volume_claim, DNS1123_LABEL, 63, "a DNS-1123 label"),
        ("name", k8s.name, DNS1035_LABEL, longest, "a DNS-1035 label (starts with a letter)"),
    ]
    for key, value, pattern, most, what in names:
        if value is not None and (len(value) > most or not pattern.fullmatch(value)):
            raise SpecError(
                f"launcher.k8s.{key}", f"{value!r} is not {what}: lower-case letters, digits and '-', at most {most}"
            )
    if not k8s.mount_path.startswith("/"):
        raise SpecError("launcher.k8s.mount_path", f"{k8s.mount_path!r} is not an absolute path")


def _validate_data(data: DataSpec, model: ModelSpec) -> None:
    """Keys and files; the tokens themselves are checked by parabench.data.check_data before launch."""
    if data.source == "synthetic" and data.path:
        raise SpecError(
            "data.path", "the synthetic source reads no file; set data=text or data=indexed, or drop data.path"
        )
    if data.tokenizer and data.source != "text":
        raise SpecError(
            "data.tokenizer", "only the text source uses a tokenizer: data=text data.tokenizer=/path/to/tokenizer.json"
        )
    if data.reader != "auto" and data.source != "indexed":
        raise SpecError("data.reader", "only the indexed source has a reader to choose: data=indexed")
    if data.source == "indexed" and not data.path:
        raise SpecError(
            "data.path", "the indexed source needs the .bin/.idx prefix: data.path=/path/to/corpus_text_document"
        )
    if data.source != "text":
        return
    if not data.path:
        raise SpecError("data.path", "the text source needs a local file: data.path=/path/to/file.txt")
    p = Path(data.path)
    if not p.is_file():
        raise SpecError("data.path", f"no such file: {data.path}")
    if data.tokenizer is None and p.stat().st_size < data.seq_len + 2:
        raise SpecError(
            "data.path", f"{data.path} holds {p.stat().st_size} bytes; need more than seq_len+1 = {data.seq_len + 1}"
        )
    if data.tokenizer is None and model.vocab_size < 256:
        raise SpecError("model.vocab_size", "the byte-level tokenizer needs vocab_size >= 256")


def validate_resilience(run: RunSpec, launch: LaunchSpec, fault: FaultSpec) -> None:
    """``run.checkpoint.*``, ``run.resume``, ``fault.*`` and ``launcher.max_restarts`` on their own
    (what the backend supports is checked by parabench.resilience.checkpoint.check_support)."""
    ckpt = run.checkpoint
    for key, value in (
        ("run.checkpoint.every", ckpt.every),
        ("run.checkpoint.keep", ckpt.keep),
        ("launcher.max_restarts", launch.max_restarts),
        ("fault.rank", fault.rank),
        ("fault.step", fault.step),
    ):
        if value < 0:
            raise SpecError(key, f"must be >= 0, got {value}")
    if ckpt.async_ and not ckpt.every:
        raise SpecError("run.checkpoint.async", "asynchronous saving needs run.checkpoint.every > 0")
    if ckpt.dir is not None and not ckpt.dir.strip():
        raise SpecError("run.checkpoint.dir", "empty path (null = <run dir>/checkpoints)")
    if not run.resume.strip():
        raise SpecError("run.resume", "empty: auto, never or the path of a checkpoint")
    if fault.kind == "none":
        return
    if fault.rank >= launch.world_size:
        raise SpecError("fault.rank", f"{fault.rank} is not a rank of this job (world size {launch.world_size})")
    total = run.warmup_steps + run.steps
    if fault.step >= total:
        raise SpecError("fault.step", f"{fault.step} is not before the last step (the job runs {total} steps)")
    every = ckpt.every
    if fault.at == "save" and (not every or not fault.step or fault.step % every):
        raise SpecError(
            "fault.at",
            f"save: fault.step={fault.step} must be a step a checkpoint is saved at "
            f"(a positive multiple of run.checkpoint.every={every})",
        )


def validate_parallel(parallel: ParallelDims, model: ModelSpec, data: DataSpec) -> None:
    """The batch geometry against the parallel dimensions the backend derived."""
    per_step = data.micro_batch_size * parallel.dp
    if data.global_batch_size % per_step:
        raise SpecError(
            "data.global_batch_size",
            f"{data.global_batch_size} is not divisible by micro_batch_size x data-parallel size = "
            f"{data.micro_batch_size} x {parallel.dp}",
        )


def tracking_from_config(cfg: Mapping[str, Any]) -> tuple[TrackingSpec, str]:
    """The tracking spec and results directory alone (for the multirun parent run)."""
    tracking = build(TrackingSpec, cfg.get("tracking"), "tracking")
    return tracking, str((cfg.get("run") or {}).get("results_dir", "results"))


def resolve_device(job: JobSpec, device_type: typing.Literal["cpu", "cuda", "npu"]) -> JobSpec:
    """Return ``job`` with ``device.type`` made concrete (auto -> what is present)."""
    return dataclasses.replace(job, device=dataclasses.replace(job.device, type=device_type))


__all__ = [
    "BackendSpec",
    "CheckpointSpec",
    "DataSpec",
    "DeviceSpec",
    "FaultSpec",
    "JobSpec",
    "LaunchSpec",
    "ModelSpec",
    "OptimSpec",
    "MODEL_FEATURES",
    "ParallelDims",
    "RopeScaling",
    "RunSpec",
    "TrackingSpec",
    "build",
    "validate_common",
    "validate_moe",
    "validate_parallel",
    "validate_resilience",
    "resolve_device",
    "to_dict",
    "tracking_from_config",
]
