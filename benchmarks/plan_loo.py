"""Leave-one-out check of ``bench plan`` on this machine (docs/plan.md, "How good is it").

1. Runs a sweep of CPU jobs (backends x layouts x world sizes x micro-batch sizes, 22 runs; a small
   Llama) and a 2-rank ``bench comm`` (all-reduce, all-gather, reduce-scatter) into the MLflow
   experiment ``plan_loo`` under ``--results`` (skipped with ``--no-run``); about 5.5 minutes here.
2. Prints the calibration of all the runs, then for every recorded run: calibrates on all the
   *other* runs (``plan.calibrate.fit_records``) and
   predicts the left-out run's step time and peak memory; prints predicted vs measured and the
   share within 20% (step time) and 25% (peak memory).
3. Prints every rank's model-state bytes, predicted vs measured (they must be equal).

    python benchmarks/plan_loo.py [--results /tmp/plan_loo] [--no-run] [--lock /tmp/pb-heavy.lock]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from parabench.plan.calibrate import Record, comm_links, describe, fit_records, predict, records
from parabench.plan.estimate import plan_profile

MODEL = [
    "+model=llama", "model.vocab_size=4096", "model.hidden_size=256", "model.intermediate_size=688",
    "model.num_hidden_layers=4", "data.seq_len=128", "run.warmup_steps=2", "run.steps=10", "run.checksum=false",
]  # fmt: skip
# Every configuration at two or three micro-batch counts (the same global batch in smaller micro-batches):
# a left-out run keeps a partner of its own layout and thread count, and each backend keeps runs that
# separate its per-micro-batch framework cost from its compute efficiency (calibrate.fit_records).
_GBS = "data.global_batch_size=8"
_X1, _X2 = "launcher.nproc_per_node=1", "launcher.nproc_per_node=2"
_Z = ["backend=deepspeed", _X2, _GBS]
_MG = ["backend=megatron", _X2, _GBS]
SWEEP = [
    *(["backend=ddp", _X2, _GBS, f"data.micro_batch_size={b}"] for b in (4, 2, 1)),
    *(["backend=ddp", _X1, _GBS, f"data.micro_batch_size={b}"] for b in (4, 2)),
    *(["backend=fsdp", _X2, _GBS, f"data.micro_batch_size={b}"] for b in (4, 2, 1)),
    *(["backend=fsdp", _X1, _GBS, f"data.micro_batch_size={b}"] for b in (4, 2)),
    *([*_Z, f"backend.zero_stage={z}", f"data.micro_batch_size={b}"] for z in (1, 2, 3) for b in (4, 2)),
    *([*_MG, "backend.distributed_optimizer=true", f"data.micro_batch_size={b}"] for b in (4, 2)),
    *([*_MG, "backend.tp=2", f"data.micro_batch_size={b}"] for b in (4, 2)),
    *([*_MG, "backend.pp=2", f"data.micro_batch_size={b}"] for b in (2, 1)),
]  # fmt: skip


def run_sweep(results: Path, lock: str | None) -> None:
    for overrides in SWEEP:
        cmd = [sys.executable, "-m", "parabench", "run", *MODEL, *overrides,
               "tracking.experiment=plan_loo", f"run.results_dir={results}"]  # fmt: skip
        if lock:  # a machine shared with other heavy jobs: one at a time
            cmd = ["flock", lock, *cmd]
        rc = subprocess.run(cmd, capture_output=True, text=True).returncode
        print(f"{'ok ' if rc == 0 else 'FAILED'} {' '.join(overrides)}", flush=True)
    # the gloo links the plan's communication runs over (alpha-beta fits of 2-rank collectives, per kind)
    cmd = [sys.executable, "-m", "parabench", "comm", "launcher.nproc_per_node=2", "comm.ops=[all_reduce,all_gather,reduce_scatter]",
           "tracking.experiment=plan_loo", f"run.results_dir={results}"]  # fmt: skip
    rc = subprocess.run(["flock", lock, *cmd] if lock else cmd, capture_output=True, text=True).returncode
    print(f"{'ok ' if rc == 0 else 'FAILED'} bench comm (all_reduce, all_gather, reduce_scatter; 2 ranks)", flush=True)


def label(r: Record) -> str:
    j = r.job
    o = {k: v for k, v in vars(j.backend.options).items() if k in ("zero_stage", "tp", "pp", "distributed_optimizer")}
    opts = " ".join(f"{k}={v}" for k, v in o.items() if v not in (1, False) or k == "zero_stage")
    return (
        f"{j.backend.name} {opts} x{j.parallel.world_size} mbs{j.data.micro_batch_size} gbs{j.data.global_batch_size}"
    )


def leave_one_out(recs: list[Record], links: dict[str, list[float]]) -> tuple[list[float], list[float]]:
    t_err, m_err = [], []
    print(f"{'left out':46} {'step pred':>10} {'meas':>8} {'err':>7} {'mem pred MiB':>13} {'meas':>8} {'err':>7}")
    for i, r in enumerate(recs):
        cal = fit_records(recs[:i] + recs[i + 1 :], f"loo-{i}", links)
        step, mem = predict(r, cal)
        te, me = (step - r.step_s) / r.step_s, (mem - r.peak_bytes) / r.peak_bytes
        t_err.append(abs(te))
        m_err.append(abs(me))
        print(f"{label(r):46} {step:10.3f} {r.step_s:8.3f} {100 * te:+6.1f}% {mem / 2**20:13.0f} "
              f"{r.peak_bytes / 2**20:8.0f} {100 * me:+6.1f}%")  # fmt: skip
    return t_err, m_err


def model_states(results: Path) -> int:
    """Predicted vs measured model-state bytes of every rank; returns the number of mismatches."""
    from parabench.jobs import job_from_json

    bad = 0
    for spec in sorted(results.glob("runs/plan_loo/*/*/spec.json")):
        job = job_from_json(spec.read_text())
        st = plan_profile(job).states(job)
        held = []
        for rank_file in sorted((spec.parent / "ranks").glob("rank*.json")):
            ms = json.loads(rank_file.read_text())["model_state"]
            held.append(ms["params"] + ms["grads"] + ms["optimizer"])
        busiest = max(held)  # the plan sizes the device for the busiest rank (pipeline stages differ)
        bad += busiest != st.total
        print(f"  {spec.parent.parent.name}: {job.backend.name:9} busiest rank of {len(held)} measured {busiest:>10} "
              f"predicted {st.total:>12.0f} {'=' if busiest == st.total else f'DIFF {st.total - busiest:+.0f}'}")  # fmt: skip
    return bad


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default="/tmp/plan_loo")
    ap.add_argument("--no-run", action="store_true", help="use the runs already recorded under --results")
    ap.add_argument("--lock", help="flock this file around each run (a machine shared with other jobs)")
    args = ap.parse_args()
    results = Path(args.results).resolve()
    if not args.no_run:
        run_sweep(results, args.lock)
    uri = f"sqlite:///{results / 'mlflow.db'}"
    recs, links = records("plan_loo", uri), comm_links("plan_loo", uri)
    print(describe(fit_records(recs, "plan_loo (all runs)", links)).split("\n", 1)[1], end="\n\n")
    t_err, m_err = leave_one_out(recs, links)
    within_t = sum(e <= 0.20 for e in t_err) / len(t_err)
    within_m = sum(e <= 0.25 for e in m_err) / len(m_err)
    print(f"\n{len(recs)} runs, leave-one-out: step time median |err| {100 * statistics.median(t_err):.1f}%, "
          f"{round(within_t * len(recs))} of {len(recs)} within 20% (max {100 * max(t_err):.1f}%); peak memory "
          f"median |err| {100 * statistics.median(m_err):.1f}%, {round(within_m * len(recs))} of {len(recs)} within 25%")  # fmt: skip
    print("\nmodel-state bytes of the busiest rank, predicted vs measured:")
    bad = model_states(results)
    print(f"{bad} run(s) differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
