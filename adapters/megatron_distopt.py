"""The distributed optimizer's state as whole tensors per model parameter, for ``bench convert``.

megatron-core's ``DistributedOptimizer`` gives each data-parallel rank one contiguous slice of every
gradient bucket; a model parameter's fp32 main copy and its AdamW moments live on the ranks whose
slice overlaps it, each as the piece ``[start, end)`` of the flattened parameter
(``_get_model_param_range_map(p)["param"]``), stepped by the inner torch optimizer as the parameter
``param_groups[group]["params"][order]`` of ``model_param_group_index_map[p]`` (as its own
``_get_main_param_and_optimizer_states`` finds it; docs/sources.md#megatron-distributed-optimizer-checkpoints).

Export puts the pieces of the data-parallel ranks together: an all-gather of each rank's pieces and
of which elements it holds, every element taken from the one rank that holds it (no arithmetic: a
-0.0 stays -0.0, which a summing all-reduce would turn into +0.0). Import gives each rank its piece
of the canonical tensors. Both run in the engine's worker (adapters/megatron.py).
"""

from __future__ import annotations

from typing import Any

from parabench.canonical import MOMENTS

STATES = ("param", *MOMENTS)  # the fp32 main param, then AdamW's moments


def _owner(optimizers: list, param: Any) -> Any:
    """The DistributedOptimizer whose buffers hold ``param`` (a ChainedOptimizer holds several): its
    buffers' ``param_index_map`` names every parameter, ``model_param_gbuf_map`` only this rank's."""
    for optimizer in optimizers:
        if any(param in buffer.param_index_map for buffer in optimizer.buffers):
            return optimizer
    raise RuntimeError("a megatron parameter is in none of the distributed optimizer's buffers")


def _local(optimizer: Any, param: Any) -> tuple[Any, Any, dict] | None:
    """(this rank's piece of ``param`` as a range of its flattened elements, the main param of that
    piece, its AdamW state) or None where this rank holds none of it. The state is created as AdamW
    creates it (zero moments, step 0.0) where no step has run yet."""
    import torch

    where = optimizer.model_param_group_index_map.get(param)
    if where is None:
        return None
    piece = optimizer._get_model_param_range_map(param)["param"]
    main = optimizer.optimizer.param_groups[where[0]]["params"][where[1]]
    state = optimizer.optimizer.state[main]
    if "exp_avg" not in state:
        state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(main), exp_avg_sq=torch.zeros_like(main))
    return piece, main, state


def gather_whole(optimizers: list, params: list) -> tuple[dict[Any, dict[str, Any]], int]:
    """Every parameter's whole fp32 main param and moments (``STATES``, each of the parameter's shape,
    on its device) put together over its optimizer's data-parallel group, and the one AdamW step
    of all of them (RuntimeError if the pieces do not cover each parameter exactly once, or if the
    steps differ)."""
    import torch
    import torch.distributed as dist

    whole: dict[Any, dict[str, Any]] = {}
    steps: set[float] = set()
    for param in params:
        optimizer = _owner(optimizers, param)
        mine = torch.zeros(len(STATES), param.numel(), dtype=torch.float32, device=param.device)
        held = torch.zeros(param.numel(), dtype=torch.int32, device=param.device)
        local = _local(optimizer, param)
        if local is not None:
            piece, main, state = local
            for i, key in enumerate(STATES):
                mine[i, piece.start : piece.end] = (main if key == "param" else state[key]).detach().view(-1)
            held[piece.start : piece.end] = 1
            steps.add(float(state["step"]))
        group = optimizer.data_parallel_group
        pieces = [torch.empty_like(mine) for _ in range(group.size())]
        holders = [torch.empty_like(held) for _ in range(group.size())]
        dist.all_gather(pieces, mine, group=group)
        dist.all_gather(holders, held, group=group)
        if not bool((torch.stack(holders).sum(0) == 1).all()):
            raise RuntimeError("the distributed optimizer's pieces of a parameter do not cover it exactly once")
        full = torch.zeros_like(mine)
        for values, holds in zip(pieces, holders, strict=True):
            full[:, holds.bool()] = values[:, holds.bool()]
        whole[param] = {key: full[i].view(param.shape) for i, key in enumerate(STATES)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(steps))
    steps = {s for part in everyone for s in part}
    if len(steps) != 1:
        raise RuntimeError(f"AdamW step counts differ between parameters: {sorted(steps)}")
    return whole, int(steps.pop())


def put_piece(optimizers: list, param: Any, values: dict[str, Any], step: int | None) -> None:
    """This rank's piece of ``param``'s whole main param and moments (``values``: key of ``STATES`` ->
    NumPy array of the parameter's shape) and the AdamW ``step`` (None: left as created, 0)."""
    import torch

    local = _local(_owner(optimizers, param), param)
    if local is None:
        return
    piece, main, state = local
    for key, value in values.items():
        target = main if key == "param" else state[key]
        target.detach().copy_(torch.from_numpy(value).reshape(-1)[piece.start : piece.end])
    if step is not None:
        state["step"] = torch.tensor(float(step))
