"""Megatron checkpoints written by Megatron-LM itself, as a source of ``bench convert`` (docs/convert.md).

Megatron-LM's ``save_checkpoint`` with ``--ckpt-format torch_dist`` (its default) writes
``SAVE/latest_checkpointed_iteration.txt`` (the iteration, or ``release``) and ``SAVE/iter_{N:07d}/``
(or ``SAVE/release/``): a ``megatron.core.dist_checkpointing`` directory whose ``metadata.json`` names
the ``torch_dist`` backend, whose ``common.pt`` holds what is not a tensor (``args``, the argparse
namespace of the run; ``checkpoint_version`` 3.0; ``iteration``; the optimizer's param groups and
``common_step``), and whose PyTorch DCP files hold every ShardedTensor under its key at its global
shape: the model's (the decoder layers stacked on a leading axis, tensor-parallel shards put back
together) and the optimizer's, ``optimizer.state.exp_avg.<model key>`` (NVIDIA/Megatron-LM
``megatron/training/checkpointing.py``: ``save_checkpoint``, ``generate_state_dict``,
``get_checkpoint_name``; megatron-core ``dist_checkpointing/strategies/torch.py``; docs/sources.md#megatron-own-checkpoints).

With the distributed optimizer (``args.use_distributed_optimizer``) only its ``fully_reshardable``
format is read, which stores ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`` at the
parameters' global shapes; its default ``dp_reshardable`` keeps each data-parallel rank's flat buffers.

The tensors are read with ``torch.distributed.checkpoint`` at their global shapes, without a process
group; the model's shape comes from ``args``. Only ``common.pt`` needs megatron-core importable: the
pickled ``args`` refer to its enums.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

from parabench import untrusted
from parabench.canonical import MOMENTS, CanonicalState
from parabench.errors import SpecError
from parabench.jobs import model_spec

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
METADATA = "metadata.json"
VERSION = 3.0  # Megatron-LM's checkpoint_version since it saved the QKV per query group
STATE = "optimizer.state."
MAIN = STATE + "fp32_param."  # Float16OptimizerWithFloat16Params' fp32 main params (bf16 runs)
DISTOPT_MAIN = STATE + "param."  # the distributed optimizer's fp32 main params (fully_reshardable)
# The distributed optimizer's one format that stores each state at its parameter's global shape
# (megatron-core DistributedOptimizer.sharded_param_state_fully_reshardable); Megatron-LM records the
# format as content_metadata in common.pt (checkpointing.py _build_sharded_state_dict_metadata).
FULLY_RESHARDABLE = "fully_reshardable"
# (args field, value the canonical Llama needs): anything else changes the math and is refused by name.
REQUIRED = (
    ("normalization", "RMSNorm"),
    ("swiglu", True),
    ("position_embedding_type", "rope"),
    ("rotary_percent", 1.0),
    ("rotary_interleaved", False),
    ("add_bias_linear", False),
    ("add_qkv_bias", False),
    ("qk_layernorm", False),
    ("use_rope_scaling", False),
    ("multi_latent_attention", False),
    ("num_experts", None),
)
OPTIONAL_DEFAULTS = {"rotary_interleaved": False, "use_rope_scaling": False, "multi_latent_attention": False}


def is_checkpoint(path: Path) -> bool:
    """Megatron-LM's save directory (its tracker file) or one iteration of it, in either format."""
    iteration = _is_iteration(path) and ((path / METADATA).is_file() or any(path.glob("mp_rank_*")))
    return (path / TRACKER).is_file() or iteration


def is_legacy(path: Path) -> bool:
    """Saved with --ckpt-format torch (parabench.convert.megatron_legacy reads it): rank directories, no DCP metadata."""
    directory = iteration_dir(path)
    return not (directory / METADATA).is_file() and any(p.is_dir() for p in directory.glob("mp_rank_*"))


def _is_iteration(path: Path) -> bool:
    return bool(re.fullmatch(r"iter_\d{7}|release", path.name))


def iteration_dir(path: Path) -> Path:
    if _is_iteration(path):
        return path
    text = (path / TRACKER).read_text().strip()
    name = "release" if text == "release" else (f"iter_{int(text):07d}" if text.isdigit() else None)
    if name is None or not (path / name).is_dir():
        raise SpecError("SRC", f"{path / TRACKER} names {text!r}, which is not a checkpoint directory beside it")
    return path / name


def _check_format(directory: Path) -> None:
    if not (directory / METADATA).is_file():
        raise SpecError("SRC", f"{directory}: no {METADATA}, not a Megatron distributed checkpoint")
    backend = json.loads((directory / METADATA).read_text()).get("sharded_backend")
    if backend != "torch_dist":
        raise SpecError("SRC", f"{directory}: sharded_backend {backend!r}; only 'torch_dist' is read")


def _common(directory: Path, trusted: bool) -> dict[str, Any]:
    # Megatron-LM pickles its argparse namespace (and megatron-core enums): allowlisted
    # (parabench.untrusted); the enums import megatron-core, whose import-time notes (no Transformer
    # Engine/Apex) say nothing about reading a checkpoint
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            common = untrusted.load(directory / COMMON, trusted=trusted, map_location="cpu")
    except ModuleNotFoundError as exc:
        raise SpecError(
            "SRC", f"{directory / COMMON} needs {exc.name} to be read (pip install megatron-core)"
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise SpecError("SRC", f"{directory / COMMON}: unreadable ({exc})") from None
    if not isinstance(common, dict) or "args" not in common:
        raise SpecError(
            "SRC", f"{directory / COMMON} holds no Megatron-LM args (not a checkpoint its training loop wrote)"
        )
    version = common.get("checkpoint_version")
    if version != VERSION:
        raise SpecError("SRC", f"{directory}: checkpoint_version {version}; only {VERSION} is read")
    return common


def _arg(args: Any, name: str) -> Any:
    if not hasattr(args, name) and name not in OPTIONAL_DEFAULTS:
        raise SpecError("SRC", f"the checkpoint's args have no {name}")
    return getattr(args, name, OPTIONAL_DEFAULTS.get(name))


def spec_from_args(args: Any, name: str):
    """The canonical ModelSpec of Megatron-LM's arguments (megatron/training/arguments.py names)."""
    for field, needed in REQUIRED:
        value = _arg(args, field)
        if value != needed and not (needed is None and not value):
            raise SpecError("SRC", f"args.{field}={value!r}: the canonical Llama needs {needed!r}")
    if _arg(args, "fp16"):
        raise SpecError("SRC", "args.fp16=True: fp16 Megatron checkpoints are not read (untested; fp32 and bf16 are)")
    heads, hidden = _arg(args, "num_attention_heads"), _arg(args, "hidden_size")
    kv_channels = getattr(args, "kv_channels", None) or hidden // heads
    if kv_channels * heads != hidden:
        raise SpecError("SRC", f"args.kv_channels={kv_channels}: the canonical Llama needs hidden_size / heads")
    groups = _arg(args, "num_query_groups") if getattr(args, "group_query_attention", False) else heads
    fields = {
        "name": name,
        "hidden_size": hidden,
        "intermediate_size": _arg(args, "ffn_hidden_size"),
        "num_hidden_layers": _arg(args, "num_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "vocab_size": _arg(args, "padded_vocab_size"),
        "rope_theta": float(_arg(args, "rotary_base")),
        "rms_norm_eps": float(_arg(args, "norm_epsilon")),
        "tie_word_embeddings": not _arg(args, "untie_embeddings_and_output_weights"),
        "max_position_embeddings": _arg(args, "max_position_embeddings"),
        "initializer_range": float(getattr(args, "init_method_std", 0.02)),
    }
    try:
        return model_spec(fields)
    except SpecError as exc:
        raise SpecError("SRC", exc.message) from None


def megatron_shapes(spec, te_names: bool) -> dict[str, tuple[int, ...]]:
    """The model's ShardedTensor keys in a Megatron distributed checkpoint and their global shapes:
    the decoder layers stacked on a leading axis of num_layers (megatron-core ``TransformerBlock.
    sharded_state_dict``), QKV fused per query group, gate and up stacked in ``linear_fc1``."""
    from parabench.adapters.megatron_mapping import Layout, norm_names

    layers, h, d = spec.num_hidden_layers, spec.hidden_size, spec.head_dim
    qkv = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * d
    ln1, ln2 = norm_names(Layout(te_names=te_names))
    shapes = {
        "embedding.word_embeddings.weight": (spec.vocab_size, h),
        f"decoder.layers.{ln1}": (layers, h),
        "decoder.layers.self_attention.linear_qkv.weight": (layers, qkv, h),
        "decoder.layers.self_attention.linear_proj.weight": (layers, h, spec.num_attention_heads * d),
        f"decoder.layers.{ln2}": (layers, h),
        "decoder.layers.mlp.linear_fc1.weight": (layers, 2 * spec.intermediate_size, h),
        "decoder.layers.mlp.linear_fc2.weight": (layers, h, spec.intermediate_size),
        "decoder.final_layernorm.weight": (h,),
    }
    if not spec.tie_word_embeddings:
        shapes["output_layer.weight"] = (spec.vocab_size, h)
    return shapes


def _tensors(directory: Path, trusted: bool) -> dict[str, Any]:
    """Every tensor key of the DCP files -> its TensorStorageMetadata; every data file must be there."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = untrusted.dcp_metadata(directory, trusted=trusted)
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise SpecError("SRC", f"{directory}: unreadable DCP metadata ({exc})") from None
    files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    missing = [f for f in files if not (directory / f).is_file()]
    if missing:
        raise SpecError("SRC", f"{directory / missing[0]} is missing: an incomplete checkpoint of {len(files)} files")
    return {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}


def _steps(node: Any, key: str) -> list[float]:
    """Every ``key`` under the optimizer's common state: ``common_step`` (one per optimizer of a
    chain), or the distributed optimizer's ``step`` (one per param group, DistributedOptimizer.state_dict)."""
    if isinstance(node, dict):
        found = [float(node[key])] if node.get(key) is not None else []
        return found + [s for k, v in node.items() if k != key for s in _steps(v, key)]
    if isinstance(node, list | tuple):
        return [s for v in node for s in _steps(v, key)]
    return []


def _distopt_format(args: Any, common: dict, directory: Path) -> str | None:
    """The distributed optimizer's format (None without one); refused unless it is fully_reshardable."""
    if not getattr(args, "use_distributed_optimizer", False):
        return None
    found = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    if found != FULLY_RESHARDABLE:
        raise SpecError(
            "SRC",
            f"{directory}: args.use_distributed_optimizer=True saved as {found or 'fully_sharded_model_space'!r}, "
            f"which keeps each data-parallel rank's flat buffers: only {FULLY_RESHARDABLE!r} is read (re-save with "
            "Megatron-LM's --dist-ckpt-optim-fully-reshardable)",
        )
    return found


def _optimizer(
    tensors: dict[str, Any], wanted: dict[str, tuple[int, ...]], common: dict, where: Path, step_key: str
) -> int | None:
    """AdamW's step when the checkpoint carries both moments of every parameter, None when it carries
    no optimizer state (``--no-save-optim``); anything in between is refused."""
    keys = [f"{STATE}{m}.{k}" for m in MOMENTS for k in wanted]
    present = [k for k in keys if k in tensors]
    if not present:
        return None
    absent = [k for k in keys if k not in tensors]
    if absent:
        raise SpecError("SRC", f"{where}: {absent[0]} is missing (an incomplete optimizer state)")
    steps = set(_steps(common.get("optimizer"), step_key))
    if len(steps) != 1:
        raise SpecError("SRC", f"{where}: the optimizer's {step_key} is {sorted(steps) or 'absent'}, not one value")
    return int(steps.pop())


def inspect(path: Path, trusted: bool = False) -> dict[str, Any]:
    """Everything checked before anything is written (SpecError naming SRC): the tracker, the format
    and version, every pickle (parabench.untrusted, unless ``trusted``), the args against the
    canonical Llama, every file, tensor name and shape."""
    directory = iteration_dir(path)
    _check_format(directory)
    untrusted.check_checkpoint(directory, trusted=trusted)
    common = _common(directory, trusted)
    args = common["args"]
    spec = spec_from_args(args, name=(path if path != directory else path.parent).name)
    distopt = _distopt_format(args, common, directory)
    tensors = _tensors(directory, trusted)
    te_names = "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in tensors
    wanted = megatron_shapes(spec, te_names)
    for key, shape in wanted.items():
        got = tuple(tensors[key].size) if key in tensors else None
        if got != shape:
            has = f"shape {list(got)}" if got else "no such tensor"
            raise SpecError("SRC", f"{key}: the Megatron checkpoint has {has}; its args give {list(shape)}")
    step = _optimizer(tensors, wanted, common, directory, "step" if distopt else "common_step")
    # the fp32 main params: the distributed optimizer's always, else Float16Optimizer's under bf16
    main_prefix = DISTOPT_MAIN if distopt else MAIN
    main = [k for k in wanted if main_prefix + k in tensors]
    bf16 = bool(_arg(args, "bf16"))
    if (bf16 or distopt) and step is not None and len(main) != len(wanted):
        absent = next(k for k in wanted if main_prefix + k not in tensors)
        raise SpecError("SRC", f"{directory}: a checkpoint without {main_prefix}{absent} (the fp32 main params)")
    tied_copy = {"output_layer.weight"} if spec.tie_word_embeddings else set()
    extra = sorted(k for k in tensors if not k.startswith(STATE) and k not in wanted and k not in tied_copy)
    if extra:
        raise SpecError("SRC", f"the Megatron checkpoint holds {extra[0]}, which the canonical model does not have")
    return {
        "spec": spec,
        "directory": directory,
        "te_names": te_names,
        "step": step,
        "precision": "bf16" if bf16 else "fp32",
        "weights_from": main_prefix if main else "",  # the fp32 main params, not the bf16 weights
        "distributed_optimizer": distopt,
        "dtypes": {k: m.properties.dtype for k, m in tensors.items()},  # as stored; read() widens to fp32
        "iteration": common.get("iteration"),
        "tp": getattr(args, "tensor_model_parallel_size", 1),
        "pp": getattr(args, "pipeline_model_parallel_size", 1),
        "world_size": None,
        "trusted": trusted,
    }


def read(meta: dict[str, Any]) -> CanonicalState:
    """The canonical state of the checkpoint ``inspect`` checked: the global tensors through
    torch.distributed.checkpoint (no process group) in their stored dtype, widened to fp32 exactly,
    unstacked per layer and mapped as a tp=1, pp=1 Megatron model
    (parabench.adapters.megatron_mapping.from_megatron). The weights are the fp32 main params where the
    checkpoint has them (bf16). Without optimizer state: AdamW moments as a fresh AdamW starts them
    (zeros, step 0)."""
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp

    spec, directory = meta["spec"], meta["directory"]
    wanted = megatron_shapes(spec, meta["te_names"])
    prefixes = [meta["weights_from"]] + ([f"{STATE}{m}." for m in MOMENTS] if meta["step"] is not None else [])
    dtypes = meta["dtypes"]
    state = {p + k: torch.empty(shape, dtype=dtypes[p + k]) for p in prefixes for k, shape in wanted.items()}
    reader = untrusted.dcp_reader(directory, meta["trusted"])
    dcp.load(
        state, storage_reader=reader, planner=untrusted.dcp_planner(directory, meta["trusted"], "SRC"), no_dist=True
    )
    state = {k: v.float() for k, v in state.items()}
    weights = _canonical(state, meta["weights_from"], spec, meta["te_names"])
    if meta["step"] is None:
        moments = {m: {n: np.zeros_like(w) for n, w in weights.items()} for m in MOMENTS}
        return CanonicalState(weights, moments, 0)
    moments = {m: _canonical(state, f"{STATE}{m}.", spec, meta["te_names"]) for m in MOMENTS}
    return CanonicalState(weights, moments, meta["step"])


def _canonical(state: dict[str, Any], prefix: str, spec, te_names: bool) -> dict[str, Any]:
    from parabench.adapters.megatron_mapping import Layout, from_megatron

    flat: dict[str, Any] = {}
    for key in megatron_shapes(spec, te_names):
        value = state[prefix + key].numpy()
        if key.startswith("decoder.layers."):
            rest = key.removeprefix("decoder.layers.")
            flat.update({f"decoder.layers.{i}.{rest}": value[i] for i in range(spec.num_hidden_layers)})
        else:
            flat[key] = value
    return from_megatron([flat], spec, Layout(te_names=te_names), 0, 0)
