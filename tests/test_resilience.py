"""Checkpoint/resume, injected faults, restarts and signals (issue 14; docs/resilience.md).

The end-to-end tests run the real `bench run` CLI on 2 gloo ranks with the tiny llama model. Their
acceptance: a 20-step fp32 run checkpointed every 5 steps, killed at step 12 and resumed, gives the
losses of steps 13-20 bitwise equal to the uninterrupted run. :func:`kill_and_resume` is the helper
other backends' tests reuse (tests/test_deepspeed.py, test_megatron.py, test_mindspore.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import (
    FAST,
    REPO,
    TWENTY,
    alive,
    alive_with,
    assert_refused_before_launch,
    bench,
    mlflow_runs,
    only_summary,
    run_ok,
)
from parabench.errors import SpecError
from parabench.hydraconfig import compose, to_plain
from parabench.jobs import from_config
from parabench.resilience.checkpoint import (
    MARKER,
    Checkpointer,
    check_compatible,
    job_identity,
    newest_complete,
    plan_resume,
)

CKPT = ["run.checkpoint.every=5"]
# ddp's kill-and-resume and hang recovery are in the default tier, fsdp's in the full tier
DEFAULT_TIER = [pytest.mark.matrix("ddp"), pytest.mark.e2e]
FULL_TIER = [pytest.mark.matrix("fsdp"), pytest.mark.full]


def kill_and_resume(args: list[str], tmp_path: Path, resumed_with: tuple[str, ...] = ()) -> tuple[dict, Path]:
    """(resumed summary, checkpoint dir) of ``args`` (a 20-step, 2-rank job): a first run
    checkpoints every 5 steps and is killed before step 13 (fault.step=12, no restart: it fails);
    a second resumes from the same checkpoint dir with run.resume=auto (and ``resumed_with``, its
    results in tmp_path/resumed). Compare with the uninterrupted run through
    :func:`assert_bitwise_after_resume`."""
    ckpt = tmp_path / "ckpt"
    killed = bench(
        ["run", *args, *CKPT, f"run.checkpoint.dir={ckpt}", "fault.kind=kill", "fault.step=12"], tmp_path / "killed"
    )
    assert killed.returncode == 1, killed.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000005", "step_000010"]
    # keep=0: the resumed run's saves (15 and the last, 20) must not prune step 10, which the callers read
    resumed = run_ok(
        [*args, *CKPT, f"run.checkpoint.dir={ckpt}", "run.checkpoint.keep=0", "run.resume=auto", *resumed_with],
        tmp_path / "resumed",
    )
    return resumed, ckpt


def assert_bitwise_after_resume(full: dict, resumed: dict, resumed_step: int = 10) -> None:
    """All 20 losses equal the uninterrupted run's, exact float equality: the restored history of the
    steps before the checkpoint as well as the steps trained after the resume."""
    assert resumed["resumed_step"] == resumed_step
    assert len(resumed["losses"]) == len(full["losses"]) == 20
    assert resumed["losses"][:resumed_step] == full["losses"][:resumed_step]  # restored from the checkpoint
    assert resumed["losses"][resumed_step:] == full["losses"][resumed_step:]  # trained again after the resume
    assert resumed["data_checksum"] == full["data_checksum"]


# --------------------------------------------------------------------------------------------
# Without workers: layout, discovery, compatibility.
# --------------------------------------------------------------------------------------------
def job_of(*overrides: str):
    return from_config(to_plain(compose(["+model=llama", *overrides])))


def fake_checkpoint(root: Path, step: int, job, *, complete: bool = True) -> Path:
    path = root / f"step_{step:06d}"
    (path / "native").mkdir(parents=True)
    (path / "native" / "data").write_bytes(b"x" * 10)
    if complete:
        marker = {"step": step, "job": job_identity(job), "files": {"native/data": 10}, "world_size": 1}
        (path / MARKER).write_text(json.dumps(marker))
    return path


def test_partial_and_corrupt_checkpoints_are_skipped_with_a_warning(tmp_path):
    job = job_of()
    good = fake_checkpoint(tmp_path, 5, job)
    fake_checkpoint(tmp_path, 10, job, complete=False)  # marker missing: a partial save
    corrupt = fake_checkpoint(tmp_path, 15, job)
    (corrupt / "native" / "data").write_bytes(b"x" * 3)  # truncated after the marker was written
    (tmp_path / "step_000020.tmp").mkdir()  # a save that never finished
    warnings: list[str] = []
    path, marker = newest_complete(tmp_path, warn=warnings.append)
    assert path == good and marker["step"] == 5
    assert len(warnings) == 3
    assert "unfinished save" in warnings[0] and "3 bytes" in warnings[1] and "partial" in warnings[2]


def test_saving_a_step_again_never_leaves_a_moment_without_the_complete_one(tmp_path, monkeypatch):
    """Re-publishing step_N moves the complete one aside; a crash between the two renames (the new
    step_N.tmp not yet visible) leaves step_N.old, which discovery uses; the next save removes it."""
    job = job_of(f"run.checkpoint.dir={tmp_path}", "run.checkpoint.every=5")
    ctx = SimpleNamespace(job=job, comm=None, run_dir=tmp_path, rank=0, world_size=1)
    saver = Checkpointer(engine=None, ctx=ctx)
    old = fake_checkpoint(tmp_path, 10, job)
    (tmp_path / "step_000010.tmp" / "native").mkdir(parents=True)
    (tmp_path / "step_000010.tmp" / "native" / "data").write_bytes(b"y" * 7)
    real_rename = os.rename

    def crash_on_publish(src, dst):
        if str(src).endswith(".tmp"):
            raise OSError("simulated crash before the new checkpoint became visible")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_publish)
    with pytest.raises(OSError, match="simulated crash"):
        saver._publish(10, tmp_path / "step_000010.tmp")
    monkeypatch.setattr(os, "rename", real_rename)
    assert not old.exists()
    warnings: list[str] = []
    path, marker = newest_complete(tmp_path, warn=warnings.append)
    assert path.name == "step_000010.old" and marker["files"] == {"native/data": 10}  # the previous one
    assert len(warnings) == 1 and "unfinished save" in warnings[0]
    saver._publish(10, tmp_path / "step_000010.tmp")  # the save done again: visible, aside deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010"]
    path, marker = newest_complete(tmp_path)
    assert path == old and marker["files"] == {"native/data": 7}


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model.hidden_size=128"], "model.hidden_size"),
        (["backend=fsdp"], "backend"),
        (["run.precision=bf16"], "run.precision"),
    ],
)
def test_incompatible_checkpoint_names_the_key(tmp_path, overrides, key):
    saved = job_of()
    fake_checkpoint(tmp_path, 5, saved)
    with pytest.raises(SpecError) as err:
        check_compatible(job_of(*overrides), *reversed(newest_complete(tmp_path)))
    assert err.value.key == key


def test_dcp_reshards_world_size_but_resume_never_keeps_checkpoints(tmp_path):
    saved = job_of("launcher.nproc_per_node=2")
    fake_checkpoint(tmp_path / "ck", 5, saved)
    one = job_of(f"run.checkpoint.dir={tmp_path / 'ck'}")
    assert plan_resume(one, None) == tmp_path / "ck" / "step_000005"  # 2 -> 1 ranks: DCP reshards
    with pytest.raises(SpecError, match="already holds checkpoint step_000005") as err:
        plan_resume(job_of(f"run.checkpoint.dir={tmp_path / 'ck'}", "run.resume=never"), None)
    assert err.value.key == "run.resume"


def test_bad_resume_inputs_are_refused_before_launch(tmp_path, capsys):
    assert_refused_before_launch(["+model=llama", f"run.resume={tmp_path / 'nowhere'}"], "run.resume", tmp_path, capsys)
    saved = job_of("model.num_hidden_layers=2")
    fake_checkpoint(tmp_path / "other", 5, saved)
    line = assert_refused_before_launch(
        ["+model=llama", f"run.resume={tmp_path / 'other'}"], "model.num_hidden_layers", tmp_path, capsys
    )
    assert "another model" in line
    assert_refused_before_launch(
        ["+model=llama", "backend=mindspore", "launcher.max_restarts=1"], "launcher.max_restarts", tmp_path, capsys
    )


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["run.checkpoint.every=-1"], "run.checkpoint.every", "must be >= 0"),
        (["run.checkpoint.async=true"], "run.checkpoint.async", "needs run.checkpoint.every"),
        (["fault.kind=kill", "fault.rank=2", "launcher.nproc_per_node=2"], "fault.rank", "world size 2"),
        (["fault.kind=kill", "fault.step=12", "run.warmup_steps=2", "run.steps=10"], "fault.step", "runs 12 steps"),
        (["fault.kind=kill", "fault.at=save", "fault.step=7", "run.checkpoint.every=5"], "fault.at", "multiple"),
        (["fault.kind=kill", "fault.at=save", "fault.step=5"], "fault.at", "run.checkpoint.every=0"),
        (["fault.kind=kill", "fault.at=load"], "fault.at", "load"),
    ],
)
def test_bad_checkpoint_and_fault_keys_are_refused_before_launch(overrides, key, says, tmp_path, capsys):
    line = assert_refused_before_launch(["+model=llama", *overrides], key, tmp_path, capsys)
    assert says in line


# --------------------------------------------------------------------------------------------
# End to end: real `bench run` processes on 2 gloo ranks.
# --------------------------------------------------------------------------------------------
def _kill_and_resume_bitwise(args: list[str], tmp_path: Path, full: dict) -> tuple[dict, Path]:
    resumed, ckpt = kill_and_resume(args, tmp_path)
    assert_bitwise_after_resume(full, resumed)
    return resumed, ckpt


@pytest.mark.parametrize(
    ("backend", "kill_and_resume_checked"),
    [
        pytest.param("ddp", _kill_and_resume_bitwise, marks=DEFAULT_TIER, id="ddp"),
        pytest.param("fsdp", lambda *a: kill_then_hang(*a), marks=FULL_TIER, id="fsdp"),  # defined below
    ],
)
def test_killed_run_resumes_bitwise_and_reshards_to_one_rank(backend, kill_and_resume_checked, tmp_path, uninterrupted):
    """fsdp's resuming command is also its hang test (kill_then_hang: FSDP2 on a 1-D mesh over the world
    runs on the default process group, whose timeout is launcher.collective_timeout_s); ddp's hang
    test is a command of its own, in the default tier."""
    args = [*TWENTY, f"backend={backend}"]
    full = uninterrupted(backend)
    resumed, ckpt = kill_and_resume_checked(args, tmp_path, full)
    assert resumed["ckpt_load_s"] > 0 and resumed["ckpt_bytes_total"] > 0
    assert_linked_to_the_killed_run(tmp_path, ckpt, resumed["losses"])
    # DCP reshards: the 2-rank checkpoint of step 10 continues on 1 rank (run.resume=<path>)
    one = run_ok([*FAST, "run.steps=20", f"backend={backend}", f"run.resume={ckpt / 'step_000010'}"], tmp_path / "one")
    assert one["resumed_step"] == 10 and one["world_size"] == 1
    assert one["losses"][:10] == full["losses"][:10]
    for a, b in zip(one["losses"][12:], full["losses"][12:], strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (a, b)


def assert_linked_to_the_killed_run(tmp_path: Path, ckpt: Path, losses: list[float]) -> None:
    """The resumed `bench run` is a new MLflow run tagged with the killed run's id, the checkpoint and
    its step; its loss history holds all 20 steps (0-19), the first 10 from the checkpoint."""
    import mlflow

    (killed,) = (row for _, row in mlflow_runs(tmp_path / "killed").iterrows())
    (resumed,) = (row for _, row in mlflow_runs(tmp_path / "resumed").iterrows())
    assert resumed["run_id"] != killed["run_id"] and resumed["status"] == "FINISHED"
    assert resumed["tags.parabench.resumed_from_run"] == killed["run_id"]
    assert resumed["tags.parabench.resumed_from_checkpoint"] == str(ckpt / "step_000010")
    assert resumed["tags.parabench.resumed_step"] == "10"
    history = mlflow.MlflowClient().get_metric_history(resumed["run_id"], "loss")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(20))
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(losses, rel=1e-6)


def assert_recovered(summary: dict, full: dict) -> None:
    """Restarted once from the step-10 checkpoint, recomputed 2 steps, same losses as uninterrupted."""
    assert summary["restarts"] == 1 and summary["steps_recomputed"] == 2 and summary["resumed_step"] == 10
    assert summary["losses"] == full["losses"]
    assert summary["data_checksum"] == full["data_checksum"]
    assert 0 <= summary["time_to_detect_s"] < summary["time_to_first_step_after_fault_s"]
    assert 0 < summary["goodput"] < 1


HANG_TIMEOUT_S = 20  # launcher.collective_timeout_s of the hang tests: above the start-up skew under load


def hang_and_recover(args: list[str], results: Path, full: dict) -> dict:
    """One command: ``args`` (a 20-step, 2-rank job) checkpointed every 5 steps, rank 1 hangs before
    step 13 and launcher.max_restarts=1. Rank 0's next collective - whichever process group the
    backend runs it on - must fail after launcher.collective_timeout_s; torchrun then restarts both
    ranks, they resume from step 10 and finish with the losses of the uninterrupted run ``full``.
    MLflow holds the run FINISHED with restarts=1 and the recovery figures. Returns the summary."""
    summary = fault_and_recover("hang", args, results, full)
    assert_hang_detected(summary, results)
    return summary


def assert_hang_detected(summary: dict, results: Path) -> None:
    """The only run of ``results`` waited for the collective timeout, and rank 0's collective failed."""
    assert summary["time_to_detect_s"] >= HANG_TIMEOUT_S  # waited for the collective timeout
    (run_dir,) = (p.parent for p in results.glob("runs/*/*/*/summary.json"))
    detected = [json.loads(line) for line in (run_dir / "faults" / "detected.jsonl").read_text().splitlines()]
    assert any(d["rank"] == 0 and d["restart"] == 0 for d in detected), detected  # rank 0's collective failed


def fault_args(kind: str) -> list[str]:
    """``fault.kind=kind`` on rank 1 before step 13, launcher.max_restarts=1, the hang tests' timeout."""
    fault = [f"fault.kind={kind}", "fault.rank=1", "fault.step=12"]
    return [*fault, "launcher.max_restarts=1", f"launcher.collective_timeout_s={HANG_TIMEOUT_S}"]


def fault_and_recover(kind: str, args: list[str], results: Path, full: dict) -> dict:
    """One command: ``args`` checkpointed every 5 steps, ``fault.kind=kind`` on rank 1 before step 13,
    launcher.max_restarts=1: restarted, resumed from step 10, FINISHED with ``full``'s losses and data
    checksum; MLflow holds restarts=1 and the recovery figures of the summary. Returns the summary."""
    summary = run_ok([*args, *CKPT, *fault_args(kind)], results)
    assert_recovered_and_recorded(summary, full, results)
    return summary


def assert_recovered_and_recorded(summary: dict, full: dict, results: Path) -> None:
    """:func:`assert_recovered`, and MLflow's only run of ``results`` FINISHED with restarts=1 and the
    summary's recovery figures."""
    assert_recovered(summary, full)
    (run,) = (row for _, row in mlflow_runs(results).iterrows())
    assert run["status"] == "FINISHED" and run["metrics.restarts"] == 1
    for metric in ("time_to_detect_s", "time_to_first_step_after_fault_s", "steps_recomputed", "goodput"):
        assert run[f"metrics.{metric}"] == pytest.approx(summary[metric]), metric


def kill_then_hang(args: list[str], tmp_path: Path, full: dict) -> tuple[dict, Path]:
    """Both faults of a backend layout in two commands (one run each fewer than kill_and_resume and
    hang_and_recover apart): ``args`` (a 20-step, 2-rank job) checkpointed every 5 steps is killed
    before step 13 with no restart; the command that resumes it with run.resume=auto has rank 1 hang
    before step 13 with launcher.max_restarts=1, so rank 0's collective times out, torchrun restarts
    both ranks and they resume from step 10 again. Its summary is checked as both tests check theirs:
    all 20 losses bitwise the uninterrupted run ``full``'s, restarted once, the hang detected, MLflow's
    run FINISHED with the recovery figures. Returns (that summary, the checkpoint dir)."""
    resumed, ckpt = kill_and_resume(args, tmp_path, resumed_with=tuple(fault_args("hang")))
    assert_bitwise_after_resume(full, resumed)
    assert_recovered_and_recorded(resumed, full, tmp_path / "resumed")
    assert_hang_detected(resumed, tmp_path / "resumed")
    return resumed, ckpt


@pytest.mark.matrix("ddp")
@pytest.mark.e2e
def test_hang_is_detected_by_the_collective_timeout_and_recovered(results, uninterrupted):
    """ddp (fsdp's hang is in its kill-and-resume test above)."""
    hang_and_recover([*TWENTY, "backend=ddp"], results, uninterrupted("ddp"))


@pytest.mark.matrix("ddp")
@pytest.mark.full
def test_rank_killed_during_a_save_loses_only_that_save_and_recovers(results, uninterrupted):
    """fault.at=save: rank 1 dies inside the step-10 save, after its DCP files and before the harness
    state and the marker. The half-written step_000010.tmp is never loaded: the restarted workers
    resume from step 5 (the previous complete checkpoint, kept), recompute 5 steps and finish with
    the losses of the uninterrupted run."""
    args = [*TWENTY, "backend=ddp", *CKPT, "fault.kind=kill", "fault.rank=1", "fault.step=10", "fault.at=save"]
    proc = bench(["run", *args, "launcher.max_restarts=1", "launcher.collective_timeout_s=20"], results)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (p.parent for p in results.glob("runs/*/*/*/summary.json"))
    logs = {r: (run_dir / "logs" / f"rank{r}.log").read_text() for r in (0, 1)}  # both attempts
    assert "injected fault: kill on rank 1 during the checkpoint save after step 10" in logs[1]
    for log in logs.values():  # each restarted rank saw the half-written save and skipped it
        assert "step_000010.tmp: an unfinished save (skipped)" in log
    summary = only_summary(results)
    assert summary["restarts"] == 1 and summary["resumed_step"] == 5 and summary["steps_recomputed"] == 5
    assert summary["losses"] == uninterrupted("ddp")["losses"]
    assert summary["data_checksum"] == uninterrupted("ddp")["data_checksum"]
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_000015", "step_000020"]  # 10 saved again, then 15 and 20 (the last); keep=2
    (run,) = (row for _, row in mlflow_runs(results).iterrows())
    assert run["status"] == "FINISHED" and run["metrics.restarts"] == 1


# +experiment=resilience_cpu's children: (run dir suffix, variant in the stability table)
EXPERIMENT_BACKENDS = [("ddp", "ddp"), ("fsdp", "fsdp"), ("deepspeed", "deepspeed/zero2"), ("megatron", "megatron/tp")]
# the same configurations in the run matrix (backend=megatron/tp sets tp = nproc_per_node = 2)
EXPERIMENT_CONFIGS = {"ddp": "ddp", "fsdp": "fsdp", "deepspeed": "zero2", "megatron": "megatron_tp"}  # matrix variants


@pytest.mark.matrix("ddp", "fsdp", "zero2", "megatron_tp")
@pytest.mark.full
def test_resilience_experiment_recovers_every_backend_and_compares(results, uninterrupted, tmp_path):
    """+experiment=resilience_cpu: one kill per backend, max_restarts=1; one parent run holding the
    stability table, and `bench compare` printing it per backend with a number in every column.
    Every child ends with the losses and data checksum of its uninterrupted run."""
    proc = bench(["run", "-m", "+experiment=resilience_cpu"], results, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = mlflow_runs(results, "resilience_cpu")
    (parent,) = (row for _, row in runs[runs["tags.parabench.kind"] == "sweep"].iterrows())
    assert parent["status"] == "FINISHED"
    children = runs[runs["tags.parabench.kind"] == "job"]
    assert len(children) == len(EXPERIMENT_BACKENDS) and set(children["status"]) == {"FINISHED"}
    for suffix, variant in EXPERIMENT_BACKENDS:
        (path,) = results.glob(f"runs/resilience_cpu/*/*_{suffix}/summary.json")
        assert_recovered(json.loads(path.read_text()), uninterrupted(EXPERIMENT_CONFIGS[suffix]))
        assert parent[f"metrics.stability/{variant}/N2/restarts"] == 1
    uri = f"sqlite:///{results / 'mlflow.db'}"
    out = bench(
        ["compare", "--experiment", "resilience_cpu", "--tracking-uri", uri, "--out", str(tmp_path / "r")], results
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout[out.stdout.index("stability") :].splitlines()
    assert "save s (blocking)" in lines[1] and "ckpt/rank" in lines[1] and "fault->step s" in lines[1]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2 : 2 + len(EXPERIMENT_BACKENDS)]}
    assert sorted(rows) == sorted(variant for _, variant in EXPERIMENT_BACKENDS)
    for cells in rows.values():  # N, save, save, ckpt/rank (value MiB), ckpt total (value MiB), ..., goodput %
        numbers = [c.removesuffix("%") for c in cells if c != "MiB"]
        assert len(numbers) == 11 and all(float(n) >= 0 for n in numbers), cells  # no '-' cell


@pytest.mark.full
def test_injected_exception_fails_the_run_once(results):
    """fault.kind=exception: an ordinary exception in the loop before step 1 (1 rank, no restart):
    the run exits 1 naming the failed worker, MLflow marks it FAILED, the fault is recorded once."""
    proc = bench(["run", *FAST, "run.steps=3", "fault.kind=exception", "fault.step=1"], results)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "bench: run failed: a worker failed" in proc.stderr
    cause = "rank 0: parabench.resilience.faults.InjectedFault: fault.kind=exception on rank 0 before step 1"
    assert f"parabench: run FAILED: a worker failed (localrun exit code 1): {cause}\n" in proc.stderr
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr
    (run_dir,) = (p.parent for p in results.glob("runs/*/*/*/spec.json"))
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "InjectedFault: fault.kind=exception on rank 0 before step 1" in log
    fired = json.loads((run_dir / "faults" / "fired.json").read_text())
    assert fired["kind"] == "exception" and fired["step"] == 1 and fired["at"] == "step"
    assert len((run_dir / "steps.jsonl").read_text().splitlines()) == 1  # step 0 ran, step 1 never did
    (run,) = (row for _, row in mlflow_runs(results).iterrows())
    assert run["status"] == "FAILED"


@pytest.mark.full
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
@pytest.mark.parametrize("backend", ["ddp", "mindspore"])  # torchrun, msrun
def test_sigkill_of_bench_run_ends_the_launcher_and_its_workers(results, backend):
    """kill -9 of `bench run` (an OOM killer, a lost login shell): torchrun and its workers stop
    within the agent's shutdown grace instead of training on to the last step, and the next
    `bench run` on that store closes the run left RUNNING as KILLED, with the reason (issue 26
    case 5)."""
    proc, run_dir = _start_until_step(results, [*FAST, f"backend={backend}", "run.steps=100000"], 2)
    started = alive_with(str(run_dir))
    assert len(started) >= 2, started  # the launcher and rank 0
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 60  # torchrun's agent gives its workers 30 s to stop, then kills them
    while alive_with(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    orphans = alive_with(str(run_dir))
    for pid in orphans:  # a failing test leaves nothing training on this machine
        os.kill(pid, signal.SIGKILL)
    assert orphans == [], f"orphans train on after kill -9 of bench run: {orphans} (started: {started})"
    (killed,) = (row for _, row in mlflow_runs(results).iterrows())
    assert killed["status"] == "RUNNING"  # nothing could record its end
    # the next bench run on this store closes it, KILLED with the reason, before its own job starts
    again = bench(["run", *FAST, "run.steps=1"], results)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "parabench: closed a run left RUNNING by a killed bench" in again.stderr, again.stderr[-3000:]
    runs = mlflow_runs(results).set_index("run_id")
    assert runs.loc[killed["run_id"], "status"] == "KILLED"
    assert "ended without recording a status (killed" in runs.loc[killed["run_id"], "tags.failure_reason"]
    assert sorted(runs["status"]) == ["FINISHED", "KILLED"]


@pytest.mark.full
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's prctl")
@pytest.mark.parametrize(("start", "module"), [("fork", "parabench.localrun"), ("torchrun", "torch.distributed.run")])
def test_sigkill_of_the_launcher_ends_its_workers_and_fails_the_run(results, start, module):
    """kill -9 of the launcher itself (the OOM killer picks the agent, a node agent): its workers end
    with it instead of training on as orphans, and `bench run` fails with the launcher's exit."""
    args = [*FAST, "run.steps=100000", "launcher.nproc_per_node=2", f"launcher.start={start}"]
    proc, run_dir = _start_until_step(results, args, 2)
    ranks = [int(p.read_text()) for p in sorted((run_dir / "pids").glob("rank*"))]
    (launcher,) = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in ranks}
    assert module in Path(f"/proc/{launcher}/cmdline").read_text()
    os.kill(launcher, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    deadline = time.monotonic() + 10
    while [pid for pid in ranks if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    orphans = [pid for pid in ranks if alive(pid)]
    for pid in orphans:  # a failing test leaves nothing training on this machine
        os.kill(pid, signal.SIGKILL)
    assert orphans == [], f"workers train on after kill -9 of {module}: {orphans}"
    assert proc.returncode == 1 and "run failed" in err, err[-3000:]
    (run,) = (row for _, row in mlflow_runs(results).iterrows())
    assert run["status"] == "FAILED"


@pytest.mark.full
def test_sigterm_to_a_mindspore_run_stops_msrun_and_its_workers(results):
    """SIGTERM to `bench run` of an msrun job: msrun gets SIGINT, the signal it stops its workers on
    (they sit in sessions of their own, out of reach of a signal to msrun's group); before, msrun
    died of SIGTERM alone and its workers trained on."""
    proc, run_dir = _start_until_step(results, [*FAST, "backend=mindspore", "run.steps=100000"], 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    orphans = alive_with(str(run_dir))
    for pid in orphans:  # a failing test leaves nothing training on this machine
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert orphans == [], f"msrun's workers train on after SIGTERM to bench run: {orphans}"
    (run,) = (row for _, row in mlflow_runs(results).iterrows())
    assert run["status"] == "KILLED"


@pytest.mark.full
def test_sigterm_to_a_sweep_ends_its_parent_run_killed(results):
    """SIGTERM to `bench run -m` while its first job trains: that job and the sweep's parent run are
    KILLED, with the signal as the reason (the parent stayed RUNNING; issue 26 case 5)."""
    cmd = [sys.executable, "-m", "parabench", "run", "-m", *FAST, "run.steps=100000", "run.seed=1,2"]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    cmd.append(f"run.results_dir={results}")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len([line for p in results.glob("runs/*/*/*/steps.jsonl") for line in p.read_text().splitlines()]) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    runs = mlflow_runs(results)
    (parent,) = (row for _, row in runs[runs["tags.parabench.kind"] == "sweep"].iterrows())
    (child,) = (row for _, row in runs[runs["tags.parabench.kind"] == "job"].iterrows())
    assert parent["status"] == "KILLED" and parent["tags.failure_reason"] == "bench interrupted by SIGTERM"
    assert child["status"] == "KILLED"


@pytest.mark.full
def test_a_dry_run_sweep_records_no_runs(results):
    """A dry-run sweep writes its launch bundles and nothing to MLflow (it made a FAILED parent run
    with no children; issue 26 case 5)."""
    proc = bench(["run", "-m", "+model=llama", "launcher.dry_run=true", "run.seed=1,2"], results)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(results.glob("runs/*/*/*/launch.sh"))) == 2
    assert not (results / "mlflow.db").exists() or mlflow_runs(results).empty


@pytest.mark.full
def test_sigterm_stops_every_worker_saves_and_marks_killed(results):
    cmd = [sys.executable, "-m", "parabench", "run", *FAST, "run.steps=500", "launcher.nproc_per_node=2"]
    cmd += ["run.checkpoint.on_signal=true", f"run.results_dir={results}"]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list(results.glob("runs/*/*/*/steps.jsonl")) or len(_steps(results)) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    (run_dir,) = {p.parent for p in results.glob("runs/*/*/*/steps.jsonl")}
    pids = [int(p.read_text()) for p in sorted((run_dir / "pids").glob("rank*"))]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "interrupted by SIGTERM" in err
    for pid in pids:  # no orphan trains on
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    (ckpt,) = (run_dir / "checkpoints").iterdir()
    finished = [json.loads(line) for line in _steps(results)]
    assert (ckpt / "COMPLETE").exists() and ckpt.name == f"step_{len(finished):06d}"  # the last finished step
    (run,) = (row for _, row in mlflow_runs(results).iterrows())
    assert run["status"] == "KILLED"
    import mlflow

    history = mlflow.MlflowClient().get_metric_history(run["run_id"], "loss")
    assert len(history) >= 3
    # the save is a real one: resumed for 2 more steps, it is the uninterrupted run of that length
    steps = f"run.steps={len(finished) + 2}"
    again = [*FAST, "launcher.nproc_per_node=2", steps, "tracking.enabled=false"]
    resumed = run_ok([*again, f"run.resume={ckpt}"], results.parent / "resumed")
    fresh = run_ok(again, results.parent / "fresh")
    assert resumed["resumed_step"] == len(finished)
    assert resumed["losses"][: len(finished)] == [step["loss"] for step in finished]  # restored history
    assert resumed["losses"] == fresh["losses"]


def test_the_stop_step_is_ahead_of_rank_0s_newest_step_not_of_the_watch_loops(tmp_path):
    """The runner's watch loop polls progress.json; short steps had passed its last_step + 2 when the
    signal came, no rank met the stop step and nothing was saved (a CI run failed so). The stop step
    is rank 0's newest finished step, read at the signal, + 2."""
    from parabench.launchers import stop
    from parabench.resilience.checkpoint import STOP_FILE
    from parabench.run.command import _Watch

    (tmp_path / "progress.json").write_text(json.dumps({"step": 17}))
    launcher = subprocess.Popen(  # stands in for the launcher: ends once the stop request is written
        ["sh", "-c", f"while [ ! -e {STOP_FILE} ]; do sleep 0.05; done"], cwd=tmp_path, start_new_session=True
    )
    stop(launcher, signal.SIGTERM, _Watch(job_of("run.checkpoint.on_signal=true"), tmp_path, None).on_stop)
    assert launcher.wait(timeout=5) == 0
    assert json.loads((tmp_path / STOP_FILE).read_text())["step"] == 19


def test_a_stop_signal_never_lands_inside_a_write_of_the_watch_loop():
    """SIGTERM raised from its handler landed wherever the main thread was, once amid the live MLflow
    write: the store then could not take the final status and the run stayed RUNNING (a CI run). The
    signal is recorded and raised between the loop's polls; a second one acts at once."""
    from parabench.errors import Interrupted
    from parabench.launchers import StopSignals

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    written = []
    with StopSignals() as stop_signals:
        stop_signals.raise_if_received()  # nothing received: no raise
        os.kill(os.getpid(), signal.SIGTERM)  # arrives "during a write"
        written.append("the write finished")
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # a second SIGTERM ends bench at once
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(Interrupted) as raised:
            stop_signals.raise_if_received()
    assert written == ["the write finished"] and raised.value.signum == signal.SIGTERM
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def _start_until_step(results: Path, args: list[str], steps: int) -> tuple[subprocess.Popen, Path]:
    """`bench run ARGS` in the background until rank 0 has finished ``steps`` steps: it and its run dir."""
    cmd = [sys.executable, "-m", "parabench", "run", *args, f"run.results_dir={results}"]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list(results.glob("runs/*/*/*/steps.jsonl")) or len(_steps(results)) < steps:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    (run_dir,) = {p.parent for p in results.glob("runs/*/*/*/steps.jsonl")}
    return proc, run_dir


def _steps(results: Path) -> list[str]:
    return [line for p in results.glob("runs/*/*/*/steps.jsonl") for line in p.read_text().splitlines()]


@pytest.mark.full
def test_disk_full_during_save_keeps_the_last_complete_checkpoint(tmp_path):
    """A real ENOSPC: the checkpoint dir is a 70 MiB tmpfs (in a private mount namespace) that holds
    one checkpoint of the FAST llama model (~46 MiB) but not two."""
    ckpt, results = tmp_path / "small", tmp_path / "results"
    ckpt.mkdir()
    run = [sys.executable, "-m", "parabench", "run", *FAST, "run.steps=12", "run.checkpoint.every=5"]
    run += ["run.checkpoint.keep=1", f"run.checkpoint.dir={ckpt}", f"run.results_dir={results}"]
    script = f"mount -t tmpfs -o size=70m tmpfs {ckpt} && {{ {' '.join(run)}; echo rc=$?; ls {ckpt}; ls {ckpt}/step_000005; }}"
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"},
    )
    out = proc.stdout
    assert "rc=1" in out, proc.stderr[-3000:]
    assert "step_000005\n" in out and "COMPLETE" in out  # the complete checkpoint of step 5 is kept
    lines = [x for x in proc.stderr.splitlines() if "checkpoint error" in x]
    # torch's writer reports ENOSPC as a position mismatch; the line adds the free space it found
    assert lines and "step_000010.tmp failed" in lines[0] and "MiB free" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
