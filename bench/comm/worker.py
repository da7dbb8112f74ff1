"""Per-rank entry of ``bench comm``: ``python -m parabench.comm.worker RUN_DIR`` (started by the
backend's launcher, torchrun or msrun, like :mod:`parabench.worker`).

Reads ``comm.json``, joins the world through the backend's adapter (torch.distributed on gloo, nccl
or hccl; MindSpore on mccl or hccl), and for every (operation, size) of the sweep: runs the warm-up
iterations, then times ``iters`` operations between device synchronisations (this rank's mean time
per operation), then, with the check on, fills the inputs with known values, runs the operation
once more and counts the result elements that differ from the expected values (nccl-tests -c).
Timed iterations run on zero-filled buffers, so that repeated in-place sums cannot overflow.
Writes ``ranks/rank<R>.json``; the front end (:mod:`parabench.comm.command`) takes the slowest rank.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from parabench.adapters.base import Adapter, WorkerContext
from parabench.adapters.registry import comm_stacks, import_target
from parabench.collectives import OPS, CommJob, Stack, options
from parabench.devices import DEVICES
from parabench.errors import SpecError
from parabench.jobs import backend_spec
from parabench.launchers import msrun_scheduler_started, rank_of, serve_msrun_scheduler
from parabench.loop import write_json_atomic
from parabench.spec import DeviceSpec, LaunchSpec, TrackingSpec, build


def comm_stack(adapter: type[Adapter]) -> Stack:
    """The stack ``bench comm`` drives for this backend (its adapter's ``comm_stack``), or a refusal
    naming the backends that declare one."""
    if adapter.comm_stack is not None:
        return adapter.comm_stack
    drivers = comm_stacks()
    torch_driver = next((n for n, st in drivers.items() if st.libraries is None), None)
    raise SpecError(
        "backend",
        f"bench comm drives {', '.join(f'backend={n}' for n in drivers)}, "
        f"not backend={adapter.name}"
        + (
            f": a backend that trains through torch.distributed calls the collectives backend={torch_driver} measures"
            if torch_driver
            else ""
        ),
    )


def measure(ops, spec: dict[str, Any], sync: Callable[[], None]) -> list[dict[str, Any]]:
    opts, rows = spec["config"]["comm"], []
    for point in spec["points"]:
        op, count = point["op"], point["count"]
        corrupt = opts["corrupt"] == op
        run, _, _ = ops.prepare(op, count, opts["inplace"], corrupt, filled=False)
        for _ in range(opts["warmup_iters"]):
            run()
        ops.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(opts["iters"]):
            run()
        sync()
        seconds = (time.perf_counter() - t0) / opts["iters"]
        wrong = None
        if opts["check"]:
            run, got, want = ops.prepare(op, count, opts["inplace"], corrupt, filled=True)
            run()
            sync()
            if corrupt and not OPS[op].reduces and ops.rank == 0:
                ops.corrupt_result(got())  # a non-reducing op has no wrong reduction: flip one element
            wrong = ops.wrong(got(), want())
        rows.append({**point, "time_s": seconds, "wrong": wrong})
    return rows


def comm_job(plain: Mapping[str, Any]) -> CommJob:
    """The CommJob of a composed ``bench comm`` config (plain dict; ``comm.json`` holds the same)."""
    backend = backend_spec(plain.get("backend"), default="ddp")
    comm_stack(backend.adapter)  # refuses a backend bench comm does not drive
    extra = sorted(set(plain) - {"backend", "device", "launcher", "tracking", "comm", "run"})
    if extra:
        raise SpecError(extra[0], "unknown top-level key of bench comm")
    job = CommJob(
        backend=backend,
        device=build(DeviceSpec, plain.get("device"), "device"),
        launch=build(LaunchSpec, plain.get("launcher"), "launcher"),
        tracking=build(TrackingSpec, plain.get("tracking"), "tracking"),
        results_dir=str((plain.get("run") or {}).get("results_dir", "results")),
        options=options(plain.get("comm")),
    )
    for key, value in [("launcher.nnodes", job.launch.nnodes), ("launcher.nproc_per_node", job.launch.nproc_per_node)]:
        if value <= 0:
            raise SpecError(key, f"must be > 0, got {value}")
    return job


def main(argv: list[str] | None = None) -> int:
    if msrun_scheduler_started():
        return serve_msrun_scheduler()
    run_dir = Path((sys.argv[1:] if argv is None else argv)[0])
    spec = json.loads((run_dir / "comm.json").read_text())
    job = comm_job(spec["config"])
    adapter = job.backend.adapter
    rank, local_rank, world = rank_of(job, run_dir)
    print(f"[parabench comm] rank {rank}/{world} pid {os.getpid()}", flush=True)
    try:
        ctx = WorkerContext(job, rank, world, local_rank, DEVICES[spec["device"]](local_rank), run_dir)  # type: ignore[arg-type]
        comm = adapter.init_worker(ctx)
        ops = import_target(comm_stack(adapter).ops)(ctx, job.options.dtype)
        rows = measure(ops, spec, ctx.device.synchronize)
        (run_dir / "ranks").mkdir(exist_ok=True)
        write_json_atomic(run_dir / "ranks" / f"rank{rank}.json", {"rank": rank, "rows": rows})
        comm.close()
        return 0
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
