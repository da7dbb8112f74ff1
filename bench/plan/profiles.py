"""What the planner knows about each backend: the layouts it can search, how a job's options map
onto the communication model (``parabench.commvolume``), the bytes of model state each rank holds
(padding included), the buffers around them, and the overlap it assumes.

The published per-rank model-state formula of each backend stays in its adapter
(``expected_model_state``); the breakdown here splits exactly that total into parameters,
gradients and optimizer states and adds the backend's padding, and tests/test_plan.py checks
that the two agree before padding for every layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from parabench.adapters.deepspeed_moe import held_numel
from parabench.adapters.megatron import rank_param_counts
from parabench.commvolume import (
    Layout,
    Widths,
    deepspeed_flat_numel,
    fsdp2_padded_numel,
    round_up,
    tp_shard_shapes,
    zero3_padded_numel,
)
from parabench.spec import JobSpec

SRC_OVERLAP = "docs/sources.md#plan-overlap"
SRC_OFFLOAD = "docs/sources.md#zero-offload"
# The offloaded optimizer step reads the fp32 master, gradient and both Adam moments and writes the
# master and moments back: 28 bytes of host memory traffic per element in one fused pass (DeepSpeed's
# CPU Adam), plus the working-dtype copy it writes for the device (docs/sources.md#zero-offload).
HOST_ADAM_BYTES = 28
# torch's own AdamW on the host: DeepSpeed's ZeRO-Offload tutorial puts DeepSpeedCPUAdam 5-7x ahead
# of the standard PyTorch implementation; the planner charges the lower end (docs/sources.md#zero-offload)
TORCH_HOST_ADAM_SLOWDOWN = 5


@dataclass(frozen=True)
class States:
    """Bytes of model state one rank holds; ``host`` of them live in host memory (offload)."""

    params: float
    grads: float
    optimizer: float
    host: float = 0.0
    elements: int = 0  # elements the rank's data-parallel group synchronises (its shard, padded)
    # of ``grads``: what DeepSpeed ZeRO-1/2 keeps beyond the rank's partition (boundary parameters
    # whole, zero_partition_grad_numel); the papers' formulas have no such term
    boundary: float = 0.0
    # of ``elements``: the experts' (MoE), which megatron-core synchronises over the expert-data-parallel
    # group (dp / ep ranks at tp = 1: commvolume.expert_data_parallel), not over dp
    expert_elements: int = 0
    expert_bytes: float = 0.0  # of ``total``: the experts' parameters, gradients and optimizer states
    # the rank's parameters and experts before the distributed optimizer's padding (MoE): the formula
    # without padding, from which bench run reports the padding's bytes (parabench.commreport)
    exact_elements: int = 0
    exact_expert_elements: int = 0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class Offload:
    """What one rank moves between device and host per step (PCIe) and the optimizer step it leaves
    to the host (docs/plan.md#time-per-step)."""

    d2h_bytes: float = 0.0
    h2d_bytes: float = 0.0
    host_elements: float = 0.0  # optimizer elements the host steps
    host_pass_bytes: float = 0.0  # host memory traffic per element of that step
    overlap: float = 0.0  # share of the transfers hidden behind the backward (as data-parallel communication)

    @property
    def transfer_bytes(self) -> float:
        return self.d2h_bytes + self.h2d_bytes


@dataclass(frozen=True)
class Profile:
    """One backend, as the planner sees it."""

    # (world, devices per node, can offload to a host) -> backend options
    layouts: Callable[[int, int, bool], Iterator[dict[str, Any]]]
    layout: Callable[[JobSpec], Layout]
    grad_fp32: Callable[[JobSpec], bool]
    states: Callable[[JobSpec], States]
    buffers: Callable[[JobSpec], float]  # bytes of communication buffers beside the model states
    overlap: Callable[[JobSpec], float]  # share of data-parallel communication hidden behind backward
    recompute: Callable[[JobSpec], str]  # none | selective | full
    # attention through a fused kernel (SDPA, Transformer Engine, npu_fusion_attention): the
    # s x s scores are recomputed in the backward, not stored (Korthikanti's 5as/h term drops)
    fused_attention: Callable[[JobSpec], bool] = lambda job: True
    # FSDP: parameters of the root module gathered once per micro-batch (commvolume's root_elements);
    # None = commvolume's default (the root stays unsharded from forward to backward), 0 = resharded too
    root_elements: Callable[[JobSpec], int | None] = lambda job: None
    offload: Callable[[JobSpec, States], Offload] = lambda job, states: Offload()
    # share of the distributed optimizer's parameter all-gather hidden behind the forward
    param_overlap: Callable[[JobSpec], float] = lambda job: 0.0
    # share of the pipeline send/recv hidden behind compute
    pp_overlap: Callable[[JobSpec], float] = lambda job: 0.0
    # the decoder layers' column-parallel backward collectives run behind its GEMMs without
    # tp_comm_overlap (commvolume.tp_backward_async: megatron-core, on a device with streams)
    tp_backward_overlap: Callable[[JobSpec], bool] = lambda job: False
    # with full recompute: the share of the decoder layers recomputed (Megatron's block method: fewer)
    recomputed_layers: Callable[[JobSpec], float] = lambda job: 1.0
    # backend options the search adds to a layout that does not fit without them, cheapest first
    # (options the layouts above do not enumerate themselves: Megatron's recompute_granularity)
    recompute_options: tuple[dict[str, Any], ...] = ()
    # (a layout's options, world size, the model's routed experts) -> the expert-parallel options the
    # search tries with that layout ({}: none; only a backend with expert parallelism has any)
    experts: Callable[[dict[str, Any], int, int], Iterator[dict[str, Any]]] = lambda options, world, experts: iter([{}])
    # times a step all-gathers the distributed optimizer's parameters (megatron: once per optimizer of its chain)
    param_gathers: Callable[[JobSpec], int] = lambda job: 1

    def widths(self, job: JobSpec) -> Widths:
        return Widths.for_precision(job.run.precision, self.grad_fp32(job))


def _param_bytes(job: JobSpec) -> int:
    """Bytes of one element in the run's precision (fp32: 4; bf16, fp16: 2)."""
    return 4 if job.run.precision == "fp32" else 2


def _group_members(job: JobSpec) -> list[list[int]]:
    """The element counts of the two AdamW groups every backend builds, in the model's parameter
    order (torch_common.adamw_param_groups): decay = 2-D weights, then the rest."""
    numels = [(len(s), math.prod(s)) for s in job.model.parameter_shapes().values()]
    return [[n for d, n in numels if d >= 2], [n for d, n in numels if d < 2]]


def _group_numels(job: JobSpec) -> list[int]:
    return [sum(g) for g in _group_members(job)]


def zero_partition_grad_numel(groups: list[list[int]], dp: int) -> int:
    """Gradient elements the busiest ZeRO-1/2 rank keeps after the reduction: DeepSpeed copies the
    reduced gradient of every parameter that starts in, or straddles into, this rank's partition of
    the flat group, whole (``copy_grads_in_partition`` sizes ``grads_in_partition`` as the sum of
    ``params_in_partition`` numels, ``get_partition_info``; stage_1_and_2.py, DeepSpeed 0.16-0.19),
    not just the partition's own slice."""
    held = [0] * dp
    for numels in groups:
        part = round_up(sum(numels), 2 * dp) // dp  # the flat group padded to 2 x dp (deepspeed_flat_numel)
        start = 0
        for n in numels:
            for r in range(dp):
                lo, hi = r * part, (r + 1) * part
                if lo <= start < hi or start < lo < start + n:
                    held[r] += n
            start += n
    return max(held)


# ---------------------------------------------------------------------------- ddp, mindspore
def _replicated(job: JobSpec) -> States:
    psi = job.model.num_params()
    return States(4.0 * psi, 4.0 * psi, 8.0 * psi, 0.0, psi)  # fp32 weights (bf16 is autocast), grads, AdamW moments


def _no_options(world: int, per_node: int, offload: bool) -> Iterator[dict[str, Any]]:
    yield {}


def _ddp_options(world: int, per_node: int, offload: bool) -> Iterator[dict[str, Any]]:
    yield from ({"activation_checkpointing": ac} for ac in (False, True))


def _ddp_buffers(job: JobSpec) -> float:
    """Without ``gradient_as_bucket_view`` DDP's buckets are a second copy of every (fp32) gradient
    (torch DistributedDataParallel docs, gradient_as_bucket_view); with it (the adapter's default)
    the gradients are views into the buckets."""
    return 0.0 if job.backend.options.gradient_as_bucket_view else 4.0 * job.model.num_params()


# ---------------------------------------------------------------------------- fsdp
def _fsdp_states(job: JobSpec) -> States:
    """Each parameter of the rank's tensor-parallel shard (all of them at tp = 1) sharded on dim 0
    over dp, dim 0 padded to a multiple of dp (FSDP2; docs/sources.md#fsdp2-tensor-parallel)."""
    n = job.parallel.dp
    padded = fsdp2_padded_numel(tp_shard_shapes(job.model, job.parallel.tp).values(), n)
    per_rank = padded / n
    host = 16.0 * per_rank if job.backend.options.cpu_offload else 0.0
    return States(4.0 * per_rank, 4.0 * per_rank, 8.0 * per_rank, host, padded)


def _fsdp_buffers(job: JobSpec) -> float:
    """Two layers unsharded at once (the current one and the prefetched next) in the param dtype,
    the root module unsharded, and one layer's unsharded fp32 gradients before the reduce-scatter.
    Without resharding after forward every layer stays unsharded until its backward. With tensor
    parallelism a layer is unsharded to its tp shard."""
    shapes = tp_shard_shapes(job.model, job.parallel.tp)
    m = job.model
    layer = sum(math.prod(s) for k, s in shapes.items() if k.startswith("model.layers.0."))
    root = sum(math.prod(s) for k, s in shapes.items() if ".layers." not in k)
    live = 2 if job.backend.options.reshard_after_forward else m.num_hidden_layers
    return live * layer * _param_bytes(job) + root * _param_bytes(job) + layer * 4


def _fsdp_overlap(job: JobSpec) -> float:
    """FSDP2 prefetches the next all-gather and reduce-scatters on side streams of the device
    (``_fsdp_param_group.py``, ``FSDPCommContext``: ``device_handle.Stream``); a CPU has no streams
    (torch.cpu.Stream is a stand-in that runs on the calling thread) and the pre-forward/pre-backward
    unshard is synchronous (``unshard_async_op`` False), so on CPU every all-gather and reduce-scatter
    blocks the training thread (measured: bench run's per-step communication log, docs/plan.md)."""
    return 0.0 if job.device.type == "cpu" else 1.0


def _fsdp_options(world: int, per_node: int, offload: bool) -> Iterator[dict[str, Any]]:
    """FSDP alone and FSDP2 + tensor parallel (torchtitan's 2-D layout), tp inside a node as for
    megatron; a tp the model's heads or MLP width do not divide is refused by the harness."""
    for tp in (d for d in _divisors(world) if d <= per_node):
        for reshard in (True, False):
            for ac in (False, True):
                for cpu_offload in (False, True) if offload else (False,):
                    yield {
                        "tp": tp,
                        "reshard_after_forward": reshard,
                        "activation_checkpointing": ac,
                        "cpu_offload": cpu_offload,
                    }


def _fsdp_layout(job: JobSpec) -> Layout:
    """FSDP over dp; with tp > 1 the decoder layers' Megatron-style collectives (2 forward + 2 backward
    all-reduces per layer), the embedding, lm_head and loss replicated (no vocab-parallel collectives)."""
    o = job.backend.options
    return Layout(
        dp=job.parallel.dp,
        tp=job.parallel.tp,
        sharding="fsdp" if o.reshard_after_forward else "fsdp_no_reshard",
        recompute=_ac(job),
        vocab_parallel=False,
        recompute_stops_early=True,  # model.DecoderLayer: torch.utils.checkpoint(use_reentrant=False)
    )


def _fsdp_offload(job: JobSpec, st: States) -> Offload:
    """FSDP2's CPUOffloadPolicy (torch docs, ``torch.distributed.fsdp.CPUOffloadPolicy``): the
    sharded fp32 parameters are copied host-to-device before every all-gather (before forward and
    again before backward when resharding after forward, the root included: the profile's
    root_elements; once per micro-batch without), the sharded fp32 gradients device-to-host after
    the step's reduce-scatter (one, on the last micro-batch), and torch's AdamW steps on the host.
    Counted per rank whatever the world size (one rank still copies its whole "shard")."""
    if not job.backend.options.cpu_offload:
        return Offload()
    shard = 4.0 * st.elements / job.parallel.dp
    gathers = (2 if job.backend.options.reshard_after_forward else 1) * job.grad_accum
    return Offload(
        d2h_bytes=shard,
        h2d_bytes=shard * gathers,
        host_elements=st.elements / job.parallel.dp,
        host_pass_bytes=HOST_ADAM_BYTES * TORCH_HOST_ADAM_SLOWDOWN,
        overlap=1.0,
    )


# ---------------------------------------------------------------------------- deepspeed
def _ds_states(job: JobSpec) -> States:
    o, psi, nd, b = job.backend.options, job.model.num_params(), job.parallel.dp, _param_bytes(job)
    k = 8 if job.run.precision == "fp32" and o.zero_stage == 0 else 12
    if getattr(o, "ep", 1) > 1:
        return _ds_moe_states(job, k)
    if o.zero_stage == 0:
        return States(b * psi, b * psi, k * psi, 0.0, psi)
    if o.zero_stage == 3:
        numels = [math.prod(s) for s in job.model.parameter_shapes().values()]
        padded = zero3_padded_numel(numels, nd)
        part = padded / nd
        # parameters up to stage3_param_persistence_threshold elements (DeepSpeed default 1e5) stay
        # whole on every rank beside their partition (partition_parameters.py, ds_persist), in the
        # all-gather buffer of their aligned size (numel rounded up to dp)
        limit = o.stage3_param_persistence_threshold if o.stage3_param_persistence_threshold is not None else 1e5
        persistent = sum(round_up(n, nd) for n in numels if n <= limit)
        st = States(b * (part + persistent), b * part, k * part)
    else:
        padded = deepspeed_flat_numel(_group_numels(job), nd)
        part = padded / nd
        # ZeRO-1 keeps full gradients while they accumulate over micro-batches; with one
        # micro-batch per step (and always in ZeRO-2) only the parameters of this rank's partition
        # keep theirs, boundary parameters whole
        full = o.zero_stage == 1 and job.grad_accum > 1
        grads = b * psi if full else b * zero_partition_grad_numel(_group_members(job), nd)
        boundary = 0.0 if full else grads - b * part
        st = States(b * padded, grads, k * part, boundary=boundary)  # the working copy is the padded flat buffer
    host = st.optimizer if o.offload_optimizer != "none" else 0.0
    if o.offload_param != "none":
        host += st.params
    return States(st.params, st.grads, st.optimizer, host, padded, st.boundary)


def _ds_moe_states(job: JobSpec, k: int) -> States:
    """DeepSpeed-MoE with expert parallelism (ZeRO 0-2): a rank holds the non-expert parameters and
    E / ep experts of every layer (deepspeed_moe.held_numel). ``split_params_into_different_moe_groups_
    for_optimizer`` puts the experts in param groups of their own, which ZeRO flattens, pads (2 x ranks)
    and partitions over the expert-data-parallel group, dp / ep ranks, and reduces there; the
    non-expert groups over dp (DeepSpeed 0.19.8 stage_1_and_2.py, moe/utils.py). Gradients: the
    partitions only (the boundary parameters kept whole are not counted)."""
    o, nd, b, ep = job.backend.options, job.parallel.dp, _param_bytes(job), job.backend.options.ep
    dense, experts = held_numel(job.model, ep)
    edp = nd // ep
    exact = {"exact_elements": dense + experts, "exact_expert_elements": experts}
    if o.zero_stage == 0:
        held = dense + experts
        return States(b * held, b * held, k * held, 0.0, held, expert_elements=experts, **exact)
    groups = [sum(n for name, n in g if ".experts." not in name) for g in _named_group_members(job)]
    padded_dense, padded_experts = deepspeed_flat_numel(groups, nd), deepspeed_flat_numel([experts], edp)
    part = padded_dense / nd + padded_experts / edp
    padded = padded_dense + padded_experts
    return States(b * padded, b * part, k * part, 0.0, padded, expert_elements=padded_experts, **exact)


def _named_group_members(job: JobSpec) -> list[list[tuple[str, int]]]:
    """(name, elements) of the two AdamW groups (decay: 2-D weights, then the rest), model order."""
    shapes = job.model.parameter_shapes().items()
    return [[(n, math.prod(s)) for n, s in shapes if len(s) >= 2], [(n, math.prod(s)) for n, s in shapes if len(s) < 2]]


def _ds_buffers(job: JobSpec) -> float:
    o, psi, b = job.backend.options, job.model.num_params(), _param_bytes(job)
    if o.zero_stage == 3:  # the prefetch bucket and the live (gathered) parameters, DeepSpeed defaults
        return (min(o.stage3_prefetch_bucket_size or 5e7, psi) + min(o.stage3_max_live_parameters or 1e9, psi)) * b
    if o.zero_stage in (1, 2):  # the reduce bucket (DeepSpeed default 5e8 elements), capped at the model
        return min(o.reduce_bucket_size or 5e8, psi) * b
    return 0.0


def _ds_overlap(job: JobSpec) -> float:
    """overlap_comm (default on for ZeRO-3, off for 1-2) hides the reduction behind the backward
    only on a device with streams: DeepSpeed's CPU accelerator is a synchronized device, which
    gets no reduction stream (stage_1_and_2.py, stage3.py: ``None if is_synchronized_device()``),
    so there the reductions block the backward."""
    o = job.backend.options
    if job.device.type == "cpu":
        return 0.0
    return float(o.overlap_comm if o.overlap_comm is not None else o.zero_stage == 3)


# (offload_optimizer, offload_param) the search tries per ZeRO stage: the harness refuses optimizer
# offload at stage 0 and parameter offload below stage 3 (adapters/deepspeed.py validate)
_DS_OFFLOADS = {
    0: [("none", "none")],
    1: [("none", "none"), ("cpu", "none")],
    2: [("none", "none"), ("cpu", "none")],
    3: [("none", "none"), ("cpu", "none"), ("cpu", "cpu")],
}


def _ds_options(world: int, per_node: int, offload: bool) -> Iterator[dict[str, Any]]:
    for stage in (0, 1, 2, 3):
        for ac in (False, True):
            for opt, param in _DS_OFFLOADS[stage] if offload else [("none", "none")]:
                yield {
                    "zero_stage": stage,
                    "activation_checkpointing": ac,
                    "offload_optimizer": opt,
                    "offload_param": param,
                }


def _ds_offload(job: JobSpec, st: States) -> Offload:
    """ZeRO-Offload / ZeRO-Infinity per step (Ren et al. 2021, sec. 4; DeepSpeed 0.19
    ``stage_1_and_2.py`` / ``stage3.py``): each reduction of this rank's gradient partition is
    converted to fp32 on the device and copied to the host (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``);
    with several micro-batches the accumulated partition comes back to the device for the next add
    (``async_accumulate_grad_in_cpu_via_gpu``; ZeRO-3: the host grad buffer); the host steps the
    fp32 master with CPU Adam and copies the updated working-dtype partition back. With
    ``offload_param`` the partition lives on the host and is copied to the device before every
    parameter all-gather (and not after the step)."""
    o, b, dp = job.backend.options, _param_bytes(job), job.parallel.dp
    if o.offload_optimizer == "none" and o.offload_param == "none":
        return Offload()
    part = st.elements / dp
    d2h = h2d = 0.0
    if o.offload_optimizer != "none":
        reductions = 1 if o.zero_stage == 1 else job.grad_accum
        d2h += 4 * part * reductions
        h2d += 4 * part * (reductions - 1) + (b * part if o.offload_param == "none" else 0.0)
    if o.offload_param != "none":  # gathers per micro-batch: once while the model stays live, else twice
        h2d += b * part * job.grad_accum * (1 if _ds_sharding(job) == "deepspeed_zero3_live" else 2)
    host_pass = (HOST_ADAM_BYTES + b) * (TORCH_HOST_ADAM_SLOWDOWN if o.offload_adam == "torch" else 1)
    host_elements = part if o.offload_optimizer != "none" else 0.0
    return Offload(d2h, h2d, host_elements, host_pass, _ds_overlap(job))


# ---------------------------------------------------------------------------- megatron, mindspeed
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
    b = _param_bytes(job)
    main = 4 if job.run.precision != "fp32" else 0  # fp32 training steps the params themselves
    experts = mg_expert_numel(job)
    if o.distributed_optimizer:
        edp = dp // getattr(o, "ep", 1)
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


def mg_expert_numel(job: JobSpec) -> int:
    """Expert parameters one megatron rank holds: the E / ep experts of each of its stage's layers,
    SwiGLU (fc1 = [gate; up], fc2 = down) of width ``moe_intermediate_size``, split over the expert
    tensor-parallel size (megatron-core's default: tp); the router is replicated with the dense ones."""
    m, o = job.model, job.backend.options
    if not m.is_moe:
        return 0
    per_expert = 3 * m.hidden_size * m.expert_intermediate_size // o.tp
    return m.num_hidden_layers // o.pp * (m.num_local_experts // getattr(o, "ep", 1)) * per_expert


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


VPP_SEARCHED = (1, 2, 4)  # virtual pipeline stages per pipeline rank the search tries


def _mg_options(world: int, per_node: int, offload: bool) -> Iterator[dict[str, Any]]:
    """tp and cp inside a node (their collectives run per layer; the search keeps tp x cp within
    the node's devices), pp and dp over the rest. cp > 1 is refused by the harness where it cannot
    run (megatron: CUDA with Transformer Engine only; mindspeed: on the NPU)."""
    for tp in (d for d in _divisors(world) if d <= per_node):
        for cp in (d for d in _divisors(world // tp) if tp * d <= per_node):
            for pp in _divisors(world // (tp * cp)):
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
    what it cannot run (with MoE: tp, pp, cp > 1, the distributed optimizer, full recompute), counted
    like any other refusal."""
    if not experts:
        yield {}
        return
    dp = world // (options["tp"] * options["cp"] * options["pp"])
    yield from ({"ep": e} for e in _divisors(dp) if experts % e == 0)


def _mg_buffers(job: JobSpec) -> float:
    """Context parallelism's ring: while a rank computes with one K/V chunk it receives the next
    (and in the backward the K/V and their gradients), so two chunks of one layer are in flight
    beside the stored activations (Megatron-Core docs, context_parallel; Liu et al. 2023, sec. 3)."""
    o, m, d = job.backend.options, job.model, job.data
    if o.cp <= 1:
        return 0.0
    kv_heads = max(m.num_key_value_heads // o.tp, 1)
    chunk = 2 * d.micro_batch_size * (d.seq_len // o.cp) * kv_heads * m.head_dim * _param_bytes(job)
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
    experts_apart = mg_expert_numel(job) > 0 and getattr(o, "ep", 1) > 1  # at ep = 1 they share the dense buffers
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
        ep=getattr(o, "ep", 1),
    )


def _dp_layout(sharding: Callable[[JobSpec], Any]) -> Callable[[JobSpec], Layout]:
    def layout(job: JobSpec) -> Layout:
        o = job.backend.options
        recompute = "full" if getattr(o, "activation_checkpointing", False) else "none"
        return Layout(dp=job.parallel.dp, sharding=sharding(job), recompute=recompute, ep=getattr(o, "ep", 1))

    return layout


def _ds_sharding(job: JobSpec) -> str:
    """DeepSpeed's communication as it runs with its defaults (commvolume: deepspeed_zero1/2 all-reduce
    multi-rank gradient buckets; ZeRO-3 keeps parameters gathered from forward to backward while the
    model fits stage3_max_live_parameters, default 1e9 elements)."""
    o = job.backend.options
    if o.zero_stage == 3:
        live = job.model.num_params() <= (o.stage3_max_live_parameters or 10**9)
        return "deepspeed_zero3_live" if live else "zero3"
    return ("none", "deepspeed_zero1", "deepspeed_zero2")[o.zero_stage]


def _ac(job: JobSpec) -> str:
    return "full" if getattr(job.backend.options, "activation_checkpointing", False) else "none"


# Overlap assumptions (docs/sources.md#plan-overlap): DDP overlaps its bucketed all-reduce with
# the backward; FSDP2 prefetches the next all-gather and reduce-scatters while the backward runs (on a device with streams);
# DeepSpeed overlaps only with overlap_comm (its default: on for ZeRO-3, off for 1 and 2);
# Megatron only with overlap_grad_reduce (and its parameter gather with overlap_param_gather, on a
# device with streams). Tensor-parallel communication is on the critical path unless the plan is
# told the stack overlaps it (estimate.Features); pipeline send/recv unless the schedule is
# interleaved (megatron, on a device with streams).
PROFILES: dict[str, Profile] = {
    "ddp": Profile(
        _ddp_options, _dp_layout(lambda j: "none"), lambda j: True, _replicated, _ddp_buffers, lambda j: 1.0, _ac
    ),
    "fsdp": Profile(
        _fsdp_options,
        _fsdp_layout,
        lambda j: True,
        _fsdp_states,
        _fsdp_buffers,
        _fsdp_overlap,
        _ac,
        # adapters/fsdp.py passes reshard_after_forward to the root's fully_shard too: the root is
        # resharded after forward and gathered again for backward, like the layers (measured: docs/comm.md)
        root_elements=lambda j: 0 if j.backend.options.reshard_after_forward else None,
        offload=_fsdp_offload,
    ),
    "deepspeed": Profile(
        _ds_options,
        _dp_layout(_ds_sharding),
        lambda j: j.run.precision == "fp32",
        _ds_states,
        _ds_buffers,
        _ds_overlap,
        _ac,
        offload=_ds_offload,
    ),
    "megatron": Profile(
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
    ),
    "mindspore": Profile(
        _no_options, _dp_layout(lambda j: "none"), lambda j: True, _replicated, lambda j: 0.0, lambda j: 1.0, _ac
    ),
}
# mindspeed: megatron's profile without expert parallelism (its adapter refuses a MoE model: Capabilities.moe)
PROFILES["mindspeed"] = replace(PROFILES["megatron"], experts=lambda options, world, experts: iter([{}]))
