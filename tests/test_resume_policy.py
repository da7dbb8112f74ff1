"""When a run saves and what a resume may do (issue 26; docs/resilience.md): the last step is always
saved when checkpointing is on, and a resume with nothing left to train is refused before launch."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_resilience import fake_checkpoint, job_of

from conftest import FAST, assert_refused_before_launch, bench, mlflow_runs
from parabench.resilience.checkpoint import Checkpointer


@pytest.mark.parametrize(("every", "saved"), [(5, [5, 10]), (10, [10]), (3, [3, 6, 9, 10]), (0, [])])
def test_the_last_step_is_always_saved_when_checkpointing_is_on(tmp_path, monkeypatch, every, saved):
    """10 steps: the loop's after_step saves every N-th step and the last one (the end state can be
    continued or converted); with checkpointing off (every=0) nothing is saved."""
    job = job_of(f"run.checkpoint.dir={tmp_path}", f"run.checkpoint.every={every}")
    ctx = SimpleNamespace(job=job, comm=None, run_dir=tmp_path, rank=0, world_size=1)
    saver = Checkpointer(engine=None, ctx=ctx)
    steps: list[int] = []
    monkeypatch.setattr(saver, "save", lambda completed, harness: steps.append(harness["step"]))
    ledger = SimpleNamespace(dp_rank=0, dp_size=1, checksum=0)
    for completed in range(1, 11):
        saver.after_step(completed, 10, {"losses": []}, ledger)
    assert steps == saved


@pytest.mark.parametrize(("saved_step", "how"), [(10, "auto"), (12, "auto"), (10, "path")])
def test_a_resume_with_nothing_left_to_train_is_refused(tmp_path, capsys, saved_step, how):
    """A checkpoint at or past the job's last step (10 = 0 warm-up + 10 steps): one line naming
    run.resume and how to measure again from step 0; exit 2, no run directory, no MLflow store."""
    ck = tmp_path / "ck"
    path = fake_checkpoint(ck, saved_step, job_of())
    resume = ["run.resume=auto"] if how == "auto" else [f"run.resume={path}"]
    line = assert_refused_before_launch(
        ["+model=llama", "run.warmup_steps=0", "run.steps=10", f"run.checkpoint.dir={ck}", *resume],
        "run.resume",
        tmp_path,
        capsys,
    )
    assert f"nothing left to train: checkpoint {path} is at step {saved_step}" in line, line
    assert "run.resume=never with another run.checkpoint.dir" in line, line


@pytest.mark.e2e
def test_the_same_command_saves_its_last_step_continues_and_measures_only_its_own_steps(tmp_path):
    """10 steps, every 5, no run.checkpoint.dir: the job's stable folder gets step_000005 and
    step_000010 (the last); the same command again has nothing to train and is refused before launch
    (exit 2, one line, no second MLflow run); with run.steps=12 it continues from step 10 and its
    figures come from its own 2 steps while the loss curve stays whole."""
    results = tmp_path / "results"
    args = ["run", *FAST, "run.steps=10", "run.checkpoint.every=5"]
    first = bench(args, results)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = results.glob("runs/*/*/*")
    ck = (run_dir / "checkpoints").resolve()
    assert ck.parent == (results / "checkpoints" / "parabench").resolve() and ck.name.startswith("ddp-llama-x1-")
    assert f"parabench: no checkpoint found in {ck}, starting at step 0" in first.stdout, first.stdout
    assert "\n  checkpoints    2 saved (longest blocking " in first.stdout, first.stdout
    assert sorted(p.name for p in ck.iterdir()) == ["step_000005", "step_000010"]
    assert json.loads((ck / "step_000010" / "COMPLETE").read_text())["step"] == 10

    again = bench(args, results)
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(lines) == 1, again.stderr[-3000:]
    assert lines[0].startswith(f"bench: error: run.resume: nothing left to train: checkpoint {ck}"), lines
    assert len(list(results.glob("runs/*/*/*"))) == 1
    runs = mlflow_runs(results)
    assert len(runs) == 1 and set(runs["status"]) == {"FINISHED"}

    more = bench([*args, "run.steps=12"], results)
    assert more.returncode == 0, more.stderr[-3000:]
    assert f"parabench: resuming from step 10 of {ck / 'step_000010'}" in more.stdout, more.stdout
    (summary_path,) = (p for p in results.glob("runs/*/*/*/summary.json") if p.parent != run_dir)
    summary = json.loads(summary_path.read_text())
    own = [json.loads(line) for line in (summary_path.parent / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in own] == [10, 11]
    assert summary["measured_steps"] == 2 and summary["step_times_max"] == [s["step_time_s"] for s in own]
    assert summary["tokens_per_s"] == pytest.approx(2 * summary["tokens_per_step"] / sum(summary["step_times_max"]))
    assert len(summary["losses"]) == 12 and summary["started_at_step"] == 10
    assert summary["started_from"] == str(ck / "step_000010")
    assert f"2 measured steps, all run here: resumed from step 10 of {ck / 'step_000010'}" in more.stdout, more.stdout
    resumed = mlflow_runs(results).set_index("run_id").drop(runs["run_id"][0])
    assert list(resumed["metrics.measured_steps"]) == [2] and list(resumed["tags.parabench.resumed_step"]) == ["10"]
    # two runs of one job, told apart in MLflow's run list by their UTC start (issue 26 case 7)
    names = list(mlflow_runs(results)["tags.mlflow.runName"])
    assert len(set(names)) == 2 and all(re.fullmatch(r"ddp-llama-x1-\d{8}-\d{6}", n) for n in names), names


def test_the_stable_checkpoint_folder_is_used_only_when_the_job_checkpoints(tmp_path, monkeypatch, capsys):
    """Dry runs (nothing trains): with run.checkpoint.every the same command finds the checkpoint the
    job's stable folder holds and says so in one line; without it (the default) it starts fresh
    however often it runs, whatever that folder holds, and says nothing about checkpoints."""
    from parabench.cli import main
    from parabench.resilience.checkpoint import default_root

    monkeypatch.chdir(tmp_path)
    results = tmp_path / "results"
    on = ["+model=llama", "run.steps=10", "run.checkpoint.every=5", f"run.results_dir={results}"]
    root = default_root(job_of(*on[1:]))
    assert root is not None and default_root(job_of(on[1], on[3])) is None
    assert default_root(job_of(*on[1:], "run.steps=20")) == root  # a longer run continues
    assert default_root(job_of(*on[1:], "run.seed=7")) != root  # another job does not
    fake_checkpoint(root, 5, job_of())

    def dry_run(*args: str) -> tuple[str, Path]:
        time.sleep(1.1)  # run directories are named by the second
        before = set(results.glob("runs/*/*/*"))
        assert main(["run", *args, "launcher.dry_run=true"]) == 0
        (run_dir,) = set(results.glob("runs/*/*/*")) - before
        return capsys.readouterr().out, run_dir

    out, run_dir = dry_run(*on)
    assert f"parabench: resuming from step 5 of {root / 'step_000005'}" in out, out
    assert (run_dir / "checkpoints").resolve() == root.resolve()
    assert json.loads((run_dir / "resume.json").read_text())["step"] == 5
    for _ in range(2):
        out, run_dir = dry_run(*on[:2], on[3])
        assert "resuming" not in out and "no checkpoint found" not in out, out
        assert not (run_dir / "checkpoints").exists()
        plan = json.loads((run_dir / "resume.json").read_text())
        assert plan["path"] is None and plan["step"] == 0 and plan["launched"] <= time.time()


@pytest.mark.parametrize("how", ["dir", "path"])
def test_a_skipped_checkpoint_is_reported_once(tmp_path, monkeypatch, capsys, how):
    """A checkpoint directory with an unfinished save: `bench run` says so once (it looked at the
    directory before launch and again once the run directory was known)."""
    from parabench.cli import main

    ck = tmp_path / "ck"
    fake_checkpoint(ck, 5, job_of())
    (ck / "step_000010.tmp").mkdir()
    where = f"run.checkpoint.dir={ck}" if how == "dir" else f"run.resume={ck}"
    monkeypatch.chdir(tmp_path)
    args = ["run", "+model=llama", "run.steps=10", where, "launcher.dry_run=true"]
    assert main([*args, f"run.results_dir={tmp_path / 'results'}"]) == 0
    err = capsys.readouterr().err
    assert err.count("step_000010.tmp: an unfinished save (skipped)") == 1, err
    (resume,) = (tmp_path / "results").glob("runs/*/*/*/resume.json")
    assert json.loads(resume.read_text())["path"] == str((ck / "step_000005").resolve())


def test_an_explicit_resume_path_wins_over_an_earlier_runs_checkpoints_in_the_job_folder(tmp_path):
    """run.resume=<path> while the job's stable folder holds a newer checkpoint of an earlier run: the
    workers start from the path asked for (they took the folder's newest one; issue 26), the runner
    says once that the folder holds another run's checkpoint, and a restarted worker continues from
    the newest checkpoint this launch saved, even below the earlier run's step."""
    from parabench.resilience.checkpoint import MARKER, plan_resume, resume_source, write_resume_file

    folder, run_dir = tmp_path / "ck", tmp_path / "run"
    run_dir.mkdir()
    asked = fake_checkpoint(tmp_path / "elsewhere", 5, job_of())
    fake_checkpoint(folder, 15, job_of())  # an earlier run's: its marker predates this launch
    job = job_of(f"run.checkpoint.dir={folder}", f"run.resume={asked}", "run.steps=20")
    warned: list[str] = []
    assert plan_resume(job, warn=warned.append) == asked
    assert len(warned) == 1 and f"starting from {asked} as asked" in warned[0] and "step_000015" in warned[0]
    write_resume_file(run_dir, asked)
    assert resume_source(job, run_dir) == asked.resolve()  # a restart before any save of this launch
    mine = fake_checkpoint(folder, 10, job_of())  # this launch's first save, written after its start
    marker = json.loads((mine / MARKER).read_text())
    (mine / MARKER).write_text(json.dumps({**marker, "time": time.time()}))
    assert resume_source(job, run_dir) == mine
    auto = job_of(f"run.checkpoint.dir={folder}", "run.resume=auto", "run.steps=20")
    assert plan_resume(auto, warn=warned.append) == folder / "step_000015" and len(warned) == 1


def test_a_checkpoint_holding_other_adamw_settings_is_refused_and_conversion_carries_them(tmp_path, capsys):
    """A checkpoint's optimizer state holds AdamW's lr, betas, eps and weight decay (torch's
    param_groups), which a resume restores: a job asking for other values would train with the
    checkpoint's while recording its own. Refused in one line naming the key; the same values resume.
    bench convert gives its target the source's values unless the user names others."""
    from parabench.convert.command import target_job
    from parabench.resilience.checkpoint import check_compatible, job_identity

    ck = tmp_path / "ck"
    path = fake_checkpoint(ck, 5, job_of())
    marker = json.loads((path / "COMPLETE").read_text())
    marker["optim"] = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    (path / "COMPLETE").write_text(json.dumps(marker))
    line = assert_refused_before_launch(
        ["+model=llama", "run.warmup_steps=0", "run.steps=10", f"run.resume={path}"], "optim.lr", tmp_path, capsys
    )
    assert "holds AdamW's lr=0.001" in line and "give optim.lr=0.001" in line, line
    check_compatible(job_of("optim.lr=1e-3"), marker, path)  # the same values: accepted
    with pytest.raises(Exception, match="optim.betas"):
        check_compatible(job_of("optim.lr=1e-3", "optim.betas=[0.9,0.999]"), marker, path)
    identity = job_identity(job_of())
    assert target_job("ddp", [], identity, 1, marker["optim"]).optim.lr == 1e-3
    assert target_job("ddp", ["optim.lr=5e-4"], identity, 1, marker["optim"]).optim.lr == 5e-4
