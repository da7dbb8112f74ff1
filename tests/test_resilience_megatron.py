"""backend=megatron checkpoints (issue 14; docs/resilience.md#megatron): megatron.core.dist_checkpointing
(sharded state dict of the model and the optimizer, torch_dist files) through the real `bench run`.
Acceptance: a 20-step fp32 run on 2 ranks, checkpointed every 5 steps, killed at step 12 and resumed
with run.resume=auto, gives the losses of steps 13-20 bitwise equal to the uninterrupted run (tp=2
and pp=2); the tp=2 checkpoint resumed with tp=1 on one rank gives losses within 1e-6 relative of the
uninterrupted tp=2 run; a rank hung before step 13 with launcher.max_restarts=1 is detected by the
collective timeout, restarted and resumed (one command), FINISHED with the uninterrupted run's losses
(tp=2 and pp=2). One uninterrupted run per layout serves both."""

import pytest
from test_resilience import (
    TWENTY,
    assert_bitwise_after_resume,
    fault_and_recover,
    hang_and_recover,
    kill_and_resume,
    run_ok,
)

from conftest import FAST

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.megatron

LAYOUT_VARIANT = {"backend.tp=2": "megatron_tp", "backend.pp=2": "megatron_pp"}  # their runs in the matrix


@pytest.mark.matrix("megatron_tp", "megatron_pp")
@pytest.mark.full
@pytest.mark.parametrize("layout", ["backend.tp=2", "backend.pp=2"])
def test_killed_and_resumed_bitwise(layout, tmp_path, uninterrupted):
    args = [*TWENTY, "backend=megatron", layout]
    full = uninterrupted(LAYOUT_VARIANT[layout])
    resumed, ckpt = kill_and_resume(args, tmp_path)
    assert_bitwise_after_resume(full, resumed)
    native = ckpt / "step_000010" / "native"
    assert (native / "metadata.json").is_file() and (native / "common.pt").is_file()  # dist_checkpointing's layout
    if layout == "backend.tp=2":  # resharded: the tp=2 checkpoint of step 10 continues with tp=1 on 1 rank
        one = run_ok(
            [*FAST, "run.steps=20", "backend=megatron", f"run.resume={ckpt / 'step_000010'}"], tmp_path / "one"
        )
        assert one["resumed_step"] == 10 and one["world_size"] == 1
        assert one["losses"][:10] == full["losses"][:10]
        for a, b in zip(one["losses"][10:], full["losses"][10:], strict=True):
            assert abs(a - b) <= 1e-6 * abs(b), (a, b)


@pytest.mark.matrix("megatron_tp", "megatron_pp")
@pytest.mark.full
@pytest.mark.parametrize("layout", ["backend.tp=2", "backend.pp=2"])
def test_hang_is_detected_restarted_and_resumed(layout, results, uninterrupted):
    """The hung peer is noticed in Megatron's own tensor- or pipeline-parallel group (the tp
    all-reduce, the pp send/recv), which the adapter creates with launcher.collective_timeout_s
    (distributed_timeout_minutes) instead of Megatron's 30-minute default."""
    hang_and_recover([*TWENTY, "backend=megatron", layout], results, uninterrupted(LAYOUT_VARIANT[layout]))


@pytest.mark.matrix("megatron_pp")
@pytest.mark.full
def test_pp2_killed_restarted_and_resumed(results, uninterrupted):
    """fault.kind=kill + launcher.max_restarts=1 at pp=2, one command (tp=2's is the resilience
    experiment's megatron child): restarted, resumed from step 10, FINISHED, restarts=1."""
    fault_and_recover("kill", [*TWENTY, "backend=megatron", "backend.pp=2"], results, uninterrupted("megatron_pp"))


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
