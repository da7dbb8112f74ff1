"""DeepSpeed: ZeRO stages 0-3, optimizer/parameter offload, on the canonical Llama.

The DeepSpeed config is a pure function of the typed spec (:func:`deepspeed_config`), optionally
merged with a user's ``ds_config.json`` (``backend.config_file``). Keys the harness owns - batch
geometry, precision, clipping, the optimizer, the ZeRO stage and offload devices - may repeat the
harness's value in that file ("auto" also means "the harness's value"), but a different value is an
error before launch, never a silent override. Tuning knobs left null here (bucket sizes, ZeRO-3
prefetch/persistence) come from the file, else DeepSpeed's own defaults.

Optimizer: the client ``torch.optim.AdamW`` from ``make_adamw`` (same algorithm, hyper-parameters
and decay mask as ddp/fsdp), passed to ``deepspeed.initialize`` with
``zero_allow_untested_optimizer`` - DeepSpeed's own ``optimizer`` block would select FusedAdam or
cpu_adam, a different implementation (docs/sources.md#deepspeed-on-cpu). With ``offload_optimizer=cpu``
DeepSpeed insists on its ``DeepSpeedCPUAdam`` (``adamw_mode=True``, same groups and values);
``backend.offload_adam=torch`` keeps torch's AdamW there too (``zero_force_ds_cpu_optimizer:
false``), slower but exact.

Model states per rank (docs/sources.md#zero-model-states: Rajbhandari et al. 2019, ZeRO, arXiv 1910.02054,
sec. 3 and 5), with b bytes
per working parameter/gradient (2 for bf16/fp16, 4 for fp32) and K = 12 (fp32 master 4 + Adam
moments 8; DeepSpeed keeps a separate fp32 master in every ZeRO stage, fp32 training included):
stage 0: (b + b + K) Psi (fp32: no master, K = 8); stage 1: 2b Psi + K Psi/Nd; stage 2:
b Psi + (b + K) Psi/Nd; stage 3: (2b + K) Psi/Nd. Measured values come from the tensors DeepSpeed
holds (each storage counted once); flat-buffer alignment padding and ZeRO-3's persistent (small,
unpartitioned) parameters are reported in ``detail``.

Mixture-of-Experts (docs/moe.md#deepspeed): DeepSpeed-MoE's own layer with ``ep_size = backend.ep``
(:mod:`parabench.adapters.deepspeed_moe`), ZeRO 0-2; a rank then holds the non-expert parameters and
E / ep experts per layer, and ZeRO partitions the experts over the Nd / ep expert-data-parallel ranks.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from parabench.adapters.base import (
    Adapter,
    Availability,
    CanonicalIO,
    Capabilities,
    Checkpointing,
    CheckpointSupport,
    ConvertSupport,
    Engine,
    ModelStateBytes,
    StateFormula,
    WorkerContext,
    torch_compile_as_identity,
)
from parabench.adapters.deepspeed_moe import (
    all_to_all_bytes,
    check_moe,
    gather_full_state,
    group_name,
    held_numel,
    swap_blocks,
)
from parabench.adapters.deepspeed_profile import PROFILE
from parabench.canonical import MOMENTS, CanonicalState, Lazy
from parabench.devices import ProbeFailed, resolve, run_probe
from parabench.errors import SpecError
from parabench.metrics import held_bytes, optimizer_state_tensors
from parabench.spec import MODEL_FEATURES, JobSpec

DS_VERSION = "0.19.8"  # the version the parity and state-bytes tests were written against
SOURCE = "Rajbhandari et al. 2019 (ZeRO, arXiv 1910.02054) sec. 5; offload: Ren et al. 2021 (arXiv 2101.06840)"


@dataclass(frozen=True)
class DeepSpeedOptions:
    zero_stage: Literal[0, 1, 2, 3] = 2
    offload_optimizer: Literal["none", "cpu"] = (
        "none"  # ZeRO-Offload: fp32 master + Adam states (and their step) on the host
    )
    offload_param: Literal["none", "cpu"] = "none"  # ZeRO-3 only: partitioned parameters on the host
    offload_pin_memory: bool = False
    offload_adam: Literal["cpu_adam", "torch"] = "cpu_adam"  # optimizer under offload_optimizer (see module doc)
    activation_checkpointing: bool = False
    # Mixture-of-Experts (docs/moe.md#deepspeed): DeepSpeed-MoE's ep_size, each expert-parallel rank
    # holding num_local_experts / ep experts of every layer; ep divides the world (megatron's name)
    ep: int = 1
    # Tuning knobs; null = from config_file if it sets them, else DeepSpeed's default (in brackets).
    reduce_bucket_size: int | None = None  # elements per gradient reduce bucket [5e8]
    allgather_bucket_size: int | None = None  # stage 1/2 parameter all-gather bucket [5e8]
    overlap_comm: bool | None = None  # [true for stage 3, false otherwise]
    contiguous_gradients: bool | None = None  # [true]
    stage3_prefetch_bucket_size: int | None = None  # [5e7]
    stage3_param_persistence_threshold: int | None = None  # params below this many elements stay whole [1e5]
    stage3_max_live_parameters: int | None = None  # [1e9]
    stage3_max_reuse_distance: int | None = None  # [1e9]
    config_file: str | None = None  # a user's ds_config.json, merged (conflicts are errors)
    extensions_dir: str | None = (
        None  # TORCH_EXTENSIONS_DIR for the JIT ops; null = ~/.cache/parabench/torch_extensions/<environment>
    )


KNOBS = {  # option -> path in the DeepSpeed config
    "reduce_bucket_size": ("zero_optimization", "reduce_bucket_size"),
    "allgather_bucket_size": ("zero_optimization", "allgather_bucket_size"),
    "overlap_comm": ("zero_optimization", "overlap_comm"),
    "contiguous_gradients": ("zero_optimization", "contiguous_gradients"),
    "stage3_prefetch_bucket_size": ("zero_optimization", "stage3_prefetch_bucket_size"),
    "stage3_param_persistence_threshold": ("zero_optimization", "stage3_param_persistence_threshold"),
    "stage3_max_live_parameters": ("zero_optimization", "stage3_max_live_parameters"),
    "stage3_max_reuse_distance": ("zero_optimization", "stage3_max_reuse_distance"),
}


# --------------------------------------------------------------------------------------------
# The DeepSpeed config: typed spec (+ user file) -> dict. Pure; no deepspeed import.
# --------------------------------------------------------------------------------------------
def harness_config(job: JobSpec) -> tuple[dict[str, Any], dict[tuple[str, ...], tuple[Any, str]]]:
    """The config the spec implies, and the keys the harness owns: path -> (value, spec key)."""
    o, prec = job.backend.options, job.run.precision
    owned: dict[tuple[str, ...], tuple[Any, str]] = {
        ("train_batch_size",): (job.data.global_batch_size, "data.global_batch_size"),
        ("train_micro_batch_size_per_gpu",): (job.data.micro_batch_size, "data.micro_batch_size"),
        ("gradient_accumulation_steps",): (job.grad_accum, "data.global_batch_size / (micro_batch_size x ranks)"),
        ("gradient_clipping",): (job.optim.grad_clip, "optim.grad_clip"),
        ("bf16", "enabled"): (prec == "bf16", "run.precision"),
        ("fp16", "enabled"): (prec == "fp16", "run.precision"),
        ("zero_optimization", "stage"): (o.zero_stage, "backend.zero_stage"),
        ("zero_allow_untested_optimizer",): (True, "the client torch AdamW"),
    }
    if o.offload_optimizer != "none":
        owned[("zero_optimization", "offload_optimizer", "device")] = (o.offload_optimizer, "backend.offload_optimizer")
        owned[("zero_optimization", "offload_optimizer", "pin_memory")] = (
            o.offload_pin_memory,
            "backend.offload_pin_memory",
        )
        if o.offload_adam == "torch":
            owned[("zero_force_ds_cpu_optimizer",)] = (False, "backend.offload_adam=torch")
    if o.offload_param != "none":
        owned[("zero_optimization", "offload_param", "device")] = (o.offload_param, "backend.offload_param")
        owned[("zero_optimization", "offload_param", "pin_memory")] = (
            o.offload_pin_memory,
            "backend.offload_pin_memory",
        )
    for name, path in KNOBS.items():
        value = getattr(o, name)
        if value is not None:
            owned[path] = (value, f"backend.{name}")
    cfg: dict[str, Any] = {"steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}  # quiet; the harness times
    for path, (value, _) in owned.items():
        _set(cfg, path, value)
    return cfg, owned


def deepspeed_config(job: JobSpec) -> dict[str, Any]:
    """The effective DeepSpeed config: the harness's, merged with ``backend.config_file``."""
    cfg, owned = harness_config(job)
    path = job.backend.options.config_file
    if not path:
        return cfg
    user = _read_user_config(path)
    if "bfloat16" in user:  # DeepSpeed's old spelling of "bf16"
        if "bf16" in user:
            raise SpecError("backend.config_file", f"{path} sets both 'bf16' and its old name 'bfloat16'")
        user["bf16"] = user.pop("bfloat16")
    if _get(user, ("bf16", "enabled")) is True and _get(user, ("fp16", "enabled")) is True:
        raise SpecError("backend.config_file", f"{path} turns on both fp16 and bf16; choose one with run.precision")
    for block in ("optimizer", "scheduler"):
        if block in user:
            raise SpecError(
                "backend.config_file",
                f"{path} has an '{block}' block: every backend uses the harness's AdamW "
                "with a constant rate (optim.*); remove the block",
            )
    for path_, (value, key) in owned.items():
        theirs = _get(user, path_)
        if theirs is None or theirs == "auto":
            continue
        if theirs != value and not (
            isinstance(value, float) and isinstance(theirs, (int, float)) and float(theirs) == value
        ):
            dotted = ".".join(path_)
            raise SpecError(
                "backend.config_file",
                f"{path} sets {dotted}={json.dumps(theirs)} but {key} gives "
                f"{json.dumps(value)}; change it on the command line, not in the file",
            )
    merged = _merge(user, cfg)
    return merged


def _read_user_config(path: str) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise SpecError("backend.config_file", f"no such file: {path}")
    try:
        data = json.loads(p.read_text())
    except ValueError as exc:
        raise SpecError("backend.config_file", f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError("backend.config_file", f"{path} must hold a JSON object")
    return data


def _get(d: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _set(d: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


def _merge(base: dict, top: dict) -> dict:
    """Deep merge, ``top`` wins (after the conflict check, it only replaces equal values or "auto")."""
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _bytes_per(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _master_and_moment_bytes(job: JobSpec) -> int:
    """K of the module doc: fp32 master 4 + Adam moments 8 per parameter; stage 0 in fp32 keeps no master."""
    return 8 if job.backend.options.zero_stage == 0 and job.run.precision == "fp32" else 12


def extensions_dir(job: JobSpec) -> str:
    """TORCH_EXTENSIONS_DIR of the JIT-built ops: backend.extensions_dir, else one folder per Python
    environment under ~/.cache/parabench/torch_extensions. The build command names the environment's
    include paths, so two environments sharing one folder rebuilt each other's ops on every run (ninja
    sees a changed command), and one could load an op built against another torch."""
    if job.backend.options.extensions_dir:
        return str(Path(job.backend.options.extensions_dir).expanduser())
    return str(Path.home() / ".cache" / "parabench" / "torch_extensions" / environment_key())


def environment_key() -> str:
    """This Python environment (its prefix, Python, torch and DeepSpeed versions) as a short folder name."""
    import hashlib
    import platform
    import sys

    versions = [importlib.metadata.version(d) if importlib.util.find_spec(m) else "-" for d, m in _BUILT_AGAINST]
    text = "|".join([sys.prefix, platform.python_version(), *versions])
    return f"py{sys.version_info.major}{sys.version_info.minor}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


_BUILT_AGAINST = (("torch", "torch"), ("deepspeed", "deepspeed"))  # (distribution, module) the ops compile against


# --------------------------------------------------------------------------------------------
# `bench env`: a subprocess probe (importing deepspeed takes ~10 s), cached per version.
# --------------------------------------------------------------------------------------------
_PROBE = r"""
import json, sys
sys.modules["mlflow"] = None  # as import_deepspeed: the autotuner's optional mlflow import costs seconds
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder.all_ops import ALL_OPS
from deepspeed.git_version_info import installed_ops
ops = {}
for name, builder in ALL_OPS.items():
    try:
        ops[name] = bool(builder.is_compatible(verbose=False))
    except Exception:
        ops[name] = False
print(json.dumps({"version": deepspeed.__version__, "accelerator": get_accelerator()._name,
                  "comm": get_accelerator().communication_backend_name(),
                  "buildable": sorted(n for n, ok in ops.items() if ok),
                  "not_buildable": sorted(n for n, ok in ops.items() if not ok),
                  "installed": sorted(n for n, ok in installed_ops.items() if ok)}))
"""


def _probe(accelerator: str) -> dict[str, Any]:
    version = importlib.metadata.version("deepspeed")
    torch_version = importlib.metadata.version("torch")
    cache = Path.home() / ".cache" / "parabench" / f"deepspeed-probe-{version}-torch{torch_version}-{accelerator}.json"
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    try:
        out = run_probe(_PROBE, 180, env={"DS_ACCELERATOR": accelerator})
    except ProbeFailed as exc:
        return {"error": f"import deepspeed failed: {str(exc)[:300]}"}
    result = json.loads(out.strip().splitlines()[-1])
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(result))
    return result


# --------------------------------------------------------------------------------------------
# The adapter (declarative, cheap to import).
# --------------------------------------------------------------------------------------------
class DeepSpeedAdapter(Adapter):
    name = "deepspeed"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda", "npu"}),
        precisions=frozenset({"fp32", "bf16", "fp16"}),
        shards_model_states=True,
        model_features=MODEL_FEATURES,
        moe=True,  # DeepSpeed-MoE's own layer with ep_size (backend.ep), ZeRO 0-2 (docs/moe.md#deepspeed)
        checkpoint=CheckpointSupport(
            format="deepspeed",
            async_save=(
                "DeepSpeed writes asynchronously only through its FastPersist writers (checkpoint.writer, "
                "the async_io op: libaio or GPUDirect Storage), which do not build on a CPU host; parabench "
                "does not wire them"
            ),
            # ZeRO files hold per-data-parallel-rank partitions: another world size needs DeepSpeed's
            # offline ds_to_universal.py conversion first (docs/resilience.md#deepspeed).
            reshard=frozenset(),
            options=frozenset({"zero_stage"}),  # stage 3 partitions parameters, 1/2 only optimizer states
        ),
        convert=ConvertSupport(),
    )
    Options = DeepSpeedOptions
    plan_profile = PROFILE
    distributions = ("torch", "deepspeed")

    @classmethod
    def availability(cls) -> Availability:
        if importlib.util.find_spec("deepspeed") is None:
            return Availability(
                False,
                f"deepspeed is not installed: pip install --no-build-isolation deepspeed=={DS_VERSION} "
                "(with your torch pinned in the same command)",
            )
        accelerator = resolve("auto")
        probe = _probe(accelerator)
        versions = {"deepspeed": importlib.metadata.version("deepspeed")}
        if "error" in probe:
            return Availability(False, probe["error"], versions)
        versions.update(
            {
                "accelerator": f"{probe['accelerator']} ({probe['comm']}; DS_ACCELERATOR={accelerator} set for workers)",
                "ops_buildable": ", ".join(probe["buildable"]) or "none",
                "ops_not_buildable": ", ".join(probe["not_buildable"]) or "none",
                "ops_prebuilt": ", ".join(probe["installed"]) or "none (JIT-built on first use)",
            }
        )
        return Availability(True, f"deepspeed {probe['version']}, accelerator {probe['accelerator']}", versions)

    @classmethod
    def validate(cls, job: JobSpec) -> None:
        o = job.backend.options
        if o.offload_optimizer != "none" and o.zero_stage == 0:
            raise SpecError(
                "backend.offload_optimizer",
                "offloading optimizer states needs ZeRO stage 1, 2 or 3 (backend.zero_stage=0)",
            )
        if o.offload_param != "none" and o.zero_stage != 3:
            raise SpecError(
                "backend.offload_param", f"offloading parameters needs ZeRO stage 3 (backend.zero_stage={o.zero_stage})"
            )
        for name in KNOBS:
            value = getattr(o, name)
            if (
                isinstance(value, int)
                and not isinstance(value, bool)
                and value < (1 if name == "reduce_bucket_size" else 0)
            ):
                raise SpecError(
                    f"backend.{name}", f"must be {'> 0' if name == 'reduce_bucket_size' else '>= 0'}, got {value}"
                )
        if job.run.precision == "fp16" and job.device.type == "cpu" and not _cpu_fp16_supported():
            raise SpecError(
                "run.precision",
                "DeepSpeed runs fp16 on a CPU only with AVX512-FP16/AMX-FP16 (this one has neither); use bf16 or fp32",
            )
        deepspeed_config(job)  # config-file conflicts, before launch
        check_moe(job, job.parallel.world_size)

    @classmethod
    def launch_env(cls, job: JobSpec) -> dict[str, str]:
        device = job.device.type if job.device.type != "auto" else "cpu"
        # The JIT-built ops (cpu_adam, shm comm) land in a stable cache: only the first run builds them,
        # inside create_engine, which the measured loop does not time.
        return {"DS_ACCELERATOR": device, "TORCH_EXTENSIONS_DIR": extensions_dir(job)}

    @classmethod
    def layout_words(cls, options: DeepSpeedOptions) -> list[str]:
        return [f"zero{options.zero_stage}"] + ([f"ep{options.ep}"] if options.ep > 1 else [])

    @classmethod
    def expected_model_state(cls, job: JobSpec) -> StateFormula:
        return zero_formula(job)

    @classmethod
    def create_engine(cls, ctx: WorkerContext) -> DeepSpeedEngine:
        return DeepSpeedEngine(ctx)


def _cpu_fp16_supported() -> bool:
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def _sharded_psi(job: JobSpec) -> tuple[int, float]:
    """(parameters a rank holds whole, parameters per rank of a ZeRO partition). Dense: (Psi, Psi / Nd).
    MoE with ep: the rank holds the non-expert Psi_d and its E / ep experts Psi_e / ep; ZeRO splits
    Psi_d over the Nd data-parallel ranks and the experts over the Nd / ep expert-data-parallel ranks
    (the MoE param groups' ``real_dp_process_group``, DeepSpeedZeroOptimizer._configure_moe_settings)."""
    ep, nd = job.backend.options.ep, job.parallel.dp
    dense, experts = held_numel(job.model, ep)
    return dense + experts, dense / nd + experts / (nd // ep)


def zero_formula(job: JobSpec) -> StateFormula:
    """Per-rank model-state bytes for the job's stage (ZeRO paper, b and K as in the module doc)."""
    nd, stage, ep = job.parallel.dp, job.backend.options.zero_stage, job.backend.options.ep
    whole, part = _sharded_psi(job)
    b, k = _bytes_per(job.run.precision), _master_and_moment_bytes(job)
    per = {0: (2 * b + k, 0), 1: (2 * b, k), 2: (b, b + k), 3: (0, 2 * b + k)}[stage]
    replicated, sharded = per
    where = " (optimizer states in host memory)" if job.backend.options.offload_optimizer != "none" else ""
    text = {
        0: f"({b} + {b} + {k}) * Psi",
        1: f"({b} + {b}) * Psi + {k} * Psi / {nd}",
        2: f"{b} * Psi + ({b} + {k}) * Psi / {nd}",
        3: f"({b} + {b} + {k}) * Psi / {nd}",
    }[stage]
    if job.model.is_moe:
        text += f"; MoE: Psi = Psi_dense + Psi_experts / {ep} (ep), experts partitioned over {nd} / {ep} ranks"
    return StateFormula(
        replicated * whole + sharded * part,
        f"ZeRO stage {stage}, {job.run.precision}: {text}; b={b} params/grads, K={k} fp32 master+Adam{where}",
        SOURCE,
    )


def optimizer_formula(job: JobSpec) -> float:
    """The optimizer-state part alone: K * Psi (stage 0) or K * Psi / Nd (stages 1-3)."""
    whole, part = _sharded_psi(job)
    k = _master_and_moment_bytes(job)
    return k * whole if job.backend.options.zero_stage == 0 else k * part


# --------------------------------------------------------------------------------------------
# Worker side.
# --------------------------------------------------------------------------------------------
MUON = "deepspeed.runtime.zero.muon.muon_optimizer"  # in 0.19.8 (tested); older releases may lack it


def import_deepspeed():
    """``import deepspeed`` without the ``import mlflow`` it makes: DeepSpeed's package import reaches
    its autotuner (deepspeed/__init__ -> runtime.config -> autotuning/autotuner.py), which tries
    ``import mlflow`` to log `deepspeed --autotuning` trials - 3.7 CPU-seconds of every rank here when
    MLflow is installed, as it is beside parabench. The workers never autotune: mlflow is made
    unimportable for the duration of this import (its ``try`` then sets ``has_mlflow = False``) and
    importable again after. ``torch.compile`` is the identity during the import too
    (adapters.base.torch_compile_as_identity) and for the Muon optimizer's module, which ZeRO's
    optimizers import on their first step (``isinstance(optimizer, MuonWithAuxAdam)``) and which
    compiles three helpers at import: that imported Inductor, 2.2 CPU-s a rank. parabench's optimizer
    is its own AdamW: the helpers are never called.
    A process that already holds mlflow or deepspeed imports as usual."""
    import sys

    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    import torch

    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        with torch_compile_as_identity(torch):
            import deepspeed

            if importlib.util.find_spec(MUON) is not None:  # ZeRO's steps import it; it compiles at import
                importlib.import_module(MUON)
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


class DeepSpeedEngine(Engine, Checkpointing, CanonicalIO):
    def __init__(self, ctx: WorkerContext):
        import torch

        deepspeed = import_deepspeed()

        from parabench.adapters.torch_common import adamw_param_groups, count_routed_tokens, make_adamw
        from parabench.model import build_llama, initial_weights, set_activation_checkpointing

        self.ctx = ctx
        job, o = ctx.job, ctx.job.backend.options
        _clear_stale_build_locks(
            Path(os.environ.get("TORCH_EXTENSIONS_DIR", extensions_dir(job))), job.launch.hang_timeout_s
        )
        self.config = deepspeed_config(job)
        _world_clone_with_timeout(job)
        model = build_llama(job.model, seed=job.run.seed).to(ctx.device.torch_device)
        self.ep_rank = _expert_parallel(model, job) if job.model.is_moe else 0
        set_activation_checkpointing(model, o.activation_checkpointing)
        named = list(model.named_parameters())
        if o.offload_optimizer != "none" and o.offload_adam == "cpu_adam":
            from deepspeed.ops.adam import DeepSpeedCPUAdam  # JIT-builds cpu_adam once (cached)

            spec = job.optim
            optimizer = DeepSpeedCPUAdam(
                adamw_param_groups(named, spec), lr=spec.lr, betas=spec.betas, eps=spec.eps, adamw_mode=True
            )
        elif job.model.is_moe:
            optimizer = _moe_adamw(named, job.optim)
        else:
            optimizer = make_adamw(named, job.optim)
        self.client_optimizer = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.config)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.routed = count_routed_tokens(model, job.model, ctx.device.torch_device)
        self.moe_blocks = [layer.block_sparse_moe for layer in model.model.layers] if job.model.is_moe else []
        self.all_to_all_formula: list[int] = []  # MoE, ep > 1: bytes per step by formula (deepspeed_moe)
        self.gas = job.grad_accum
        if job.run.precision != "fp32":
            # DeepSpeed casts the model to bf16/fp16 and derives its fp32 masters from those copies;
            # put the canonical fp32 values back so every backend starts from the same weights.
            self._set_fp32_masters(initial_weights(job.model, job.run.seed))
        self._grad_snapshot: dict[str, int] | None = None
        self._steps = 0
        self._torch = torch

    # -- training ---------------------------------------------------------------------------
    def train_step(self, micro_batches):
        from parabench.model import training_loss

        n = len(micro_batches)
        if n != self.gas:
            raise RuntimeError(f"{n} micro-batches but gradient_accumulation_steps={self.gas}")
        total = self._torch.zeros((), device=self.ctx.device.torch_device)
        first, self._steps = self._steps == 0, self._steps + 1
        for inputs, targets in micro_batches:
            loss = training_loss(self.engine, self.ctx.job.model, inputs, targets)  # MoE: + coef x aux loss
            self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself
            if first:
                # Gradients held after each micro-batch's backward (DeepSpeed frees them after the
                # step); the most over the micro-batches, taken in the first step only (the layout
                # repeats every step).
                held = self._grad_bytes()
                if self._grad_snapshot is None or held["grads"] > self._grad_snapshot["grads"]:
                    self._grad_snapshot = held
            self.engine.step()  # an optimizer step only at the accumulation boundary
            total += loss.detach() / n
        return total

    # -- weights ----------------------------------------------------------------------------
    def _master_for(self, param):
        """The fp32 master tensor a stage-0 bf16/fp16 optimizer keeps for ``param`` (or None)."""
        opt = self.engine.optimizer
        lp, hp = getattr(opt, "fp16_groups", None), getattr(opt, "fp32_groups", None)
        if lp is None or hp is None:
            return None
        for lg, hg in zip(lp, hp):
            for a, b in zip(lg, hg):
                if a is param:
                    return b
        return None

    def _set_fp32_masters(self, weights) -> None:
        import torch
        from deepspeed.utils import safe_set_full_fp32_param

        for name, p in zip(self.names, self.params):
            value = torch.from_numpy(weights[name]).to(self.ctx.device.torch_device)
            if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
                safe_set_full_fp32_param(p, value)
            else:
                master = self._master_for(p)
                if master is None:
                    raise RuntimeError(f"no fp32 master found for {name} ({type(self.engine.optimizer).__name__})")
                master.data.copy_(value.view_as(master))

    def full_state_dict(self):
        """Full fp32 weights: the fp32 masters where DeepSpeed keeps them (gathered from the ZeRO
        partitions, a collective), else the parameters themselves (stage 0, fp32). MoE: the experts
        of every expert-parallel rank, under their canonical names (deepspeed_moe.gather_full_state)."""
        if self.ctx.job.model.is_moe:
            job = self.ctx.job
            return gather_full_state(
                self.names, lambda i: self._full_weight(self.params[i]), job.model, job.backend.options.ep, self.ep_rank
            )
        return {name: self._full_weight(p) for name, p in zip(self.names, self.params)}

    def _full_weight(self, p):
        """One parameter's full fp32 weight (collective under ZeRO: every rank calls it)."""
        from deepspeed.utils import safe_get_full_fp32_param

        if hasattr(p, "ds_id"):
            full = safe_get_full_fp32_param(p)  # an all-gather of the stage-3 partitions
        elif hasattr(p, "_hp_mapping"):
            full = _gather_hp_fragments(p)  # collective: every rank calls it, fragment or not
        else:
            full = self._master_for(p)
            full = p if full is None else full
        return full.detach().float().cpu().reshape(_full_shape(p)).clone()

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, directory: Path, *, async_save: bool = False) -> None:
        """DeepSpeed's own layout: ``<directory>/global_step<N>/`` with the module states
        (``mp_rank_00_model_states.pt``), one ZeRO optimizer partition per rank
        (``*_optim_states.pt``: fp32 masters, Adam moments and step) and ``latest`` naming the tag."""
        if async_save:
            raise RuntimeError(f"deepspeed: {DeepSpeedAdapter.capabilities.checkpoint.async_save}")
        self.engine.save_checkpoint(str(directory))

    def load_checkpoint(self, directory: Path) -> None:
        """Everything save_checkpoint wrote; the working weights come from the fp32 masters
        (``load_from_fp32_weights``, DeepSpeed's default), so a bf16 resume is exact too."""
        path, _ = self.engine.load_checkpoint(
            str(directory), load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise RuntimeError(f"deepspeed found no checkpoint in {directory} (no 'latest' tag file)")

    # -- bench convert ------------------------------------------------------------------------
    # DeepSpeed's own accessors of the full fp32 optimizer state per parameter (deepspeed.utils
    # safe_get/set_full_optimizer_state; docs/sources.md#canonical-conversion): stage 3 all-gathers
    # its partitions (exact); stage 1/2 fragments are gathered bit-exactly (_gather_hp_fragments).
    def _basic_optimizer(self):
        opt = self.engine.optimizer
        return getattr(opt, "optimizer", opt)  # ZeRO wraps the client AdamW

    def _full_moment(self, p, key: str):
        from deepspeed.utils import safe_get_full_optimizer_state

        if hasattr(p, "ds_id"):
            full = safe_get_full_optimizer_state(p, key)
        elif hasattr(p, "_hp_mapping"):
            full = _gather_hp_fragments(p, key)
        else:  # no ZeRO: the client AdamW's own state, on the fp32 master where there is one
            master = self._master_for(p)
            full = self._basic_optimizer().state[p if master is None else master][key]
        return full.detach().float().cpu().reshape(_full_shape(p)).clone()

    def export_canonical(self):
        """One parameter's weight or moment at a time, gathered when canonical.write (or checksum)
        reaches it, in the same order on every rank: a conversion holds one full tensor, not the model."""
        _no_moe_conversion(self.ctx.job)
        self._link_optimizer_fragments()
        params = dict(zip(self.names, self.params))
        shapes = {n: tuple(_full_shape(p)) for n, p in params.items()}
        weights = Lazy(shapes, lambda n: self._full_weight(params[n]))
        moments = {k: Lazy(shapes, lambda n, k=k: self._full_moment(params[n], k)) for k in MOMENTS}
        steps = {float(s["step"]) for s in self._basic_optimizer().state.values() if "step" in s}
        if len(steps) > 1:
            raise RuntimeError(f"AdamW step counts differ between parameter groups: {sorted(steps)}")
        return CanonicalState(weights, moments, int(steps.pop()) if steps else 0)

    def _ensure_optimizer_state(self) -> None:
        """torch's AdamW creates its state at the first step (ZeRO's initialize_optimizer_states no
        longer steps): create it as AdamW would (zero moments, step 0.0 as a CPU float32 tensor;
        torch/optim/adamw.py ``_init_group``) on each flat fp32 partition, and link ZeRO-1/2's
        per-parameter fragments to it as a checkpoint load does (``_link_all_hp_params``)."""
        opt, basic = self.engine.optimizer, self._basic_optimizer()
        flats = getattr(opt, "fp32_partitioned_groups_flat", None)  # stage 3
        if flats is None:
            flats = getattr(opt, "single_partition_of_fp32_groups", None) or []  # stage 1/2
        torch = self._torch
        for flat in flats:
            if "exp_avg" not in basic.state.get(flat, {}):
                basic.state[flat] = {
                    "step": torch.tensor(0.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(flat, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(flat, memory_format=torch.preserve_format),
                }
        self._link_optimizer_fragments()

    def _link_optimizer_fragments(self) -> None:
        """ZeRO-1/2 link each parameter's view of the AdamW state only at the next step
        (``_lazy_init_hp_params_optimizer_state``); after a load or a fresh state, link them now."""
        opt = self.engine.optimizer
        if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    def import_canonical(self, state):
        from deepspeed.utils import safe_set_full_optimizer_state

        _no_moe_conversion(self.ctx.job)
        if state.moments is None:
            return  # weights only: AdamW starts fresh, as in a new run
        self._ensure_optimizer_state()
        dev = self.ctx.device.torch_device
        for name, p in zip(self.names, self.params):
            for key, values in state.moments.items():
                value = values[name].to(dev)
                if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
                    safe_set_full_optimizer_state(p, value, key)
                else:
                    master = self._master_for(p)
                    target = self._basic_optimizer().state[p if master is None else master][key]
                    target.copy_(value.view_as(target))
        for entry in self._basic_optimizer().state.values():
            if "step" in entry:
                old = entry["step"]
                entry["step"] = (
                    self._torch.tensor(float(state.step), dtype=old.dtype) if hasattr(old, "dtype") else state.step
                )
        self.engine.global_steps = state.step  # the checkpoint tag (global_step<N>) and DeepSpeed's counters
        self.engine.global_samples = state.step * self.engine.train_batch_size()

    # -- MoE ---------------------------------------------------------------------------------
    def tokens_per_expert(self):
        """Collective, after each step: the canonical count of the router logits each layer returned
        (as ddp counts), summed over the world (every rank routes its own rows before the all-to-all);
        and, with ep > 1, the step's all-to-all bytes by formula from each layer forward's capacity."""
        if self.routed is None:
            return None
        loads = [load for block in self.moe_blocks for load in block.loads]
        for block in self.moe_blocks:
            block.loads.clear()
        job = self.ctx.job
        ep = job.backend.options.ep
        if ep > 1 and loads:
            from deepspeed.utils import groups

            # DeepSpeed's dropless capacity: the most tokens one expert gets from one rank of the group
            most = self._torch.stack(loads)
            self._torch.distributed.all_reduce(
                most, op=self._torch.distributed.ReduceOp.MAX, group=groups._get_expert_parallel_group(group_name(ep))
            )
            self.all_to_all_formula.append(all_to_all_bytes(job.model, most.tolist(), _bytes_per(job.run.precision)))
        return self.routed.take(group=None)

    # -- accounting -------------------------------------------------------------------------
    def _grad_bytes(self) -> dict[str, int]:
        opt = self.engine.optimizer
        tensors = [p.grad for p in self.params]
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            tensors += [p.grad for g in inner.param_groups for p in g["params"]]
        buckets, sources = [], {"grads.param.grad": held_bytes(tensors)}
        for attr, value in vars(opt).items():
            if "grad" not in attr.lower() and "ipg" not in attr.lower():
                continue
            found = [t for t in _tensors(value) if t.dim() > 0]
            if found:
                is_bucket = "ipg" in attr.lower()  # reduce buckets: communication buffers, not gradients
                (buckets if is_bucket else tensors).extend(found)
                sources[f"{'buckets' if is_bucket else 'grads'}.{attr.split('__')[-1]}"] = held_bytes(found)
        return {"grads": held_bytes(tensors), "comm_buckets": held_bytes(buckets), "sources": sources}

    def model_state_bytes(self) -> ModelStateBytes:
        job, o = self.ctx.job, self.ctx.job.backend.options
        opt = self.engine.optimizer
        inner = getattr(opt, "optimizer", opt)
        working = [getattr(p, "ds_tensor", None) for p in self.params] + [p.data for p in self.params]
        params = held_bytes(working)
        param_ptrs = {t.untyped_storage().data_ptr() for t in working if t is not None and t.numel()}
        # The fp32 masters are the tensors the wrapped optimizer steps: its state keys (ZeRO-3 empties
        # its param_groups between steps) and param groups; stage-0 fp32 steps the parameters themselves.
        candidates = list(inner.state.keys()) + [p for g in inner.param_groups for p in g["params"]]
        masters, seen = [], set()
        for t in candidates:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in param_ptrs and id(t) not in seen:
                seen.add(id(t))
                masters.append(t)
        moments, other = optimizer_state_tensors([inner])
        master_bytes, moment_bytes = held_bytes(masters), held_bytes(moments)
        master_elements = sum(p.numel() for p in masters)
        nd = job.parallel.dp
        snap = self._grad_snapshot or self._grad_bytes()
        detail = {
            "fp32_master_bytes": master_bytes,
            "adam_moment_bytes": moment_bytes,
            "fp32_master_elements": master_elements,
            "optimizer_formula_bytes": int(optimizer_formula(job)),
            "comm_bucket_bytes": snap["comm_buckets"],
            **{k: v for k, v in snap.get("sources", {}).items() if v},  # where the gradient bytes live
        }
        if o.zero_stage >= 1:
            # DeepSpeed pads each flat group so that it splits evenly (and aligned) over Nd ranks
            # (MoE: the experts' groups over the Nd / ep expert-data-parallel ranks; x Nd as if every
            # rank padded alike)
            detail["padding_elements"] = round((master_elements - _sharded_psi(job)[1]) * nd)
        if o.zero_stage == 3:
            persistent = [p.data for p in self.params if getattr(p, "ds_persist", False)]
            detail["zero3_persistent_param_bytes"] = held_bytes(persistent)
            detail["zero3_persistent_params"] = len(persistent)
        host = 0
        if o.offload_optimizer != "none":
            host += master_bytes + moment_bytes
        if o.offload_param != "none":
            host += held_bytes(getattr(p, "ds_tensor", None) for p in self.params)
        return ModelStateBytes(
            params=params,
            grads=snap["grads"],
            optimizer=master_bytes + moment_bytes,
            optimizer_other=held_bytes(other),
            host=host,
            detail=detail,
        )

    def extra_metrics(self) -> dict[str, float]:
        ms = self.model_state_bytes()
        out = {
            f"zero.rank{self.ctx.rank}.optimizer_minus_formula_bytes": ms.optimizer
            - ms.detail["optimizer_formula_bytes"]
        }
        if "padding_elements" in ms.detail:
            out["zero.padding_elements"] = ms.detail["padding_elements"]
        measured = self.all_to_all_formula[self.ctx.job.run.warmup_steps :]
        if measured:  # MoE, ep > 1: read by parabench.run.comm_report beside the measured all-to-all bytes
            out[f"moe.rank{self.ctx.rank}.all_to_all_formula_bytes"] = sum(measured) / len(measured)
        return out

    def artifacts(self) -> dict[str, Any]:
        import deepspeed

        zc = self.engine._config.zero_config
        return {
            "deepspeed_config": self.config,
            "config_file": self.ctx.job.backend.options.config_file,
            "zero_config_resolved": json.loads(zc.model_dump_json()) if hasattr(zc, "model_dump_json") else str(zc),
            "client_optimizer": self.client_optimizer,
            "deepspeed_optimizer": type(self.engine.optimizer).__name__,
            "deepspeed_version": deepspeed.__version__,
            "torch_extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR"),
        }


def _no_moe_conversion(job: JobSpec) -> None:
    if job.model.is_moe:
        raise RuntimeError(
            "deepspeed: bench convert of a DeepSpeed-MoE model (its experts) is not mapped yet (docs/moe.md)"
        )


def _expert_parallel(model, job: JobSpec) -> int:
    """DeepSpeed's expert-parallel groups of ``backend.ep`` ranks (made now, as DeepSpeed-MoE would
    at ``deepspeed.initialize``, to know this rank's experts), then every layer's canonical block
    swapped for DeepSpeed's MoE layer holding them. Returns this rank's expert-parallel rank."""
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import groups

    ep = job.backend.options.ep
    comm.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    if group_name(ep) not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep)
    ep_rank = groups._get_expert_parallel_rank(group_name(ep))
    swap_blocks(model, job.model, ep, ep_rank)
    return ep_rank


def _moe_adamw(named, spec):
    """The harness's AdamW groups, named, with the experts moved into DeepSpeed's MoE groups (ZeRO
    partitions those over the expert-data-parallel ranks): DeepSpeed's own
    ``split_params_into_different_moe_groups_for_optimizer``."""
    import torch
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from parabench.adapters.torch_common import adamw_param_groups

    groups = adamw_param_groups(named, spec)
    for group, name in zip(groups, ("decay", "no_decay"), strict=True):
        group["name"] = name
    groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps)


def _world_clone_with_timeout(job: JobSpec) -> None:
    """Make DeepSpeed's clone of the world group with ``launcher.collective_timeout_s``.

    Without a model-parallel unit, ZeRO reduces gradients and gathers parameters on the group
    ``deepspeed.utils.groups._clone_world_group()`` creates with ``dist.new_group(ranks)``: no
    timeout, so torch's 30-minute default, not the job's. Measured (2 gloo ranks, ZeRO-2, rank 1 hung
    before step 5): rank 0 waited in ZeRO's reduction until the runner's hang watchdog killed the
    job, FAILED, instead of failing the collective and being restarted. DeepSpeed has no setting for
    that group's timeout; create the clone it would create (same ranks), with the timeout, first.
    Sources: deepspeed/utils/groups.py (``_clone_world_group``, ``_get_data_parallel_group``) in
    deepspeed 0.19.8; torch/distributed/distributed_c10d.py (``new_group`` with
    ``timeout=None`` takes ``_get_default_timeout``: 30 minutes but for NCCL's 10) in torch 2.13."""
    import datetime

    import torch.distributed as dist
    from deepspeed.utils import groups

    if getattr(groups, "_WORLD_GROUP", None) is None:
        timeout = datetime.timedelta(seconds=job.launch.collective_timeout_s)
        groups._WORLD_GROUP = dist.new_group(ranks=list(range(dist.get_world_size())), timeout=timeout)


def _clear_stale_build_locks(root: Path, max_age_s: float) -> None:
    """Remove JIT-build lock files left by a killed build. torch's build baton waits forever on a
    lock file; one older than the runner's hang watchdog belongs to a run that was killed."""
    import time

    for lock in root.glob("*/lock") if root.is_dir() else []:
        try:
            age = time.time() - lock.stat().st_mtime
            if age > max_age_s:
                lock.unlink()
                print(f"[parabench deepspeed] removed a stale build lock {lock} ({age:.0f} s old)", flush=True)
        except FileNotFoundError:
            pass


def _gather_hp_fragments(param, optim_state_key: str | None = None):
    """The full fp32 master (or, with ``optim_state_key``, its AdamW moment) of a stage-1/2 (or
    BF16_Optimizer) parameter, bit-exact.

    DeepSpeed's ``safe_get_full_fp32_param`` sums zero-padded fragments with an all-reduce, which
    turns -0.0 into +0.0 (the canonical init has a few) and so changes the weights checksum. Summing
    the fragments' bit patterns as int32 instead is exact: every element is owned by one rank."""
    import torch
    import torch.distributed as dist

    mapping = param._hp_mapping
    buf = torch.zeros(param.numel(), dtype=torch.int32, device=param.device)
    if mapping is not None:  # None: no part of this parameter lives in this rank's partition
        address = mapping.lp_fragment_address
        fragment = mapping.get_hp_fragment(optim_state_key).detach().float().contiguous().view(torch.int32).flatten()
        buf.narrow(0, address.start, address.numel).copy_(fragment)
    dist.all_reduce(buf, group=param._dp_group)
    return buf.view(torch.float32).view(param.shape)


def _full_shape(p):
    """A parameter's full shape (ZeRO-3 keeps it in ``ds_shape``; the tensor itself is empty)."""
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def _tensors(value, depth: int = 0):
    """Tensors inside an attribute value (tensor, list/tuple, dict, dataclass; up to three levels)."""
    if hasattr(value, "untyped_storage"):
        yield value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v, depth + 1)
    elif depth < 3 and hasattr(value, "__dataclass_fields__"):  # e.g. the stage-1/2 IPGBucket
        for v in vars(value).values():
            yield from _tensors(v, depth + 1)
