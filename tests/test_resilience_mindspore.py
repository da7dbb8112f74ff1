"""backend=mindspore checkpoints (issue 14; docs/resilience.md#mindspore): mindspore.save_checkpoint /
load_checkpoint (weights, both AdamW moments and the step) through the real `bench run` under msrun.
Acceptance: a 20-step fp32 run on 2 ranks, checkpointed every 5 steps, killed at step 12 and resumed
with run.resume=auto, gives the losses of steps 13-20 bitwise equal to the uninterrupted run."""

import pytest
from test_resilience import FAST, TWENTY, assert_bitwise_after_resume, kill_and_resume, run_ok

pytest.importorskip("mindspore")


def test_killed_and_resumed_bitwise(tmp_path):
    args = [*TWENTY, "backend=mindspore"]
    full = run_ok([*args, "tracking.enabled=false"], tmp_path / "full")
    resumed, ckpt = kill_and_resume(args, tmp_path)
    assert_bitwise_after_resume(full, resumed)
    native = ckpt / "step_000010" / "native"
    assert sorted(p.name for p in native.iterdir()) == ["rank0.ckpt", "rank1.ckpt"]


def test_async_save_is_complete_and_resumes_bitwise(tmp_path):
    """run.checkpoint.async=true: MindSpore's writer thread (save_checkpoint(async_save="thread"));
    the marker is written only after it has ended, and the checkpoint resumes exactly."""
    args = [*FAST, "run.steps=6", "launcher.nproc_per_node=2", "backend=mindspore", "run.checkpoint.every=5"]
    args += ["run.checkpoint.async=true", f"run.checkpoint.dir={tmp_path / 'ck'}"]
    saved = run_ok([*args, "tracking.enabled=false"], tmp_path / "saved")
    assert (tmp_path / "ck" / "step_000005" / "COMPLETE").is_file()
    resumed = run_ok([*args, "run.resume=auto", "tracking.enabled=false"], tmp_path / "resumed")
    assert resumed["resumed_step"] == 5
    assert resumed["losses"] == saved["losses"]
