"""One job: validate the composed config (:func:`prepare`), then run it (:func:`execute`): run dir ->
spawn workers (the backend's launcher: torchrun or msrun) -> watch -> collect -> track.

One call of :func:`execute` is one job. The run directory
``<results_dir>/runs/<experiment>/<timestamp>/<job>/`` holds ``config.resolved.yaml`` (what was
composed), ``spec.json`` (what workers read), ``launch.sh`` (the exact command and environment),
``logs/rank<R>.log``, ``ranks/rank<R>.json``, ``summary.json`` and ``env.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from parabench import __version__, expertload, rundir
from parabench.devices import DEVICES, cpu_info, cpu_threads, versions
from parabench.errors import RunFailed, stopped_by
from parabench.flops import FORMULA, GemmReading, Peak, flops_per_token
from parabench.launchers import Launch, launch_env, log_tails, supervise
from parabench.metrics import summarize
from parabench.resilience.checkpoint import (
    RUN_ID_ENV,
    STEPS_FILE,
    plan_resume,
    write_stop_request,
)
from parabench.resilience.faults import recovery_figures
from parabench.run import comm_report
from parabench.runnames import job_run_name
from parabench.spec import JobSpec, to_dict
from parabench.tracking import store as trackstore
from parabench.tracking.runs import JobRun, StepTail, flatten, git_sha, is_secret, store_uri

LIVE_S = 2.0  # rank 0's finished steps go to MLflow in a batch this often during the run
STOP_GRACE_S = 60.0  # run.checkpoint.on_signal: how long the workers get to write the last checkpoint


# --------------------------------------------------------------------------------------------
# Pre-flight: everything that can be refused before a process starts.
# --------------------------------------------------------------------------------------------
def _interrupted_status(exc: KeyboardInterrupt, tracker) -> str:
    """MLflow status of an interrupted job: KILLED (Ctrl-C, a SIGTERM to bench run), or FAILED with the
    reason when Slurm ended the job step: it sends SIGTERM on scancel, at the time limit, on
    preemption and when a node of the job fails (docs/sources.md#slurm)."""
    signum = stopped_by(exc)
    env = os.environ
    array = (env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID"))  # a sweep's job: squeue's 42_1
    job_id = "_".join(array) if all(array) else env.get("SLURM_JOB_ID")  # type: ignore[arg-type]
    if signum != signal.SIGTERM or not job_id:
        return "KILLED"
    why = f"Slurm job {job_id} ended by SIGTERM (scancel, its time limit, preemption or a failed node)"
    tracker.set_tags({"failure_reason": why})
    return "FAILED"


# --------------------------------------------------------------------------------------------
# Launch.
# --------------------------------------------------------------------------------------------
class _Progress:
    """tqdm bar driven by rank 0's progress file."""

    def __init__(self, total: int, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True, leave=True)
        self.step = 0

    def update(self, info: dict) -> None:
        step = int(info.get("step", 0))
        if step > self.step:
            self.bar.update(step - self.step)
            self.step = step
            self.bar.set_postfix(loss=f"{info['loss']:.4f}", step_s=f"{info['step_time']:.3f}")

    def close(self) -> None:
        self.bar.close()


def _progress(run_dir: Path) -> dict[str, Any] | None:
    """Rank 0's last finished step and its figures (``progress.json``, written after each step)."""
    try:
        return json.loads((run_dir / "progress.json").read_text())
    except (OSError, ValueError):
        return None


def _progress_step(run_dir: Path) -> int:
    """Rank 0's last finished step; -1 before the first."""
    return int((_progress(run_dir) or {}).get("step", -1))


def launch(job: JobSpec, run_dir: Path, env: dict[str, str], port: int, tracker=None) -> tuple[int, str]:
    """Start the workers through the backend's launcher and watch them (parabench.launchers). Returns
    (exit code, reason). With ``tracker``, rank 0's finished steps go to MLflow every LIVE_S while the
    workers run (this process only reads the file rank 0 appends to after each step: nothing in the
    timed region)."""
    watch = _Watch(job, run_dir, tracker)
    try:
        rc, reason = supervise(Launch.of(job, run_dir, env=env, port=port, poll=watch.poll, on_stop=watch.on_stop))
    finally:
        watch.bar.close()
    watch.live.flush()
    return rc, reason


class _Watch:
    """What `bench run` does while its workers run: the progress bar and the live metrics every poll
    (the watchdog times rank 0's steps), and on SIGINT/SIGTERM with run.checkpoint.on_signal a last
    checkpoint at a step none of them has finished yet (``stop.json``, read after every step)."""

    def __init__(self, job: JobSpec, run_dir: Path, tracker) -> None:
        self.job, self.run_dir = job, run_dir
        self.bar = _Progress(job.run.warmup_steps + job.run.steps, f"{job.backend.name} x{job.launch.world_size}")
        self.live = _Live(job, run_dir, tracker)

    def poll(self) -> int | None:
        """Rank 0's newest finished step (None: no progress file yet); the bar and live metrics follow it."""
        info = _progress(self.run_dir)
        if info:
            self.bar.update(info)
        self.live.poll()
        return int(info.get("step", 0)) if info else None

    def on_stop(self) -> float:
        """The grace period the workers get to write the last checkpoint (none without on_signal)."""
        self.bar.close()
        if not self.job.run.checkpoint.on_signal:
            return 0.0
        # ranks are at most one step apart (each step ends in an all-reduce): rank 0's last finished
        # step + 2 is ahead of all, read now (a step read a poll ago was passed by short steps: no
        # rank stopped, nothing saved)
        write_stop_request(self.run_dir, max(_progress_step(self.run_dir), 0) + 2)
        print(f"\nparabench: interrupted: saving a last checkpoint (up to {STOP_GRACE_S:.0f} s)", file=sys.stderr)
        return STOP_GRACE_S


class _Live:
    """Live metrics: rank 0's new steps (``steps.jsonl``) logged in one batch every LIVE_S."""

    def __init__(self, job: JobSpec, run_dir: Path, tracker):
        self.tracker = tracker
        self.tail = StepTail(run_dir / STEPS_FILE, job.run.warmup_steps, job.tokens_per_step)
        self.last = time.monotonic()

    def poll(self) -> None:
        if time.monotonic() - self.last >= LIVE_S:
            self.flush()

    def flush(self) -> None:
        self.last = time.monotonic()
        if self.tracker is not None and self.tracker.active:
            self.tracker.log_metrics(self.tail.new())


# --------------------------------------------------------------------------------------------
# One job.
# --------------------------------------------------------------------------------------------
def _run_metadata(
    job: JobSpec,
    plain: dict[str, Any],
    env: dict[str, str],
    versions: dict[str, Any],
    run_dir: Path,
    extra_tags: dict[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The MLflow params (the composed config, the resolved model, derived sizes) and tags of a job."""
    tags = {
        "backend": job.backend.name,
        "device": job.device.type,
        "world_size": job.parallel.world_size,
        "model": job.model.name,
        "precision": job.run.precision,
        "host": socket.gethostname(),
        "git_sha": git_sha(),
        "parabench_version": __version__,
        "experiment": job.experiment,
        "run_dir": str(run_dir),
        "parabench.kind": "job",
        **(extra_tags or {}),
        **{f"version.{k}": v for k, v in versions.items() if v},
    }
    params = flatten(plain)
    params.update(flatten({"model": to_dict(job.model)}))  # the resolved model (e.g. read from a config.json)
    params.update(
        {
            "derived.grad_accum": str(job.grad_accum),
            "derived.num_params": str(job.model.num_params()),
            "derived.dp": str(job.parallel.dp),
            "derived.tp": str(job.parallel.tp),
            "derived.pp": str(job.parallel.pp),
            "derived.cp": str(job.parallel.cp),
            "derived.threads_per_rank": env.get("OMP_NUM_THREADS", ""),
        }
    )
    return params, tags


def execute(
    job: JobSpec, plain: dict[str, Any], run_dir: Path, extra_tags: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    # refused (exit 2) before the run directory is touched. prepare() has looked at the checkpoint
    # folder and a run.resume path already and reported their skipped checkpoints once.
    repeat = (extra_tags or {}).get("repeat")
    resume_from = plan_resume(job, repeat, warn=lambda msg: None)
    plain = rundir.prepare(job, plain, run_dir, repeat, resume_from)
    env = launch_env(job)
    port = job.launch.master_port  # 0: the launcher takes one as it starts (launchers._c10d)
    bundle = rundir.write_bundle(job, run_dir, env, job.launch.master_port or 29500)
    if job.launch.dry_run:
        print(f"dry run: launch bundle written to {bundle} (with spec.json and config.resolved.yaml beside it)")
        return None

    versions = _write_env_doc(run_dir, env)
    params, tags = _run_metadata(job, plain, env, versions, run_dir, extra_tags)
    # One MLflow run per job: on a multi-node job only node 0 records (the other nodes' workers
    # write their rank files into the same, shared run directory).
    tracking = job.tracking if job.launch.node_rank == 0 else dataclasses.replace(job.tracking, enabled=False)
    tracker = JobRun(tracking, job.run.results_dir, run_dir)
    tags.update(resume_tags(resume_from))
    tracker.start(job_run_name(job, repeat), params, tags)
    env[RUN_ID_ENV] = tracker.run_id or ""
    status = "FAILED"
    try:
        started = time.monotonic()
        rc, reason = launch(job, run_dir, env, port, tracker)
        started_at = int(tags.get("parabench.resumed_step") or 0)
        summary = _summarise(job, run_dir, (rc, reason), time.monotonic() - started, tracker, started_at, resume_from)
        status = "FINISHED"
        print_summary(job, summary, tracker, run_dir)
        return summary
    except KeyboardInterrupt as exc:
        status = _interrupted_status(exc, tracker)
        _log_partial(job, tracker, run_dir)
        raise
    finally:
        tracker.log_artifacts(_artifact_files(run_dir), run_dir)
        tracker.end(status)


def _write_env_doc(run_dir: Path, env: dict[str, str]) -> dict[str, str | None]:
    """env.json: package versions, the launch environment without secrets, host, CPU, Python. Returns
    the versions (recorded as MLflow params too)."""
    installed = versions()
    env_doc = {
        "versions": installed,
        "launch_env": {k: v for k, v in env.items() if not is_secret(k)},
        "host": socket.gethostname(),
        "cpu": cpu_info(),
        "python": sys.version,
    }
    (run_dir / "env.json").write_text(json.dumps(env_doc, indent=2))
    return installed


def _summarise(
    job: JobSpec,
    run_dir: Path,
    outcome: tuple[int, str | None],
    wall_s: float,
    tracker: JobRun,
    started_at: int,
    resume_from: Path | None,
) -> dict[str, Any]:
    """summary.json of a launch that ended with ``outcome`` (exit code, reason), logged to MLflow;
    RunFailed unless every rank reported."""
    rc, reason = outcome
    ranks = sorted((run_dir / "ranks").glob("rank*.json")) if (run_dir / "ranks").exists() else []
    if rc != 0 or len(ranks) != job.parallel.world_size:
        reason = reason or f"{len(ranks)} of {job.parallel.world_size} ranks reported results"
        _report_failure(run_dir, reason, tracker)
        raise RunFailed(f"run failed: {reason}; logs in {run_dir / 'logs'}")
    results = [json.loads(p.read_text()) for p in ranks]
    summary = build_summary(job, job.backend.adapter, results)
    summary.update(recovery_figures(run_dir, results, wall_s, started_at))
    # the measured figures are this run's own steps (parabench.loop): say where it started
    summary.update(started_at_step=started_at, started_from=str(resume_from) if resume_from else None)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    _log_results(tracker, summary, results)
    return summary


def _log_partial(job: JobSpec, tracker, run_dir: Path) -> None:
    """An interrupted job's MLflow run keeps the steps its rank 0 had finished (``steps.jsonl``;
    those already logged live are not logged again)."""
    metrics = StepTail(run_dir / STEPS_FILE, job.run.warmup_steps, job.tokens_per_step).new()
    tracker.log_metrics(metrics)
    tracker.set_tags({"interrupted_after_step": max((s for k, _, s in metrics if k == "loss"), default=-1) + 1})


def resume_tags(resume_from: Path | None) -> dict[str, Any]:
    """A resumed job is a new MLflow run linked to the one that wrote its checkpoint."""
    if resume_from is None:
        return {}
    marker = json.loads((resume_from / "COMPLETE").read_text())
    return {
        "parabench.resumed_from_run": marker.get("mlflow_run_id"),
        "parabench.resumed_from_checkpoint": str(resume_from),
        "parabench.resumed_step": marker.get("step"),
    }


def _artifact_files(run_dir: Path) -> list[Path]:
    names = [
        "config.resolved.yaml",
        "spec.json",
        "env.json",
        "summary.json",
        "launch.sh",
        "command.txt",
        "backend_artifacts.json",
    ]
    files = [run_dir / n for n in names]
    files += sorted((run_dir / "ranks").glob("*.json")) if (run_dir / "ranks").exists() else []
    files += sorted((run_dir / "logs").glob("*.log"))
    return [f for f in files if f.is_file()]


def _report_failure(run_dir: Path, reason: str, tracker) -> None:
    """One line with the failed rank's own error where the logs name it (never the launcher's
    traceback); the logs' last lines only where they do not."""
    cause = failure_cause(run_dir / "logs")
    print(f"\nparabench: run FAILED: {reason}" + (f": {cause}" if cause else ""), file=sys.stderr)
    if cause is None:
        print(log_tails(run_dir / "logs"), file=sys.stderr)  # ranks, the launcher, msrun's scheduler/workers
    tracker.set_tags({"failure_reason": (f"{reason}: {cause}" if cause else reason)[:5000]})


# torchrun's summary of a failed job: "Root Cause (first observed failure):" ... "rank : R" ... "exitcode : C"
ROOT_CAUSE = re.compile(r"Root Cause[^\n]*\n.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def failure_cause(logs: Path) -> str | None:
    """``rank R: <its last exception line>`` or ``rank R: killed by signal N (NAME)``: the first rank
    torchrun saw fail, else the first rank log ending in an exception; None when no log says."""
    try:
        found = ROOT_CAUSE.search((logs / "launcher.log").read_text(errors="replace"))
    except OSError:
        found = None
    if found:
        rank, code = int(found.group(1)), int(found.group(2))
        error = _last_exception(logs / f"rank{rank}.log")
        if error:
            return f"rank {rank}: {error}"
        if code < 0:
            return f"rank {rank}: killed by signal {-code} ({signal.Signals(-code).name})"
        return None
    for log in sorted(logs.glob("rank*.log"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0)):
        error = _last_exception(log)
        if error:
            return f"{log.stem.replace('rank', 'rank ')}: {error}"
    return None


def _last_exception(log: Path) -> str | None:
    """The ``Type: message`` line that ends the last Python traceback of ``log``, if any."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    after = [line for line in lines[starts[-1] + 1 :] if line and not line.startswith((" ", "\t"))]
    return after[0].strip() if after else None


def build_summary(job: JobSpec, adapter, results: list[dict]) -> dict[str, Any]:
    results = sorted(results, key=lambda r: r["rank"])
    fpt = flops_per_token(job.model, job.data.seq_len)
    peak = _peak(job, results[0]["device_name"], results[0].get("gemm"))  # rank 0 measures (parabench.worker)
    summary = summarize(results, job.tokens_per_step, fpt, peak.tflops if peak else None)
    checksums = {r["initial_checksum"] for r in results}
    expected = adapter.expected_model_state(job)
    state_per_rank = [r["model_state"] for r in results]
    core = [s["params"] + s["grads"] + s["optimizer"] for s in state_per_rank]
    summary.update(
        {
            "backend": job.backend.name,
            "model": job.model.name,
            "device": job.device.type,
            "device_name": results[0]["device_name"],
            "precision": job.run.precision,
            "num_params": job.model.num_params(),
            "matmul_params": job.model.num_matmul_params(),
            "tokens_per_step": job.tokens_per_step,
            "grad_accum": job.grad_accum,
            "flops_per_token": fpt,
            "flops_formula": FORMULA,
            "peak_tflops_per_device": peak.tflops if peak else None,
            "peak_source": peak.source if peak else "unknown device peak: MFU not computed",
            "peak_uncertain": bool(peak and peak.uncertain),
            "peak_measured_at": peak.measured_at if peak else None,
            "initial_checksum": checksums.pop() if len(checksums) == 1 else f"MISMATCH {sorted(checksums)}",
            **_data_summary(results),
            "losses": results[0]["losses"],
            "model_state_per_rank": state_per_rank,
            # per rank: bytes / the parameters that rank's shard holds (TP/PP shards hold a part of the model)
            "model_state_bytes_per_param": max(
                c / (s.get("detail", {}).get("param_count") or job.model.num_params())
                for c, s in zip(core, state_per_rank)
            ),
            "peak_memory_kind": results[0]["peak_memory_kind"],
            "peak_memory_bytes_per_rank": [r["peak_memory_bytes"] for r in results],
        }
    )
    if expected is not None:
        summary["model_state_expected_bytes"] = expected.bytes
        summary["model_state_expected_formula"] = expected.formula
        summary["model_state_expected_source"] = expected.source
        summary["model_state_diff_bytes"] = max(core) - expected.bytes
    # MoE: tokens per expert per step, already summed over the ranks (every rank holds the same sums)
    summary.update(expertload.summary(results[0].get("tokens_per_expert") or []))
    extra = {k: v for r in results for k, v in r.get("extra", {}).items()}
    summary.update({f"extra.{k}": v for k, v in extra.items()})
    summary.update(comm_report.comm_summary(job, results, summary["step_time_median_s"]))  # measured vs formula
    return summary


def _data_summary(results: list[dict]) -> dict[str, str]:
    """Which reader the ranks used, and the run's checksum of the rows they trained on."""
    from parabench.data import combined_checksum

    readers = sorted({r["data"]["reader"] for r in results})
    return {
        "data_reader": readers[0] if len(readers) == 1 else f"MISMATCH {readers}",
        "data_checksum": combined_checksum([r["data"] for r in results]),
    }


def _peak(job: JobSpec, device_name: str, gemm: dict | None):
    """``gemm``: the GEMM rank 0 measured (parabench.worker), or None (then measured here, if needed)."""
    if job.device.peak_tflops:
        return Peak(job.device.peak_tflops, "user-supplied (device.peak_tflops)")
    return DEVICES[job.device.type].peak(
        job.run.precision,
        cpu_threads(job.launch.nproc_per_node, job.device.threads_per_rank),
        Path(job.run.results_dir) / ".cache",
        device_name,
        GemmReading(**gemm) if gemm else None,
    )


def _log_results(tracker, summary: dict[str, Any], results: list[dict]) -> None:
    warm = len(summary["losses"]) - summary["measured_steps"]
    metrics = [("loss", v, i) for i, v in enumerate(summary["losses"])]
    # the per-step metrics as the live ones (tracking.step_metrics); those already logged are left out
    metrics += [("step_time_s", v, warm + i) for i, v in enumerate(summary["step_times_max"])]
    metrics += [
        ("step_tokens_per_s", summary["tokens_per_step"] / v, warm + i) for i, v in enumerate(summary["step_times_max"])
    ]
    for step, counts in zip(summary.get("moe_tokens_per_expert_steps", []), summary.get("moe_tokens_per_expert", [])):
        metrics += expertload.step_metrics(step, counts)
    scalar = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics += [(k, v, 0) for k, v in scalar.items()]
    for r in results:
        ms = r["model_state"]
        metrics += [
            (f"rank{r['rank']}.{k}", ms[k], 0) for k in ("params", "grads", "optimizer", "optimizer_other", "total")
        ]
        metrics += [(f"rank{r['rank']}.peak_memory_bytes", r["peak_memory_bytes"], 0)]
    tracker.log_metrics(metrics)
    tracker.set_tags(
        {
            k: summary[k]
            for k in (
                "flops_formula",
                "peak_source",
                "initial_checksum",
                "data_checksum",
                "data_reader",
                "device_name",
                "peak_memory_kind",
                "model_state_expected_formula",
            )
            if k in summary
        }
    )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return str(n)


def _measured(job: JobSpec, s: dict[str, Any]) -> str:
    """What the figures below were measured on: a resumed run's own steps only."""
    if s.get("started_from"):
        return (
            f"{s['measured_steps']} measured steps, all run here: resumed from step {s['started_at_step']} "
            f"of {s['started_from']}"
        )
    return f"{s['measured_steps']} measured steps after {job.run.warmup_steps} warm-up"


def resilience_lines(s: dict[str, Any]) -> list[str]:
    """The summary's faults, restarts, resume and checkpoints, where there were any (docs/resilience.md)."""
    lines = []
    if s.get("fault"):
        detect = f", detected after {s['time_to_detect_s']:.1f} s" if s.get("time_to_detect_s") is not None else ""
        lines.append(f"  fault          {s['fault']}{detect}")
    if s.get("restarts"):
        lines.append(f"  restarts       {s['restarts']} (torchrun restarted the workers)")
    if s.get("resumed_step") is not None:
        again = f"; {s['steps_recomputed']} steps recomputed" if s.get("steps_recomputed") is not None else ""
        source = f" of {s['resumed_from']}" if s.get("resumed_from") else ""
        lines.append(f"  resumed        from step {s['resumed_step']}{source}{again}")
    if s.get("ckpt_saves"):
        lines.append(
            f"  checkpoints    {s['ckpt_saves']} saved (longest blocking {s['ckpt_save_blocking_s']:.2f} s; "
            f"last {_fmt_bytes(s['ckpt_bytes_total'])})"
        )
    if lines and s.get("goodput") is not None:
        lines.append(f"  goodput        {s['goodput']:.3f} (kept step time / wall time)")
    return lines


def print_summary(job: JobSpec, s: dict[str, Any], tracker, run_dir: Path) -> None:
    mfu = (
        f"{100 * s['mfu']:.1f}% of {s['peak_tflops_per_device']:.4g} TFLOP/s per device ({s['peak_source']})"
        if s["mfu"] is not None
        else f"not computed: {s['peak_source']}"
    )
    lines = [
        f"\nparabench | {s['backend']} | {s['model']} ({s['num_params'] / 1e6:.1f}M params) | {s['device']} "
        f"({s['device_name']}) x{s['world_size']} | {s['precision']} | {_measured(job, s)}",
        f"  tokens/s       {s['tokens_per_s']:.1f} global, {s['tokens_per_s_per_device']:.1f} per device "
        f"({s['tokens_per_step']} tokens/step / slowest rank's step time)",
        f"  step time      {s['step_time_median_s']:.4f} s median (min {s['step_time_min_s']:.4f}, max {s['step_time_max_s']:.4f};"
        f" rank spread {s['rank_step_time_spread_s']:.4f} s)",
        f"  achieved       {s['achieved_tflops_per_device']:.4g} TFLOP/s per device; {s['flops_formula']}",
        f"  MFU            {mfu}",
        f"  memory         {_fmt_bytes(s['peak_memory_bytes_max'])} max over ranks ({s['peak_memory_kind']})",
        f"  model states   {_fmt_bytes(s['model_state_bytes_max'])} per rank (max) = {s['model_state_bytes_per_param']:.3f} bytes/param",
    ]
    if "model_state_expected_bytes" in s:
        exp = s["model_state_expected_bytes"]
        lines.append(
            f"                 formula {s['model_state_expected_formula']} = {_fmt_bytes(exp)}; "
            f"measured - formula = {s['model_state_diff_bytes']:+.0f} B"
        )
    lines += [
        f"  loss           {s['loss_first']:.6f} (step 0) -> {s['loss_final']:.6f} (step {len(s['losses']) - 1})",
        *expertload.summary_line(s),
        *resilience_lines(s),
        *comm_report.summary_lines(s),
        f"  init checksum  {s['initial_checksum']}",
        f"  data           {s['data_reader']}; rows checksum {s['data_checksum']}",
        f"  run dir        {run_dir}",
    ]
    store = trackstore.shown(store_uri(job.tracking, job.run.results_dir))
    if tracker.offline:
        lines.append(f"  MLflow         not reached ({tracker.offline}): spooled in {run_dir / 'tracking'}")
    elif tracker.run_id:
        lines.append(f"  MLflow run     {tracker.run_id} in {store}")
        experiment_id = tracker.state.get("experiment_id")
        link = trackstore.ui_link(store, experiment_id) if experiment_id else None
        if link:
            lines.append(f"  MLflow UI      {link}")
    print("\n".join(lines))
