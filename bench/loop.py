"""The backend-agnostic measured loop: warm-up steps, then measured steps.

Burn-in is separated from measurement (nanoGPT's bench.py): the first ``run.warmup_steps`` steps
(allocator growth, lazy initialisation, JIT builds) are run but not recorded. Each step's wall time
is taken with the device synchronised before and after; the batch is prepared before the clock
starts, as a data loader with prefetching would have it ready. After each step, outside the timed
region, one all-reduce gives the mean loss over ranks and one the slowest rank's step time.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parabench.adapters.base import Engine, WorkerContext
from parabench.data import DataLedger, TokenSource
from parabench.resilience.checkpoint import Checkpointer, planned_step
from parabench.resilience.faults import fire_fault


def write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def train(
    engine: Engine,
    ctx: WorkerContext,
    on_step: Callable[[int, int, float, float, list | None], None] | None = None,
    checkpointer: Checkpointer | None = None,
) -> dict:
    job = ctx.job
    source = TokenSource(job.data, job.model.vocab_size, ctx.run_dir)
    dp_rank, dp_size = engine.data_parallel()
    ledger = DataLedger(source, dp_rank, dp_size)  # which rows this rank trained on (checksum)
    total = job.run.warmup_steps + job.run.steps
    step_times: list[float] = []
    losses: list[float] = []
    # every step's slowest-rank time, warm-up included: checkpointed with the losses (goodput)
    # MoE: [step, tokens per expert of every layer] (parabench.expertload), the whole curve as the losses
    history = {"losses": losses, "step_times": step_times, "all_step_times": [], "tokens_per_expert": []}
    start = checkpointer.resume(ledger, history) if checkpointer else 0
    # measured figures come only from steps this `bench run` executed: a resumed run's restored
    # history keeps the losses (the whole curve) but not another run's step times
    own_from = planned_step(ctx.run_dir) if checkpointer else 0
    # the restored step times are those of steps [start - restored, start): drop the ones before
    # own_from (none when the checkpoint carried no history, as a converted foreign checkpoint does)
    restored = len(step_times)
    inherited = min(restored, max(0, own_from - (start - restored)))
    for step in range(start, total):
        fire_fault(job, ctx.run_dir, ctx.rank, step)
        micro_batches = source.rank_micro_batches(step, dp_rank, dp_size)
        ledger.record(step, micro_batches)
        loss, elapsed = _timed_step(engine, ctx, step, engine.prepare_batch(micro_batches))
        mean_loss, slowest = ctx.comm.reduce_stats(float(loss), elapsed)
        expert_tokens = engine.tokens_per_expert()  # collective, outside the timed region
        losses.append(mean_loss)  # every step, warm-up included: step 0 is the parity anchor
        if step >= job.run.warmup_steps:
            step_times.append(elapsed)
        history["all_step_times"].append(slowest)
        if expert_tokens is not None:
            history["tokens_per_expert"].append([step, expert_tokens])
        if on_step is not None:
            on_step(step, total, mean_loss, slowest, expert_tokens)
        if checkpointer is not None:  # outside the timed region
            checkpointer.after_step(step + 1, total, history, ledger)
    if checkpointer is not None:
        checkpointer.finish()
    return _rank_results(engine, ctx, history, step_times[inherited:], ledger, checkpointer)


def _timed_step(engine: Engine, ctx: WorkerContext, step: int, batches) -> tuple[Any, float]:
    """One optimizer step between device synchronisations: (its loss, its seconds)."""
    ctx.device.synchronize()
    t0 = time.perf_counter()
    with ctx.comm_log.step(step) if ctx.comm_log else contextlib.nullcontext():
        loss = engine.train_step(batches)
    ctx.device.synchronize()
    return loss, time.perf_counter() - t0


def _rank_results(
    engine: Engine,
    ctx: WorkerContext,
    history: dict,
    own_step_times: list[float],
    ledger: DataLedger,
    checkpointer: Checkpointer | None,
) -> dict:
    """What this rank reports to the runner (ranks/rankN.json)."""
    peak, peak_kind = ctx.device.peak_memory()
    return {
        "rank": ctx.rank,
        "step_times": own_step_times,  # the steps this `bench run` executed
        "losses": history["losses"],
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        "model_state": engine.model_state_bytes().as_dict(),
        "extra": engine.extra_metrics(),
        "data": ledger.as_dict(),
        "all_step_times": history["all_step_times"],
        "tokens_per_expert": history["tokens_per_expert"],  # [[step, [layer][expert]], ...], every rank alike
        "checkpoint": checkpointer.stats.as_dict() if checkpointer else None,
        "comm": ctx.comm_log.steps if ctx.comm_log else None,  # per step: bytes and time per collective kind
    }
