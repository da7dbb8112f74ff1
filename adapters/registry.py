"""Backend name -> adapter class, imported lazily so that listing backends imports no framework.

A backend of parabench: one line in ``_BUILTIN`` (and ``conf/backend/<name>.yaml``; a test checks
the two agree). A backend of another installed package: an entry point of group
``parabench.backends`` (``toy = "toy_backend:ToyAdapter"`` under ``[project.entry-points."parabench.backends"]``),
its ``backend/<name>.yaml`` on Hydra's search path (a ``hydra_plugins`` SearchPathPlugin), and its
adapter's declarations; tests/data/toy_backend is one (tests/test_cli.py).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

from parabench.errors import SpecError

if TYPE_CHECKING:  # pragma: no cover
    from parabench.adapters.base import Adapter, Capabilities
    from parabench.adapters.profile import Profile
    from parabench.collectives import Stack

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
ENTRY_POINTS = "parabench.backends"


def _registered() -> dict[str, tuple[str, str]]:
    """The built-in backends and those installed packages declare as entry points (target, description;
    a plugin's description is its adapter's docstring, read when listed). A plugin may not take a
    built-in's name."""
    found = dict(_BUILTIN)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        if ep.name in found:
            raise SpecError(
                "backend",
                f"entry point {ep.name} = {ep.value} ({ENTRY_POINTS}) takes the name of backend {ep.name} "
                f"({found[ep.name][0]}); rename the plugin's backend",
            )
        found[ep.name] = (ep.value, "")
    return found


def names() -> list[str]:
    return sorted(_registered())


def describe() -> dict[str, str]:
    found = _registered()
    return {n: found[n][1] or _docstring_line(found[n][0]) for n in sorted(found)}


def _docstring_line(target: str) -> str:
    doc = (_load(target).__doc__ or "").strip()
    return doc.splitlines()[0] if doc else target


def import_target(target: str) -> Any:
    """The object a ``"module:name"`` target names (an adapter class, a backend's worker-side class),
    its module imported now."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _load(target: str) -> type[Adapter]:
    adapter: type[Adapter] = import_target(target)
    return adapter


def get_adapter(name: str) -> type[Adapter]:
    found = _BUILTIN if name in _BUILTIN else _registered()
    if name not in found:
        raise SpecError("backend", f"unknown backend {name!r} (choices: {', '.join(names())})")
    return _load(found[name][0])


# The facts the commands read of every backend, by name. Nothing outside this module and the job's
# composition (parabench.jobs, which hands the job its adapter) looks an adapter up by name
# (tests/test_architecture.py checks it).
def adapters() -> dict[str, type[Adapter]]:
    """Every registered backend's adapter class, by name (declarative: imports no framework)."""
    return {name: get_adapter(name) for name in names()}


def plan_profiles() -> dict[str, Profile]:
    """The plan profile of every backend that declares one (``Adapter.plan_profile``), by name."""
    return {name: a.plan_profile for name, a in adapters().items() if a.plan_profile is not None}


def comm_stacks() -> dict[str, Stack]:
    """The stack ``bench comm`` drives of every backend that declares one (``Adapter.comm_stack``), by name."""
    return {name: a.comm_stack for name, a in adapters().items() if a.comm_stack is not None}


def capabilities(name: str) -> Capabilities:
    """What backend ``name`` declares it supports, for a backend known only by a recorded name (a
    checkpoint's identity); a composed job reads ``job.backend.adapter.capabilities``."""
    return get_adapter(name).capabilities
