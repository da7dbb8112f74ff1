"""The fsdp backend as the planner sees it (``FSDPAdapter.plan_profile``; adapters/profile.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from parabench.adapters.profile import (
    HOST_ADAM_BYTES,
    TORCH_HOST_ADAM_SLOWDOWN,
    Offload,
    Profile,
    States,
    activation_recompute,
    divisors,
    param_bytes,
)
from parabench.commvolume import Layout, fsdp2_padded_numel, tp_shard_shapes
from parabench.spec import JobSpec


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
    return live * layer * param_bytes(job) + root * param_bytes(job) + layer * 4


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
    for tp in (d for d in divisors(world) if d <= per_node):
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
        recompute=activation_recompute(job),
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


PROFILE = Profile(
    _fsdp_options,
    _fsdp_layout,
    lambda j: True,
    _fsdp_states,
    _fsdp_buffers,
    _fsdp_overlap,
    activation_recompute,
    # adapters/fsdp.py passes reshard_after_forward to the root's fully_shard too: the root is
    # resharded after forward and gathered again for backward, like the layers (measured: docs/comm.md)
    root_elements=lambda j: 0 if j.backend.options.reshard_after_forward else None,
    offload=_fsdp_offload,
)
