"""adapters/megatron_distopt.py on stand-ins for megatron-core's DistributedOptimizer (the attributes it
reads: its buffers' param_index_map, model_param_group_index_map, _get_model_param_range_map, the inner
optimizer's param_groups/state, data_parallel_group), in a one-process gloo group: pieces put together
bit for bit (a -0.0 stays -0.0), a piece that leaves elements uncovered refused, and import writing
only this rank's piece. The multi-rank paths run end to end in tests/test_convert_distopt.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
dist = torch.distributed

from parabench.adapters import megatron_distopt  # noqa: E402


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _optimizer(param, start: int, end: int, group, state: dict | None = None):
    """A stand-in holding ``param``'s elements [start, end) as its main param (and ``state``)."""
    main = param.detach().view(-1)[start:end].clone()
    inner = SimpleNamespace(param_groups=[{"params": [main]}], state={main: state or {}})
    return SimpleNamespace(
        buffers=[SimpleNamespace(param_index_map={param: (0, param.numel(), 0)})],
        model_param_group_index_map={param: (0, 0)},
        _get_model_param_range_map=lambda p: {"param": SimpleNamespace(start=start, end=end)},  # megatron Range
        optimizer=inner,
        data_parallel_group=group,
    ), main


def test_pieces_are_put_together_bit_for_bit(one_rank):
    param = torch.tensor([[1.5, -0.0], [3.0, -2.0]])
    state = {"step": torch.tensor(7.0), "exp_avg": torch.tensor([-0.0, 1e-30, 2.0, 3.0])}
    state["exp_avg_sq"] = torch.tensor([4.0, 5.0, 6.0, 7.0])
    optimizer, _ = _optimizer(param, 0, 4, one_rank, state)
    whole, step = megatron_distopt.gather_whole([optimizer], [param])
    assert step == 7
    assert whole[param]["param"].shape == param.shape
    assert whole[param]["param"].numpy().tobytes() == param.numpy().tobytes()  # -0.0 kept
    assert whole[param]["exp_avg"].view(-1).numpy().tobytes() == state["exp_avg"].numpy().tobytes()


def test_a_piece_that_leaves_elements_uncovered_is_refused(one_rank):
    param = torch.ones(2, 3)
    optimizer, _ = _optimizer(param, 0, 5, one_rank)
    with pytest.raises(RuntimeError, match="do not cover it exactly once"):
        megatron_distopt.gather_whole([optimizer], [param])


def test_import_writes_this_ranks_piece_and_a_fresh_state(one_rank):
    param = torch.zeros(2, 3)
    optimizer, main = _optimizer(param, 2, 5, one_rank)
    values = {"param": torch.arange(6.0).view(2, 3).numpy(), "exp_avg": -torch.arange(6.0).view(2, 3).numpy()}
    megatron_distopt.put_piece([optimizer], param, values, step=4)
    state = optimizer.optimizer.state[main]
    assert main.tolist() == [2.0, 3.0, 4.0] and state["exp_avg"].tolist() == [-2.0, -3.0, -4.0]
    assert state["exp_avg_sq"].tolist() == [0.0, 0.0, 0.0] and float(state["step"]) == 4.0
    with pytest.raises(RuntimeError, match="none of the distributed optimizer's buffers"):
        megatron_distopt.put_piece([optimizer], torch.zeros(1), values, step=4)


def test_megatron_lm_reader_takes_fully_reshardable_only():
    """bench/convert/megatron_checkpoint.py: a Megatron-LM checkpoint with the distributed optimizer is read in the one
    format that stores each state at its parameter's shape; others are refused with the flag that
    re-saves it; the step is the param groups' (DistributedOptimizer.state_dict)."""
    from argparse import Namespace
    from pathlib import Path

    from parabench.convert import megatron_checkpoint
    from parabench.errors import SpecError

    on, where = Namespace(use_distributed_optimizer=True), Path("iter_0000003")
    fully = {"content_metadata": {"distrib_optim_sharding_type": "fully_reshardable"}}
    assert megatron_checkpoint._distopt_format(on, fully, where) == "fully_reshardable"
    assert megatron_checkpoint._distopt_format(Namespace(use_distributed_optimizer=False), {}, where) is None
    for common, named in (
        ({"content_metadata": {"distrib_optim_sharding_type": "dp_reshardable"}}, "dp_reshardable"),
        ({}, "fully_sharded_model_space"),
    ):
        with pytest.raises(SpecError, match="--dist-ckpt-optim-fully-reshardable") as refused:
            megatron_checkpoint._distopt_format(on, common, where)
        assert named in str(refused.value) and "\n" not in str(refused.value)
    groups = {
        "optimizer": {"param_groups": [{"step": 3.0, "lr": 1e-3}, {"step": 3.0}]},
        "param_state_sharding_type": "x",
    }
    assert megatron_checkpoint._steps(groups, "step") == [3.0, 3.0]
