"""Megatron-Core: tensor, sequence, pipeline (1F1B and interleaved), data parallelism and the
distributed optimizer on the canonical Llama, expressed as a megatron-core ``GPTModel``.

The model: RMSNorm, SwiGLU (``gated_linear_unit`` + SiLU), RoPE (non-interleaved, i.e. HF's
half-rotation layout), GQA through ``num_query_groups``, no biases, untied embeddings; the local
(pure megatron-core) layer spec on CPU/NPU, Transformer Engine's on CUDA when it is installed
(``backend.transformer_impl``). The canonical weights are mapped into Megatron's layout by
``megatron_mapping`` (fused QKV per query group, fused gate/up, vocab-parallel embedding and output
layer, TP/PP shards) before Megatron's DDP copies them into its buffers, so the starting point is
the other backends' bit for bit (fp32).

Optimizer: Megatron's own ``get_megatron_optimizer(OptimizerConfig(optimizer='adam'))``. Without
Transformer Engine or Apex (CPU) megatron-core falls back to ``torch.optim.AdamW`` (decoupled weight
decay), the class every other backend uses; with them it uses their FusedAdam in AdamW mode. Its
gradient clipping is global-norm with ``max_norm / (norm + 1e-6)`` as in torch. Megatron puts
weight decay multipliers (0 for 1-D parameters: the norms) into its param groups and leaves applying
them to its LR scheduler; we use no scheduler (constant LR), so the engine applies ``wd_mult``
itself once after building the optimizer.

Loss: GPTModel's per-token vocab-parallel cross entropy (fp32), averaged over the tokens of each
micro-batch; the pipeline schedule divides by the number of micro-batches (legacy averaging), which
is ``causal_lm_loss`` averaged over micro-batches as in the other backends.

Mixture-of-Experts (``model.num_local_experts > 0``, docs/moe.md#megatron): every layer's MLP is
megatron-core's ``MoELayer`` (``TopKRouter``, the ``backend.moe_token_dispatcher``, ``SequentialMLP``
experts) with ``expert_model_parallel_size = backend.ep``; router and experts are mapped from the
canonical Mixtral names, expert-parallel rank r holding experts [r*E/ep, (r+1)*E/ep). The canonical
load-balancing loss is added to each micro-batch's loss (``MegatronEngine._aux_loss``); with pipeline
stages it is exchanged between them (``MegatronEngine._stage_aux``, docs/moe.md#megatron).

CPU/NPU execution goes through ``parabench.redirect.install("cuda", target)`` inside the
worker only (CUDA APIs, ``device="cuda"`` literals, CUDA RNG -> host/NPU); see docs/megatron.md.

Model states per rank (docs/sources.md#megatron-distributed-optimizer: Megatron-LM docs, distributed
optimizer section; Rajbhandari et al. 2019, arXiv 1910.02054): bytes per parameter held by the rank (its TP/PP shard) with DP data-parallel
ranks are, without / with the distributed optimizer,
  fp32: 4 param + 4 grad + 8 Adam moments = 16      /  4 + 4 + 8/DP
  bf16: 2 param + 4 fp32 grad + 4 fp32 main param + 8 moments = 18  /  6 + 12/DP
(with fp32 params the "main" params are views of the model params, nothing extra). Megatron pads
its flat buffers, so the measurement is a little above the formula. A MoE model's experts have
buffers and a DistributedOptimizer of their own, sharded over the dp / ep expert-data-parallel ranks
(``_distopt_bytes``, docs/moe.md#megatron).

Pipeline bubble: predicted (p-1)/m for 1F1B and (p-1)/(v*m) interleaved (Narayanan et al. 2021,
arXiv 2104.04473, sections 2.2.1-2.2.2). Measured per rank as 1 - (time in forward_step +
backward_step) / (wall time of the schedule); p2p waits count as bubble. TP communication: every
collective on the tensor-parallel group is counted during the step (calls and bytes); decoder
layers alone predict 2 all-reduces forward + 2 backward per layer and micro-batch (ibid., section
2.3), the vocab-parallel embedding and cross entropy add a few more.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from parabench.adapters import megatron_distopt
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
)
from parabench.adapters.megatron_compat import (
    adamw_options,
    build_chunk,
    content_metadata_kwargs,
    define_router_gemm_without_te,
    distopt_checkpoint_blocker,
    distopt_format,
    import_core_uncompiled,
    loading_torch_adam,
    num_layers_to_build,
    optimizer_state_kwargs,
    patch_fp8_fallback,
    saved_distopt_format,
)
from parabench.adapters.megatron_profile import PROFILE, expert_numel, rank_param_counts
from parabench.canonical import MOMENTS, CanonicalState, Lazy, view
from parabench.devices import package_version
from parabench.errors import SpecError
from parabench.expertload import RoutedTokens
from parabench.metrics import held_bytes, optimizer_state_tensors
from parabench.redirect import install
from parabench.spec import JobSpec, ModelSpec, ParallelDims

# megatron-core release series this adapter is written against and tested with (docs/megatron.md
# lists the patch releases tested): 0.12 is MindSpeed's pin (core_r0.12.1), 0.16 the newest. What
# differs between them is chosen in megatron_compat. Its private pieces (schedule internals,
# optimizer groups, buffer layout) change between releases: other series are refused.
SUPPORTED_SERIES = ("0.12", "0.16")
INSTALL_HINT = "pip install 'parabench[megatron]'"


def supported(version: str | None) -> bool:
    """``version`` (a megatron-core release, e.g. 0.12.1 or 0.16.1) belongs to a supported series."""
    return version is not None and ".".join(version.split(".")[:2]) in SUPPORTED_SERIES


def unsupported_reason(version: str | None) -> str:
    series = ", ".join(f"{s}.x" for s in SUPPORTED_SERIES)
    return f"megatron-core {version} is not supported (supported: {series}; {INSTALL_HINT})"


@dataclass(frozen=True)
class MegatronOptions:
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size (stages)
    vpp: int = 1  # virtual stages (model chunks) per pipeline rank; > 1 = interleaved 1F1B
    cp: int = 1  # context-parallel size (needs Transformer Engine attention: CUDA only)
    sequence_parallel: bool = False  # shard norms/dropout activations along the sequence (needs tp > 1)
    distributed_optimizer: bool = False  # shard fp32 main params + Adam states over data-parallel ranks
    overlap_grad_reduce: bool = False  # overlap the DP grad all-reduce/reduce-scatter with backward
    overlap_param_gather: bool = False  # overlap the param all-gather with forward (distributed optimizer)
    num_microbatches: int = 0  # 0: global_batch_size / (micro_batch_size x dp); else must equal it
    bucket_size: int = 0  # DDP bucket size in elements; 0 = megatron-core's default
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"  # auto: TE on CUDA if installed
    # Mixture-of-Experts (docs/moe.md): expert_model_parallel_size, each expert-parallel rank holding
    # num_local_experts / ep experts of every layer; the ep ranks are data-parallel ranks (ep divides dp)
    ep: int = 1
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"  # megatron-core's moe_token_dispatcher_type
    # Activation recompute: TransformerConfig's fields of the same names (docs/megatron.md#activation-recompute).
    # None: keep every activation; full: checkpoint whole decoder layers (their input only); selective:
    # recompute the core attention (QK^T, softmax, its dropout and xV) in the backward.
    recompute_granularity: Literal["full", "selective"] | None = None
    # full only: uniform (every layer, in units of recompute_num_layers) | block (the first
    # recompute_num_layers layers of each model chunk); None with full = uniform
    recompute_method: Literal["uniform", "block"] | None = None
    recompute_num_layers: int | None = None  # full only: layers per unit (uniform) or per chunk (block); None = 1


def _layout(job: JobSpec, te_names: bool = False):
    from parabench.adapters.megatron_mapping import Layout

    o = job.backend.options
    return Layout(tp=o.tp, pp=o.pp, vpp=o.vpp, te_names=te_names, ep=o.ep)


def _distopt_bytes(job: JobSpec, psi: int) -> tuple[float, str]:
    """Model-state bytes of a rank holding ``psi`` parameters under the distributed optimizer, and the
    formula: every parameter's weight and fp32 gradient held (4 + 4 in fp32, 2 + 4 in bf16), the fp32
    main params (bf16 only) and AdamW moments sharded - the dense parameters' over the dp data-parallel
    ranks, a MoE model's experts' over the dp / ep expert-data-parallel ranks, the group megatron-core
    gives their own buffers and DistributedOptimizer (``expert_parallel_buffers`` on
    ``intra_expt_dp_group``, ``get_megatron_optimizer``'s ``is_expert_parallel`` groups)."""
    o, dp = job.backend.options, job.parallel.dp
    (held, sharded), word = ((6, 12), "6") if job.run.precision == "bf16" else ((8, 8), "4 + 4")
    experts = expert_numel(job)
    if not experts:
        return (held + sharded / dp) * psi, f"({word} + {sharded}/{dp}) * Psi_rank, Psi_rank = {psi}"
    edp = dp // o.ep  # the expert-data-parallel size: (dp x tp) / (ep x expert tp = tp)
    dense = psi - experts
    text = (
        f"({word} + {sharded}/{dp}) * Psi_dense + ({word} + {sharded}/{edp}) * Psi_experts, "
        f"Psi_dense = {dense}, Psi_experts = {experts} (experts' states over dp/ep = {edp} ranks)"
    )
    return (held + sharded / dp) * dense + (held + sharded / edp) * experts, text


# The combinations of a MoE model with other megatron options that parabench has not mapped or checked
# (option, is it set, why it is refused); docs/moe.md#megatron.
def _moe_unchecked(o: MegatronOptions) -> list[tuple[str, bool, str]]:
    return [
        (
            "backend.sequence_parallel",
            o.tp > 1 and not o.sequence_parallel,
            "megatron-core's MoE layer trains with tp > 1 only under sequence parallelism: set "
            "backend.sequence_parallel=true",
        ),
        (
            "backend.tp",
            o.tp > 1 and o.pp > 1,
            "tp > 1 with pp > 1 is not checked with MoE (the load-balancing loss is exchanged between the "
            "tensor ranks' sequence slices and between the stages, not both): use tp=1 or pp=1",
        ),
        (
            "backend.vpp",
            o.vpp > 1,
            "interleaved stages are not checked with MoE (the load-balancing loss is exchanged per stage): use vpp=1",
        ),
        ("backend.cp", o.cp > 1, "context parallelism is not checked with MoE: use cp=1"),
        (
            "backend.transformer_impl",
            o.transformer_impl == "transformer_engine",
            "Transformer Engine's MoE layer spec is not mapped (auto and local use the local spec for MoE)",
        ),
        (
            "backend.recompute_granularity",
            o.recompute_granularity == "full",
            "full recompute runs each layer's first forward without gradients, so the router logits the "
            "load-balancing loss over all layers is computed from carry none (its gradient would be lost; "
            "measured: step 1's loss off the canonical model's by 2.4e-5): use selective or null",
        ),
    ]


def _check_moe(job: JobSpec) -> None:
    """Expert parallelism (``backend.ep``) and what a MoE model on megatron-core needs (docs/moe.md)."""
    o, m, dp = job.backend.options, job.model, job.parallel.dp
    if o.ep < 1:
        raise SpecError("backend.ep", f"must be >= 1, got {o.ep}")
    if not m.is_moe:
        if o.ep > 1:
            raise SpecError(
                "backend.ep", f"expert parallelism (ep={o.ep}) needs a MoE model (model.num_local_experts > 0)"
            )
        return
    if m.num_local_experts % o.ep:
        raise SpecError("backend.ep", f"model.num_local_experts={m.num_local_experts} is not divisible by ep={o.ep}")
    if dp % o.ep:
        raise SpecError(
            "backend.ep", f"ep={o.ep} does not divide the data-parallel size {dp} (the ep ranks are dp ranks)"
        )
    for key, bad, why in _moe_unchecked(o):
        if bad:
            raise SpecError(key, f"with a MoE model (model.num_local_experts={m.num_local_experts}): {why}")
    if o.tp > 1 and o.ep > 1 and job.device.type != "cuda":
        # measured: moe-tiny ep=2 x tp=2 on 4 CPU ranks, "ProcessGroupGloo::allgather: invalid tensor size"
        raise SpecError(
            "backend.ep",
            f"ep > 1 with tp > 1: megatron-core's token dispatcher all-gathers uneven token counts over the "
            f"tensor ranks, which gloo cannot; nccl can (device={job.device.type}: use ep=1 or tp=1 here)",
        )
    if m.num_experts_per_tok == 1:
        raise SpecError(
            "model.num_experts_per_tok",
            "megatron-core needs moe_router_pre_softmax at top-1, whose weight is the softmax probability, "
            "not Mixtral's renormalised 1 (with model.norm_topk_prob=false they agree, but top-1 is not checked)",
        )
    version = package_version("megatron-core")
    if version is not None and not version.startswith("0.16."):
        raise SpecError(
            "model.num_local_experts", f"MoE on megatron is checked with megatron-core 0.16 only, not {version}"
        )


def recompute_settings(o: MegatronOptions) -> dict[str, Any]:
    """TransformerConfig's recompute fields for these options: full without a method or a layer count
    recomputes every layer on its own (uniform, units of 1 layer); megatron-core itself requires both."""
    if o.recompute_granularity != "full":
        return {"recompute_granularity": o.recompute_granularity}
    return {
        "recompute_granularity": "full",
        "recompute_method": o.recompute_method or "uniform",
        "recompute_num_layers": 1 if o.recompute_num_layers is None else o.recompute_num_layers,
    }


def _check_recompute(job: JobSpec) -> None:
    """What megatron-core's recompute accepts (transformer_config.py ``__post_init__``; and
    transformer_block.py ``_checkpointed_forward``: uniform steps through the chunk's layers in units of
    recompute_num_layers and indexes past its last layer when the units do not divide them)."""
    o = job.backend.options
    if o.recompute_granularity != "full":
        for key, value in (("recompute_method", o.recompute_method), ("recompute_num_layers", o.recompute_num_layers)):
            if value is not None:
                raise SpecError(
                    f"backend.{key}",
                    f"{key}={value} applies to full recompute only (recompute_granularity="
                    f"{o.recompute_granularity or 'null'}): set backend.recompute_granularity=full or {key}=null",
                )
        return
    n = recompute_settings(o)["recompute_num_layers"]
    per_chunk = job.model.num_hidden_layers // (o.pp * o.vpp)
    if not 1 <= n <= per_chunk:
        raise SpecError(
            "backend.recompute_num_layers",
            f"must be between 1 and the {per_chunk} layers of a model chunk (num_hidden_layers / (pp x vpp)), got {n}",
        )
    if (o.recompute_method or "uniform") == "uniform" and per_chunk % n:
        raise SpecError(
            "backend.recompute_num_layers",
            f"uniform recompute takes units of {n} layers, which do not divide the {per_chunk} layers of a "
            f"model chunk (num_hidden_layers / (pp x vpp)): use a divisor or recompute_method=block",
        )


def _check_distopt_checkpoint(job: JobSpec) -> None:
    """A job that saves or loads the distributed optimizer where this installation cannot, refused."""
    ckpt = job.run.checkpoint
    uses = ckpt.every > 0 or ckpt.on_signal or job.run.resume not in ("auto", "never")
    if job.backend.options.distributed_optimizer and uses:
        blocker = distopt_checkpoint_blocker(package_version("megatron-core"))
        if blocker:
            raise SpecError("backend.distributed_optimizer", blocker)


def _check_tensor_split(job: JobSpec) -> None:
    """Every tensor-parallel split divides: heads, key/value heads, MLP rows, vocabulary."""
    o, m = job.backend.options, job.model
    if m.num_attention_heads % o.tp:
        raise SpecError(
            "backend.tp", f"model.num_attention_heads={m.num_attention_heads} is not divisible by tp={o.tp}"
        )
    qkv_rows = (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim
    if qkv_rows % o.tp or (o.tp % m.num_key_value_heads and m.num_key_value_heads % o.tp):
        raise SpecError(
            "backend.tp",
            f"{m.num_key_value_heads} key/value heads cannot be split over tp={o.tp} (one must divide the other)",
        )
    for key, value in (("intermediate_size", m.intermediate_size), ("vocab_size", m.vocab_size)):
        if value % o.tp:
            raise SpecError("backend.tp", f"model.{key}={value} is not divisible by tp={o.tp}")


def _check_pipeline(job: JobSpec) -> None:
    """Pipeline stages and their virtual (interleaved) chunks hold whole, equal numbers of layers."""
    o, m = job.backend.options, job.model
    if o.vpp > 1 and o.pp == 1:
        raise SpecError("backend.vpp", f"interleaving (vpp={o.vpp}) needs pipeline parallelism (pp >= 2)")
    if m.num_hidden_layers % (o.pp * o.vpp):
        key = "backend.vpp" if o.vpp > 1 else "backend.pp"
        raise SpecError(
            key,
            f"model.num_hidden_layers={m.num_hidden_layers} is not divisible by pp x vpp = "
            f"{o.pp} x {o.vpp} (every virtual stage needs the same number of layers)",
        )


def _check_sequence_and_context(job: JobSpec) -> None:
    """Sequence parallelism shards over tp; context parallelism needs Transformer Engine on CUDA."""
    o = job.backend.options
    if o.sequence_parallel and o.tp == 1:
        raise SpecError(
            "backend.sequence_parallel", "sequence parallelism shards along the tensor-parallel group: needs tp > 1"
        )
    if o.sequence_parallel and job.data.seq_len % o.tp:
        raise SpecError("backend.sequence_parallel", f"data.seq_len={job.data.seq_len} is not divisible by tp={o.tp}")
    if o.cp > 1:
        if job.device.type != "cuda":
            raise SpecError(
                "backend.cp",
                f"context parallelism needs Transformer Engine attention (CUDA); megatron-core's "
                f"local attention asserts context_parallel_size == 1 (device={job.device.type})",
            )
        if o.transformer_impl == "local":
            raise SpecError("backend.cp", "context parallelism needs transformer_impl=transformer_engine or auto")
        if job.data.seq_len % (2 * o.cp):
            raise SpecError("backend.cp", f"data.seq_len={job.data.seq_len} is not divisible by 2 x cp = {2 * o.cp}")


def _check_engine_options(job: JobSpec) -> None:
    """Transformer Engine, the overlapped param gather, tied embeddings across stages, buckets."""
    o, m = job.backend.options, job.model
    if o.transformer_impl == "transformer_engine" and job.device.type != "cuda":
        raise SpecError("backend.transformer_impl", f"Transformer Engine runs on CUDA only (device={job.device.type})")
    if o.overlap_param_gather and not o.distributed_optimizer:
        raise SpecError(
            "backend.overlap_param_gather",
            "overlapping the param all-gather needs backend.distributed_optimizer=true",
        )
    if m.tie_word_embeddings and o.pp > 1:
        raise SpecError(
            "model.tie_word_embeddings", "tied embeddings across pipeline stages are not mapped; use pp=1 or untied"
        )
    if o.bucket_size < 0:
        raise SpecError("backend.bucket_size", f"must be >= 0 (0 = default), got {o.bucket_size}")


def _check_micro_batches(job: JobSpec) -> None:
    """An explicit micro-batch count matches the batch; the interleaved schedule needs a multiple of pp."""
    o = job.backend.options
    m_batches = job.grad_accum
    if o.num_microbatches and o.num_microbatches != m_batches:
        need = o.num_microbatches * job.data.micro_batch_size * job.parallel.dp
        raise SpecError(
            "backend.num_microbatches",
            f"{o.num_microbatches} micro-batches per step need data.global_batch_size="
            f"{need} (= num_microbatches x micro_batch_size x dp = {o.num_microbatches} x "
            f"{job.data.micro_batch_size} x {job.parallel.dp}); it gives {m_batches}",
        )
    if o.vpp > 1 and m_batches % o.pp:
        raise SpecError(
            "backend.vpp",
            f"the interleaved schedule needs micro-batches per step ({m_batches}) to be a multiple "
            f"of pp={o.pp}: raise data.global_batch_size",
        )


class MegatronAdapter(Adapter):
    name = "megatron"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda", "npu"}),
        precisions=frozenset({"fp32", "bf16"}),
        shards_model_states=True,
        # megatron-core's MoELayer: router, top-k, SequentialMLP experts, expert parallelism (backend.ep)
        moe=True,
        # Qwen2's q/k/v biases: add_qkv_bias, the fused linear_qkv's bias (adapters/megatron_mapping.py)
        model_features=frozenset({"qkv_bias"}),
        # dist_checkpointing stores every tensor as a ShardedTensor (global shape + this rank's
        # offsets), so a job with another TP size or data-parallel size loads the same files
        # (docs/resilience.md#megatron).
        checkpoint=CheckpointSupport(
            format="megatron-dist",
            async_save=None,
            # tp and data-parallel size reshard (tested tp=2 -> tp=1, docs/resilience.md#megatron)
            reshard=frozenset({"tp", "world_size", "dp", "dp_shard"}),
            # model0/model1.. per virtual stage; the distributed optimizer's param_state differs in kind
            options=frozenset({"vpp", "distributed_optimizer"}),
        ),
        # the distributed optimizer's slices are put together / handed out by megatron_distopt
        convert=ConvertSupport(),
    )
    Options = MegatronOptions
    distributions = ("torch", "megatron-core")
    plan_profile = PROFILE

    @classmethod
    def availability(cls) -> Availability:
        version = package_version("megatron-core")
        if version is None:
            return Availability(False, f"megatron-core not installed ({INSTALL_HINT})")
        versions = {"megatron-core": version, "torch": package_version("torch")}
        if not supported(version):
            return Availability(False, unsupported_reason(version), versions)
        return Availability(True, f"megatron-core {version}", versions)

    @classmethod
    def parallel_dims(cls, options: MegatronOptions, world_size: int, model: ModelSpec) -> ParallelDims:
        for key in ("tp", "pp", "vpp", "cp"):
            if getattr(options, key) < 1:
                raise SpecError(f"backend.{key}", f"must be >= 1, got {getattr(options, key)}")
        mp = options.tp * options.pp * options.cp
        if world_size % mp:
            raise SpecError(
                "backend.tp",
                f"world size {world_size} is not divisible by tp x pp x cp = "
                f"{options.tp} x {options.pp} x {options.cp} = {mp}",
            )
        dp = world_size // mp
        return ParallelDims(
            world_size=world_size,
            dp=dp,
            tp=options.tp,
            pp=options.pp,
            cp=options.cp,
            dp_shard=dp if options.distributed_optimizer else 1,
        )

    @classmethod
    def validate(cls, job: JobSpec) -> None:
        _check_tensor_split(job)
        _check_pipeline(job)
        _check_sequence_and_context(job)
        _check_engine_options(job)
        _check_micro_batches(job)
        _check_distopt_checkpoint(job)
        _check_moe(job)
        _check_recompute(job)

    @classmethod
    def launch_env(cls, job: JobSpec) -> dict[str, str]:
        # Megatron asserts this on CUDA for TP/SP communication ordering (docs/sources.md#megatron-max-connections).
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}

    @classmethod
    def layout_words(cls, options: MegatronOptions) -> list[str]:
        flags = (("sp", options.sequence_parallel), ("distopt", options.distributed_optimizer))
        degrees = [f"vpp{options.vpp}"] if options.vpp > 1 else []
        degrees += [f"ep{options.ep}"] if options.ep > 1 else []
        degrees += [f"recompute-{options.recompute_granularity}"] if options.recompute_granularity else []
        return degrees + [word for word, on in flags if on]

    @classmethod
    def expected_model_state(cls, job: JobSpec) -> StateFormula:
        o = job.backend.options
        psi = max(rank_param_counts(job).values())  # the largest TP/PP shard (first/last stage hold the vocab)
        if o.distributed_optimizer:
            per, text = _distopt_bytes(job, psi)
        else:
            per, text = (18.0 * psi, "(2 + 4 + 4 + 8)") if job.run.precision == "bf16" else (16.0 * psi, "(4 + 4 + 8)")
            text += f" * Psi_rank, Psi_rank = {psi}"
        what = "distributed optimizer" if o.distributed_optimizer else "replicated optimizer"
        source = "Megatron-LM distributed optimizer docs (6 + 12/d bytes/param for bf16); Rajbhandari et al. 2019 (arXiv 1910.02054)"
        shard = "largest TP/PP shard"
        if job.model.is_moe:
            # each rank holds its num_local_experts / ep experts (docs/sources.md#megatron-moe)
            shard += f", {job.model.num_local_experts // o.ep} of {job.model.num_local_experts} experts per layer (ep={o.ep})"
            source += "; Megatron-Core MoE docs (expert parallelism: experts split over EP ranks), Lepikhin et al. 2020 (GShard, arXiv 2006.16668)"
        return StateFormula(per, f"{text} ({shard}), {job.run.precision}, {what} (+ buffer padding)", source)

    @classmethod
    def create_engine(cls, ctx: WorkerContext) -> Engine:
        version = package_version("megatron-core")
        if not supported(version):
            raise RuntimeError(unsupported_reason(version))
        return MegatronEngine(ctx)


# ------------------------------------------------------------------------------------------------
# Worker side. Everything below imports megatron-core only when an engine is created.
# ------------------------------------------------------------------------------------------------
class _Counters:
    """Scoped, reversible instrumentation: TP collectives and schedule compute time."""

    def __init__(self, tp_group: Any = None):
        self.tp_group = tp_group
        self.tp_calls = 0
        self.tp_bytes = 0
        self.compute_s = 0.0
        self.active = False  # count only inside train_step (not the checksum's gathers)
        self._undo: list = []

    def patch(self, obj: Any, name: str, make) -> None:
        old = getattr(obj, name)
        setattr(obj, name, make(old))
        self._undo.append(lambda: setattr(obj, name, old))

    def define(self, obj: Any, name: str, value: Any) -> None:
        """Give ``obj`` an attribute it lacks, removed again by restore()."""
        setattr(obj, name, value)
        self._undo.append(lambda: delattr(obj, name))

    def collective(self, fn):
        def counted(tensor, *args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next(
                    (a for a in args if a is not None and hasattr(a, "size") and not hasattr(a, "dtype")), None
                )
            if self.active and group is self.tp_group:
                self.tp_calls += 1
                t = tensor[0] if isinstance(tensor, (list, tuple)) else tensor
                self.tp_bytes += (
                    t.numel() * t.element_size() * (len(tensor) if isinstance(tensor, (list, tuple)) else 1)
                )
            return fn(tensor, *args, **kwargs)

        return counted

    def timed(self, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.compute_s += time.perf_counter() - t0

        return wrapper

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def moe_config(spec: ModelSpec, opts: MegatronOptions) -> dict:
    """The canonical MoE block as megatron-core's MoELayer (docs/moe.md#megatron): top-k over the
    logits then softmax over the k (= Mixtral's softmax, top-k, renormalised), or with
    ``norm_topk_prob: false`` moe_router_pre_softmax, the softmax over all experts then top-k, not
    renormalised (megatron-core 0.16 moe/moe_utils.py ``topk_routing_with_score_function``: no
    scaling factor, Qwen2-MoE's weights); dropless (no capacity factor), SequentialMLP experts (no
    grouped GEMM kernel on a CPU). Megatron's own
    load-balancing loss is off: it is computed per layer and divided by top-k (moe_utils.
    switch_load_balancing_loss_func), not Mixtral's over all layers' tokens together, so the
    engine adds the canonical one to the loss (:meth:`MegatronEngine._aux_loss`)."""
    if not spec.is_moe:
        return {}
    return {
        "num_moe_experts": spec.num_local_experts,
        "moe_router_topk": spec.num_experts_per_tok,
        "moe_ffn_hidden_size": spec.expert_intermediate_size,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not spec.norm_topk_prob,
        "moe_expert_capacity_factor": None,
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": opts.moe_token_dispatcher,
        # also on the config, not only in parallel_state: the expert linears read it to mark their
        # weights expert-parallel (allreduce=False); unset, Megatron's DDP broadcast rank 0's
        # experts over the dp group at start and all-reduced expert grads across the ep ranks
        "expert_model_parallel_size": opts.ep,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        # Qwen2-MoE's shared expert: SharedExpertMLP (moe/shared_experts.py) with its sigmoid gate
        "moe_shared_expert_intermediate_size": spec.shared_expert_intermediate_size or None,
        "moe_shared_expert_gate": bool(spec.shared_expert_intermediate_size),
    }


class MegatronEngine(Engine, Checkpointing, CanonicalIO):
    def __init__(self, ctx: WorkerContext, redirect_cuda: bool = True):
        """``redirect_cuda=False`` when something else already maps CUDA onto the device (MindSpeed's
        adaptor applies torch_npu's transfer_to_npu)."""
        import torch

        self.ctx = ctx
        job = ctx.job
        self.opts: MegatronOptions = job.backend.options
        self.device_type = job.device.type
        self._redirection = None
        self._async_queue = None  # dist_checkpointing's background saves (run.checkpoint.async)
        self.counters = _Counters()
        try:
            if self.device_type == "cpu":  # fusions off on a CPU: no compile wrappers (megatron_compat)
                import_core_uncompiled(torch)
            if redirect_cuda and self.device_type in ("cpu", "npu"):
                # CUDA -> host (or NPU): torch.cuda.*, device="cuda" literals, CUDA RNG, .cuda(), nccl.
                self._redirection = install("cuda", self.device_type)
                self._redirect_inside_backward(torch)
            self._build(torch)
        except BaseException:
            self.close()
            raise

    # -- construction ----------------------------------------------------------------------------
    def _build(self, torch) -> None:
        o = self.opts
        ps = self._init_parallel_state(torch)
        bf16 = self.ctx.job.run.precision == "bf16"
        dtype = torch.bfloat16 if bf16 else torch.float32
        use_te = self._use_te()
        config = self._transformer_config(dtype, use_te)
        self.config = config
        layer_spec = self._layer_spec(use_te, config)

        chunks = self._build_chunks(torch, ps, config, layer_spec, use_te)
        self.chunks = self._wrap_ddp(chunks, config)
        self._build_optimizer(dtype)
        self.forward_backward = self._wire_schedules(config)
        self.counters.tp_group = ps.get_tensor_model_parallel_group()
        self._instrument()
        if o.distributed_optimizer:
            patch_fp8_fallback(self.counters.patch)  # 0.12 without Transformer Engine
        self.steps = 0
        self.schedule_s = 0.0

    def _build_chunks(self, torch, ps, config, layer_spec, use_te: bool) -> list:
        """This rank's model chunks (one per virtual stage) as megatron-core GPTModels holding the
        canonical weights' shards, on the device (wrapped for bf16)."""
        from megatron.core.models.gpt.gpt_model import GPTModel

        job, o, spec = self.ctx.job, self.opts, self.ctx.job.model
        bf16 = job.run.precision == "bf16"
        chunks = []
        stage = ps.get_pipeline_model_parallel_rank()
        tp_rank = ps.get_tensor_model_parallel_rank()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        layout = _layout(job, te_names=use_te)
        self.layout, self.stage, self.tp_rank = layout, stage, tp_rank
        self._router_logits: list = []  # this micro-batch's router logits per MoE layer (the aux loss)
        self._aux_sends: list = []  # pp > 1: (request, tensor) of the router statistics sent this step
        self.routed = None  # MoE: tokens per expert of this step (parabench.expertload)
        for c in range(o.vpp):
            vp_stage = c if o.vpp > 1 else None
            model = build_chunk(
                GPTModel,
                ps,
                vp_stage,
                config=config,
                transformer_layer_spec=layer_spec(vp_stage),
                vocab_size=spec.vocab_size,
                max_sequence_length=job.data.seq_len,
                pre_process=layout.is_first(stage, c),
                post_process=layout.is_last(stage, c),
                share_embeddings_and_output_weights=spec.tie_word_embeddings,
                position_embedding_type="rope",
                rotary_percent=1.0,
                rotary_base=spec.rope_theta,
            )
            self._load_canonical(model, c)
            model.to(torch.cuda.current_device())
            if bf16:
                from megatron.core.transformer.module import Float16Module

                model = Float16Module(config, model)
            chunks.append(model)
        return chunks

    def _build_optimizer(self, dtype) -> None:
        """megatron-core's Adam (AdamW semantics) over the chunks, constant LR, weight decay per group."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.opts
        bf16 = self.ctx.job.run.precision == "bf16"
        opt = self.ctx.job.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                min_lr=opt.lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.betas[0],
                adam_beta2=opt.betas[1],
                adam_eps=opt.eps,
                clip_grad=opt.grad_clip,
                bf16=bf16,
                params_dtype=dtype,
                use_distributed_optimizer=o.distributed_optimizer,
                **adamw_options(OptimizerConfig),
            ),
            self.chunks,
        )
        for group in self.param_groups():
            # Megatron's LR scheduler applies wd_mult (0 for 1-D params); we run a constant LR, no scheduler.
            group["weight_decay"] = opt.weight_decay * group.get("wd_mult", 1.0)
            group["lr"] = opt.lr * group.get("lr_mult", 1.0)

    def _load_canonical(self, model, chunk: int) -> None:
        """Model chunk ``chunk``'s canonical initial weights, mapped onto this tp/ep rank's shards, and
        the marks and MoE hooks Megatron's own initialisation would have left."""
        from parabench.adapters.megatron_mapping import canonical_names, to_megatron
        from parabench.model import initial_weights

        job, spec, layout = self.ctx.job, self.ctx.job.model, self.layout
        canonical = initial_weights(spec, job.run.seed, canonical_names(spec, layout, self.stage, chunk, self.ep_rank))
        self._load(model, to_megatron(canonical, spec, layout, self.stage, chunk, self.tp_rank, self.ep_rank))
        _mark_tensor_parallel(model)
        if spec.is_moe:
            self._capture_router_logits(model)
            self._count_routed_tokens(model)
            define_router_gemm_without_te(self.counters.define)

    def _init_parallel_state(self, torch):
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        o = self.opts
        torch.cuda.set_device(self.ctx.local_rank)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=o.tp,
            pipeline_model_parallel_size=o.pp,
            virtual_pipeline_model_parallel_size=o.vpp if o.vpp > 1 else None,
            context_parallel_size=o.cp,
            expert_model_parallel_size=o.ep,
            # every group Megatron creates (tp, pp, dp, ...) gets the job's collective timeout, not
            # Megatron's 30-minute default, so a hung peer fails the tp all-reduce or pp send/recv
            # (megatron/core/parallel_state.py: timedelta(minutes=distributed_timeout_minutes) for
            # every new_group, megatron-core 0.16.1). Measured without it (tp=2, rank 1 hung):
            # rank 0 waited until the runner's launcher.hang_timeout_s killed the job, no restart.
            distributed_timeout_minutes=self.ctx.job.launch.collective_timeout_s / 60,
        )
        self.ps = ps
        model_parallel_cuda_manual_seed(self.ctx.job.run.seed)  # dropout is 0; the RNG tracker must exist anyway
        return ps

    def _transformer_config(self, dtype, use_te: bool):
        """The canonical Llama as a megatron-core TransformerConfig, in this job's parallel layout."""
        import torch.nn.functional as F
        from megatron.core.transformer.transformer_config import TransformerConfig

        o, spec = self.opts, self.ctx.job.model
        return TransformerConfig(
            num_layers=spec.num_hidden_layers,
            hidden_size=spec.hidden_size,
            ffn_hidden_size=spec.intermediate_size,
            num_attention_heads=spec.num_attention_heads,
            num_query_groups=spec.num_key_value_heads,
            kv_channels=spec.head_dim,
            layernorm_epsilon=spec.rms_norm_eps,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=spec.qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tensor_model_parallel_size=o.tp,
            pipeline_model_parallel_size=o.pp,
            virtual_pipeline_model_parallel_size=o.vpp if o.vpp > 1 else None,
            context_parallel_size=o.cp,
            sequence_parallel=o.sequence_parallel,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=self.ctx.job.run.precision == "bf16",
            # Weights come from the canonical mapping: skip Megatron's own (full-matrix) init.
            perform_initialization=False,
            use_cpu_initialization=True,
            # Fused CUDA kernels are not available on the host / through the redirection.
            bias_activation_fusion=use_te,
            apply_rope_fusion=False,
            masked_softmax_fusion=use_te,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
            bias_dropout_fusion=False,
            # Megatron-LM's training defaults: the interleaved schedule overlaps p2p with compute
            # (individual isend/irecv), 1F1B batches its p2p ops.
            overlap_p2p_comm=o.vpp > 1,
            batch_p2p_comm=o.vpp == 1,
            # Megatron frees a stage's output right after posting its send. On CUDA the caching
            # allocator keeps the memory until the send's stream is done; on the host a gloo isend
            # still in flight (overlapped p2p) then reads reused memory and the next stage gets
            # garbage (seen: wrong losses for micro-batches 3 and 4 at pp=2, vpp=2). Keep outputs.
            deallocate_pipeline_outputs=self.device_type == "cuda",
            **recompute_settings(o),
            **moe_config(self.ctx.job.model, self.opts),
        )

    def _capture_router_logits(self, model) -> None:
        """Keep each MoE layer's router logits of the running forward (``TopKRouter.gating``, wrapped
        on this model's routers only) for the canonical load-balancing loss."""
        from megatron.core.transformer.moe.router import TopKRouter

        for module in model.modules():
            if isinstance(module, TopKRouter):

                def gating(hidden, gate=module.gating):
                    logits = gate(hidden)
                    self._router_logits.append(logits)
                    return logits

                module.gating = gating

    def _count_routed_tokens(self, model) -> None:
        """Count each MoE layer's routed tokens (parabench.expertload) from the routing map its
        ``TopKRouter`` returns, the one the token dispatcher sends by: a forward hook on this model's
        routers only. ``layer_number`` is megatron-core's global 1-based layer number (offset by the
        stage's first layer)."""
        from megatron.core.transformer.moe.router import TopKRouter

        spec = self.ctx.job.model
        if self.routed is None:
            self.routed = RoutedTokens(spec.num_hidden_layers, spec.num_local_experts, self.ctx.device.torch_device)
        routed = self.routed
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(
                    lambda router, _inputs, output: routed.add_routing_map(router.layer_number - 1, output[1])
                )

    def tokens_per_expert(self):
        if self.routed is None:
            return None
        # Summed over tp x cp x dp, the group megatron-core itself sums its routers' local_tokens_per_expert
        # over (moe_utils.get_updated_expert_bias): the ranks of one pipeline stage that route distinct
        # tokens - data-parallel ranks their own rows (the expert-parallel ranks are data-parallel ranks
        # and route their own tokens before the all-to-all), context-parallel ranks their sequence chunks,
        # tensor-parallel ranks their sequence-parallel slices (megatron-core's MoELayer refuses tp > 1
        # without sequence parallelism in training). With pp > 1 each stage counted its own layers:
        # summed over the pipeline group too.
        counts = self.routed.take(self.ps.get_tensor_and_data_parallel_group(with_context_parallel=True))
        if self.opts.pp == 1:
            return counts
        import torch
        import torch.distributed as dist

        total = torch.tensor(counts, dtype=torch.int64)
        dist.all_reduce(total, group=self.ps.get_pipeline_model_parallel_group())
        return total.tolist()

    def _aux_loss(self):
        """``router_aux_loss_coef`` x the Switch load-balancing loss over this micro-batch's router
        logits of all layers, as the canonical ``training_loss`` (parabench.model.load_balancing_loss).
        With pp > 1, on the last stage: the earlier stages' routed assignments and probabilities
        (``_stage_aux``) received, the whole loss's value, its gradient through this stage's routers."""
        from parabench.model import load_balancing_loss

        spec = self.ctx.job.model
        logits = [x.reshape(-1, spec.num_local_experts) for x in self._router_logits]
        self._router_logits.clear()
        if self.opts.tp > 1:  # sequence parallel: this rank's routers saw its slice of the tokens
            return self._tp_aux_loss(logits)
        if self.opts.pp == 1:
            return spec.router_aux_loss_coef * load_balancing_loss(
                logits, spec.num_local_experts, spec.num_experts_per_tok
            )
        import torch
        import torch.distributed as dist

        assigned, probs = _router_sums(logits, spec.num_local_experts, spec.num_experts_per_tok)
        group, ranks = self._pp_ranks()
        others = [torch.empty(2, spec.num_local_experts) for _ in ranks[:-1]]
        for src, part in zip(ranks[:-1], others, strict=True):
            dist.recv(part, src=src, group=group, tag=_AUX_TAG)
        assigned = assigned + sum(part[0] for part in others)
        for dst in ranks[:-1]:  # every stage's gradient needs every layer's assignments
            self._aux_sends.append((dist.isend(assigned, dst=dst, group=group, tag=_AUX_TAG + 1), assigned))
        total = probs + sum(part[1] for part in others)  # the earlier stages' without gradient
        return self._aux_scale(logits) * torch.sum(assigned * total)

    def _aux_scale(self, logits: list, slices: int = 1) -> float:
        """coef x E / N^2, N = the micro-batch's (token, layer) rows over all layers: the load-balancing
        loss is coef x E x sum_e (assignments to e / N) (probabilities of e / N). ``slices``: the
        tensor-parallel ranks whose sequence slices together make the micro-batch's tokens."""
        spec = self.ctx.job.model
        rows = logits[0].shape[0] * slices * spec.num_hidden_layers
        return spec.router_aux_loss_coef * spec.num_local_experts / rows**2

    def _tp_aux_loss(self, logits: list):
        """The load-balancing loss of the micro-batch's tokens when tensor-parallel ranks route the
        slices sequence parallelism gives them (megatron-core refuses tp > 1 with MoE without it): the
        assignments and probabilities summed over the tensor-parallel group, the whole loss on every
        rank, its gradient through this rank's probabilities only - megatron-core sums the router's
        gradient over the group (a ``sequence_parallel`` parameter), which adds the other slices'."""
        import torch
        import torch.distributed as dist

        spec = self.ctx.job.model
        assigned, probs = _router_sums(logits, spec.num_local_experts, spec.num_experts_per_tok)
        group = self.ps.get_tensor_model_parallel_group()
        sums = torch.stack([assigned, probs.detach()])
        dist.all_reduce(sums, group=group)
        total_probs = probs + (sums[1] - probs.detach())  # the value of the sum, the gradient of this slice
        return self._aux_scale(logits, self.opts.tp) * torch.sum(sums[0] * total_probs)

    def _pp_ranks(self):
        import torch.distributed as dist

        group = self.ps.get_pipeline_model_parallel_group()
        return group, dist.get_process_group_ranks(group)

    def _stage_aux(self, hidden, micro_batches: int):
        """A stage before the last (pp > 1): its layers' share of the load-balancing loss of Mixtral, a
        product of sums over all layers that no stage can compute alone. Its routed assignments and
        summed router probabilities go to the last stage, which computes the loss's value; in the
        backward its probabilities get the loss's gradient, coef x E / N^2 x the assignments summed over
        all layers (received from the last stage) / the micro-batches (the schedule's averaging)."""
        import torch
        import torch.distributed as dist

        spec = self.ctx.job.model
        logits = [x.reshape(-1, spec.num_local_experts) for x in self._router_logits]
        self._router_logits.clear()
        assigned, probs = _router_sums(logits, spec.num_local_experts, spec.num_experts_per_tok)
        group, ranks = self._pp_ranks()
        sent = torch.stack([assigned, probs.detach()])
        self._aux_sends.append((dist.isend(sent, dst=ranks[-1], group=group, tag=_AUX_TAG), sent))

        def received():
            out = assigned.new_empty(assigned.shape)
            dist.recv(out, src=ranks[-1], group=group, tag=_AUX_TAG + 1)
            return out * (self._aux_scale(logits) / micro_batches)

        return _aux_gradient().apply(hidden, probs, received)

    def _wrap_ddp(self, chunks: list, config) -> list:
        """Megatron's DDP around each model chunk (bucketing on the first only), replicas identical."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        o = self.opts
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=o.overlap_grad_reduce,
            overlap_param_gather=o.overlap_param_gather,
            use_distributed_optimizer=o.distributed_optimizer,
            bucket_size=o.bucket_size or None,
            average_in_collective=False,
        )
        wrapped = [
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=m, disable_bucketing=(i > 0))
            for i, m in enumerate(chunks)
        ]
        for m in wrapped:  # DDP copied the weights into its buffers; broadcast keeps replicas identical
            m.broadcast_params()
        return wrapped

    def _wire_schedules(self, config):
        """Wire the schedules to the DDP wrappers, as megatron's training loop does; returns the
        forward-backward schedule function."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func

        o = self.opts
        one = lambda fns: fns[0] if len(fns) == 1 else fns  # noqa: E731
        if o.overlap_grad_reduce:
            config.no_sync_func = one([m.no_sync for m in self.chunks])
            config.grad_sync_func = one([m.start_grad_sync for m in self.chunks])
        if o.overlap_param_gather:
            config.param_sync_func = one([m.start_param_sync for m in self.chunks])
        config.finalize_model_grads_func = finalize_model_grads
        return get_forward_backward_func()

    def _redirect_inside_backward(self, torch) -> None:
        """Keep the redirection's device-rewriting TorchFunctionMode active in autograd backward.

        The autograd engine runs ``torch.autograd.Function.backward`` with an empty mode stack, so
        ``torch.empty(..., device=torch.cuda.current_device())`` in megatron-core's backward passes
        (sequence-parallel reduce-scatter/all-gather) would name the absent CUDA device 0. The
        engine calls ``BackwardCFunction.apply``: re-enter the mode there (scoped, undone in close).
        """
        from torch.overrides import _get_current_function_mode_stack

        stack = _get_current_function_mode_stack()
        if not stack:
            return
        mode = stack[-1]  # parabench.redirect enters its device mode last

        def make(apply):
            def apply_redirected(ctx, *args):
                if _get_current_function_mode_stack():
                    return apply(ctx, *args)
                with mode:
                    return apply(ctx, *args)

            return apply_redirected

        self.counters.patch(torch.autograd.function.BackwardCFunction, "apply", make)

    def _use_te(self) -> bool:
        impl = self.opts.transformer_impl
        if impl == "local" or self.device_type != "cuda" or self.ctx.job.model.is_moe:
            return False
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            if impl == "transformer_engine":
                raise RuntimeError(
                    "backend.transformer_impl=transformer_engine but transformer_engine is not importable"
                ) from None
            return False
        return True

    @staticmethod
    def _layer_spec(use_te: bool, config):
        from megatron.core.models.gpt import gpt_layer_specs

        # Returns vp_stage -> spec (a ModuleSpec is itself callable: it builds the module).
        if use_te:
            te_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
            return lambda vp_stage: te_spec
        # num_experts: MoELayer (router, token dispatcher, SequentialMLP experts) as every layer's MLP
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=False, normalization="RMSNorm"
        )
        if not config.sequence_parallel:
            return lambda vp_stage: spec
        # Without Apex the local spec's norm is torch's (WrappedTorchNorm), which asserts
        # sequence_parallel is off: its weight lacks the ``sequence_parallel`` mark that makes
        # finalize_model_grads all-reduce norm gradients over the TP group (each rank saw only its
        # sequence slice). Same math, marked weight (as Megatron's FusedLayerNorm marks it).
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        norm = _sequence_parallel_rmsnorm()
        layer = dataclasses.replace(
            spec, submodules=dataclasses.replace(spec.submodules, input_layernorm=norm, pre_mlp_layernorm=norm)
        )
        return lambda vp_stage: TransformerBlockSubmodules(
            layer_specs=[layer] * num_layers_to_build(config, vp_stage), layer_norm=norm
        )

    @staticmethod
    def _load(model, shard: dict) -> None:
        import torch

        params = dict(model.named_parameters())
        differ = set(params) ^ set(shard)
        if differ:
            raise RuntimeError(f"megatron and mapped parameter names differ: {sorted(differ)[:6]}")
        with torch.no_grad():
            for name, value in shard.items():
                p = params[name]
                if tuple(p.shape) != value.shape:
                    raise RuntimeError(f"{name}: megatron shape {tuple(p.shape)} != mapped {value.shape}")
                p.copy_(torch.from_numpy(value))

    def _instrument(self) -> None:
        import torch.distributed as dist
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.tensor_parallel import mappings

        c = self.counters
        for name in (
            "all_reduce",
            "all_gather",
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "_all_gather_base",
            "_reduce_scatter_base",
        ):
            if hasattr(dist, name):
                c.patch(dist, name, c.collective)
        for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):  # bound at megatron import
            c.patch(mappings, name, c.collective)
        c.patch(schedules, "forward_step", c.timed)
        c.patch(schedules, "backward_step", c.timed)

    # -- Engine ----------------------------------------------------------------------------------
    def _megatron_optimizers(self) -> list:
        """Megatron's optimizers that wrap a torch optimizer (a ChainedOptimizer holds several)."""
        return [o for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer]) if o.optimizer is not None]

    def param_groups(self) -> list[dict]:
        return [g for o in self._megatron_optimizers() for g in o.optimizer.param_groups]

    def data_parallel(self) -> tuple[int, int]:
        return self.ps.get_data_parallel_rank(), self.ps.get_data_parallel_world_size()

    def train_step(self, micro_batches):
        import torch
        import torch.distributed as dist

        o, job = self.opts, self.ctx.job
        seq = job.data.seq_len
        for m in self.chunks:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()

        def forward_step(data_iterator, model):
            tokens, labels = next(data_iterator)
            positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
            if o.cp > 1:  # this CP rank's 2 of 2*cp sequence chunks (load-balanced causal split)
                from megatron.core.utils import get_batch_on_this_cp_rank

                b = get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels, "position_ids": positions})
                tokens, labels, positions = b["tokens"], b["labels"], b["position_ids"]
            self._router_logits.clear()
            per_token = model(tokens, positions, None, labels=labels)  # loss on the last stage, hidden states elsewhere
            if not job.model.is_moe:
                return per_token, _loss
            if not self.ps.is_pipeline_last_stage(ignore_virtual=True):
                return self._stage_aux(per_token, len(micro_batches)), _loss
            return per_token, lambda per_token: _loss(per_token, self._aux_loss())

        data = [iter(micro_batches) for _ in self.chunks] if len(self.chunks) > 1 else iter(micro_batches)
        self.counters.active = True
        t0 = time.perf_counter()
        losses = self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=data,
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=seq,
            micro_batch_size=job.data.micro_batch_size,
            forward_only=False,
        )
        self.schedule_s += time.perf_counter() - t0
        ok, _grad_norm, _ = self.optimizer.step()
        self.counters.active = False
        while self._aux_sends:  # the stages' router statistics sent to the last stage (pp > 1)
            self._aux_sends.pop()[0].wait()
        if not ok:
            raise RuntimeError("megatron optimizer step was skipped (non-finite gradients)")
        self.steps += 1

        loss = torch.zeros((), dtype=torch.float32)
        if self.ps.is_pipeline_last_stage(ignore_virtual=True):
            loss = torch.stack([d["loss"] for d in losses]).float().mean()
        if o.pp > 1:
            dist.broadcast(
                loss,
                src=self.ps.get_pipeline_model_parallel_last_rank(),
                group=self.ps.get_pipeline_model_parallel_group(),
            )
        return loss

    def full_state_dict(self):
        return self._gather_canonical(lambda name, p: p)

    def _gather_canonical(self, value_of, to_all: bool = True):
        """Canonical full tensors of ``value_of(name, param)`` over every chunk's parameters: gathered
        over the TP group and mapped back (fused QKV / gate-up split, megatron_mapping.from_megatron;
        elementwise states such as AdamW moments map exactly as the weights do), then over the stages.
        ``to_all=False``: only tensor-parallel rank 0 gathers and maps (the others return what their
        pipeline peers of the same tp rank hold: nothing), so rank 0 holds the whole state, not every rank."""
        import numpy as np
        import torch
        import torch.distributed as dist

        from parabench.adapters.megatron_mapping import from_megatron

        ps, spec = self.ps, self.ctx.job.model
        tp_group, tp = ps.get_tensor_model_parallel_group(), self.opts.tp
        canonical: dict[str, np.ndarray] = {}
        for c, chunk in enumerate(self.chunks):
            local = {n: value_of(n, p).detach().float() for n, p in _unwrap(chunk).named_parameters()}
            shards = []
            if tp > 1 and not to_all:
                mine = self.tp_rank == 0
                for name in sorted(local):
                    parts = [torch.empty_like(local[name]) for _ in range(tp)] if mine else None
                    dist.gather(
                        local[name].contiguous(), parts, dst=ps.get_tensor_model_parallel_src_rank(), group=tp_group
                    )
                    local[name] = parts
                if not mine:
                    continue
                shards = [{n: local[n][r].cpu().numpy() for n in local} for r in range(tp)]
            elif tp > 1:
                gathered = {}
                for name in sorted(local):
                    parts = [torch.empty_like(local[name]) for _ in range(tp)]
                    dist.all_gather(parts, local[name].contiguous(), group=tp_group)
                    gathered[name] = parts
                shards = [{n: gathered[n][r].cpu().numpy() for n in gathered} for r in range(tp)]
            else:
                shards = [{n: t.cpu().numpy() for n, t in local.items()}]
            canonical.update(from_megatron(shards, spec, self.layout, self.stage, c, self.ep_rank))
        if self.opts.ep > 1:  # each expert-parallel rank mapped its own experts: merge them
            parts = [None] * self.opts.ep
            dist.all_gather_object(parts, canonical, group=ps.get_expert_model_parallel_group())
            canonical = {k: v for part in parts for k, v in part.items()}
        if self.opts.pp > 1:
            parts: list = [None] * self.opts.pp
            dist.all_gather_object(parts, canonical, group=ps.get_pipeline_model_parallel_group())
            canonical = {k: v for part in parts for k, v in part.items()}
        return {n: torch.from_numpy(v) for n, v in canonical.items()}

    # -- bench convert: AdamW state per parameter, through the same mapping as the weights ----------
    def _main_param(self, p):
        """The fp32 copy of model parameter ``p`` the optimizer steps: Float16OptimizerWithFloat16Params'
        main param under bf16 (``fp32_from_float16_groups``, paired with ``float16_groups``), ``p``
        itself in fp32. Under bf16 it holds the bits the bf16 weights are rounded from."""
        for mo in self._megatron_optimizers():
            groups = zip(getattr(mo, "float16_groups", []), getattr(mo, "fp32_from_float16_groups", []))
            main = next((b for g16, g32 in groups for a, b in zip(g16, g32) if a is p), None)
            if main is not None:
                return main
        return p

    def _adam_state(self, p) -> dict:
        """The torch AdamW state of model parameter ``p``, on its main copy (:meth:`_main_param`);
        created as AdamW would (zero moments, step 0.0) where no step has run yet."""
        import torch

        main = self._main_param(p)
        for mo in self._megatron_optimizers():
            if any(q is main for g in mo.optimizer.param_groups for q in g["params"]):
                state = mo.optimizer.state[main]
                if "exp_avg" not in state:
                    state.update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(main), exp_avg_sq=torch.zeros_like(main)
                    )
                return state
        raise RuntimeError("a megatron parameter is in none of the optimizer's groups")

    def _gathered(self, value_of) -> Lazy:
        """The canonical tensors of ``value_of`` gathered (a collective) when canonical.write or
        checksum first reaches one of them, and dropped once it has passed them all: weights and
        the two moments are held one group at a time, not together."""
        shapes = self.ctx.job.model.parameter_shapes()
        return Lazy(shapes, whole=lambda: self._gather_canonical(value_of, to_all=False), complete=self.ctx.rank == 0)

    def export_canonical(self):
        if self.opts.distributed_optimizer:  # each data-parallel rank holds slices: put them together
            params = [p for c in self.chunks for p in _unwrap(c).parameters()]
            whole, step = megatron_distopt.gather_whole(self._megatron_optimizers(), params)
            weights = self._gathered(lambda _n, p: whole[p]["param"])
            moments = {k: self._gathered(lambda _n, p, k=k: whole[p][k]) for k in MOMENTS}
            return CanonicalState(weights, moments, step)
        # the fp32 main copies, not the bf16 weights rounded from them: a bf16 run resumes exactly
        weights = self._gathered(lambda _n, p: self._main_param(p))
        moments = {k: self._gathered(lambda _n, p, k=k: self._adam_state(p)[k]) for k in MOMENTS}
        steps = {float(self._adam_state(p)["step"]) for c in self.chunks for p in _unwrap(c).parameters()}
        if len(steps) != 1:
            raise RuntimeError(f"AdamW step counts differ between parameters: {sorted(steps)}")
        return CanonicalState(weights, moments, int(steps.pop()))

    def import_canonical(self, state):
        """The model's weights came from the canonical ones (``model.weights``), rounded to bf16 under
        bf16, and Megatron's fp32 main copies from those: set the main copies to the canonical fp32
        values, then the AdamW moments and step."""
        import torch

        from parabench.adapters.megatron_mapping import canonical_names, to_megatron

        spec = self.ctx.job.model
        for c, chunk in enumerate(self.chunks):
            params = dict(_unwrap(chunk).named_parameters())
            wanted = canonical_names(spec, self.layout, self.stage, c, self.ep_rank)

            def shards(values, c=c, wanted=wanted):  # the full tensors read one at a time as the mapping takes them
                full = view(values, wanted, lambda t: t.numpy() if hasattr(t, "numpy") else t)
                return to_megatron(full, spec, self.layout, self.stage, c, self.tp_rank, self.ep_rank).items()

            if self.opts.distributed_optimizer:  # this rank's slices of the main params and moments
                whole = {"param": dict(shards(state.weights))}
                whole.update({key: dict(shards(values)) for key, values in (state.moments or {}).items()})
                for name, p in params.items():
                    step = None if state.moments is None else state.step
                    values = {key: whole[key][name] for key in whole}
                    megatron_distopt.put_piece(self._megatron_optimizers(), p, values, step)
                continue
            mains = {n: self._main_param(p) for n, p in params.items()}
            if any(mains[n] is not p for n, p in params.items()):  # bf16: separate fp32 main copies
                for name, value in shards(state.weights):
                    mains[name].data.copy_(torch.from_numpy(value).view_as(mains[name]))
            if state.moments is None:
                continue
            for key, values in state.moments.items():
                for name, value in shards(values):
                    target = self._adam_state(params[name])[key]
                    target.copy_(torch.from_numpy(value).view_as(target))
            for p in params.values():
                self._adam_state(p)["step"] = torch.tensor(float(state.step))
        if state.moments is not None:
            self.steps = state.step

    # -- checkpoints: megatron.core.dist_checkpointing ------------------------------------------
    def _sharded_state_dict(self, is_loading: bool, distopt_format: str | None) -> dict:
        """Megatron-LM's layout (training/checkpointing.py generate_state_dict): ``model`` (or
        ``model0``, ``model1``.. per virtual stage) and ``optimizer``, whose states point at the
        model's ShardedTensors; the distributed optimizer's in ``distopt_format``
        (megatron_compat.distopt_format: one tensor of the parameter's shape per state, reshardable)."""
        models = [_unwrap(chunk) for chunk in self.chunks]  # GPTModel: Megatron-LM unwraps DDP/Float16Module too
        if len(models) == 1:
            state = {"model": models[0].sharded_state_dict()}
        else:
            state = {f"model{i}": model.sharded_state_dict() for i, model in enumerate(models)}
        kwargs = optimizer_state_kwargs(self._distributed_optimizer(), distopt_format) if distopt_format else {}
        state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=is_loading, **kwargs)
        return state

    def _distributed_optimizer(self) -> type:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        return DistributedOptimizer

    def _distopt_format(self) -> str | None:
        """The format this release saves the distributed optimizer in (None without one)."""
        return distopt_format(self._distributed_optimizer()) if self.opts.distributed_optimizer else None

    def _strategies(self, directory, saving: bool):
        """torch_dist (PyTorch DCP files) with the work spread over the data-parallel replicas."""
        from megatron.core.dist_checkpointing.serialization import (
            get_default_load_sharded_strategy,
            get_default_save_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelLoadStrategyWrapper,
            FullyParallelSaveStrategyWrapper,
        )

        group = self.ps.get_data_parallel_group(with_context_parallel=True)
        if saving:
            return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), group)
        return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(directory)), group)

    def _gather_updated_params(self) -> None:
        """With overlap_param_gather, the weights other data-parallel ranks updated reach this rank's
        model only in the next forward's all-gather: gather them now, or the model's part of the
        checkpoint is one step behind its optimizer's (Megatron-LM's save_checkpoint_and_time does
        the same: force_param_sync, megatron/training/training.py). Megatron then marks the gather
        done, so the next forward would skip it; it is marked pending again, so the step after a save
        communicates what every other step does (the measured volume stays the formula's)."""
        if not self.opts.overlap_param_gather:
            return
        for chunk in self.chunks:
            chunk.start_param_sync(force_sync=True)
            for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                group.param_gather_dispatched = False

    def save_checkpoint(self, directory, *, async_save: bool = False) -> None:
        from megatron.core import dist_checkpointing

        Path(directory).mkdir(parents=True, exist_ok=True)  # every rank: dist_checkpointing needs it to exist
        self._gather_updated_params()
        fmt = self._distopt_format()
        state = self._sharded_state_dict(is_loading=False, distopt_format=fmt)
        strategy = self._strategies(directory, saving=True)
        recorded = content_metadata_kwargs(dist_checkpointing.save, fmt) if fmt else {}
        request = dist_checkpointing.save(state, str(directory), strategy, async_sharded_save=async_save, **recorded)
        if request is not None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._async_queue = self._async_queue or AsyncCallsQueue()
            self._async_queue.schedule_async_request(request)

    def finish_checkpoint(self) -> None:
        if self._async_queue is not None:
            self._async_queue.maybe_finalize_async_calls(blocking=True, no_dist=False)

    def load_checkpoint(self, directory) -> None:
        from megatron.core import dist_checkpointing

        fmt = self._distopt_format()
        fmt = fmt and saved_distopt_format(str(directory), fmt)
        with loading_torch_adam(self._megatron_optimizers()):
            state = self._sharded_state_dict(is_loading=True, distopt_format=fmt)
            loaded = dist_checkpointing.load(state, str(directory), self._strategies(directory, saving=False))
            models = [_unwrap(chunk) for chunk in self.chunks]
            for i, model in enumerate(models):
                model.load_state_dict(loaded["model" if len(models) == 1 else f"model{i}"])
            self.optimizer.load_state_dict(loaded["optimizer"])

    def model_state_bytes(self) -> ModelStateBytes:
        params = [p for m in self.chunks for p in m.parameters()]
        optimizers = self._megatron_optimizers()
        moments, other = optimizer_state_tensors(o.optimizer for o in optimizers)
        main = []
        for opt in optimizers:
            # fp32 master copies of low-precision params (bf16): Float16Optimizer / DistributedOptimizer
            for groups in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
                for group in getattr(opt, groups, []) or []:
                    main.extend(group)
        grads = [getattr(p, "main_grad", None) for p in params]
        param_bytes = held_bytes(params)
        main_bytes = held_bytes(main)
        return ModelStateBytes(
            params=param_bytes,
            grads=held_bytes(grads),
            optimizer=held_bytes(moments) + main_bytes,
            optimizer_other=held_bytes(other),
            detail={"fp32_main_params": main_bytes, "param_count": sum(p.numel() for p in params)},
        )

    def extra_metrics(self) -> dict[str, float]:
        o, m = self.opts, self.ctx.job.grad_accum
        out: dict[str, float] = {}
        if o.pp > 1:
            out["pipeline_bubble_predicted"] = (o.pp - 1) / (o.vpp * m)  # Narayanan et al. 2021, 2104.04473
        if self.steps and self.schedule_s > 0:
            rank = self.ctx.rank
            if o.pp > 1:
                out[f"rank{rank}.pipeline_bubble_measured"] = max(0.0, 1.0 - self.counters.compute_s / self.schedule_s)
            if o.tp > 1:
                layers = self.ctx.job.model.num_hidden_layers // o.pp
                out[f"rank{rank}.tp_collectives_per_step"] = self.counters.tp_calls / self.steps
                out[f"rank{rank}.tp_comm_bytes_per_step"] = self.counters.tp_bytes / self.steps
                out["tp_decoder_allreduces_predicted_per_step"] = 4 * layers * m  # 2 fwd + 2 bwd per layer
        return out

    def artifacts(self) -> dict[str, Any]:
        return {
            "megatron": {
                "version": package_version("megatron-core"),
                "layout": dataclasses.asdict(self.layout),
                "transformer_config": {
                    k: str(v) for k, v in sorted(vars(self.config).items()) if not k.startswith("_") and not callable(v)
                },
            }
        }

    def close(self) -> None:
        if self._async_queue is not None:
            self._async_queue.close()  # waits for a save still running
            self._async_queue = None
        ps = getattr(self, "ps", None)
        if ps is not None and ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        self.counters.restore()
        if self._redirection is not None:
            self._redirection.remove()
            self._redirection = None


def _mark_tensor_parallel(model) -> None:
    """Give every tensor-parallel weight the marks Megatron's own init sets
    (``set_tensor_model_parallel_attributes``), which ``perform_initialization=False`` skips
    (docs/sources.md#megatron-tensor-parallel-marks). Unmarked, ``param_is_not_tensor_parallel_duplicate``
    counts the shards of tp rank 0 only in the gradient norm: with tp=2 it was the true norm / sqrt(2),
    so ``optim.grad_clip`` let through sqrt(2) x the clipped gradient, and AdamW's moments had twice
    the scale (squared) of a tp=1 run's (a tp=2 -> tp=1 resume then went wrong)."""
    from megatron.core.tensor_parallel import layers

    dims = {layers.ColumnParallelLinear: 0, layers.VocabParallelEmbedding: 0, layers.RowParallelLinear: 1}
    for module in model.modules():
        mode = {"column": 0, "row": 1}.get(getattr(module, "parallel_mode", None))  # Transformer Engine layers
        dim = next((d for cls, d in dims.items() if isinstance(module, cls)), mode)
        weight = getattr(module, "weight", None)
        if dim is not None and weight is not None and not getattr(weight, "tensor_model_parallel", False):
            layers.set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


def _sequence_parallel_rmsnorm():
    import torch

    class SequenceParallelRMSNorm(torch.nn.RMSNorm):
        """torch RMSNorm whose weight is marked for the TP all-reduce of sequence-parallel grads."""

        def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_ignored):
            super().__init__(hidden_size, eps=eps)
            self.weight.sequence_parallel = bool(config.sequence_parallel)

    return SequenceParallelRMSNorm


_AUX_TAG = 3100  # p2p tags of the load-balancing loss's exchange between stages (megatron's own p2p: 0)


def _router_sums(logits: list, experts: int, top_k: int):
    """(assignments to each expert, router probabilities of each expert) summed over the rows of
    ``logits`` (one [rows, experts] tensor per layer), as ``load_balancing_loss`` computes them: softmax
    in fp32, the top-k of it, one assignment per (row, slot); the probabilities keep their gradient."""
    import torch
    import torch.nn.functional as F

    probs = F.softmax(torch.cat(logits, dim=0), dim=-1, dtype=torch.float)
    _, selected = torch.topk(probs, top_k, dim=-1)
    assigned = F.one_hot(selected, experts).float().sum(dim=(0, 1))
    return assigned, probs.sum(dim=0)


def _aux_gradient():
    """An autograd function: the stage's output unchanged forward; backward, its gradient unchanged and
    the router probabilities' of the load-balancing loss (``received()``), as a stage before the last
    one cannot add the loss to a loss of its own (megatron-core backpropagates its output)."""
    import torch

    class AuxGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, probs, received):
            ctx.received = received
            return hidden.view_as(hidden)

        @staticmethod
        def backward(ctx, grad):
            return grad, ctx.received(), None

    return AuxGradient


def _loss(per_token, aux_loss=0.0):
    # token mean of this micro-batch (+ a MoE model's load-balancing term, MegatronEngine._aux_loss)
    loss = per_token.float().mean() + aux_loss
    # The schedule divides the returned tensor by m in place: report a copy.
    return loss, {"loss": loss.detach().clone()}


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module
