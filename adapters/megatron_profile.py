"""The megatron backend as the planner sees it (``MegatronAdapter.plan_profile``; mindspeed's is
this one without expert parallelism; adapters/profile.py), and the parameters a rank of a
Megatron layout holds (``rank_param_counts``), which the adapter's model-state formula uses too."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from parabench.adapters.profile import Profile, States, divisors, param_bytes
from parabench.commvolume import Layout, round_up
from parabench.spec import JobSpec, ModelSpec


# ---------------------------------------------------------------------------- megatron, mindspeed
def _mlp_numel(model: ModelSpec, tp: int, ep: int) -> int:
    """One layer's MLP parameters on one rank: the dense SwiGLU split over TP, or a MoE layer's
    replicated router and its num_local_experts / ep experts (docs/sources.md#megatron-moe), plus a
    shared expert: megatron-core's SharedExpertMLP, fc1/fc2 split over TP like the dense MLP and its
    (1, hidden) sigmoid gate whole on every rank (moe/shared_experts.py ``gate_weight``)."""
    h = model.hidden_size
    if not model.is_moe:
        return 3 * model.intermediate_size * h // tp
    experts = model.num_local_experts // ep
    shared = model.shared_expert_intermediate_size
    shared_numel = 3 * shared * h // tp + h if shared else 0
    return model.num_local_experts * h + experts * 3 * model.expert_intermediate_size * h // tp + shared_numel


def _shard_numel(model: ModelSpec, tp: int, first: bool, last: bool, layers: int, ep: int = 1) -> int:
    """Parameters one tensor (and expert) rank of one model chunk holds (norms replicated over TP)."""
    h, d = model.hidden_size, model.head_dim
    qkv = (model.num_attention_heads + 2 * model.num_key_value_heads) * d
    bias = qkv // tp if model.qkv_bias else 0  # add_qkv_bias: linear_qkv's bias, split with its rows
    per_layer = 2 * h + qkv * h // tp + bias + h * model.num_attention_heads * d // tp + _mlp_numel(model, tp, ep)
    n = layers * per_layer
    if first:
        n += model.vocab_size * h // tp
    if last:
        n += h + (0 if model.tie_word_embeddings else model.vocab_size * h // tp)
    return n


def rank_param_counts(job: JobSpec) -> dict[tuple[int, int], int]:
    """(pipeline stage, tensor rank) -> parameters held, summed over the stage's virtual chunks."""
    o, m = job.backend.options, job.model
    per_chunk = m.num_hidden_layers // (o.pp * o.vpp)
    out = {}
    for s in range(o.pp):
        for r in range(o.tp):
            out[(s, r)] = sum(
                _shard_numel(m, o.tp, s == 0 and c == 0, s == o.pp - 1 and c == o.vpp - 1, per_chunk, o.ep)
                for c in range(o.vpp)
            )
    return out


def _mg_states(job: JobSpec) -> States:
    """Megatron keeps params (working dtype) and fp32 main grads in contiguous buffers; with the
    distributed optimizer each buffer is padded to a multiple of dp (x 128 elements per bucket in
    megatron-core) and the fp32 main params + Adam moments are sharded over dp. A MoE model's experts
    (``E / ep`` of each layer on a rank: ``rank_param_counts``) sit in buffers of their own, which the
    distributed optimizer pads and shards over the expert-data-parallel group, dp / ep ranks
    (megatron-core 0.16 ``distributed_data_parallel.py``: ``expert_parallel_buffers`` on
    ``intra_expt_dp_group``; ``optimizer/__init__.py``: the ``is_expert_parallel`` groups); docs/moe.md#planner."""
    o, dp = job.backend.options, job.parallel.dp
    psi = max(rank_param_counts(job).values())
    b = param_bytes(job)
    main = 4 if job.run.precision != "fp32" else 0  # fp32 training steps the params themselves
    experts = expert_numel(job)
    if o.distributed_optimizer:
        edp = dp // o.ep
        dense = _dist_opt_padded(psi - experts, dp)
        expert = _dist_opt_padded(experts, edp) if experts else 0
        padded = dense + expert
        optimizer = (8 + main) * (dense / dp + expert / edp)
        held = (b + 4.0) * expert + (8 + main) * expert / edp
        exact = {"exact_elements": psi, "exact_expert_elements": experts}
        return States(
            b * padded, 4.0 * padded, optimizer, 0.0, padded, expert_elements=expert, expert_bytes=held, **exact
        )
    held = (b + 4.0 + 8.0 + main) * experts
    exact = {"exact_elements": psi, "exact_expert_elements": experts}
    return States(b * psi, 4.0 * psi, (8.0 + main) * psi, 0.0, psi, expert_elements=experts, expert_bytes=held, **exact)


def _dist_opt_padded(n: int, ranks: int) -> int:
    """A distributed-optimizer buffer of ``n`` elements padded to a multiple of its ranks (x 128)."""
    return round_up(n, math.lcm(ranks, 128)) if ranks > 1 else n


def expert_numel(job: JobSpec) -> int:
    """Expert parameters one megatron rank holds: the E / ep experts of each of its stage's layers,
    SwiGLU (fc1 = [gate; up], fc2 = down) of width ``moe_intermediate_size``, split over the expert
    tensor-parallel size (megatron-core's default: tp); the router is replicated with the dense ones."""
    m, o = job.model, job.backend.options
    if not m.is_moe:
        return 0
    per_expert = 3 * m.hidden_size * m.expert_intermediate_size // o.tp
    return m.num_hidden_layers // o.pp * (m.num_local_experts // o.ep) * per_expert


VPP_SEARCHED = (1, 2, 4)  # virtual pipeline stages per pipeline rank the search tries


def _mg_options(world: int, per_node: int, offload: bool) -> Iterator[dict[str, Any]]:
    """tp and cp inside a node (their collectives run per layer; the search keeps tp x cp within
    the node's devices), pp and dp over the rest. cp > 1 is refused by the harness where it cannot
    run (megatron: CUDA with Transformer Engine only; mindspeed: on the NPU)."""
    for tp in (d for d in divisors(world) if d <= per_node):
        for cp in (d for d in divisors(world // tp) if tp * d <= per_node):
            for pp in divisors(world // (tp * cp)):
                # interleaving depths the published runs use (MindSpeed-LLM's Llama 2 70B: 4); a depth
                # the model's layers do not divide is refused by the adapter's validate, like bench run
                for vpp in VPP_SEARCHED if pp > 1 else (1,):
                    for sp in (False, True) if tp > 1 else (False,):
                        for dist_opt in (False, True) if world // (tp * cp * pp) > 1 else (False,):
                            yield {
                                "tp": tp,
                                "cp": cp,
                                "pp": pp,
                                "vpp": vpp,
                                "sequence_parallel": sp,
                                "distributed_optimizer": dist_opt,
                            }


def _mg_experts(options: dict[str, Any], world: int, experts: int) -> Iterator[dict[str, Any]]:
    """Expert-parallel sizes with a MoE model: the divisors of dp that divide the routed experts
    (megatron-core carves the ep groups out of the data-parallel ranks). The adapter's validate refuses
    what it cannot run (with MoE: vpp, cp > 1, tp > 1 without sequence parallelism or with pp > 1,
    full recompute), counted like any other refusal. Not searched: tp > 1 with a MoE model (expert
    tensor parallelism runs, and its token dispatcher's gathers over the tensor ranks are in the
    communication formula, commvolume.moe_all_to_all, but the estimate would hide them as the dense
    layers' fused tensor-parallel collectives: such a layout would be priced too cheap)."""
    if not experts:
        yield {}
        return
    if options["tp"] > 1:
        return
    dp = world // (options["tp"] * options["cp"] * options["pp"])
    yield from ({"ep": e} for e in divisors(dp) if experts % e == 0)


def _mg_buffers(job: JobSpec) -> float:
    """Context parallelism's ring: while a rank computes with one K/V chunk it receives the next
    (and in the backward the K/V and their gradients), so two chunks of one layer are in flight
    beside the stored activations (Megatron-Core docs, context_parallel; Liu et al. 2023, sec. 3)."""
    o, m, d = job.backend.options, job.model, job.data
    if o.cp <= 1:
        return 0.0
    kv_heads = max(m.num_key_value_heads // o.tp, 1)
    chunk = 2 * d.micro_batch_size * (d.seq_len // o.cp) * kv_heads * m.head_dim * param_bytes(job)
    return 2.0 * chunk


def _mg_param_overlap(job: JobSpec) -> float:
    """overlap_param_gather (distributed optimizer): the next bucket's parameter all-gather runs
    during the forward (Megatron-Core docs, distributed optimizer) on a device with streams; on the
    CPU (no streams) it blocks, as FSDP's does (``_fsdp_overlap``)."""
    o = job.backend.options
    return float(o.overlap_param_gather and o.distributed_optimizer and job.device.type != "cpu")


def _mg_param_gathers(job: JobSpec) -> int:
    """How often a step all-gathers every parameter buffer (dense and expert): megatron-core's
    ChainedOptimizer steps one DistributedOptimizer per param-group kind - the dense one over dp and,
    with MoE, the experts' over dp / ep - and each one's ``step_with_ready_grads`` calls
    ``start_param_sync`` on every model chunk, which gathers all of the chunk's bucket groups, the
    expert ones too (megatron-core 0.16.1 optimizer/distrib_optimizer.py, distributed/
    distributed_data_parallel.py ``start_param_sync``): twice per step with experts unless
    ``overlap_param_gather`` moves the gathers to the forward's pre-hooks. Measured: moe-tiny ep=2 on
    2 ranks, 4 all-gathers per step (2 buffers x 2 optimizers), bus bytes twice the single gather's;
    at ep = 1 one all-gather (the experts sit in the dense buffers, one optimizer)."""
    o = job.backend.options
    experts_apart = expert_numel(job) > 0 and o.ep > 1  # at ep = 1 they share the dense buffers
    return 2 if o.distributed_optimizer and experts_apart and not o.overlap_param_gather else 1


def interleaved_warmup(pp: int, vpp: int, micro_batches: int) -> int:
    """Forward chunk-steps the interleaved schedule runs before its first backward on pipeline rank 0
    (the busiest), and as many backward chunk-steps after its last forward: megatron-core's
    ``forward_backward_pipelining_with_interleaving``, (p - 1) x 2 + (v - 1) x the micro-batch group
    (``microbatch_group_size_per_vp_stage``, default p), at most every one of its m x v chunk-steps."""
    return min(2 * (pp - 1) + (vpp - 1) * pp, micro_batches * vpp)


def _mg_pp_overlap(job: JobSpec) -> float:
    """Share of the pipeline send/recv hidden behind compute (docs/sources.md#plan-overlap). Plain
    1F1B's send/recv blocks: none. The interleaved schedule (Narayanan et al. 2021 sec. 2.2.2) crosses
    v times as many stage boundaries (commvolume counts them) and overlaps a chunk-step's send/recv
    with the next chunk-step's compute (``overlap_p2p_comm``, on by default) only in its steady 1F1B
    phase: its warm-up and cool-down send/recv block (``overlap_p2p_comm_warmup_flush``, off by
    default), 2 x ``interleaved_warmup`` of its 2 m v chunk-steps, a share that grows with v.
    None on the CPU (no streams)."""
    o = job.backend.options
    if o.vpp <= 1 or job.device.type == "cpu":
        return 0.0
    m = job.grad_accum
    return 1.0 - interleaved_warmup(o.pp, o.vpp, m) / (m * o.vpp)


def _mg_recompute(job: JobSpec) -> str:
    """backend.recompute_granularity (adapters/megatron.py): none | selective | full."""
    return job.backend.options.recompute_granularity or "none"


def _mg_recomputed_layers(job: JobSpec) -> float:
    """Full recompute's share of a model chunk's layers: all (uniform), or the first
    recompute_num_layers of each chunk (block; transformer_block.py ``_checkpointed_forward``)."""
    o = job.backend.options
    if o.recompute_granularity != "full" or o.recompute_method != "block":
        return 1.0
    per_chunk = job.model.num_hidden_layers // (o.pp * o.vpp)
    return min(o.recompute_num_layers or 1, per_chunk) / per_chunk


def _mg_layout(job: JobSpec) -> Layout:
    o, par = job.backend.options, job.parallel
    return Layout(
        dp=par.dp,
        tp=o.tp,
        pp=o.pp,
        vpp=o.vpp,
        cp=o.cp,
        sequence_parallel=o.sequence_parallel,
        sharding="distributed_optimizer" if o.distributed_optimizer else "none",
        # megatron-core's tensor_parallel.checkpoint is reentrant: the whole layer forward, its TP
        # collectives included, runs again
        recompute=_mg_recompute(job),  # type: ignore[arg-type]
        ep=o.ep,
    )


PROFILE = Profile(
    _mg_options,
    _mg_layout,
    lambda j: True,
    _mg_states,
    _mg_buffers,
    lambda j: float(j.backend.options.overlap_grad_reduce),
    _mg_recompute,
    lambda j: j.device.type != "cpu",  # megatron-core's local attention (CPU) keeps the scores
    param_overlap=_mg_param_overlap,
    pp_overlap=_mg_pp_overlap,
    # CUDA_DEVICE_MAX_CONNECTIONS=1 orders the asynchronous collective before the next GEMM on the
    # device's streams; on the CPU gloo's collective and the GEMM share the rank's cores (docs/plan.md)
    tp_backward_overlap=lambda j: j.device.type != "cpu",
    recomputed_layers=_mg_recomputed_layers,
    # selective (the attention core again) costs less than full (the whole forward again)
    recompute_options=({"recompute_granularity": "selective"}, {"recompute_granularity": "full"}),
    experts=_mg_experts,
    param_gathers=_mg_param_gathers,
)
