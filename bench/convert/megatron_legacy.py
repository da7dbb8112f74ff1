"""Megatron checkpoints in Megatron-LM's legacy ``torch`` format, as a source of ``bench convert``.

Megatron-LM's ``save_checkpoint`` with ``--ckpt-format torch`` (the format before ``torch_dist``, still
written by MindSpeed-LLM's training and its weight converter) writes, beside
``latest_checkpointed_iteration.txt``, one ``torch.save`` file per tensor- and pipeline-parallel rank of
the first data-parallel replica: ``iter_{N:07d}/mp_rank_{TP:02d}[_{PP:03d}]/model_optim_rng.pt``
(the pipeline suffix only when pp > 1; ``get_checkpoint_name``). Each holds ``generate_state_dict``'s
dict: ``args``, ``checkpoint_version``, ``iteration``, ``model`` (the rank's module
``state_dict_for_save_checkpoint``: its tensor shard of every parameter, layers numbered within the
stage), ``optimizer`` (the optimizer's ``state_dict``: torch's AdamW state under integer ids, and
under bf16 also ``fp32_from_fp16_params``, the fp32 main params, group by group), the scheduler's
state and the RNG states (NVIDIA/Megatron-LM ``megatron/training/checkpointing.py``:
``get_checkpoint_name``, ``generate_state_dict``; megatron-core ``optimizer/optimizer.py``:
``FP32Optimizer.state_dict``, ``Float16OptimizerWithFloat16Params.state_dict``).

The optimizer's ids are the parameters' positions in its param groups: megatron-core's
``_get_param_groups`` walks ``named_parameters()`` (the order of the saved ``model``) and puts the
parameters without weight decay (1-D, or a ``.bias``; ``get_standard_config_overrides``) in the group
whose ``wd_mult`` is 0, the others in the group whose ``wd_mult`` is 1. Every id is matched to its
parameter that way and checked against the moment's shape; anything else is refused.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from parabench import untrusted
from parabench.canonical import MOMENTS, CanonicalState
from parabench.convert.megatron_checkpoint import VERSION, spec_from_args
from parabench.errors import SpecError

FILE = "model_optim_rng.pt"
RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?")  # get_checkpoint_name: tensor rank [_pipeline rank]
EXTRA_STATE = "_extra_state"  # Transformer Engine's (or None) beside each linear's weight


def is_legacy(directory: Path) -> bool:
    return any(p.is_dir() for p in directory.glob("mp_rank_*"))


def _rank_dirs(directory: Path) -> dict[tuple[int, int], Path]:
    """(pipeline rank, tensor rank) -> its model_optim_rng.pt; an expert-parallel or unknown name is refused."""
    found: dict[tuple[int, int], Path] = {}
    for path in sorted(directory.glob("mp_rank_*")):
        match = RANK_DIR.fullmatch(path.name)
        if not match:
            raise SpecError(
                "SRC", f"{path.name}: not a tensor[/pipeline] rank directory (expert-parallel files are not read)"
            )
        if not (path / FILE).is_file():
            raise SpecError("SRC", f"{path / FILE} is missing: an incomplete checkpoint")
        found[(int(match.group(2) or 0), int(match.group(1)))] = path / FILE
    return found


def _load(path: Path, trusted: bool) -> dict[str, Any]:
    # the args (argparse.Namespace and megatron-core enums) and numpy RNG states: allowlisted globals
    try:
        state = untrusted.load(path, trusted=trusted, map_location="cpu", mmap=True)
    except ModuleNotFoundError as exc:
        raise SpecError("SRC", f"{path} needs {exc.name} to be read (pip install megatron-core)") from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise SpecError("SRC", f"{path}: unreadable ({exc})") from None
    if not isinstance(state, dict) or "args" not in state or "model" not in state:
        what = "model0/model1 (virtual pipeline stages, not read)" if "model0" in (state or {}) else "no args and model"
        raise SpecError("SRC", f"{path} holds {what}: not a Megatron-LM checkpoint this reader takes")
    return state


def _check_layout(args: Any, ranks: dict[tuple[int, int], Path], directory: Path) -> tuple[int, int]:
    tp, pp = getattr(args, "tensor_model_parallel_size", 1), getattr(args, "pipeline_model_parallel_size", 1)
    if getattr(args, "virtual_pipeline_model_parallel_size", None):
        raise SpecError("SRC", f"{directory}: saved with virtual pipeline stages (model0, model1, ...): not read")
    if getattr(args, "use_distributed_optimizer", False):
        raise SpecError(
            "SRC",
            f"{directory}: args.use_distributed_optimizer=True in the legacy format keeps each data-parallel "
            "rank's flat buffers in distrib_optim.pt: not read (re-save with --ckpt-format torch_dist)",
        )
    wanted = {(p, t) for p in range(pp) for t in range(tp)}
    missing = sorted(wanted - set(ranks))
    if missing:
        p, t = missing[0]
        name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
        raise SpecError("SRC", f"{directory / name / FILE} is missing: the args say tp={tp} pp={pp}")
    if set(ranks) - wanted:
        raise SpecError("SRC", f"{directory}: more rank directories than the args' tp={tp} pp={pp}")
    return tp, pp


def _no_decay(name: str, shape: tuple[int, ...]) -> bool:
    """megatron-core get_standard_config_overrides: '*.bias' or 1-D parameters get wd_mult 0."""
    return name.endswith(".bias") or len(shape) == 1


def _params(model: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model.items() if not k.endswith(EXTRA_STATE) and hasattr(v, "shape")}


def _inner(optimizer: Any, path: Path, bf16: bool) -> tuple[dict[str, Any], list | None]:
    """The torch optimizer's state_dict and, under bf16, the fp32 main params by group."""
    if isinstance(optimizer, list):
        raise SpecError("SRC", f"{path}: a chain of {len(optimizer)} optimizers (e.g. expert params apart): not read")
    if bf16:
        if not isinstance(optimizer, dict) or "fp32_from_fp16_params" not in optimizer:
            raise SpecError("SRC", f"{path}: args.bf16=True but no fp32_from_fp16_params (the fp32 main params)")
        return optimizer["optimizer"], optimizer["fp32_from_fp16_params"]
    if not isinstance(optimizer, dict) or "param_groups" not in optimizer:
        raise SpecError("SRC", f"{path}: its optimizer state is not a torch optimizer's state_dict")
    return optimizer, None


def _group_members(params: dict[str, Any], group: dict[str, Any], index: int, path: Path) -> list[str]:
    wd_mult = group.get("wd_mult")
    if wd_mult not in (0.0, 1.0) or group.get("is_expert_parallel") or group.get("lr_mult", 1.0) != 1.0:
        raise SpecError("SRC", f"{path}: param group {index} is not one of megatron-core's standard two: not read")
    members = [n for n, p in params.items() if _no_decay(n, tuple(p.shape)) == (wd_mult == 0.0)]
    if len(members) != len(group["params"]):
        raise SpecError(
            "SRC",
            f"{path}: param group {index} holds {len(group['params'])} ids; the model has {len(members)} such parameters",
        )
    return members


def rank_state(path: Path, state: dict[str, Any], bf16: bool) -> tuple[dict, dict | None, int | None]:
    """One rank's (weights, {moment: {name: tensor}} or None, step or None) under its module names."""
    params = _params(state["model"])
    optimizer = state.get("optimizer")
    if optimizer is None:  # --no-save-optim
        return params, None, None
    inner, mains = _inner(optimizer, path, bf16)
    weights, moments, steps = dict(params), {m: {} for m in MOMENTS}, set()
    for index, group in enumerate(inner["param_groups"]):
        for j, (pid, name) in enumerate(zip(group["params"], _group_members(params, group, index, path), strict=True)):
            held = inner["state"].get(pid) or {}
            if any(tuple(held[m].shape) != tuple(params[name].shape) for m in MOMENTS if m in held) or not all(
                m in held for m in MOMENTS
            ):
                raise SpecError("SRC", f"{path}: optimizer id {pid} has no AdamW moments shaped like {name}")
            moments["exp_avg"][name], moments["exp_avg_sq"][name] = held["exp_avg"], held["exp_avg_sq"]
            steps.add(float(held["step"]))
            if mains is not None:
                weights[name] = mains[index][j]
    if len(steps) != 1:
        raise SpecError("SRC", f"{path}: the optimizer's step is {sorted(steps) or 'absent'}, not one value")
    return weights, moments, int(steps.pop())


def inspect(directory: Path, name: str, trusted: bool) -> dict[str, Any]:
    """Everything checked before anything is written: every rank file there and its pickle checked,
    the args against the canonical Llama, every rank's parameters (names and shapes, against the
    args' model sharded at the saved layout) and optimizer ids, one step."""
    ranks = _rank_dirs(directory)
    if not ranks:
        raise SpecError("SRC", f"{directory}: no mp_rank_* directory")
    first = _load(ranks[min(ranks)], trusted)
    if first.get("checkpoint_version") != VERSION:
        raise SpecError(
            "SRC", f"{directory}: checkpoint_version {first.get('checkpoint_version')}; only {VERSION} is read"
        )
    args = first["args"]
    tp, pp = _check_layout(args, ranks, directory)
    bf16 = bool(getattr(args, "bf16", False))
    meta = {
        "format": "torch",
        "spec": spec_from_args(args, name=name),
        "directory": directory,
        "ranks": ranks,
        "te_names": any(k.endswith("linear_qkv.layer_norm_weight") for k in _params(first["model"])),
        "step": None,
        "precision": "bf16" if bf16 else "fp32",
        "distributed_optimizer": None,
        "iteration": first.get("iteration"),
        "tp": tp,
        "pp": pp,
        "world_size": None,
        "trusted": trusted,
    }
    _, meta["step"] = _assemble(meta)  # names, shapes and the one step; read() assembles again
    return meta


def _shards(meta: dict[str, Any]) -> tuple[dict[str, dict], int | None]:
    """{"weights" | moment: {(stage, 0, tensor rank): {module name: fp32 array}}} of every rank file, and
    the optimizer's step, which every rank must hold alike (None: no optimizer state, no moments)."""
    bf16 = meta["precision"] == "bf16"
    parts: dict[str, dict] = {"weights": {}, **{m: {} for m in MOMENTS}}
    steps = set()
    for (stage, tp_rank), path in meta["ranks"].items():
        weights, moments, step = rank_state(path, _load(path, meta["trusted"]), bf16)
        steps.add(step)
        parts["weights"][(stage, 0, tp_rank)] = {n: t.float().numpy() for n, t in weights.items()}
        for m in MOMENTS:
            parts[m][(stage, 0, tp_rank)] = {n: t.float().numpy() for n, t in (moments or {}).get(m, {}).items()}
    if len(steps) != 1:
        where = meta["directory"]
        raise SpecError("SRC", f"{where}: the ranks hold optimizer state at different steps or only some: {steps}")
    step = steps.pop()
    return (parts if step is not None else {"weights": parts["weights"]}), step


def _assemble(meta: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], int | None]:
    """The full canonical weights (and moments) of every rank's shards, put together by the layout's
    mapping (parabench.adapters.megatron_mapping); every rank must hold exactly the names and shapes
    the args' model has at that rank when sharded the same way. With the optimizer's step."""
    from parabench.adapters.megatron_mapping import Layout, shard_all, unshard_all

    spec = meta["spec"]
    layout = Layout(tp=meta["tp"], pp=meta["pp"], te_names=meta["te_names"])
    parts, step = _shards(meta)
    try:
        full = {key: unshard_all(shards, spec, layout) for key, shards in parts.items()}
        expected = shard_all(full["weights"], spec, layout)
    except (KeyError, ValueError) as exc:
        raise SpecError("SRC", f"{meta['directory']}: its shards do not make the args' model ({exc})") from None
    for (stage, _, tp_rank), shard in expected.items():
        held = parts["weights"][(stage, 0, tp_rank)]
        wrong = sorted(
            n for n in set(shard) | set(held) if n not in shard or n not in held or shard[n].shape != held[n].shape
        )
        if wrong:
            raise SpecError(
                "SRC", f"{meta['ranks'][(stage, tp_rank)]}: {wrong[0]} is not what the args' model holds at that rank"
            )
    return full, step


def read(meta: dict[str, Any]) -> CanonicalState:
    """The canonical state: every rank's shards (fp32 main params under bf16) widened to fp32 exactly
    and put together by the layout's mapping; without optimizer state, moments as a fresh AdamW starts
    them (zeros, step 0)."""
    import numpy as np

    full, _ = _assemble(meta)
    if meta["step"] is None:
        zeros = {n: np.zeros_like(w) for n, w in full["weights"].items()}
        return CanonicalState(full["weights"], {m: zeros for m in MOMENTS}, 0)
    return CanonicalState(full["weights"], {m: full[m] for m in MOMENTS}, meta["step"])
