"""backend=megatron checkpoints (issue 14; docs/resilience.md#megatron): megatron.core.dist_checkpointing
(sharded state dict of the model and the optimizer, torch_dist files) through the real `bench run`.
Acceptance: a 20-step fp32 run on 2 ranks, checkpointed every 5 steps, killed at step 12 and resumed
with run.resume=auto, gives the losses of steps 13-20 bitwise equal to the uninterrupted run (tp=2
and pp=2); the tp=2 checkpoint resumed with tp=1 on one rank gives losses within 1e-6 relative of the
uninterrupted tp=2 run; a rank hung before step 13 with launcher.max_restarts=1 is detected by the
collective timeout, restarted and resumed (one command), FINISHED with the uninterrupted run's losses
(tp=2 and pp=2). Per layout both happen in two commands (the resuming command is the one that hangs),
against the matrix's uninterrupted run. The distributed optimizer (issue 30)
is killed and resumed the same way, bitwise; where megatron-core cannot save it, the job is refused
before launch."""

import pytest
from test_resilience import (
    TWENTY,
    assert_bitwise_after_resume,
    kill_and_resume,
    kill_then_hang,
    run_ok,
)

from conftest import FAST

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.megatron

LAYOUT_VARIANT = {"backend.tp=2": "megatron_tp", "backend.pp=2": "megatron_pp"}  # their runs in the matrix
DISTOPT = "backend=megatron/dp_overlap"  # the matrix's megatron_distopt: dp=2, distributed optimizer, both overlaps


@pytest.mark.matrix("megatron_tp", "megatron_pp")
@pytest.mark.full
@pytest.mark.parametrize("layout", ["backend.tp=2", "backend.pp=2"])
def test_killed_resumed_then_hung_restarted_bitwise(layout, tmp_path, uninterrupted):
    """Killed before step 13 (no restart), then resumed with run.resume=auto by a command in which rank 1
    hangs before step 13 with launcher.max_restarts=1 (test_resilience.kill_then_hang): the hung peer
    is noticed in Megatron's own tensor- or pipeline-parallel group (the tp all-reduce, the pp
    send/recv), which the adapter creates with launcher.collective_timeout_s
    (distributed_timeout_minutes) instead of Megatron's 30-minute default; restarted, resumed from step
    10 again, all 20 losses bitwise the uninterrupted run's. A kill with restart in one command is the
    resilience experiment's megatron child (tp=2); torchrun's restart does not depend on the layout."""
    args = [*TWENTY, "backend=megatron", layout]
    full = uninterrupted(LAYOUT_VARIANT[layout])
    _, ckpt = kill_then_hang(args, tmp_path, full)
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


@pytest.mark.matrix("megatron_distopt")
@pytest.mark.full
def test_distributed_optimizer_killed_and_resumed_bitwise(tmp_path, uninterrupted):
    """The distributed optimizer (issue 30): saved every 5 steps, killed before step 13, resumed
    from step 10, bitwise equal to the uninterrupted run. Its overlapped parameter all-gather is
    finished before each save, so the model's weights in the checkpoint are those its optimizer
    holds. Where megatron-core records the format (0.16), megatron-core's own reader names
    ``fully_reshardable`` (docs/megatron.md#checkpoints-with-the-distributed-optimizer)."""
    resumed, ckpt = kill_and_resume([*TWENTY, DISTOPT], tmp_path)
    assert_bitwise_after_resume(uninterrupted("megatron_distopt"), resumed)
    native = ckpt / "step_000010" / "native"
    from megatron.core import dist_checkpointing

    if hasattr(dist_checkpointing, "load_content_metadata"):
        assert (
            dist_checkpointing.load_content_metadata(str(native))["distrib_optim_sharding_type"] == "fully_reshardable"
        )
        assert_optimizer_holds_saved_weights(native, tmp_path / "step_000010.pt")


def assert_optimizer_holds_saved_weights(native, out):
    """Every fp32 master in a fully_reshardable checkpoint equals the model weight saved beside it
    (they were one step apart before the overlapped all-gather was finished at save), and each AdamW
    moment has its parameter's shape. Read with torch's own DCP reader."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(native), str(out))
    saved = torch.load(out, weights_only=False)
    names = [k.removeprefix("optimizer.state.param.") for k in saved if k.startswith("optimizer.state.param.")]
    assert "embedding.word_embeddings.weight" in names
    for name in names:
        assert torch.equal(saved[f"optimizer.state.param.{name}"], saved[name]), name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert saved[f"optimizer.state.{moment}.{name}"].shape == saved[name].shape, (moment, name)


def test_distributed_optimizer_checkpoint_refused_where_it_cannot_be_saved(tmp_path, capsys, monkeypatch):
    """megatron-core 0.12 saves the distributed optimizer as fully_sharded_model_space, whose code
    calls numpy.product (gone in numpy 2): a checkpointed job is refused before launch with one
    line; without checkpoints, or with numpy 1, it is not."""
    import numpy
    from test_resilience import job_of

    from conftest import assert_refused_before_launch
    from parabench.adapters import megatron

    real = megatron.package_version
    monkeypatch.setattr(megatron, "package_version", lambda d: "0.12.1" if d == "megatron-core" else real(d))
    monkeypatch.delattr(numpy, "product", raising=False)
    args = ["+model=llama", "backend=megatron", "backend.distributed_optimizer=true", "launcher.nproc_per_node=2"]
    line = assert_refused_before_launch(
        [*args, "run.checkpoint.every=5"], "backend.distributed_optimizer", tmp_path, capsys
    )
    assert "numpy<2" in line and "0.12.1" in line
    megatron.MegatronAdapter.validate(job_of(*args[1:]))  # no checkpoint: runs
    monkeypatch.setattr(numpy, "product", numpy.prod, raising=False)
    megatron.MegatronAdapter.validate(job_of(*args[1:], "run.checkpoint.every=5"))  # numpy 1: saved


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
