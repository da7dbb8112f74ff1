"""Per-rank entry point: ``python -m parabench.worker RUN_DIR`` (started by the backend's launcher: torchrun or msrun).

Reads the resolved spec the runner wrote (no Hydra here), joins the process group, asks the
adapter for an engine, runs the measured loop, and writes ``ranks/rank<R>.json``. Its output goes
to ``logs/rank<R>.log``; its pid to ``pids/rank<R>`` (launchers.record_pid) (the runner prints log tails on failure).
Everything backend-specific, including framework monkeypatches, happens inside
``adapter.create_engine`` in this process only. Under msrun the same command also starts msrun's
scheduler (``MS_ROLE=MS_SCHED``), which this module serves without training.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

from parabench.adapters.base import WorkerContext, check_roles
from parabench.commlog import CommLog
from parabench.devices import DEVICES, cpu_threads, drain_comm_threads
from parabench.jobs import load_job
from parabench.launchers import msrun_scheduler_started, rank_of, serve_msrun_scheduler
from parabench.resilience.checkpoint import RUN_ID_ENV, STEPS_FILE, Checkpointer, CheckpointError, StopRequested
from parabench.resilience.faults import record_detection, restart_count


def main(argv: list[str] | None = None) -> int:
    started_wall = time.time()
    if msrun_scheduler_started():
        return serve_msrun_scheduler()
    argv = sys.argv[1:] if argv is None else argv
    run_dir = Path(argv[0])
    job = load_job(run_dir / "spec.json")
    adapter = job.backend.adapter
    rank, local_rank, world = rank_of(job, run_dir)
    print(f"[parabench worker] rank {rank}/{world} local_rank {local_rank} pid {os.getpid()}", flush=True)
    try:
        code = _run(job, adapter, run_dir, rank, local_rank, world, started_wall)
        drain_comm_threads()  # else an abort at exit, seen after a 2-rank ddp run (convert's resume)
        return code
    except StopRequested as exc:
        print(f"[parabench worker] {exc}", flush=True)
        return 0
    except CheckpointError as exc:  # one line: what could not be written or read, and where
        record_detection(run_dir, rank, f"checkpoint error: {exc}")
        print(f"[parabench worker] checkpoint error: {exc}", file=sys.stderr, flush=True)
        return 1
    except Exception as exc:
        record_detection(run_dir, rank, f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        sys.stderr.flush()
        return 1


def _run(job, adapter, run_dir: Path, rank: int, local_rank: int, world: int, started_wall: float) -> int:
    from parabench.loop import train, write_json_atomic
    from parabench.model import weights_checksum

    device = DEVICES[job.device.type](local_rank)
    ctx = WorkerContext(job=job, rank=rank, world_size=world, local_rank=local_rank, device=device, run_dir=run_dir)
    ctx.comm = adapter.init_worker(ctx)
    if adapter.capabilities.launcher == "torchrun":  # torch.distributed stacks: log their collectives
        ctx.comm_log = CommLog()
        ctx.comm_log.install()

    t0 = time.perf_counter()
    engine = adapter.create_engine(ctx)
    check_roles(adapter, engine)  # run.checkpoint / run.resume were admitted on its capabilities.checkpoint
    setup_s = time.perf_counter() - t0
    checksum = weights_checksum(engine.full_state_dict()) if job.run.checksum else None
    print(f"[parabench worker] engine ready in {setup_s:.1f}s, initial weights checksum {checksum}", flush=True)

    progress_path = run_dir / "progress.json"
    first_step: list[float] = []  # wall time after this process's first step (recovery figures)

    def on_step(step: int, total: int, loss: float, step_time: float, tokens_per_expert: list | None) -> None:
        if not first_step:
            first_step.append(time.time())
        print(f"step {step + 1}/{total} loss {loss:.6f} step_time {step_time:.4f}s", flush=True)
        if rank == 0:
            write_json_atomic(
                progress_path,
                {"step": step + 1, "total": total, "loss": loss, "step_time": step_time, "time": time.time()},
            )
            line: dict = {"step": step, "loss": loss, "step_time_s": step_time}
            if tokens_per_expert is not None:  # MoE: [layer][expert], summed over the ranks (parabench.expertload)
                line["moe_tokens_per_expert"] = tokens_per_expert
            with open(run_dir / STEPS_FILE, "a") as f:
                f.write(json.dumps(line) + "\n")

    checkpointer = None
    if adapter.capabilities.checkpoint is not None:
        checkpointer = Checkpointer(engine, ctx, run_id=os.environ.get(RUN_ID_ENV) or None)
    result = train(engine, ctx, on_step, checkpointer)
    result.update(initial_checksum=checksum, setup_s=setup_s, device_name=ctx.device.name(), pid=os.getpid())
    result.update(gemm=_peak_reading(job, rank))
    first = first_step[0] if first_step else None
    result.update(restart_count=restart_count(), started_wall=started_wall, first_step_wall=first)
    if rank == 0:
        artifacts = engine.artifacts()
        if artifacts:
            write_json_atomic(run_dir / "backend_artifacts.json", artifacts)
    (run_dir / "ranks").mkdir(exist_ok=True)
    write_json_atomic(run_dir / "ranks" / f"rank{rank}.json", result)
    engine.close()
    ctx.comm.close()
    return 0


def _peak_reading(job, rank: int) -> dict | None:
    """Rank 0 measures the GEMM peak of MFU (a CPU's; a datasheet device has none) after its last step,
    where torch is loaded already: in the bench parent that measurement was its only use of torch
    (2.5 CPU-seconds of import in every run). A process without torch (MindSpore's) leaves it to the
    parent; so does a user-supplied device.peak_tflops."""
    if rank != 0 or job.device.peak_tflops or "torch" not in sys.modules:
        return None
    threads = cpu_threads(job.launch.nproc_per_node, job.device.threads_per_rank)
    reading = DEVICES[job.device.type].read_peak(job.run.precision, threads)
    return dataclasses.asdict(reading) if reading else None


if __name__ == "__main__":
    sys.exit(main())
