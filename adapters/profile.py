"""What the planner (``bench plan``) and a run's communication report know about a backend, as the
backend's adapter declares it (``Adapter.plan_profile``): the layouts it can search, how a job's
options map onto the communication model (``parabench.commvolume``), the bytes of model state each
rank holds (padding included), the buffers around them, and the overlap it assumes. This module
holds the types and what several backends share; each backend's profile lives beside its adapter
(ddp.py, mindspore.py, fsdp_profile.py, deepspeed_profile.py, megatron_profile.py).

The published per-rank model-state formula of each backend stays in its adapter
(``expected_model_state``); a profile splits exactly that total into parameters, gradients and
optimizer states and adds the backend's padding, and tests/test_plan.py checks that the two agree
before padding for every layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from parabench.commvolume import Layout, Widths, round_up
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
    # without padding, from which bench run reports the padding's bytes (parabench.run.comm_report)
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


def no_experts(options: dict[str, Any], world: int, experts: int) -> Iterator[dict[str, Any]]:
    """No expert-parallel options (a backend without expert parallelism)."""
    yield {}


# Overlap assumptions (docs/sources.md#plan-overlap): DDP overlaps its bucketed all-reduce with
# the backward; FSDP2 prefetches the next all-gather and reduce-scatters while the backward runs (on a device with streams);
# DeepSpeed overlaps only with overlap_comm (its default: on for ZeRO-3, off for 1 and 2);
# Megatron only with overlap_grad_reduce (and its parameter gather with overlap_param_gather, on a
# device with streams). Tensor-parallel communication is on the critical path unless the plan is
# told the stack overlaps it (estimate.Features); pipeline send/recv unless the schedule is
# interleaved (megatron, on a device with streams).
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
    experts: Callable[[dict[str, Any], int, int], Iterator[dict[str, Any]]] = no_experts
    # times a step all-gathers the distributed optimizer's parameters (megatron: once per optimizer of its chain)
    param_gathers: Callable[[JobSpec], int] = lambda job: 1

    def widths(self, job: JobSpec) -> Widths:
        return Widths.for_precision(job.run.precision, self.grad_fp32(job))


def param_bytes(job: JobSpec) -> int:
    """Bytes of one element in the run's precision (fp32: 4; bf16, fp16: 2)."""
    return 4 if job.run.precision == "fp32" else 2


def group_members(job: JobSpec) -> list[list[int]]:
    """The element counts of the two AdamW groups every backend builds, in the model's parameter
    order (torch_common.adamw_param_groups): decay = 2-D weights, then the rest."""
    numels = [(len(s), math.prod(s)) for s in job.model.parameter_shapes().values()]
    return [[n for d, n in numels if d >= 2], [n for d, n in numels if d < 2]]


def group_numels(job: JobSpec) -> list[int]:
    return [sum(g) for g in group_members(job)]


def named_group_members(job: JobSpec) -> list[list[tuple[str, int]]]:
    """(name, elements) of the two AdamW groups (decay: 2-D weights, then the rest), model order."""
    shapes = job.model.parameter_shapes().items()
    return [[(n, math.prod(s)) for n, s in shapes if len(s) >= 2], [(n, math.prod(s)) for n, s in shapes if len(s) < 2]]


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
def replicated_states(job: JobSpec) -> States:
    psi = job.model.num_params()
    return States(4.0 * psi, 4.0 * psi, 8.0 * psi, 0.0, psi)  # fp32 weights (bf16 is autocast), grads, AdamW moments


def no_options(world: int, per_node: int, offload: bool) -> Iterator[dict[str, Any]]:
    yield {}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def dp_layout(sharding: Callable[[JobSpec], Any]) -> Callable[[JobSpec], Layout]:
    def layout(job: JobSpec) -> Layout:
        o = job.backend.options
        return Layout(
            dp=job.parallel.dp, sharding=sharding(job), recompute=activation_recompute(job), ep=getattr(o, "ep", 1)
        )

    return layout


def activation_recompute(job: JobSpec) -> str:
    return "full" if getattr(job.backend.options, "activation_checkpointing", False) else "none"


def replicated_profile(
    options: Callable[[int, int, bool], Iterator[dict[str, Any]]], buffers: Callable[[JobSpec], float]
) -> Profile:
    """A data-parallel backend that holds every model state on every rank (ddp, mindspore): fp32
    states (``replicated_states``), the gradient all-reduce overlapped with the backward."""
    return Profile(
        options,
        dp_layout(lambda j: "none"),
        lambda j: True,
        replicated_states,
        buffers,
        lambda j: 1.0,
        activation_recompute,
    )
