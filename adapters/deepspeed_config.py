"""The DeepSpeed config of a job: the typed spec (+ the user's ``backend.config_file``) -> the dict
``deepspeed.initialize`` takes, pure, no deepspeed import (checked before launch by the adapter,
used by the engine); and the folder its JIT-built ops go to (``TORCH_EXTENSIONS_DIR``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Any

from parabench.errors import SpecError
from parabench.spec import JobSpec

KNOBS = {  # option -> path in the DeepSpeed config
    "reduce_bucket_size": ("zero_optimization", "reduce_bucket_size"),
    "allgather_bucket_size": ("zero_optimization", "allgather_bucket_size"),
    "overlap_comm": ("zero_optimization", "overlap_comm"),
    "contiguous_gradients": ("zero_optimization", "contiguous_gradients"),
    "stage3_prefetch_bucket_size": ("zero_optimization", "stage3_prefetch_bucket_size"),
    "stage3_param_persistence_threshold": ("zero_optimization", "stage3_param_persistence_threshold"),
    "stage3_max_live_parameters": ("zero_optimization", "stage3_max_live_parameters"),
    "stage3_max_reuse_distance": ("zero_optimization", "stage3_max_reuse_distance"),
}


def harness_config(job: JobSpec) -> tuple[dict[str, Any], dict[tuple[str, ...], tuple[Any, str]]]:
    """The config the spec implies, and the keys the harness owns: path -> (value, spec key)."""
    o, prec = job.backend.options, job.run.precision
    owned: dict[tuple[str, ...], tuple[Any, str]] = {
        ("train_batch_size",): (job.data.global_batch_size, "data.global_batch_size"),
        ("train_micro_batch_size_per_gpu",): (job.data.micro_batch_size, "data.micro_batch_size"),
        ("gradient_accumulation_steps",): (job.grad_accum, "data.global_batch_size / (micro_batch_size x ranks)"),
        ("gradient_clipping",): (job.optim.grad_clip, "optim.grad_clip"),
        ("bf16", "enabled"): (prec == "bf16", "run.precision"),
        ("fp16", "enabled"): (prec == "fp16", "run.precision"),
        ("zero_optimization", "stage"): (o.zero_stage, "backend.zero_stage"),
        ("zero_allow_untested_optimizer",): (True, "the client torch AdamW"),
    }
    if o.offload_optimizer != "none":
        owned[("zero_optimization", "offload_optimizer", "device")] = (o.offload_optimizer, "backend.offload_optimizer")
        owned[("zero_optimization", "offload_optimizer", "pin_memory")] = (
            o.offload_pin_memory,
            "backend.offload_pin_memory",
        )
        if o.offload_adam == "torch":
            owned[("zero_force_ds_cpu_optimizer",)] = (False, "backend.offload_adam=torch")
    if o.offload_param != "none":
        owned[("zero_optimization", "offload_param", "device")] = (o.offload_param, "backend.offload_param")
        owned[("zero_optimization", "offload_param", "pin_memory")] = (
            o.offload_pin_memory,
            "backend.offload_pin_memory",
        )
    for name, path in KNOBS.items():
        value = getattr(o, name)
        if value is not None:
            owned[path] = (value, f"backend.{name}")
    cfg: dict[str, Any] = {"steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}  # quiet; the harness times
    for path, (value, _) in owned.items():
        _set(cfg, path, value)
    return cfg, owned


def deepspeed_config(job: JobSpec) -> dict[str, Any]:
    """The effective DeepSpeed config: the harness's, merged with ``backend.config_file``."""
    cfg, owned = harness_config(job)
    path = job.backend.options.config_file
    if not path:
        return cfg
    user = _read_user_config(path)
    if "bfloat16" in user:  # DeepSpeed's old spelling of "bf16"
        if "bf16" in user:
            raise SpecError("backend.config_file", f"{path} sets both 'bf16' and its old name 'bfloat16'")
        user["bf16"] = user.pop("bfloat16")
    if _get(user, ("bf16", "enabled")) is True and _get(user, ("fp16", "enabled")) is True:
        raise SpecError("backend.config_file", f"{path} turns on both fp16 and bf16; choose one with run.precision")
    for block in ("optimizer", "scheduler"):
        if block in user:
            raise SpecError(
                "backend.config_file",
                f"{path} has an '{block}' block: every backend uses the harness's AdamW "
                "with a constant rate (optim.*); remove the block",
            )
    for path_, (value, key) in owned.items():
        theirs = _get(user, path_)
        if theirs is None or theirs == "auto":
            continue
        if theirs != value and not (
            isinstance(value, float) and isinstance(theirs, (int, float)) and float(theirs) == value
        ):
            dotted = ".".join(path_)
            raise SpecError(
                "backend.config_file",
                f"{path} sets {dotted}={json.dumps(theirs)} but {key} gives "
                f"{json.dumps(value)}; change it on the command line, not in the file",
            )
    merged = _merge(user, cfg)
    return merged


def _read_user_config(path: str) -> dict[str, Any]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise SpecError("backend.config_file", f"no such file: {path}")
    try:
        data = json.loads(p.read_text())
    except ValueError as exc:
        raise SpecError("backend.config_file", f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError("backend.config_file", f"{path} must hold a JSON object")
    return data


def _get(d: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _set(d: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


def _merge(base: dict, top: dict) -> dict:
    """Deep merge, ``top`` wins (after the conflict check, it only replaces equal values or "auto")."""
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def extensions_dir(job: JobSpec) -> str:
    """TORCH_EXTENSIONS_DIR of the JIT-built ops: backend.extensions_dir, else one folder per Python
    environment under ~/.cache/parabench/torch_extensions. The build command names the environment's
    include paths, so two environments sharing one folder rebuilt each other's ops on every run (ninja
    sees a changed command), and one could load an op built against another torch."""
    if job.backend.options.extensions_dir:
        return str(Path(job.backend.options.extensions_dir).expanduser())
    return str(Path.home() / ".cache" / "parabench" / "torch_extensions" / environment_key())


def environment_key() -> str:
    """This Python environment (its prefix, Python, torch and DeepSpeed versions) as a short folder name."""
    import hashlib
    import platform
    import sys

    versions = [importlib.metadata.version(d) if importlib.util.find_spec(m) else "-" for d, m in _BUILT_AGAINST]
    text = "|".join([sys.prefix, platform.python_version(), *versions])
    return f"py{sys.version_info.major}{sys.version_info.minor}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


_BUILT_AGAINST = (("torch", "torch"), ("deepspeed", "deepspeed"))  # (distribution, module) the ops compile against
