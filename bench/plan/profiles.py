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
from dataclasses import dataclass
from typing import Any

from parabench.adapters.megatron import rank_param_counts
from parabench.commvolume import Layout, Widths, deepspeed_flat_numel, fsdp2_padded_numel, round_up, zero3_padded_numel
from parabench.spec import JobSpec

SRC_OVERLAP = "docs/sources.md#plan-overlap"


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

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class Profile:
    """One backend, as the planner sees it."""

    layouts: Callable[[int, int], Iterator[dict[str, Any]]]  # (world, devices per node) -> backend options
    layout: Callable[[JobSpec], Layout]
    grad_fp32: Callable[[JobSpec], bool]
    states: Callable[[JobSpec], States]
    buffers: Callable[[JobSpec], float]  # bytes of communication buffers beside the model states
    overlap: Callable[[JobSpec], float]  # share of data-parallel communication hidden behind backward
    recompute: Callable[[JobSpec], str]  # none | full
    # attention through a fused kernel (SDPA, Transformer Engine, npu_fusion_attention): the
    # s x s scores are recomputed in the backward, not stored (Korthikanti's 5as/h term drops)
    fused_attention: Callable[[JobSpec], bool] = lambda job: True
    # FSDP: parameters of the root module gathered once per micro-batch (commvolume's root_elements);
    # None = commvolume's default (the root stays unsharded from forward to backward), 0 = resharded too
    root_elements: Callable[[JobSpec], int | None] = lambda job: None

    def widths(self, job: JobSpec) -> Widths:
        return Widths.for_precision(job.run.precision, self.grad_fp32(job))


def _b(job: JobSpec) -> int:
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


def _no_options(world: int, per_node: int) -> Iterator[dict[str, Any]]:
    yield {}


def _ddp_options(world: int, per_node: int) -> Iterator[dict[str, Any]]:
    yield from ({"activation_checkpointing": ac} for ac in (False, True))


# ---------------------------------------------------------------------------- fsdp
def _fsdp_states(job: JobSpec) -> States:
    n = job.parallel.world_size
    padded = fsdp2_padded_numel(job.model.parameter_shapes().values(), n)
    per_rank = padded / n
    host = 16.0 * per_rank if job.backend.options.cpu_offload else 0.0
    return States(4.0 * per_rank, 4.0 * per_rank, 8.0 * per_rank, host, padded)


def _fsdp_buffers(job: JobSpec) -> float:
    """Two layers unsharded at once (the current one and the prefetched next) in the param dtype,
    the root module unsharded, and one layer's unsharded fp32 gradients before the reduce-scatter.
    Without resharding after forward every layer stays unsharded until its backward."""
    m = job.model
    layer = sum(math.prod(s) for k, s in m.parameter_shapes().items() if k.startswith("model.layers.0."))
    root = sum(math.prod(s) for k, s in m.parameter_shapes().items() if ".layers." not in k)
    live = 2 if job.backend.options.reshard_after_forward else m.num_hidden_layers
    return live * layer * _b(job) + root * _b(job) + layer * 4


def _fsdp_options(world: int, per_node: int) -> Iterator[dict[str, Any]]:
    for reshard in (True, False):
        for ac in (False, True):
            yield {"reshard_after_forward": reshard, "activation_checkpointing": ac}


# ---------------------------------------------------------------------------- deepspeed
def _ds_states(job: JobSpec) -> States:
    o, psi, nd, b = job.backend.options, job.model.num_params(), job.parallel.dp, _b(job)
    k = 8 if job.run.precision == "fp32" and o.zero_stage == 0 else 12
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


def _ds_buffers(job: JobSpec) -> float:
    o, psi, b = job.backend.options, job.model.num_params(), _b(job)
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


def _ds_options(world: int, per_node: int) -> Iterator[dict[str, Any]]:
    for stage in (0, 1, 2, 3):
        for ac in (False, True):
            yield {"zero_stage": stage, "activation_checkpointing": ac}


# ---------------------------------------------------------------------------- megatron, mindspeed
def _mg_states(job: JobSpec) -> States:
    """Megatron keeps params (working dtype) and fp32 main grads in contiguous buffers; with the
    distributed optimizer each buffer is padded to a multiple of dp (x 128 elements per bucket in
    megatron-core) and the fp32 main params + Adam moments are sharded over dp."""
    o, dp = job.backend.options, job.parallel.dp
    psi = max(rank_param_counts(job).values())
    b = _b(job)
    if o.distributed_optimizer:
        padded = round_up(psi, math.lcm(dp, 128)) if dp > 1 else psi
        main = 4 if job.run.precision != "fp32" else 0  # fp32 training steps the params themselves
        return States(b * padded, 4.0 * padded, (8 + main) * padded / dp, 0.0, padded)
    main = 4 if job.run.precision != "fp32" else 0
    return States(b * psi, 4.0 * psi, (8.0 + main) * psi, 0.0, psi)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mg_options(world: int, per_node: int) -> Iterator[dict[str, Any]]:
    for tp in (d for d in _divisors(world) if d <= per_node):
        for pp in _divisors(world // tp):
            for vpp in (1, 2) if pp > 1 else (1,):
                for sp in (False, True) if tp > 1 else (False,):
                    for dist_opt in (False, True) if world // (tp * pp) > 1 else (False,):
                        yield {
                            "tp": tp,
                            "pp": pp,
                            "vpp": vpp,
                            "sequence_parallel": sp,
                            "distributed_optimizer": dist_opt,
                        }


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
    )


def _dp_layout(sharding: Callable[[JobSpec], Any]) -> Callable[[JobSpec], Layout]:
    def layout(job: JobSpec) -> Layout:
        o = job.backend.options
        recompute = "full" if getattr(o, "activation_checkpointing", False) else "none"
        return Layout(dp=job.parallel.dp, sharding=sharding(job), recompute=recompute)

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
# the backward; FSDP2 prefetches the next all-gather and reduce-scatters while the backward runs;
# DeepSpeed overlaps only with overlap_comm (its default: on for ZeRO-3, off for 1 and 2);
# Megatron only with overlap_grad_reduce. Tensor- and pipeline-parallel communication is on the
# critical path in all of them.
PROFILES: dict[str, Profile] = {
    "ddp": Profile(
        _ddp_options, _dp_layout(lambda j: "none"), lambda j: True, _replicated, lambda j: 0.0, lambda j: 1.0, _ac
    ),
    "fsdp": Profile(
        _fsdp_options,
        _dp_layout(lambda j: "fsdp" if j.backend.options.reshard_after_forward else "fsdp_no_reshard"),
        lambda j: True,
        _fsdp_states,
        _fsdp_buffers,
        lambda j: 1.0,
        _ac,
        # adapters/fsdp.py passes reshard_after_forward to the root's fully_shard too: the root is
        # resharded after forward and gathered again for backward, like the layers (measured: docs/comm.md)
        root_elements=lambda j: 0 if j.backend.options.reshard_after_forward else None,
    ),
    "deepspeed": Profile(
        _ds_options,
        _dp_layout(_ds_sharding),
        lambda j: j.run.precision == "fp32",
        _ds_states,
        _ds_buffers,
        _ds_overlap,
        _ac,
    ),
    "megatron": Profile(
        _mg_options,
        _mg_layout,
        lambda j: True,
        _mg_states,
        lambda j: 0.0,
        lambda j: float(j.backend.options.overlap_grad_reduce),
        lambda j: "none",
        lambda j: j.device.type != "cpu",  # megatron-core's local attention (CPU) keeps the scores
    ),
    "mindspore": Profile(
        _no_options, _dp_layout(lambda j: "none"), lambda j: True, _replicated, lambda j: 0.0, lambda j: 1.0, _ac
    ),
}
PROFILES["mindspeed"] = PROFILES["megatron"]
