"""backend=deepspeed checkpoints (issue 14; docs/resilience.md#deepspeed): engine.save_checkpoint /
load_checkpoint through the real `bench run`. Acceptance: a 20-step fp32 run on 2 ranks,
checkpointed every 5 steps, killed at step 12 and resumed with run.resume=auto, gives the losses of
steps 13-20 bitwise equal to the uninterrupted run, for ZeRO stages 1, 2 and 3."""

import importlib.util

import pytest
from test_resilience import TWENTY, assert_bitwise_after_resume, kill_and_resume, run_ok

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed", allow_module_level=True)

pytestmark = pytest.mark.deepspeed


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_killed_and_resumed_bitwise(stage, tmp_path):
    args = [*TWENTY, "backend=deepspeed", f"backend.zero_stage={stage}"]
    full = run_ok([*args, "tracking.enabled=false"], tmp_path / "full")
    resumed, ckpt = kill_and_resume(args, tmp_path)
    assert_bitwise_after_resume(full, resumed)
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
