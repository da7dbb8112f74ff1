"""Every backend x layout x micro-batch size the harness accepts, estimated and ranked.

A candidate is a plain job config (the user's composed config with the backend's options and the
cluster's placement set), validated by exactly what ``bench run`` validates (``jobs.prepare``
with ``launcher.dry_run``: the spec checks, the backend's ``parallel_dims`` and ``validate``), so a
row the plan shows is a row ``bench run`` accepts, and its overrides are printed with it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parabench import rundir
from parabench.adapters.profile import Profile
from parabench.adapters.registry import plan_profiles
from parabench.errors import SpecError, UserError
from parabench.hf import spec_fields
from parabench.hydraconfig import compose, to_plain
from parabench.jobs import prepare
from parabench.plan.cluster import Cluster
from parabench.plan.estimate import Calibration, Estimate, Features, estimate, plan_profile

GIB = 1024**3


@dataclass
class Searched:
    ranked: list[Estimate] = field(default_factory=list)  # fit, best first
    unfit: list[Estimate] = field(default_factory=list)  # valid but over the device memory, least over first
    invalid: dict[str, int] = field(default_factory=dict)  # reason -> how many layouts it rejected
    refusals: dict[str, str] = field(default_factory=dict)  # reason -> the first refusal's whole line
    overrides: dict[int, list[str]] = field(default_factory=dict)  # id(estimate) -> bench run overrides
    plains: dict[int, dict[str, Any]] = field(default_factory=dict)


def plannable() -> dict[str, Profile]:
    """Every registered backend whose adapter declares a plan profile, by name."""
    return plan_profiles()


def backend_defaults(backends: list[str], user: list[str]) -> dict[str, dict[str, Any]]:
    """Each backend's composed config group (its name and option defaults)."""
    out, profiles = {}, plannable()
    for name in backends:
        if name not in profiles:
            raise SpecError("plan.backends", f"unknown backend {name!r} (plannable: {', '.join(profiles)})")
        out[name] = to_plain(compose([*user, f"backend={name}"]))
    return out


def candidates(base: dict[str, dict[str, Any]], cluster: Cluster, world: int, mbs: list[int]):
    """(plain config, bench run overrides) for every layout of every backend (not yet validated)."""
    per_node = min(world, cluster.devices_per_node)
    nnodes = world // per_node
    place = [f"device={cluster.device_kind}", f"launcher.nproc_per_node={per_node}"]
    if nnodes > 1:
        place += [f"launcher.nnodes={nnodes}", "launcher.master_port=29500"]
    profiles = plannable()
    for name, plain in base.items():
        experts = _routed_experts(plain["model"])
        for options in _with_experts(name, profiles.get(name), world, cluster, experts):
            for b in mbs:
                cfg = copy.deepcopy(plain)
                cfg["backend"].update(options)
                cfg["data"]["micro_batch_size"] = b
                cfg["device"]["type"] = cluster.device_kind
                cfg["launcher"].update(nproc_per_node=per_node, nnodes=nnodes, dry_run=True)
                if nnodes > 1:
                    cfg["launcher"]["master_port"] = 29500
                changed = [f"backend.{k}={_yaml(v)}" for k, v in options.items() if plain["backend"].get(k) != v]
                yield cfg, [f"backend={name}", *changed, f"data.micro_batch_size={b}", *place]


def _routed_experts(node: dict[str, Any]) -> int:
    """The model's routed experts per layer (0: dense), ``+model=hf`` read from its config.json."""
    fields = spec_fields(node) if "path" in node else node
    return int(fields.get("num_local_experts") or 0)


def _with_experts(name: str, prof: Profile | None, world: int, cluster: Cluster, experts: int):
    """The profile's layouts, each with every expert-parallel size it tries for a model of ``experts``
    routed experts (none: the layout alone)."""
    if prof is None:  # backend_defaults admits plannable backends only
        raise SpecError("plan.backends", f"backend {name!r} declares no plan profile")
    for options in prof.layouts(world, cluster.devices_per_node, cluster.host_link is not None):
        for extra in prof.experts(options, world, experts):
            yield {**options, **extra}


def _yaml(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def search(
    base: dict[str, dict[str, Any]],
    cluster: Cluster,
    world: int,
    mbs: list[int],
    peak: float | None,
    cal: Calibration,
    features: Features | None = None,
) -> Searched:
    """``features``: what the stack does beyond the harness's options, for every candidate (published runs).
    A layout that does not fit is tried again with each of its profile's ``recompute_options``, cheapest
    first, until one fits (a layout that fits without recompute is only slower with it)."""
    out = Searched()
    for cfg, overrides in candidates(base, cluster, world, mbs):
        est = _admit(out, cfg, overrides, cluster, peak, cal, features)
        if est is None or est.fits or (features and features.recompute):
            continue
        for extra in plan_profile(est.job).recompute_options:
            variant = copy.deepcopy(cfg)
            variant["backend"].update(extra)
            more = [f"backend.{k}={_yaml(v)}" for k, v in extra.items()]
            again = _admit(out, variant, [overrides[0], *more, *overrides[1:]], cluster, peak, cal, features)
            if again is None or again.fits:
                break
    out.ranked.sort(key=lambda e: (-e.tokens_per_s_per_device, e.device_bytes))
    out.unfit.sort(key=lambda e: e.shortfall_bytes)
    return out


def _admit(
    out: Searched,
    cfg: dict[str, Any],
    overrides: list[str],
    cluster: Cluster,
    peak: float | None,
    cal: Calibration,
    features: Features | None,
) -> Estimate | None:
    """Validate one candidate as bench run would and estimate it into ``out``; None: refused (counted)."""
    try:
        job = prepare(cfg)
    except UserError as exc:
        reason = str(exc).split(":", 1)[0]  # the key that refused it
        out.invalid[reason] = out.invalid.get(reason, 0) + 1
        out.refusals.setdefault(reason, str(exc))
        return None
    est = estimate(job, cluster, peak, cal, features=features)
    out.overrides[id(est)] = overrides
    out.plains[id(est)] = cfg
    (out.ranked if est.fits else out.unfit).append(est)
    return est


def describe(e: Estimate) -> str:
    """A layout in a few words: backend and the options that matter."""
    o, name = e.job.backend.options, e.job.backend.name
    bits = [name]
    if name == "deepspeed":
        bits.append(f"zero{o.zero_stage}")
        bits += ["offload-opt"] if o.offload_optimizer != "none" else []
        bits += ["offload-param"] if o.offload_param != "none" else []
    if name == "fsdp":
        bits += [f"tp{o.tp}"] if o.tp > 1 else []
        bits += (["no-reshard"] if not o.reshard_after_forward else []) + (["cpu-offload"] if o.cpu_offload else [])
    if name in ("megatron", "mindspeed"):
        bits += (
            [f"tp{o.tp}"] + ([f"cp{o.cp}"] if o.cp > 1 else []) + [f"pp{o.pp}"] + ([f"v{o.vpp}"] if o.vpp > 1 else [])
        )
        bits += [f"ep{o.ep}"] if getattr(o, "ep", 1) > 1 else []
        bits += (["sp"] if o.sequence_parallel else []) + (["distopt"] if o.distributed_optimizer else [])
    if getattr(o, "activation_checkpointing", False) or getattr(o, "recompute_granularity", None) == "full":
        bits.append("recompute")
    if getattr(o, "recompute_granularity", None) == "selective":
        bits.append("recompute-selective")
    bits.append(f"dp{e.job.parallel.dp} mbs{e.job.data.micro_batch_size}")
    return " ".join(bits)


def why_wins(e: Estimate, best: Estimate) -> str:
    gib = e.margin_bytes / GIB
    if e is best:
        text = (
            f"fastest that fits ({gib:.1f} GiB spare); comm {100 * e.comm_share:.0f}% exposed, "
            f"bubble {100 * e.bubble_share:.0f}%"
        )
    else:
        slower = 1 - e.tokens_per_s_per_device / best.tokens_per_s_per_device
        if slower < 0.005:
            more = (e.device_bytes - best.device_bytes) / GIB
            text = f"as fast as #1 (within 0.5%), {more:+.2f} GiB memory per device"
        else:
            text = f"{100 * slower:.0f}% slower than #1: " + _cost(e, best)
    return text + "".join(
        f"; {note}" for note in (_ep_note(e), _cp_note(e), _offload_note(e), _overlap_note(e)) if note
    )


def _overlap_note(e: Estimate) -> str:
    """Each communication mechanism of the row and how much of it compute hides (estimate._overlap)."""
    parts = [f"{k} {_dur(e.overlap.hidden.get(k, 0.0))} of {_dur(v)}" for k, v in e.overlap.total.items() if v > 0]
    return "hidden: " + ", ".join(parts) if parts else ""


def _ep_note(e: Estimate) -> str:
    """What expert parallelism buys (the experts' states over ep) and costs (the exposed all-to-all)."""
    o, m = e.job.backend.options, e.job.model
    ep = getattr(o, "ep", 1)
    if not m.is_moe or ep <= 1:
        return ""
    group = "inside a node" if e.job.parallel.tp * ep <= e.job.launch.nproc_per_node else "across nodes"
    return (
        f"ep{ep}: {m.num_local_experts // ep} of {m.num_local_experts} experts per layer on each device "
        f"({e.states.expert_bytes / GIB:.1f} GiB of expert states), token all-to-all {e.comm.bus_bytes('ep') / 2**30:.2f} GiB "
        f"per step {group}, {_dur(e.overlap.total.get('ep all-to-all', 0.0))} exposed"
    )


def _cp_note(e: Estimate) -> str:
    """What context parallelism buys and costs in this row."""
    cp = getattr(e.job.backend.options, "cp", 1)
    if cp <= 1:
        return ""
    return (
        f"cp{cp}: activations / {cp}, ring K/V exchange {e.comm.bus_bytes('cp') / 2**20:.0f} MiB per step, "
        f"{_dur(e.cp_hidden_s)} of it hidden behind attention"
    )


def _offload_note(e: Estimate) -> str:
    """What offloading buys (the device memory it frees) and costs (host link, host optimizer step)."""
    if not e.host_bytes:
        return ""
    without = e.device_bytes + e.host_bytes
    fits = "would not fit" if without > e.memory_bytes else "would fit"
    return (
        f"offload keeps {e.host_bytes / GIB:.2f} GiB of states in host memory (without: {without / GIB:.2f} GiB, "
        f"{fits}); costs {_dur(e.host_step_s)} host optimizer step + {_dur(e.transfer_s)} host link, "
        f"{_dur(e.offload_s)} exposed"
    )


def _cost(e: Estimate, best: Estimate) -> str:
    """The component of the step time that grew most against the best row."""
    parts = {
        "compute (recompute or lower efficiency)": e.compute_s - best.compute_s,
        "framework work per micro-batch (calibrated)": e.framework_s - best.framework_s,
        "exposed communication": e.exposed_comm_s - best.exposed_comm_s,
        "pipeline bubble": e.bubble_s - best.bubble_s,
        "offload (host optimizer step and host link)": e.offload_s - best.offload_s,
    }
    what, delta = max(parts.items(), key=lambda kv: kv[1])
    share = {"exposed communication": e.comm_share, "pipeline bubble": e.bubble_share}.get(what)
    tail = f" ({100 * share:.0f}% of its step)" if share is not None else ""
    return f"+{_dur(delta)} {what}{tail}"


def _dur(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def why_lost(e: Estimate) -> str:
    if e.margin_bytes < 0:
        need, have = e.device_bytes / GIB, e.memory_bytes / GIB
        text = f"does not fit by {-e.margin_bytes / GIB:.2f} GiB (needs {need:.2f} of {have:.2f} GiB)"
    else:
        need, have = e.host_bytes / GIB, e.host_capacity_bytes / GIB
        text = (
            f"host memory does not fit by {-e.host_margin_bytes / GIB:.2f} GiB (offloaded states need {need:.2f} of "
            f"the {have:.2f} GiB of host memory per device)"
        )
    return text + "".join(
        f"; {note}" for note in (_ep_note(e), _cp_note(e), _offload_note(e), _overlap_note(e)) if note
    )


def emit_bundle(plain: dict[str, Any], out_dir: Path) -> Path:
    """The dry-run launch bundle of a row, written as ``bench run ... launcher.dry_run=true`` writes it."""
    job = prepare(plain)
    rundir.dry_run(job, plain, out_dir)
    return out_dir
