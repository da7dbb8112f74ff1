"""backend=deepspeed checkpoints (issue 14; docs/resilience.md#deepspeed): engine.save_checkpoint /
load_checkpoint through the real `bench run`. Acceptance: a 20-step fp32 run on 2 ranks,
checkpointed every 5 steps, killed at step 12 and resumed with run.resume=auto, gives the losses of
steps 13-20 bitwise equal to the uninterrupted run, for ZeRO stages 1, 2 and 3; and a rank hung before
step 13 with launcher.max_restarts=1 is detected by the collective timeout, restarted and resumed (one
command), FINISHED with the uninterrupted run's losses. Per stage both happen in two commands (the
resuming command is the one that hangs: test_resilience.kill_then_hang), against the matrix's
uninterrupted run."""

import importlib.util

import pytest
from test_resilience import TWENTY, kill_then_hang

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed", allow_module_level=True)

pytestmark = pytest.mark.deepspeed


@pytest.mark.matrix("zero1", "zero2", "zero3")
@pytest.mark.full
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_killed_resumed_then_hung_restarted_bitwise(stage, tmp_path, uninterrupted):
    """Killed before step 13 (no restart), then resumed with run.resume=auto by a command in which rank 1
    hangs before step 13 with launcher.max_restarts=1: the hang is noticed on DeepSpeed's clone of the
    world group, which the adapter creates with launcher.collective_timeout_s (without it the hung
    peer held rank 0 for torch's 30-minute default and the runner's hang watchdog ended the job
    FAILED); torchrun restarts both ranks, they load step 10 again and finish with all 20 losses
    bitwise the uninterrupted run's. DeepSpeed's own layout is in the checkpoint. A kill with
    restart (one command) is the resilience experiment's deepspeed child (ZeRO-2); torchrun's
    restart does not depend on the stage."""
    args = [*TWENTY, "backend=deepspeed", f"backend.zero_stage={stage}"]
    resumed, ckpt = kill_then_hang(args, tmp_path, uninterrupted(f"zero{stage}"))
    native = ckpt / "step_000010" / "native"
    assert (native / "latest").read_text() == "global_step10"  # DeepSpeed's own layout
    assert len(list((native / "global_step10").glob("*optim_states.pt"))) == 2  # one ZeRO partition per rank
    assert resumed["ckpt_load_s"] > 0 and resumed["ckpt_bytes_total"] > 0


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
