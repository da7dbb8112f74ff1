"""Injected failures (``fault.kind=kill|hang|exception``) and the recovery figures measured around them.

A fault fires once per run directory: the rank that fires it first creates ``faults/fired.json``
with ``O_EXCL`` (time, step, kind), so a worker restarted by torchrun's elastic agent
(``launcher.max_restarts``), which runs the same step again, does not fire it twice. Workers that
notice a failure (a collective that raised, the agent's SIGTERM) append the moment to
``faults/detected.jsonl``. :func:`recovery_figures` turns these files and the ranks' results into
the stability metrics of the summary (docs/resilience.md).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from parabench.spec import JobSpec

FIRED = "fired.json"
DETECTED = "detected.jsonl"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun's elastic agent in every worker


class InjectedFault(RuntimeError):
    """fault.kind=exception: an ordinary Python exception in the training loop."""


def restart_count() -> int:
    return int(os.environ.get(RESTART_ENV, "0") or 0)


def fire_fault(job: JobSpec, run_dir: Path, rank: int, step: int, at: str = "step") -> None:
    """Fire the configured fault on ``fault.rank`` where ``fault.at`` says: before ``step``
    (``at="step"``, the loop) or inside the save after ``step`` completed steps (``at="save"``, the
    checkpointer); once per run directory."""
    fault = job.fault
    if fault.kind == "none" or rank != fault.rank or step != fault.step or at != fault.at:
        return
    folder = run_dir / "faults"
    folder.mkdir(exist_ok=True)
    try:
        fd = os.open(folder / FIRED, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return  # fired already (this is a restarted or resumed worker)
    record = {"kind": fault.kind, "rank": rank, "step": step, "at": at, "time": time.time()}
    record["restart"] = restart_count()
    os.write(fd, json.dumps(record).encode())
    os.fsync(fd)
    os.close(fd)
    where = f"before step {step}" if at == "step" else f"during the checkpoint save after step {step}"
    print(f"[parabench] injected fault: {fault.kind} on rank {rank} {where}", flush=True)
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "exception":
        raise InjectedFault(f"fault.kind=exception on rank {rank} {where}")
    while True:  # hang: never reach the next collective; the peers' collective timeout fires
        time.sleep(3600)


def record_detection(run_dir: Path, rank: int, what: str) -> None:
    """A worker noticed the job failing (``what``): append the moment (one short line, atomic append)."""
    folder = run_dir / "faults"
    folder.mkdir(exist_ok=True)
    line = json.dumps({"rank": rank, "time": time.time(), "what": what[:200], "restart": restart_count()})
    with open(folder / DETECTED, "a") as f:
        f.write(line + "\n")


def _read_lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def recovery_figures(
    run_dir: Path, results: list[dict[str, Any]], wall_s: float, start_step: int = 0
) -> dict[str, Any]:
    """Stability figures of a finished job from its ranks' results and the fault files.

    restarts: torchrun's restart count seen by the last workers; steps_recomputed: steps that had
    completed before the fault and ran again after the resume; goodput: the step times of the steps
    the run kept from ``start_step`` on (the step this `bench run` started from; slowest rank,
    warm-up included) / the job's wall time from launch to exit."""
    rank0 = min(results, key=lambda r: r["rank"])
    ckpt = rank0.get("checkpoint") or {}
    saves = ckpt.get("saves") or []
    out: dict[str, Any] = {
        "restarts": max(r.get("restart_count", 0) for r in results),
        "ckpt_saves": len(saves),
        "goodput": sum(rank0.get("all_step_times", [])[start_step:]) / wall_s if wall_s > 0 else None,
        "wall_time_s": wall_s,
    }
    if saves:
        out["ckpt_save_blocking_s"] = max(s["blocking_s"] for s in saves)
        out["ckpt_save_total_s"] = max(s["total_s"] or s["blocking_s"] for s in saves)
        out["ckpt_bytes_total"] = saves[-1]["bytes_total"]
        out["ckpt_bytes_per_rank"] = saves[-1]["bytes_total"] / len(results)
    if ckpt.get("load_s") is not None:
        out["ckpt_load_s"] = max((r.get("checkpoint") or {}).get("load_s") or 0.0 for r in results)
        out["resumed_step"] = ckpt.get("resumed_step")
        out["resumed_from"] = ckpt.get("resumed_from")
    fired = _read_lines(run_dir / "faults" / FIRED)
    if fired:
        fault = fired[0]
        where = "before step" if fault.get("at", "step") == "step" else "in the save after step"
        out["fault"] = f"{fault['kind']} on rank {fault['rank']} {where} {fault['step']}"
        detected = [d["time"] for d in _read_lines(run_dir / "faults" / DETECTED) if d["time"] >= fault["time"]]
        # no peer noticed (the agent stopped them first): the restarted workers' start bounds it
        detected = detected or [r["started_wall"] for r in results if r.get("restart_count") and "started_wall" in r]
        if detected:
            out["time_to_detect_s"] = min(detected) - fault["time"]
        first = rank0.get("first_step_wall")
        if first is not None and first > fault["time"]:
            out["time_to_first_step_after_fault_s"] = first - fault["time"]
        if ckpt.get("resumed_step") is not None:
            out["steps_recomputed"] = fault["step"] - ckpt["resumed_step"]
    return out
