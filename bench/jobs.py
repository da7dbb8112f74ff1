"""Building a JobSpec: from the composed config (:func:`from_config`) or a run's ``spec.json``
(:func:`load_job`).

This sits above the adapters, because a job cannot be typed without its backend: the ``backend.*``
keys are the chosen adapter's ``Options`` dataclass, and the adapter splits the world into parallel
dimensions. A Hugging Face model (``+model=hf model.path=...``) is read here too, before launch
(:mod:`parabench.hf`). The dataclasses and the checks that need neither live in :mod:`parabench.spec`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from parabench.adapters.base import Adapter, check_capabilities
from parabench.adapters.registry import get_adapter
from parabench.errors import SpecError
from parabench.hf import check_weights, spec_fields
from parabench.hydraconfig import available_options
from parabench.launchers import slurm_placement
from parabench.resilience.checkpoint import plan_resume
from parabench.spec import (
    BackendSpec,
    DataSpec,
    DeviceSpec,
    FaultSpec,
    JobSpec,
    LaunchSpec,
    ModelSpec,
    OptimSpec,
    ParallelDims,
    RunSpec,
    TrackingSpec,
    build,
    check_precision,
    resolve_device,
    validate_common,
    validate_launch_words,
    validate_moe,
    validate_parallel,
    validate_resilience,
)
from parabench.tracking import store as trackstore

_TOP_LEVEL = {"model", "data", "optim", "device", "launcher", "run", "tracking", "backend", "experiment", "fault"}


def from_config(cfg: Mapping[str, Any]) -> JobSpec:
    """Convert a composed, resolved config (plain dict) into a JobSpec, validating everything
    that does not depend on this machine (the runner's ``prepare`` then resolves the device and
    runs the adapter's own checks)."""
    cfg = dict(cfg)
    if "model" not in cfg or cfg.get("model") is None:
        raise SpecError(
            "model", f"no model chosen: add +model=NAME (available: {', '.join(available_options('model'))})"
        )
    model = model_spec(cfg["model"])
    data = build(DataSpec, cfg.get("data"), "data")
    optim = build(OptimSpec, cfg.get("optim"), "optim")
    device = build(DeviceSpec, cfg.get("device"), "device")
    launch = build(LaunchSpec, cfg.get("launcher"), "launcher")
    check_precision(cfg.get("run"))
    run = build(RunSpec, cfg.get("run"), "run")
    tracking = build(TrackingSpec, cfg.get("tracking"), "tracking")
    fault = build(FaultSpec, cfg.get("fault"), "fault")

    backend = backend_spec(cfg.get("backend"))
    extra = sorted(set(cfg) - _TOP_LEVEL)
    if extra:
        raise SpecError(extra[0], "unknown top-level key")

    validate_common(model, data, optim, device, launch, run)
    validate_launch_words(launch)
    validate_moe(model)
    validate_resilience(run, launch, fault)
    parallel = backend.adapter.parallel_dims(backend.options, launch.world_size, model)
    validate_parallel(parallel, model, data)
    return JobSpec(
        model=model,
        data=data,
        optim=optim,
        device=device,
        launch=launch,
        run=run,
        tracking=tracking,
        backend=backend,
        parallel=parallel,
        experiment=cfg.get("experiment") if isinstance(cfg.get("experiment"), str) else None,
        fault=fault,
    )


def backend_spec(node: Mapping[str, Any] | None, default: str | None = None) -> BackendSpec:
    """The ``backend`` node of a composed config (``name`` and the ``backend.*`` options) as a
    BackendSpec that carries its adapter: with ``job_from_json``, the one place that looks a backend's
    adapter up by name (``bench run`` and ``bench comm`` compose through it)."""
    backend_node = dict(node or {})
    name = backend_node.pop("name", None) or default
    if not name:
        raise SpecError("backend", "no backend chosen: add backend=NAME")
    adapter = get_adapter(name)  # raises SpecError listing the choices
    return BackendSpec(name, build(adapter.Options, backend_node, "backend"), adapter)


def model_spec(node: Mapping[str, Any]) -> ModelSpec:
    """The model: a preset's fields, or (``+model=hf model.path=...``) a Hugging Face config.json read
    here, before launch; weights named by the spec are checked tensor by tensor against it."""
    if isinstance(node, Mapping) and "path" in node:
        node = spec_fields(node)
    model = build(ModelSpec, node, "model")
    if model.weights:
        check_weights(model)
    return model


def job_from_json(text: str) -> JobSpec:
    """The JobSpec that ``JobSpec.to_json`` wrote."""
    raw = json.loads(text)
    backend_raw = raw.pop("backend")
    adapter = get_adapter(backend_raw["name"])
    return JobSpec(
        model=build(ModelSpec, raw["model"], "model"),
        data=build(DataSpec, raw["data"], "data"),
        optim=build(OptimSpec, raw["optim"], "optim"),
        device=build(DeviceSpec, raw["device"], "device"),
        launch=build(LaunchSpec, raw["launch"], "launcher"),
        run=build(RunSpec, raw["run"], "run"),
        tracking=build(TrackingSpec, raw["tracking"], "tracking"),
        backend=BackendSpec(backend_raw["name"], build(adapter.Options, backend_raw["options"], "backend"), adapter),
        parallel=build(ParallelDims, raw["parallel"], "parallel"),
        experiment=raw.get("experiment"),
        fault=build(FaultSpec, raw.get("fault"), "fault"),
    )


def load_job(path: str | Path) -> JobSpec:
    """The JobSpec of a run directory's ``spec.json``."""
    return job_from_json(Path(path).read_text())


def usable_device(adapter: type[Adapter], kind: str, launch: LaunchSpec) -> Literal["cpu", "cuda", "npu"]:
    """The device kind a job runs on here (``auto``: cuda > npu > cpu, among what this backend
    supports and sees), or SpecError with ``bench env``'s reason why the backend or device cannot run."""
    available = adapter.availability()
    if not available.available:
        raise SpecError(
            "backend",
            f"{adapter.name} cannot run here: {available.reason} "
            "(launcher.dry_run=true writes the launch bundle without running)",
        )
    if kind == "auto":
        kind = next(
            (k for k in ("cuda", "npu") if k in adapter.capabilities.devices and adapter.device_presence(k).available),
            "cpu",
        )
    presence = adapter.device_presence(kind)
    if not presence.available:
        raise SpecError(
            "device",
            f"{kind} requested but not usable here: {presence.reason} "
            "(launcher.dry_run=true writes the launch bundle for a machine that has it)",
        )
    if launch.nnodes == 1 and kind != "cpu" and launch.nproc_per_node > presence.count:
        raise SpecError(
            "launcher.nproc_per_node", f"{launch.nproc_per_node} ranks but only {presence.count} {kind} device(s)"
        )
    return kind  # type: ignore[return-value]


def prepare(plain: dict[str, Any]) -> JobSpec:
    """The job of a composed config, checked as `bench run` checks it before anything starts: its
    fields, its data, its tracking store, its checkpoint keys or run.resume, the backend's capabilities
    and own validation, on the device it will run on here (a dry run: the device it names). Every
    command that builds a job to launch or plan (run, convert, plan's candidates) goes through it."""
    launcher = plain.get("launcher") or {}
    if launcher.get("slurm") and not launcher.get("dry_run"):
        plain = {**plain, "launcher": {**launcher, **_slurm_placement(launcher)}}
    job = from_config(plain)
    _check_data(job)
    # a bundle's server is reached from elsewhere; a server that does not answer: the run spools
    trackstore.check(job.tracking, probe=not job.launch.dry_run, unreachable_ok=job.tracking.on_unreachable == "spool")
    # checkpoint keys, the job's checkpoint folder (the first repeat's) or run.resume, before anything starts
    plan_resume(job, 0 if job.run.repeats > 1 else None)
    adapter = job.backend.adapter
    check_capabilities(adapter, job)
    if job.launch.dry_run:
        # A launch bundle is written for another machine: no local backend or device needed.
        job = resolve_device(job, _bundle_device(adapter, job.device.type))
        adapter.validate(job)
        return job
    job = resolve_device(job, usable_device(adapter, job.device.type, job.launch))
    check_capabilities(adapter, job)
    adapter.validate(job)
    return job


def _bundle_device(adapter: type[Adapter], asked: str) -> Literal["cpu", "cuda", "npu"]:
    """The device kind a launch bundle names: the one asked for, else (auto) the CPU where the backend
    runs on one, else its first kind."""
    devices = adapter.capabilities.devices
    kind = asked if asked != "auto" else ("cpu" if "cpu" in devices else sorted(devices)[0])
    kinds: dict[str, Literal["cpu", "cuda", "npu"]] = {"cpu": "cpu", "cuda": "cuda", "npu": "npu"}
    if kind not in kinds:
        raise SpecError("device.type", f"{kind!r} is not one of cpu, cuda, npu, auto")
    return kinds[kind]


def _slurm_placement(launcher: dict[str, Any]) -> dict[str, Any]:
    """This node's nnodes/node_rank/master_addr from the Slurm allocation (launcher.slurm=true)."""
    try:
        return slurm_placement(dict(os.environ))
    except RuntimeError as exc:
        raise SpecError("launcher.slurm", str(exc)) from None


def _check_data(job: JobSpec) -> None:
    """Data problems (missing/corrupt files, token ids outside the vocabulary) refused before launch."""
    from parabench.data import check_data

    check_data(job, Path(job.run.results_dir) / ".cache")
