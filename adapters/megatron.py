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

from dataclasses import dataclass
from typing import Literal

from parabench.adapters.base import (
    Adapter,
    Availability,
    Capabilities,
    CheckpointSupport,
    ConvertSupport,
    StateFormula,
    WorkerContext,
)
from parabench.adapters.megatron_build import recompute_settings
from parabench.adapters.megatron_compat import distopt_checkpoint_blocker
from parabench.adapters.megatron_engine import MegatronEngine
from parabench.adapters.megatron_profile import PROFILE, expert_numel, rank_param_counts
from parabench.devices import package_version
from parabench.errors import SpecError
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
    if m.num_experts_per_tok == 1 and m.norm_topk_prob:
        raise SpecError(
            "model.num_experts_per_tok",
            "megatron-core needs moe_router_pre_softmax at top-1, whose weight is the softmax probability, "
            "not Mixtral's renormalised 1: set model.norm_topk_prob=false (that probability, as Qwen2-MoE and "
            "the Switch Transformer weigh their expert) or top-k > 1",
        )
    version = package_version("megatron-core")
    if version is not None and not version.startswith("0.16."):
        raise SpecError(
            "model.num_local_experts", f"MoE on megatron is checked with megatron-core 0.16 only, not {version}"
        )


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
    def create_engine(cls, ctx: WorkerContext) -> MegatronEngine:
        version = package_version("megatron-core")
        if not supported(version):
            raise RuntimeError(unsupported_reason(version))
        return MegatronEngine(ctx)
