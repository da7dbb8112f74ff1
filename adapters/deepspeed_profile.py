"""The deepspeed backend as the planner sees it (``DeepSpeedAdapter.plan_profile``;
adapters/profile.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from parabench.adapters.deepspeed_moe import held_numel
from parabench.adapters.profile import (
    HOST_ADAM_BYTES,
    TORCH_HOST_ADAM_SLOWDOWN,
    Offload,
    Profile,
    States,
    activation_recompute,
    dp_layout,
    group_members,
    group_numels,
    named_group_members,
    param_bytes,
    zero_partition_grad_numel,
)
from parabench.commvolume import deepspeed_flat_numel, round_up, zero3_padded_numel
from parabench.spec import JobSpec


# ---------------------------------------------------------------------------- deepspeed
def _ds_states(job: JobSpec) -> States:
    o, psi, nd, b = job.backend.options, job.model.num_params(), job.parallel.dp, param_bytes(job)
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
        padded = deepspeed_flat_numel(group_numels(job), nd)
        part = padded / nd
        # ZeRO-1 keeps full gradients while they accumulate over micro-batches; with one
        # micro-batch per step (and always in ZeRO-2) only the parameters of this rank's partition
        # keep theirs, boundary parameters whole
        full = o.zero_stage == 1 and job.grad_accum > 1
        grads = b * psi if full else b * zero_partition_grad_numel(group_members(job), nd)
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
    o, nd, b, ep = job.backend.options, job.parallel.dp, param_bytes(job), job.backend.options.ep
    dense, experts = held_numel(job.model, ep)
    edp = nd // ep
    exact = {"exact_elements": dense + experts, "exact_expert_elements": experts}
    if o.zero_stage == 0:
        held = dense + experts
        return States(b * held, b * held, k * held, 0.0, held, expert_elements=experts, **exact)
    groups = [sum(n for name, n in g if ".experts." not in name) for g in named_group_members(job)]
    padded_dense, padded_experts = deepspeed_flat_numel(groups, nd), deepspeed_flat_numel([experts], edp)
    part = padded_dense / nd + padded_experts / edp
    padded = padded_dense + padded_experts
    return States(b * padded, b * part, k * part, 0.0, padded, expert_elements=padded_experts, **exact)


def _ds_buffers(job: JobSpec) -> float:
    o, psi, b = job.backend.options, job.model.num_params(), param_bytes(job)
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
    o, b, dp = job.backend.options, param_bytes(job), job.parallel.dp
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


def _ds_sharding(job: JobSpec) -> str:
    """DeepSpeed's communication as it runs with its defaults (commvolume: deepspeed_zero1/2 all-reduce
    multi-rank gradient buckets; ZeRO-3 keeps parameters gathered from forward to backward while the
    model fits stage3_max_live_parameters, default 1e9 elements)."""
    o = job.backend.options
    if o.zero_stage == 3:
        live = job.model.num_params() <= (o.stage3_max_live_parameters or 10**9)
        return "deepspeed_zero3_live" if live else "zero3"
    return ("none", "deepspeed_zero1", "deepspeed_zero2")[o.zero_stage]


PROFILE = Profile(
    _ds_options,
    dp_layout(_ds_sharding),
    lambda j: j.run.precision == "fp32",
    _ds_states,
    _ds_buffers,
    _ds_overlap,
    activation_recompute,
    offload=_ds_offload,
)
