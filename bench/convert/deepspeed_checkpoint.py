"""DeepSpeed checkpoints written by DeepSpeed itself, as a source of ``bench convert`` (docs/convert.md).

``engine.save_checkpoint(DIR)`` writes ``DIR/latest`` (the tag) and ``DIR/<tag>/``: the model states
(``mp_rank_00_model_states.pt`` under ZeRO 0-2, one ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
per rank under ZeRO-3) and one ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank
(deepspeed/runtime/engine.py, ``save_checkpoint``; docs/sources.md#deepspeed-own-checkpoints). The
model's shape comes from the ``config.json`` beside ``latest``, where the Hugging Face Trainer writes
it (``checkpoint-N/``). The state is read through DeepSpeed's own universal-checkpoint converter
(``python -m deepspeed.checkpoint.ds_to_universal``), which writes every parameter's full fp32 value
and AdamW moments as ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``; the names are the module's: for a
transformers Llama, the Hugging Face names the canonical model uses (parabench.hf).
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

from parabench import untrusted
from parabench.canonical import MOMENTS, CanonicalState, Lazy
from parabench.errors import RunFailed, SpecError
from parabench.hf import CONFIG, ignored, spec_fields
from parabench.jobs import model_spec
from parabench.launchers import Launch, supervise

LATEST = "latest"
OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
UNIVERSAL = ["-m", "deepspeed.checkpoint.ds_to_universal"]


def is_checkpoint(path: Path) -> bool:
    return (path / LATEST).is_file()


def _load(path: Path, trusted: bool) -> dict[str, Any]:
    # DeepSpeed's own files pickle more than tensors (its loss scaler, ZeRO stage enum): allowlisted
    try:
        return untrusted.load(path, trusted=trusted, map_location="cpu")
    except ModuleNotFoundError as exc:
        raise SpecError("SRC", f"{path} needs {exc.name} to be read (pip install deepspeed)") from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise SpecError("SRC", f"{path}: unreadable ({exc})") from None


def _tag_dir(path: Path) -> Path:
    tag = (path / LATEST).read_text().strip()
    tag_dir = path / tag
    if not tag or not tag_dir.is_dir():
        raise SpecError("SRC", f"{path / LATEST} names {tag!r}, which is not a directory beside it")
    if not (path / CONFIG).is_file():
        raise SpecError("SRC", f"{path} holds a DeepSpeed checkpoint but no {CONFIG} (the model's shape) beside it")
    return tag_dir


def _ranks(tag_dir: Path, states: dict[str, Any]) -> int:
    """The data-parallel world size, every rank's optimizer file present, one model-parallel rank."""
    world, mp = int(states.get("dp_world_size") or 0), int(states.get("mp_world_size") or 1)
    if mp != 1:
        raise SpecError(
            "SRC", f"{tag_dir}: mp_world_size={mp}: DeepSpeed tensor/pipeline-parallel checkpoints are not read"
        )
    found = {int(m.group(1)) for p in tag_dir.iterdir() if (m := OPTIM.match(p.name))}
    missing = sorted(set(range(world)) - found)
    if world < 1 or missing:
        raise SpecError(
            "SRC",
            f"{tag_dir}: the optimizer states of rank {missing[0] if missing else 0} are missing "
            f"(an incomplete checkpoint of {world} ranks)",
        )
    if _stage(tag_dir) == 3:  # ZeRO-3 also writes one model-states file per rank
        absent = [r for r in range(world) if not (tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt").is_file()]
        if absent:
            raise SpecError("SRC", f"{tag_dir}: the model states of rank {absent[0]} are missing")
    return world


def inspect(path: Path, trusted: bool = False) -> dict[str, Any]:
    """Everything checked before anything is written (SpecError naming SRC): the tag directory, every
    rank's file, and the parameter names and shapes DeepSpeed recorded against config.json. Every
    pickle ds_to_universal will read is checked first (parabench.untrusted) unless ``trusted``."""
    tag_dir = _tag_dir(path)
    states_file = next((tag_dir / n for n in MODEL_STATES if (tag_dir / n).is_file()), None)
    if states_file is None:
        raise SpecError("SRC", f"{tag_dir}: no {' or '.join(MODEL_STATES)} (an incomplete DeepSpeed checkpoint)")
    untrusted.check_checkpoint(tag_dir, trusted=trusted)
    states = _load(states_file, trusted)
    world = _ranks(tag_dir, states)
    try:
        spec = model_spec(spec_fields({"path": str(path / CONFIG), "load_weights": False}))
    except SpecError as exc:
        raise SpecError("SRC", exc.message) from None
    recorded = {n: tuple(s) for group in states.get("param_shapes") or [] for n, s in group.items()}
    shapes = spec.parameter_shapes()
    for name, shape in shapes.items():
        if recorded.get(name) != shape:
            got = f"shape {list(recorded[name])}" if name in recorded else "no such parameter"
            raise SpecError("SRC", f"{name}: the DeepSpeed checkpoint has {got}; {CONFIG} gives {list(shape)}")
    extra = sorted(n for n in recorded if n not in shapes and not ignored(n, spec))
    if extra:
        raise SpecError("SRC", f"the DeepSpeed checkpoint holds {extra[0]}, which the canonical model does not have")
    version = states.get("ds_version")
    stage = _stage(tag_dir)
    return {
        "spec": spec,
        "tag_dir": tag_dir,
        "world_size": world,
        "ds_version": version,
        "stage": stage,
        "trusted": trusted,
    }


def _stage(tag_dir: Path) -> int:
    return 3 if any(tag_dir.glob("zero_pp_rank_*_model_states.pt")) else 1  # ZeRO 1/2 read alike


def _step(tag_dir: Path, trusted: bool) -> int:
    """AdamW's step counter, from rank 0's optimizer file (torch's AdamW keeps it per flat group)."""
    rank0 = next(p for p in sorted(tag_dir.iterdir()) if (m := OPTIM.match(p.name)) and m.group(1) == "0")
    optim = _load(rank0, trusted)
    outer = optim["optimizer_state_dict"]
    base = outer.get("optimizer_state_dict") or outer.get("base_optimizer_state")  # ZeRO-3 / ZeRO 1-2
    groups = base["state"] if isinstance(base, dict) else base  # ZeRO 1-2 keep a list of group states
    steps = {int(float(s["step"])) for s in (groups.values() if isinstance(groups, dict) else groups)}
    if len(steps) != 1:
        raise RunFailed(f"{tag_dir}: AdamW step counts differ between parameter groups: {sorted(steps)}")
    return steps.pop()


def read(meta: dict[str, Any], work: Path):
    """The canonical state (parabench.canonical.CanonicalState) of the checkpoint ``inspect`` checked,
    through ds_to_universal into ``work/universal/``; its log in ``work/logs/``."""

    tag_dir, out = meta["tag_dir"], work / "universal" / meta["tag_dir"].name
    cmd = [sys.executable, *UNIVERSAL, "--input_folder", str(tag_dir), "--output_folder", str(out)]
    cmd += ["--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
    rc, _ = supervise(Launch.program(cmd, work))  # its output: work/logs/launcher.log
    if rc != 0:
        raise RunFailed(f"DeepSpeed's ds_to_universal failed (exit code {rc}); log in {work / 'logs' / 'launcher.log'}")
    zero, shapes = out / "zero", meta["spec"].parameter_shapes()

    def value(name: str, state: str):
        # ZeRO 1/2: {"param": tensor, ...} (merge_tp_slices); ZeRO-3: the flat tensor (merge_zero3_slices)
        saved = _load(zero / name / f"{state}.pt", meta["trusted"])
        flat = saved["param"] if isinstance(saved, dict) else saved
        if flat.numel() != math.prod(shapes[name]):
            raise RunFailed(f"{zero / name / state}.pt: {flat.numel()} values, {name} has shape {list(shapes[name])}")
        return flat.float().reshape(shapes[name]).contiguous()

    weights = Lazy(shapes, lambda n: value(n, "fp32"))  # one file read at a time, as canonical.write reaches it
    moments = {key: Lazy(shapes, lambda n, key=key: value(n, key)) for key in MOMENTS}
    return CanonicalState(weights, moments, _step(tag_dir, meta["trusted"]))
