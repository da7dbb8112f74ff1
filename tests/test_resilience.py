"""Checkpoint/resume, injected faults, restarts and signals (issue 14; docs/resilience.md).

The end-to-end tests run the real `bench run` CLI on 2 gloo ranks with the tiny llama model. Their
acceptance: a 20-step fp32 run checkpointed every 5 steps, killed at step 12 and resumed, gives the
losses of steps 13-20 bitwise equal to the uninterrupted run. :func:`kill_and_resume` is the helper
other backends' tests reuse (tests/test_deepspeed.py, test_megatron.py, test_mindspore.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FAST, assert_refused_before_launch, bench
from parabench.checkpoint import MARKER, check_compatible, job_identity, newest_complete, plan_resume
from parabench.confutil import compose, to_plain
from parabench.errors import SpecError
from parabench.jobs import from_config

TWENTY = [*FAST, "run.steps=20", "launcher.nproc_per_node=2"]
CKPT = ["run.checkpoint.every=5"]


def only_summary(results: Path) -> dict:
    (path,) = results.glob("runs/*/*/*/summary.json")
    return json.loads(path.read_text())


def run_ok(args: list[str], results: Path, **kw) -> dict:
    proc = bench(["run", *args], results, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return only_summary(results)


def kill_and_resume(args: list[str], tmp_path: Path) -> tuple[dict, dict, Path]:
    """(uninterrupted summary, resumed summary, checkpoint dir) of ``args`` (a 20-step, 2-rank job):
    the second run checkpoints every 5 steps and is killed before step 13 (fault.step=12, no
    restart: it fails); the third resumes from the same checkpoint dir with run.resume=auto."""
    ckpt = tmp_path / "ckpt"
    full = run_ok([*args, "tracking.enabled=false"], tmp_path / "full")
    killed = bench(
        ["run", *args, *CKPT, f"run.checkpoint.dir={ckpt}", "fault.kind=kill", "fault.step=12"], tmp_path / "killed"
    )
    assert killed.returncode == 1, killed.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000005", "step_000010"]
    resumed = run_ok([*args, *CKPT, f"run.checkpoint.dir={ckpt}", "run.resume=auto"], tmp_path / "resumed")
    return full, resumed, ckpt


def assert_bitwise_after_resume(full: dict, resumed: dict, resumed_step: int = 10) -> None:
    assert resumed["resumed_step"] == resumed_step
    assert len(resumed["losses"]) == len(full["losses"]) == 20
    assert resumed["losses"][12:] == full["losses"][12:]  # steps 13-20, exact float equality
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
