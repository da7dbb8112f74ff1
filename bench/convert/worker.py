"""Per-rank entry point of ``bench convert``: ``python -m parabench.convert.worker RUN_DIR``.

Started by the backend's own launcher (torchrun or msrun) with the job of one side of a conversion
(``spec.json``) and what to do (``convert.json``):

* ``export``: the SOURCE backend with the source checkpoint's own layout loads the native checkpoint
  (``Checkpointing.load_checkpoint``), gathers the canonical full tensors (``CanonicalIO.export_canonical``) and
  rank 0 writes the canonical directory (parabench.canonical) with the source ranks' harness states;
* ``import``: the TARGET backend with the target layout starts from the canonical weights (the job's
  ``model.weights``, the path every backend initialises from), takes the AdamW moments and step
  (``CanonicalIO.import_canonical``), exports again to check the canonical checksum, and writes a native
  checkpoint (``Checkpointing.save_checkpoint``) with per-rank harness files into ``step_N.tmp``, without a
  marker: the command writes the COMPLETE marker naming the target job and renames it to ``step_N``
  only once the checksum matches (parabench.convert.command.import_verified), so that ``bench run ...
  run.resume=<out>`` continues from a verified checkpoint and never from a failed conversion.

Rank 0 writes ``result.json`` (checksums, sizes) for the command to report.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from parabench import canonical
from parabench.adapters.base import WorkerContext, check_roles
from parabench.devices import DEVICES, drain_comm_threads
from parabench.jobs import load_job
from parabench.launchers import msrun_scheduler_started, rank_of, serve_msrun_scheduler
from parabench.resilience.checkpoint import TMP, _ledger_checksum, read_marker, rng_state

REQUEST = "convert.json"
RESULT = "result.json"


def _export(engine, ctx, request: dict[str, Any]) -> dict[str, Any]:
    import torch

    source = Path(request["source"])
    marker = read_marker(source)
    engine.load_checkpoint(source / "native")
    state = engine.export_canonical()  # its tensors may be gathered on access (canonical.Lazy): a collective
    world = int(marker["world_size"])
    harness = None
    if ctx.rank == 0:
        harness = [torch.load(source / "harness" / f"rank{r}.pt", weights_only=True) for r in range(world)]
    info = {"source": {"path": str(source), "marker_step": marker["step"], "job": marker["job"], "world_size": world}}
    # every rank visits the tensors in the same order, one at a time; rank 0 writes each as it comes
    manifest = canonical.write(Path(request["canonical"]), state, harness, info, writing=ctx.rank == 0)
    if manifest is None:
        return {}
    return {"checksum": manifest["checksum"], "tensors": manifest["tensors"], "bytes": manifest["bytes"]}


def _harness(ctx, engine, saved: list[dict[str, Any]], step: int) -> dict[str, Any]:
    dp_rank, dp_size = engine.data_parallel()
    return harness_state(ctx.rank, dp_rank, dp_size, saved, step)


def harness_state(rank: int, dp_rank: int, dp_size: int, saved: list[dict[str, Any]], step: int) -> dict[str, Any]:
    """Target rank ``rank``'s harness state: the RNG streams and history of the source rank it stands
    for (rank mod the source world size; the loss list is the same on every rank), and the data
    ledger checksum resharded as a resume would (checkpoint._ledger_checksum)."""
    mine = saved[rank % len(saved)]
    ledger = SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size)
    checksum = _ledger_checksum([s["ledger"] for s in saved], ledger)
    return {
        "step": step,
        "rng": mine["rng"],
        "ledger": {"dp_rank": dp_rank, "dp_size": dp_size, "checksum": checksum},
        "history": mine["history"],
    }


def _fresh_harness(ctx, engine, step: int) -> dict[str, Any]:
    """The harness state of a source parabench did not write (Hugging Face: step 0; DeepSpeed's own:
    its optimizer step): no loss history, an empty data ledger, this rank's RNG streams as the target
    built them; a resume continues parabench's data stream at ``step``."""
    dp_rank, dp_size = engine.data_parallel()
    history: dict[str, list] = {"losses": [], "step_times": [], "all_step_times": []}
    return {
        "step": step,
        "rng": rng_state(),
        "ledger": {"dp_rank": dp_rank, "dp_size": dp_size, "checksum": 0},
        "history": history,
    }


def _import(engine, ctx, request: dict[str, Any]) -> dict[str, Any]:
    import torch

    state, saved = canonical.load(Path(request["canonical"]))  # read one tensor at a time, on access
    engine.import_canonical(state)
    after = engine.export_canonical()  # what the target framework now holds, read back through it
    if state.moments is None:  # weights only: compare what was carried
        after = canonical.CanonicalState(after.weights, None, state.step, state.no_optimizer)
    checked = canonical.checksum(after, hashing=ctx.rank == 0)  # collective where ``after`` is gathered on access
    step = int(saved[0]["step"]) if saved else state.step
    tmp = Path(request["out"]) / f"step_{step:06d}{TMP}"  # published by the command once verified
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "harness").mkdir(parents=True)
    ctx.comm.barrier()
    engine.save_checkpoint(tmp / "native")
    harness = _harness(ctx, engine, saved, step) if saved else _fresh_harness(ctx, engine, step)
    torch.save(harness, tmp / "harness" / f"rank{ctx.rank}.pt")
    ctx.comm.barrier()
    if ctx.rank != 0:
        return {}
    return {"checksum": checked, "staging": str(tmp), "step": step}


def _run(run_dir: Path, rank: int, local_rank: int, world: int) -> int:
    job = load_job(run_dir / "spec.json")
    request = json.loads((run_dir / REQUEST).read_text())
    adapter = job.backend.adapter
    device = DEVICES[job.device.type](local_rank)
    ctx = WorkerContext(job=job, rank=rank, world_size=world, local_rank=local_rank, device=device, run_dir=run_dir)
    ctx.comm = adapter.init_worker(ctx)
    engine = adapter.create_engine(ctx)
    check_roles(adapter, engine)  # bench convert admitted the backend on its capabilities.convert
    result = (_export if request["mode"] == "export" else _import)(engine, ctx, request)
    if rank == 0:
        (run_dir / RESULT).write_text(json.dumps(result, indent=1))
    engine.close()
    ctx.comm.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    if msrun_scheduler_started():
        return serve_msrun_scheduler()
    argv = sys.argv[1:] if argv is None else argv
    run_dir = Path(argv[0])
    job = load_job(run_dir / "spec.json")
    rank, local_rank, world = rank_of(job, run_dir)
    print(f"[parabench convert] rank {rank}/{world} pid {os.getpid()}", flush=True)
    try:
        code = _run(run_dir, rank, local_rank, world)
        drain_comm_threads()  # else an abort at exit, seen at the end of a DeepSpeed export
        return code
    except Exception:  # the command prints this log's tail and exits 1
        traceback.print_exc()
        sys.stderr.flush()
        return 1


if __name__ == "__main__":
    sys.exit(main())
