"""Per-rank measurements and their aggregation into a run summary.

Every number here is measured; formulas are named where a figure is derived:
* step time: wall time per optimizer step with the device synchronised before and after; the
  step time of the job is the max over ranks (the slowest rank sets the pace);
* tokens/s = global_batch_size * seq_len / step time, averaged over the measured steps as
  (tokens per step * steps) / sum(step times); per device = that / world size;
* achieved TFLOP/s per device and MFU: see flops.py (PaLM formula);
* model-state bytes: storage actually held by a rank's parameters, gradients and optimizer
  states, each storage counted once (views and flat buffers are not double counted).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model state actually held by one rank (storage counted once, padding included)."""

    params: int
    grads: int
    optimizer: int  # moments (and fp32 master copies where the backend keeps them separately)
    optimizer_other: int = 0  # step counters and other non-per-parameter state
    host: int = 0  # of the above, bytes that live in host memory while the device is an accelerator
    detail: Mapping[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.optimizer_other

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["total"] = self.total
        return d


def held_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None and duplicates skipped)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = getattr(t, "_local_tensor", t)  # DTensor -> this rank's shard
        storage = local.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen or storage.nbytes() == 0:
            continue
        seen.add(ptr)
        total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizers: Iterable[Any]) -> tuple[list[Any], list[Any]]:
    """The tensors in the ``state`` of torch optimizers, as (moments, scalars): per-parameter
    tensors such as Adam's exp_avg/exp_avg_sq, and 0-d ones such as its step counter."""
    moments, scalars = [], []
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if hasattr(value, "untyped_storage"):
                    (scalars if value.dim() == 0 else moments).append(value)
    return moments, scalars


def torch_model_state(params: Sequence[Any], optimizer: Any) -> ModelStateBytes:
    """Model state of a plain torch model + optimizer on this rank (DDP, FSDP2)."""
    moments, other = optimizer_state_tensors([optimizer])
    return ModelStateBytes(
        params=held_bytes(params),
        grads=held_bytes(p.grad for p in params),
        optimizer=held_bytes(moments),
        optimizer_other=held_bytes(other),
    )


def summarize(rank_results: list[dict], tokens_per_step: int, flops_token: float, peak_tflops: float | None) -> dict:
    """Combine the per-rank results into the job summary (rank 0's losses are the job's)."""
    world = len(rank_results)
    steps = len(rank_results[0]["step_times"])
    per_step_max = [max(r["step_times"][i] for r in rank_results) for i in range(steps)]
    per_step_min = [min(r["step_times"][i] for r in rank_results) for i in range(steps)]
    total = sum(per_step_max)
    tokens_per_s = tokens_per_step * steps / total
    per_device = tokens_per_s / world
    achieved = per_device * flops_token / 1e12
    summary: dict[str, Any] = {
        "world_size": world,
        "measured_steps": steps,
        "step_time_mean_s": total / steps,
        "step_time_median_s": statistics.median(per_step_max),
        "step_time_min_s": min(per_step_max),
        "step_time_max_s": max(per_step_max),
        "step_times_max": per_step_max,  # per measured step: the slowest rank's time
        "rank_step_time_spread_s": statistics.median(a - b for a, b in zip(per_step_max, per_step_min)),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": per_device,
        "achieved_tflops_per_device": achieved,
        "mfu": achieved / peak_tflops if peak_tflops else None,
        "loss_first": rank_results[0]["losses"][0],
        "loss_final": rank_results[0]["losses"][-1],
        "peak_memory_bytes_max": max(r["peak_memory_bytes"] for r in rank_results),
        "model_state_bytes_max": max(r["model_state"]["total"] for r in rank_results),
        "model_state_bytes_min": min(r["model_state"]["total"] for r in rank_results),
    }
    return summary
