"""When a run saves and what a resume may do (issue 26; docs/resilience.md): the last step is always
saved when checkpointing is on, and a resume with nothing left to train is refused before launch."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_resilience import fake_checkpoint, job_of

from conftest import FAST, assert_refused_before_launch, bench, mlflow_runs
from parabench.checkpoint import Checkpointer


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
def test_a_finished_run_saves_its_last_step_and_is_not_resumed_again(tmp_path):
    """10 steps, every 5: step_000005 and step_000010 (the last); the same command again has nothing
    to train and is refused before launch: exit 2, one line, and the store keeps only the first run."""
    ck, results = tmp_path / "ck", tmp_path / "results"
    args = ["run", *FAST, "run.steps=10", "run.checkpoint.every=5", f"run.checkpoint.dir={ck}"]
    first = bench(args, results)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "\n  checkpoints    2 saved (longest blocking " in first.stdout, first.stdout
    assert sorted(p.name for p in ck.iterdir()) == ["step_000005", "step_000010"]
    assert json.loads((ck / "step_000010" / "COMPLETE").read_text())["step"] == 10
    again = bench(args, results)
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(lines) == 1, again.stderr[-3000:]
    assert lines[0].startswith("bench: error: run.resume: nothing left to train"), lines
    assert len(list(Path(results).glob("runs/*/*/*"))) == 1
    runs = mlflow_runs(results)
    assert len(runs) == 1 and set(runs["status"]) == {"FINISHED"}
    # two more steps: the resumed run's figures come from its own 2 steps, the loss curve stays whole
    more = bench([*args, "run.steps=12"], tmp_path / "more")
    assert more.returncode == 0, more.stderr[-3000:]
    (summary_path,) = (tmp_path / "more").glob("runs/*/*/*/summary.json")
    summary = json.loads(summary_path.read_text())
    own = [json.loads(line) for line in (summary_path.parent / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in own] == [10, 11]
    assert summary["measured_steps"] == 2 and summary["step_times_max"] == [s["step_time_s"] for s in own]
    assert summary["tokens_per_s"] == pytest.approx(2 * summary["tokens_per_step"] / sum(summary["step_times_max"]))
    assert len(summary["losses"]) == 12 and summary["started_at_step"] == 10
    assert summary["started_from"] == str((ck / "step_000010").resolve())
    assert f"2 measured steps, all run here: resumed from step 10 of {ck / 'step_000010'}" in more.stdout, more.stdout
    (run,) = (row for _, row in mlflow_runs(tmp_path / "more").iterrows())
    assert run["metrics.measured_steps"] == 2 and run["tags.parabench.resumed_step"] == "10"


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
