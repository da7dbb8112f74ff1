"""``bench plan``: which backend and layout for a model on a cluster, predicted and explained.

    bench plan +model=llama3-70b cluster=h100-sxm plan.devices=64 data.global_batch_size=512 \
        data.seq_len=4096 run.precision=bf16 [plan.backends=[megatron,fsdp]] [plan.top=5] \
        [plan.micro_batch_sizes=[1,2]] [plan.calibration=EXPERIMENT] [--format table|md|json|csv] \
        [--emit-bundle DIR [--row K]]
    bench plan --calibrate EXPERIMENT [--tracking-uri URI]

Every other ``key=value`` is a job override, composed by Hydra exactly as ``bench run`` composes it
(``+model=hf model.path=/path/to/config.json`` works too).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from parabench.errors import SpecError, UserError
from parabench.plan import calibrate
from parabench.plan.cluster import Cluster, available, load, peak
from parabench.plan.estimate import DEFAULT_UNCERTAINTY, Calibration, Estimate
from parabench.plan.gemms import CURVES
from parabench.plan.render import render
from parabench.plan.search import Searched, backend_defaults, describe, emit_bundle, search
from parabench.runnames import plan_experiment, stamp
from parabench.spec import TrackingSpec, build, check_precision
from parabench.tracking import store as trackstore
from parabench.tracking.runs import JobRun

GIB = 1024**3
PLAN_KEYS = {"backends", "top", "devices", "nodes", "micro_batch_sizes", "calibration"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench plan", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("overrides", nargs="*", help="+model=NAME cluster=NAME plan.KEY=VALUE and job overrides")
    p.add_argument("--format", choices=["table", "md", "json", "csv"], default="table")
    p.add_argument("--emit-bundle", metavar="DIR", help="write the dry-run launch bundle of a ranked row here")
    p.add_argument("--row", type=int, default=1, metavar="K", help="the row --emit-bundle writes (default 1)")
    p.add_argument("--calibrate", metavar="EXPERIMENT", help="fit efficiency and overhead from recorded runs")
    p.add_argument("--tracking-uri", help="MLflow store to read (--calibrate); default: results/mlflow.db")
    return p


def _split(overrides: list[str]) -> tuple[str | None, dict[str, str], list[str]]:
    cluster, plan, job = None, {}, []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "cluster":
            cluster = value
        elif key.startswith("plan."):
            if key[5:] not in PLAN_KEYS:
                raise SpecError(key, f"unknown plan key (valid: {', '.join(sorted(PLAN_KEYS))})")
            plan[key[5:]] = value
        else:
            job.append(o)
    return cluster, plan, job


def _int(plan: dict[str, str], key: str, default: int) -> int:
    try:
        value = int(plan.get(key, default))
    except ValueError:
        raise SpecError(f"plan.{key}", f"expected an integer, got {plan[key]!r}") from None
    if value < 1:
        raise SpecError(f"plan.{key}", f"must be >= 1, got {value}")
    return value


def _list(text: str | None) -> list[str]:
    return [v.strip() for v in (text or "").strip("[]").split(",") if v.strip()]


def _world(cluster: Cluster, plan: dict[str, str]) -> int:
    if "devices" in plan:
        world = _int(plan, "devices", 1)
        per = cluster.devices_per_node
        if world > per and world % per:
            raise SpecError("plan.devices", f"{world} devices do not fill whole nodes of {per} ({cluster.name})")
        return world
    return _int(plan, "nodes", 1) * cluster.devices_per_node


def _calibration(plan: dict[str, str], tracking_uri: str | None) -> Calibration:
    name = plan.get("calibration")
    if not name:
        return Calibration()
    return calibrate.load(name, tracking_uri)


def run_plan(args: argparse.Namespace) -> int:
    cluster_name, plan, job_overrides = _split(args.overrides)
    if not cluster_name:
        raise SpecError("cluster", f"no cluster chosen: add cluster=NAME (available: {', '.join(available())})")
    cluster = load(cluster_name)
    world = _world(cluster, plan)
    backends = _list(plan.get("backends")) or ["ddp", "fsdp", "deepspeed", "megatron"]
    base = backend_defaults(backends, job_overrides)
    first = next(iter(base.values()))
    if not first.get("model"):
        raise SpecError("model", "no model chosen: add +model=NAME or +model=hf model.path=/path/to/config.json")
    mbs = [int(v) for v in _list(plan.get("micro_batch_sizes"))] or _micro_batches(first)
    check_precision(first["run"])  # before the peak lookup and the search, which would blame the batch
    precision = first["run"]["precision"]
    pk = peak(cluster, precision, Path(first["run"]["results_dir"]) / ".cache")
    cal = _calibration(plan, args.tracking_uri)
    found = search(base, cluster, world, mbs, pk.tflops if pk else None, cal)
    _refuse_if_empty(found, first)
    top = _int(plan, "top", 5)
    shown = min(top, len(found.ranked))
    if args.emit_bundle and not 1 <= args.row <= shown:
        raise SpecError("--row", f"row {args.row} is not one of the {shown} ranked rows this plan shows (1-{shown})")
    model = found.ranked[0].job.model.name  # resolved (+model=hf reads it from config.json)
    context = {**_context(cluster, world, first, pk, cal), "model": model, "job_overrides": " ".join(job_overrides)}
    print(render(found, top, context, args.format))
    _track(first, found, top, context)
    if args.emit_bundle:
        chosen = found.ranked[args.row - 1]
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the plan (json/csv)
            out = emit_bundle(found.plains[id(chosen)], Path(args.emit_bundle))
        print(f"plan: launch bundle of row {args.row} written under {out}", file=sys.stderr)
    return 0


def _micro_batches(first: dict[str, Any]) -> list[int]:
    gbs = int(first["data"]["global_batch_size"])
    return [b for b in (1, 2, 4, 8, 16) if b <= gbs]


def _refuse_if_empty(found: Searched, first: dict[str, Any]) -> None:
    if found.ranked:
        return
    if found.unfit:
        best = found.unfit[0]
        if best.margin_bytes < 0:
            raise UserError(
                f"fits nowhere: the best candidate ({describe(best)}) needs {best.device_bytes / GIB:.2f} GiB per "
                f"device, {-best.margin_bytes / GIB:.2f} GiB more than the {best.memory_bytes / GIB:.2f} GiB it has"
            )
        raise UserError(
            f"fits nowhere: the best candidate ({describe(best)}) fits the device only by offloading "
            f"{best.host_bytes / GIB:.2f} GiB per device to host memory, {-best.host_margin_bytes / GIB:.2f} GiB "
            f"more than the {best.host_capacity_bytes / GIB:.2f} GiB of host memory per device"
        )
    if len(found.refusals) == 1:  # one key refused every layout: its own line, unless it is the batch's
        ((key, line),) = found.refusals.items()
        if not key.startswith("data."):
            raise UserError(line)
    reasons = "; ".join(f"{k} ({n} layouts)" for k, n in sorted(found.invalid.items(), key=lambda kv: -kv[1]))
    gbs = first["data"]["global_batch_size"]
    raise SpecError(
        "data.global_batch_size", f"no layout accepts a global batch of {gbs} on these devices: refused by {reasons}"
    )


def _context(cluster: Cluster, world: int, first: dict[str, Any], pk: Any, cal: Calibration) -> dict[str, Any]:
    cal_text = (
        f"calibration {cal.name} ({cal.runs} runs; fit error: step time {100 * (cal.time_error or 0):.0f}%, "
        f"memory {100 * (cal.memory_error or 0):.0f}%)"
        if cal.runs
        else f"no calibration: default efficiencies and overheads, step times uncertain by about "
        f"+-{100 * DEFAULT_UNCERTAINTY:.0f}% (bench plan --calibrate EXPERIMENT)"
    )
    if not cal.runs and cluster.device_kind in CURVES:  # compute from the GEMM shapes (docs/plan.md)
        cal_text = (
            f"compute from the step's GEMM shapes, {cluster.device_kind} curve fitted on published runs "
            f"({CURVES[cluster.device_kind].fitted_on}; its error: docs/plan.md, Published runs); "
            "memory overheads uncalibrated (bench plan --calibrate EXPERIMENT)"
        )
    return {
        "model": first["model"].get("name"),
        "cluster": cluster.name,
        "devices": world,
        "device_memory_gib": cluster.memory_bytes / GIB,
        "global_batch_size": first["data"]["global_batch_size"],
        "seq_len": first["data"]["seq_len"],
        "precision": first["run"]["precision"],
        "peak_tflops": pk.tflops if pk else None,
        "peak_source": pk.source if pk else "unknown peak: no MFU, no step time",
        "calibration": cal_text,
        "uncertain": sorted(set(cluster.uncertain_values() + (["peak"] if pk and pk.uncertain else []))),
    }


def _track(first: dict[str, Any], found: Searched, top: int, context: dict[str, Any]) -> None:
    """The plan as an MLflow run in ``<experiment>-plan``, named with the model, cluster, devices and
    UTC time (two plans differ): context as params, the table as artifacts."""
    tracking = build(TrackingSpec, first.get("tracking"), "tracking")
    if not tracking.enabled:
        return
    name = f"plan-{context['model']}-{context['cluster']}x{context['devices']}-{stamp()}"
    results_dir = first["run"]["results_dir"]
    # the plan's files (and the tracking spool, for bench sync if the store fails) stay under results/plans/
    root = Path(results_dir) / "plans" / f"{name}-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    (root / "plan.md").write_text(render(found, top, context, "md"))
    (root / "plan.json").write_text(render(found, top, context, "json"))
    run = JobRun(
        dataclasses.replace(tracking, experiment=plan_experiment(tracking.experiment)), results_dir, run_dir=root
    )
    tags = {"parabench.kind": "plan", "model": context["model"], "cluster": context["cluster"]}
    run.start(name, _params(context), tags)
    run.log_artifacts([root / "plan.md", root / "plan.json"], root)
    best: Estimate = found.ranked[0]
    run.log_metrics(
        [
            ("predicted_tokens_per_s_per_device", best.tokens_per_s_per_device, 0),
            ("predicted_step_time_s", best.step_s, 0),
            ("predicted_device_bytes", best.device_bytes, 0),
        ]
    )
    run.end("FINISHED")


def _params(context: dict[str, Any]) -> dict[str, str]:
    return {f"plan.{k}": json.dumps(v) if isinstance(v, list) else str(v) for k, v in context.items()}


def main(argv: list[str]) -> int:
    try:
        args = _parser().parse_intermixed_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:  # a login in a URI goes to MLflow's variables: no message (MLflow's quote the URL) or file holds it
        args.overrides = trackstore.overrides_without_credentials(args.overrides, os.environ)
        if args.tracking_uri:
            args.tracking_uri = trackstore.credentials_to_env(args.tracking_uri, os.environ)
            trackstore.check(
                TrackingSpec(uri=args.tracking_uri, experiment=args.calibrate or "Default"), key="--tracking-uri"
            )
        if args.calibrate:
            print(calibrate.describe(calibrate.fit(args.calibrate, args.tracking_uri)))
            return 0
        return run_plan(args)
    except UserError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return exc.exit_code
