"""backend=megatron checkpoints (issue 14; docs/resilience.md#megatron): megatron.core.dist_checkpointing
(sharded state dict of the model and the optimizer, torch_dist files) through the real `bench run`.
Acceptance: a 20-step fp32 run on 2 ranks, checkpointed every 5 steps, killed at step 12 and resumed
with run.resume=auto, gives the losses of steps 13-20 bitwise equal to the uninterrupted run (tp=2
and pp=2). The tp=2 checkpoint resumed with tp=1 is refused for now (see the test below)."""

import pytest
from test_resilience import TWENTY, assert_bitwise_after_resume, kill_and_resume, run_ok

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("layout", ["backend.tp=2", "backend.pp=2"])
def test_killed_and_resumed_bitwise(layout, tmp_path):
    args = [*TWENTY, "backend=megatron", layout]
    full = run_ok([*args, "tracking.enabled=false"], tmp_path / "full")
    resumed, ckpt = kill_and_resume(args, tmp_path)
    assert_bitwise_after_resume(full, resumed)
    native = ckpt / "step_000010" / "native"
    assert (native / "metadata.json").is_file() and (native / "common.pt").is_file()  # dist_checkpointing's layout


def test_tp2_checkpoint_is_refused_with_tp1_until_the_optimizer_state_reshards(tmp_path, capsys):
    """The issue asks tp=2 -> tp=1 within 1e-6; measured on megatron-core 0.16.1: the weights reshard
    (step 11 after the load is bitwise equal), the AdamW state does not (step 12 off by 3.6e-4, steps
    13-20 by up to 5.5e-3). Until that is fixed the resume is refused before launch, never run wrong."""
    from test_resilience import fake_checkpoint, job_of

    from conftest import assert_refused_before_launch

    fake_checkpoint(tmp_path / "ck", 10, job_of("backend=megatron", "backend.tp=2", "launcher.nproc_per_node=2"))
    line = assert_refused_before_launch(
        ["+model=llama", "backend=megatron", "backend.tp=1", f"run.resume={tmp_path / 'ck'}"],
        "backend.tp",
        tmp_path,
        capsys,
    )
    assert "reshard" in line


def test_pipeline_size_and_optimizer_kind_are_refused_before_launch(tmp_path, capsys):
    from test_resilience import fake_checkpoint, job_of

    from conftest import assert_refused_before_launch

    fake_checkpoint(tmp_path / "ck", 5, job_of("backend=megatron", "backend.pp=2", "launcher.nproc_per_node=2"))
    ck = f"run.resume={tmp_path / 'ck'}"
    line = assert_refused_before_launch(
        ["+model=llama", "backend=megatron", "launcher.nproc_per_node=2", ck],
        "backend.pp",
        tmp_path,
        capsys,
    )
    assert "cannot reshard pp" in line
    assert_refused_before_launch(
        [
            "+model=llama",
            "backend=megatron",
            "backend.pp=2",
            "launcher.nproc_per_node=2",
            "backend.distributed_optimizer=true",
            ck,
        ],
        "backend.distributed_optimizer",
        tmp_path,
        capsys,
    )
