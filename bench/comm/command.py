"""``bench comm``: the collectives benchmark, in the style of nccl-tests (docs/comm.md).

Every job of the command (all combinations of a ``-m`` sweep) is composed from ``conf/comm.yaml``
and checked first (:func:`prepare`): the stack and device must be usable here (``bench env``'s
reasons), the sizes must make sense for the world size; an operation the stack cannot do on this
device is refused by name. Then each job (:func:`execute`) writes its run directory, starts the
workers (:mod:`parabench.comm.worker`) through the backend's launcher, and reads back each rank's
times and wrong-element counts: per (operation, size) the slowest rank's time, algbw and busbw
(parabench.collectives, docs/sources.md#communication-volume), the alpha-beta fit per operation,
one MLflow run per (stack, world size). A wrong result is an error (exit 1), never a bandwidth.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from parabench import __version__
from parabench.collectives import OPS, CommJob, Fit, SizePoint, fit_alpha_beta, sweep
from parabench.comm.worker import comm_job, comm_stack
from parabench.devices import DEVICES, versions
from parabench.errors import SpecError, UserError, stopped_by
from parabench.hydraconfig import compose, expand_sweep, to_plain
from parabench.jobs import usable_device
from parabench.launchers import Launch, log_tails, supervise
from parabench.tracking import store as trackstore
from parabench.tracking.runs import JobRun, flatten, git_sha, store_uri

ENTRY = ["-m", "parabench.comm.worker"]
USAGE = """usage: bench comm [-m] [key=value ...]

Collectives benchmark (nccl-tests style): time, algbw and busbw per operation and size, results
checked, an alpha-beta fit per operation, one MLflow run per (stack, world size). Keys (conf/comm.yaml):
  backend=ddp|mindspore          torch.distributed (gloo/nccl/hccl by device) or MindSpore
  launcher.nproc_per_node=N      ranks (and the other launcher.*, device=*, tracking.* keys of bench run)
  comm.ops=[all_reduce,all_gather,reduce_scatter,all_to_all,broadcast,send_recv]
  comm.min_bytes=1K comm.max_bytes=16M comm.factor=2 comm.dtype=fp32|bf16|fp16
  comm.warmup_iters=5 comm.iters=20 comm.inplace=false comm.check=true
  -m                             sweep: comma-separated values run one job each (launcher.nproc_per_node=1,2)
"""


@dataclasses.dataclass(frozen=True)
class Prepared:
    job: CommJob
    plain: dict[str, Any]
    device: str  # the resolved device kind
    library: str  # e.g. torch.distributed/gloo
    points: list[SizePoint]
    refused: dict[str, str]  # op -> why this stack cannot run it on this device


def prepare(plain: dict[str, Any]) -> Prepared:
    job = comm_job(plain)
    if job.launch.dry_run:
        raise SpecError("launcher.dry_run", "bench comm writes no launch bundle; run it on the machine to measure")
    adapter = job.backend.adapter
    stack = comm_stack(adapter)
    kind = usable_device(adapter, job.device.type, job.launch)
    if kind not in adapter.capabilities.devices:
        raise SpecError("device", f"backend {adapter.name} does not run on {kind}")
    opts = job.options
    if opts.dtype not in stack.dtypes:
        raise SpecError("comm.dtype", f"{adapter.name} runs {', '.join(sorted(stack.dtypes))} here, not {opts.dtype}")
    refused = {o: stack.refused[(kind, o)] for o in opts.ops if (kind, o) in stack.refused}
    runnable = tuple(o for o in opts.ops if o not in refused)
    if not runnable:
        first = next(iter(refused))
        raise SpecError("comm.ops", f"{first}: {refused[first]}")
    if opts.corrupt in refused:
        raise SpecError("comm.corrupt", f"{opts.corrupt} does not run here: {refused[opts.corrupt]}")
    points = sweep(dataclasses.replace(opts, ops=runnable), job.launch.world_size)
    _check_memory(job, kind, max(p.size for p in points))
    return Prepared(job, plain, kind, stack.library_on(kind, DEVICES[kind].dist_backend), points, refused)


def _check_memory(job: CommJob, kind: str, largest: int) -> None:
    """CPU ranks share this host's memory: each holds up to 3 buffers of the largest size (input,
    output, the expected values of the check)."""
    if kind != "cpu":
        return
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = 3 * largest * job.launch.nproc_per_node
    if need > total // 2:
        raise SpecError(
            "comm.max_bytes",
            f"{largest} B buffers on {job.launch.nproc_per_node} ranks need ~{need >> 20} MiB, "
            f"more than half this host's {total >> 20} MiB",
        )


def launch(p: Prepared, run_dir: Path) -> tuple[int, str]:
    """Start the workers and watch them (parabench.launchers; launcher.setup_timeout_s bounds the
    whole launch: the workers report no steps). (exit code, reason)."""
    job = dataclasses.replace(p.job, device=dataclasses.replace(p.job.device, type=p.device))
    # a CommJob has the launch, device and backend fields of a JobSpec that launching reads
    return supervise(Launch.of(job, run_dir, entry=ENTRY))  # type: ignore[arg-type]


def collect(p: Prepared, run_dir: Path) -> list[dict[str, Any]]:
    """Per (op, size): the slowest rank's time, algbw, busbw (None when a result was wrong), wrong elements."""
    ranks = [json.loads(f.read_text()) for f in sorted((run_dir / "ranks").glob("rank*.json"))]
    world = p.job.launch.world_size
    rows = []
    for i, point in enumerate(p.points):
        per_rank = [r["rows"][i] for r in ranks]
        t = max(r["time_s"] for r in per_rank)
        checked = all(r["wrong"] is not None for r in per_rank)
        wrong = sum(r["wrong"] or 0 for r in per_rank) if checked else None
        algbw = point.size / t / 1e9
        ok = not wrong  # None (not checked) or 0
        rows.append(
            {
                **dataclasses.asdict(point),
                "time_s": t,
                "algbw_GBps": algbw if ok else None,
                "busbw_GBps": algbw * OPS[point.op].factor(world) if ok else None,
                "wrong": wrong,
                "wrong_ranks": [r["rank"] for r in ranks if r["rows"][i]["wrong"]],
            }
        )
    return rows


def fits(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        good = [r for r in rows if r["op"] == op and r["algbw_GBps"] is not None]
        fit = fit_alpha_beta([r["size"] for r in good], [r["time_s"] for r in good])
        if fit is not None:
            out[op] = fit
    return out


def print_table(p: Prepared, rows: list[dict[str, Any]], fitted: dict[str, Any]) -> None:
    o, world = p.job.options, p.job.launch.world_size
    print(
        f"\nparabench comm | {p.library} | {p.device} x{world} | {o.dtype} | "
        f"{'in-place' if o.inplace else 'out-of-place'} | {o.warmup_iters} warm-up + {o.iters} timed iterations "
        f"per size; time = slowest rank's mean; GB/s = 1e9 B/s; check {'on' if o.check else 'OFF'}"
    )
    for op in o.ops:
        if op in p.refused:
            print(f"\n{op}: not run: {p.refused[op]}")
            continue
        print(f"\n{op}  (busbw = algbw x {OPS[op].bus_factor} = x{OPS[op].factor(world):.3f})")
        print(f"{'size(B)':>12} {'count':>11} {'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}")
        for r in (r for r in rows if r["op"] == op):
            bw = (
                f"{r['algbw_GBps']:12.4f} {r['busbw_GBps']:12.4f}"
                if r["algbw_GBps"] is not None
                else f"{'WRONG':>12} {'-':>12}"
            )
            wrong = "n/a" if r["wrong"] is None else str(r["wrong"])
            note = f"  (rounded from {r['requested']} B)" if r["size"] != r["requested"] else ""
            print(f"{r['size']:12d} {r['count']:11d} {r['time_s'] * 1e6:11.1f} {bw} {wrong:>7}{note}")
        if op in fitted:
            print(fit_line(fitted[op]))


def fit_line(fit: Fit) -> str:
    """The alpha-beta line under an operation's table, or a warning where the fit means nothing."""
    problem = fit.problem()
    if problem:
        return (
            f"  fit: warning: no latency/bandwidth model: {problem} "
            f"(max error {100 * fit.max_rel_err:.1f}% over {fit.points} sizes)"
        )
    return (
        f"  fit: t = {fit.alpha_s * 1e6:.1f} us + S / {1 / fit.beta_s_per_byte / 1e9:.4g} GB/s "
        f"(max error {100 * fit.max_rel_err:.1f}% over {fit.points} sizes)"
    )


def _record(
    p: Prepared, run_dir: Path, rows: list[dict[str, Any]] | None, fitted: dict[str, Any], failure: str
) -> str | None:
    """One MLflow run for this (stack, world size): comm.* and the fits as params, per op and size
    ``<op>.time_us`` / ``.algbw_GBps`` / ``.busbw_GBps`` with the size in bytes as the step."""
    job = p.job
    tracker = JobRun(job.tracking, job.results_dir, run_dir)  # spooled there; artifacts are its files
    params = flatten(p.plain)
    for op, f in fitted.items():
        params.update(f.as_params(op))
    installed = versions()
    tags = {
        "parabench.kind": "comm",
        "stack": p.library,
        "backend": job.backend.name,
        "device": p.device,
        "world_size": job.launch.world_size,
        "dtype": job.options.dtype,
        "git_sha": git_sha(),
        "parabench_version": __version__,
        "run_dir": str(run_dir),
        **{f"refused.{op}": why for op, why in p.refused.items()},
        **{f"version.{k}": v for k, v in installed.items() if v},
    }
    tracker.start(f"comm-{p.library.replace('/', '-')}-x{job.launch.world_size}", params, tags)
    metrics = []
    for r in rows or []:
        metrics.append((f"{r['op']}.time_us", r["time_s"] * 1e6, r["size"]))
        if r["busbw_GBps"] is not None:
            metrics += [
                (f"{r['op']}.algbw_GBps", r["algbw_GBps"], r["size"]),
                (f"{r['op']}.busbw_GBps", r["busbw_GBps"], r["size"]),
            ]
        if r["wrong"]:
            metrics.append((f"{r['op']}.wrong_elements", r["wrong"], r["size"]))
    tracker.log_metrics(metrics)
    if failure:
        tracker.set_tags({"failure_reason": failure[:5000]})
    files = [run_dir / n for n in ("comm.json", "results.json", "command.txt")] + sorted(
        (run_dir / "logs").glob("*.log")
    )
    tracker.log_artifacts([f for f in files if f.is_file()], run_dir)
    tracker.end("FAILED" if failure else "FINISHED")
    return tracker.run_id


def _wrong_summary(rows: list[dict[str, Any]]) -> str:
    bad = [r for r in rows if r["wrong"]]
    if not bad:
        return ""
    ops = ", ".join(dict.fromkeys(r["op"] for r in bad))
    first = bad[0]
    return (
        f"wrong results ({ops}) at {len(bad)} (op, size) points; first: {first['op']} {first['size']} B: "
        f"{first['wrong']} wrong elements on rank(s) {first['wrong_ranks']}"
    )


def execute(p: Prepared, run_dir: Path) -> int:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    spec = {"config": p.plain, "device": p.device, "points": [dataclasses.asdict(x) for x in p.points]}
    (run_dir / "comm.json").write_text(json.dumps(spec, indent=2))
    rc, reason = launch(p, run_dir)
    ranks = list((run_dir / "ranks").glob("rank*.json")) if (run_dir / "ranks").exists() else []
    if rc != 0 or len(ranks) != p.job.launch.world_size:
        failure = f"run failed: {reason or f'launcher exit code {rc}'}; logs in {run_dir / 'logs'}"
        print(f"\nparabench comm: {failure}", file=sys.stderr)
        print(log_tails(run_dir / "logs"), file=sys.stderr)
        _record(p, run_dir, None, {}, failure)
        return 1
    rows = collect(p, run_dir)
    fitted = fits(rows)
    (run_dir / "results.json").write_text(
        json.dumps(
            {
                "library": p.library,
                "device": p.device,
                "world_size": p.job.launch.world_size,
                "rows": rows,
                "refused": p.refused,
                "fits": {k: dataclasses.asdict(v) for k, v in fitted.items()},
            },
            indent=2,
        )
    )
    print_table(p, rows, fitted)
    failure = _wrong_summary(rows)
    run_id = _record(p, run_dir, rows, fitted, failure)
    print(f"\n  run dir        {run_dir}")
    if run_id:
        print(f"  MLflow run     {run_id} in {store_uri(p.job.tracking, p.job.results_dir)}")
    if failure:
        print(f"bench comm: error: {failure}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    multirun = any(a in ("-m", "--multirun") for a in argv)
    try:  # a tracking.uri login goes to MLflow's variables, never into comm.json or the run's params
        overrides = trackstore.overrides_without_credentials(
            [a for a in argv if a not in ("-m", "--multirun")], os.environ
        )
        combos = expand_sweep(overrides) if multirun else [overrides]
        prepared = [prepare(to_plain(compose(c, config_name="comm"))) for c in combos]
    except UserError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return exc.exit_code
    stamp = time.strftime("%Y%m%d-%H%M%S")
    status = 0
    try:
        for i, p in enumerate(prepared):
            name = f"{p.library.replace('/', '-')}-x{p.job.launch.world_size}"
            base = Path(p.job.results_dir) / "runs" / p.job.tracking.experiment / stamp
            status = max(status, execute(p, base / (f"{i}_{name}" if multirun else name)))
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (parabench.errors.Interrupted): workers stopped
        signum = stopped_by(exc)
        print(f"bench comm: interrupted by {signum.name}: workers stopped", file=sys.stderr)
        return 128 + signum
    return status
