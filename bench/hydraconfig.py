"""Composition of the shipped Hydra config, outside of a Hydra app (pre-flight checks, listings).

``bench run`` composes every job of a command (all combinations of a ``-m`` sweep) here first and
converts each into a JobSpec, so that a bad value anywhere in a sweep is refused with one line and
exit 2 before any job starts or anything is written to MLflow.
"""

from __future__ import annotations

import itertools
from importlib import resources
from typing import Any

from parabench.errors import UserError
from parabench.spec import FaultSpec, RunSpec, to_dict

CONFIG_MODULE = "parabench.conf"
SPEC_DEFAULTS = "spec_defaults"  # the config node of register_spec_defaults, named in conf/config.yaml's defaults


def available_options(group: str) -> list[str]:
    root = resources.files(CONFIG_MODULE) / group
    try:
        return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    msg = text[0] if text else type(exc).__name__
    if "Could not override 'model'" in str(exc) or (
        "model" in str(exc) and "No match in the defaults list" in str(exc)
    ):
        return f"model is chosen with a plus sign: +model=NAME (available: {', '.join(available_options('model'))})"
    if "Could not find 'model/" in str(exc) or "In 'config': Could not find 'model" in str(exc):
        return f"{msg} (available models: {', '.join(available_options('model'))})"
    return msg


def register_resolvers() -> None:
    """Config arithmetic the shipped experiments use, e.g. weak scaling's global batch
    ``${mul:${data.micro_batch_size},${launcher.nproc_per_node}}``."""
    import math

    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("mul"):
        OmegaConf.register_new_resolver("mul", lambda *xs: math.prod(int(x) for x in xs))
    if not OmegaConf.has_resolver("slurm_gpus"):  # conf/hydra/launcher/slurm_torchrun.yaml: GPUs per node
        OmegaConf.register_new_resolver("slurm_gpus", lambda device, n: None if device in ("cpu", "npu") else int(n))


def register_spec_defaults() -> None:
    """Store the ``run.*`` and ``fault.*`` defaults, RunSpec's and FaultSpec's, as the config node
    conf/config.yaml's defaults list takes in: written once, in parabench.spec, yet every key is in the
    composed config (``run.steps=5`` needs no ``+``; ``--cfg job`` and the MLflow params list them)."""
    from hydra.core.config_store import ConfigStore

    node = {"run": to_dict(RunSpec()), "fault": to_dict(FaultSpec())}
    ConfigStore.instance().store(name=SPEC_DEFAULTS, node=node)


def compose(overrides: list[str], return_hydra_config: bool = False, config_name: str = "config"):
    """Compose the config (``config``: bench run, ``comm``: bench comm) with ``overrides``;
    Hydra/OmegaConf errors become one-line UserErrors."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_resolvers()
    register_spec_defaults()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            return hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=return_hydra_config)
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise UserError(f"config: {_short(exc)}") from None
    finally:
        GlobalHydra.instance().clear()


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """All combinations of a multirun command line (``backend=ddp,fsdp x=1,2`` -> 4 lists)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        raise UserError(f"overrides: {_short(exc)}") from None
    choices: list[list[str]] = []
    for ov in parsed:
        key = ov.get_key_element()
        if ov.is_sweep_override():
            choices.append([f"{key}={v}" for v in ov.sweep_string_iterator()])
        else:
            choices.append([ov.input_line])
    return [list(combo) for combo in itertools.product(*choices)] if choices else [[]]


def to_plain(cfg) -> dict[str, Any]:
    """Resolve a composed config (without the ``hydra`` node) into plain containers."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return {
            k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
            for k in cfg
            if k != "hydra"
        }
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", "") or ""
        raise UserError(f"{key or 'config'}: {_short(exc)}") from None
