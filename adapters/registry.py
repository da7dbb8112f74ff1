"""Backend name -> adapter class, imported lazily so that listing backends imports no framework.

Register a backend by adding one line to ``_BUILTIN`` (and ``conf/backend/<name>.yaml``; a test
checks the two agree).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from parabench.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from parabench.adapters.base import Adapter

# name -> ("module:Class", one-line description)
_BUILTIN: dict[str, tuple[str, str]] = {
    "ddp": ("parabench.adapters.ddp:DDPAdapter", "PyTorch DistributedDataParallel (replicated model states)"),
    "fsdp": (
        "parabench.adapters.fsdp:FSDPAdapter",
        "PyTorch FSDP2 fully_shard (sharded params, grads, optimizer states)",
    ),
    "deepspeed": (
        "parabench.adapters.deepspeed:DeepSpeedAdapter",
        "DeepSpeed ZeRO stage 0-3 with optional CPU offload of optimizer states / parameters",
    ),
    "megatron": (
        "parabench.adapters.megatron:MegatronAdapter",
        "Megatron-Core GPTModel: tensor/sequence/pipeline/data parallel, distributed optimizer",
    ),
    "mindspeed": (
        "parabench.adapters.mindspeed:MindSpeedAdapter",
        "Megatron-Core + MindSpeed on Ascend NPUs (torch_npu, HCCL)",
    ),
    "mindspore": (
        "parabench.adapters.mindspore:MindSporeAdapter",
        "Native MindSpore nn.Cell, data parallel over msrun (mccl on CPU, hccl on Ascend)",
    ),
}
_REGISTRY: dict[str, tuple[str, str]] = dict(_BUILTIN)


def register(name: str, target: str, description: str) -> None:
    """Add a backend (e.g. from a plugin). Names are unique."""
    if name in _REGISTRY:
        raise ValueError(f"backend {name!r} is already registered ({_REGISTRY[name][0]})")
    _REGISTRY[name] = (target, description)


def names() -> list[str]:
    return sorted(_REGISTRY)


def describe() -> dict[str, str]:
    return {n: _REGISTRY[n][1] for n in names()}


def get_adapter(name: str) -> type[Adapter]:
    try:
        target, _ = _REGISTRY[name]
    except KeyError:
        raise SpecError("backend", f"unknown backend {name!r} (choices: {', '.join(names())})") from None
    module, _, cls = target.partition(":")
    adapter: type[Adapter] = getattr(importlib.import_module(module), cls)
    return adapter
