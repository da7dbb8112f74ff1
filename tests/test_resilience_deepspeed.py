"""backend=deepspeed checkpoints (issue 14; docs/resilience.md#deepspeed): engine.save_checkpoint /
load_checkpoint through the real `bench run`. Acceptance: a 20-step fp32 run on 2 ranks,
checkpointed every 5 steps, killed at step 12 and resumed with run.resume=auto, gives the losses of
steps 13-20 bitwise equal to the uninterrupted run, for ZeRO stages 1, 2 and 3; and a rank hung before
step 13 with launcher.max_restarts=1 is detected by the collective timeout, restarted and resumed (one
command), FINISHED with the uninterrupted run's losses. One uninterrupted run per stage serves both."""

import importlib.util

import pytest
from test_resilience import (
    TWENTY,
    assert_bitwise_after_resume,
    fault_and_recover,
    hang_and_recover,
    kill_and_resume,
)

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed", allow_module_level=True)

pytestmark = pytest.mark.deepspeed


@pytest.mark.matrix("zero1", "zero2", "zero3")
@pytest.mark.full
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_killed_and_resumed_bitwise(stage, tmp_path, uninterrupted):
    args = [*TWENTY, "backend=deepspeed", f"backend.zero_stage={stage}"]
    resumed, ckpt = kill_and_resume(args, tmp_path)
    assert_bitwise_after_resume(uninterrupted(f"zero{stage}"), resumed)
    native = ckpt / "step_000010" / "native"
    assert (native / "latest").read_text() == "global_step10"  # DeepSpeed's own layout
    assert len(list((native / "global_step10").glob("*optim_states.pt"))) == 2  # one ZeRO partition per rank
    assert resumed["ckpt_load_s"] > 0 and resumed["ckpt_bytes_total"] > 0


@pytest.mark.matrix("zero1", "zero2", "zero3")
@pytest.mark.full
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_hang_is_detected_restarted_and_resumed(stage, results, uninterrupted):
    """ZeRO reduces (and at stage 3 gathers) on DeepSpeed's clone of the world group, which the adapter
    creates with launcher.collective_timeout_s: without it the hung peer held rank 0 for torch's
    30-minute default and the runner's hang watchdog ended the job FAILED."""
    args = [*TWENTY, "backend=deepspeed", f"backend.zero_stage={stage}"]
    hang_and_recover(args, results, uninterrupted(f"zero{stage}"))


@pytest.mark.matrix("zero1", "zero3")
@pytest.mark.full
@pytest.mark.parametrize("stage", [1, 3])
def test_zero_stage_killed_restarted_and_resumed(stage, results, uninterrupted):
    """fault.kind=kill + launcher.max_restarts=1, one command (ZeRO-2's is the resilience experiment's
    deepspeed child): torchrun restarts both ranks, they resume from step 10, FINISHED, restarts=1."""
    args = [*TWENTY, "backend=deepspeed", f"backend.zero_stage={stage}"]
    fault_and_recover("kill", args, results, uninterrupted(f"zero{stage}"))


def test_other_world_size_and_stage_are_refused_before_launch(tmp_path, capsys):
    """ZeRO files are per-data-parallel-rank partitions: DeepSpeed loads them only into the same
    data-parallel size and stage (its universal format needs an offline conversion)."""
    from test_resilience import fake_checkpoint, job_of

    from conftest import assert_refused_before_launch

    saved = job_of("backend=deepspeed", "backend.zero_stage=2", "launcher.nproc_per_node=2")
    fake_checkpoint(tmp_path / "ck", 5, saved)
    ck = f"run.resume={tmp_path / 'ck'}"
    line = assert_refused_before_launch(
        ["+model=llama", "backend=deepspeed", "backend.zero_stage=2", ck], "launcher.nproc_per_node", tmp_path, capsys
    )
    assert "cannot reshard" in line
    assert_refused_before_launch(
        ["+model=llama", "backend=deepspeed", "backend.zero_stage=3", "launcher.nproc_per_node=2", ck],
        "backend.zero_stage",
        tmp_path,
        capsys,
    )
    assert_refused_before_launch(
        ["+model=llama", "backend=deepspeed", "run.checkpoint.every=5", "run.checkpoint.async=true"],
        "run.checkpoint.async",
        tmp_path,
        capsys,
    )
