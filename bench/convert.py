"""``bench convert SRC --to TARGET [backend.*=...] --out DIR``: carry training state across stacks.

Through the canonical form (parabench.canonical, docs/convert.md), with each framework's own APIs:
the source backend is launched with the checkpoint's own job (read from its COMPLETE marker) to load
it and export the canonical full tensors; the target backend is launched with the target layout to
import them and save its native checkpoint, whose marker names the target job (``bench run ...
run.resume=DIR`` continues from it). TARGET is a backend, ``canonical`` (the canonical directory
only) or ``hf`` (config.json + model.safetensors a transformers LlamaForCausalLM reads).

Everything that can be refused is refused before anything is written: one line, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from parabench import canonical
from parabench.adapters.registry import get_adapter
from parabench.checkpoint import LAYOUT_KEYS, MARKER, CheckpointError, job_identity, newest_complete, read_marker
from parabench.confutil import compose, to_plain
from parabench.convertworker import REQUEST, RESULT
from parabench.errors import RunFailed, SpecError, UserError
from parabench.hf import SINGLE, hf_config
from parabench.jobs import model_spec
from parabench.launchers import get_launcher
from parabench.runner import free_port, launch_env, prepare
from parabench.spec import JobSpec, to_dict

ENTRY = ["-m", "parabench.convertworker"]
WORK = "convert"  # <out>/convert/{export,import}/: each launch's spec, request and logs
RECORD = "convert.json"
NON_BACKENDS = ("canonical", "hf")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench convert", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "src", help="a parabench checkpoint (step_N), a directory of them, a run directory, or a canonical dir"
    )
    p.add_argument("--to", required=True, help="target backend (ddp, fsdp, deepspeed, ...), canonical or hf")
    p.add_argument("--out", required=True, help="new directory for the converted checkpoint")
    p.add_argument("overrides", nargs="*", help="the target's layout and options, as bench run takes them")
    return p


# --------------------------------------------------------------------------------------------
# The source: what it is and the job that wrote it.
# --------------------------------------------------------------------------------------------
def _canonical_source(path: Path) -> tuple[str, Path, dict[str, Any]]:
    try:
        return "canonical", path, canonical.read_manifest(path)
    except ValueError as exc:
        raise SpecError("SRC", str(exc)) from None


def find_source(text: str) -> tuple[str, Path, dict[str, Any]]:
    """("native", step dir, marker) or ("canonical", dir, manifest): a canonical directory itself, else
    the native checkpoint (the newest complete one of a directory), else a conversion's canonical/."""
    path = Path(text).expanduser()
    if not path.is_dir():
        raise SpecError("SRC", f"no such checkpoint directory: {path}")
    if (path / canonical.MANIFEST).exists():
        return _canonical_source(path)
    try:
        if (path / MARKER).exists() or path.name.startswith("step_"):
            found = path, read_marker(path)
        else:
            found = newest_complete(path) or newest_complete(path / "checkpoints")
    except CheckpointError as exc:
        raise SpecError("SRC", str(exc)) from None
    if not found and (path / "canonical" / canonical.MANIFEST).exists():
        return _canonical_source(path / "canonical")
    if not found:
        raise SpecError("SRC", f"no complete parabench checkpoint in {path}")
    marker = found[1]
    job = marker.get("job")
    if (
        not isinstance(job, dict)
        or not {"backend", "model", "layout", "options"} <= set(job)
        or "world_size" not in marker
    ):
        raise SpecError("SRC", f"{found[0] / MARKER}: not a marker format this parabench reads (no job identity)")
    harness = [found[0] / "harness" / f"rank{r}.pt" for r in range(int(marker["world_size"]))]
    missing = [p for p in harness if not p.is_file()]
    if missing:
        raise SpecError("SRC", f"{missing[0]} is missing: an incomplete checkpoint of {len(harness)} ranks")
    return "native", found[0], marker


def _plain(backend: str, overrides: list[str]) -> dict[str, Any]:
    named = any(o.lstrip("+~").startswith("model=") for o in overrides)
    return to_plain(compose([*([] if named else ["+model=llama"]), f"backend={backend}", *overrides]))


def source_job(identity: dict[str, Any], world_size: int) -> JobSpec:
    """The job that wrote a checkpoint, rebuilt from its marker (backend, options, model, precision,
    world size): the export launches exactly that layout."""
    plain = _plain(identity["backend"], [])
    plain["backend"].update(identity["options"])
    plain["model"] = {"name": identity.get("model_name") or "model", **identity["model"]}
    plain["run"]["precision"] = identity["precision"]
    plain["launcher"]["nproc_per_node"] = world_size
    plain["tracking"] = {**plain.get("tracking", {}), "enabled": False}
    return prepare(plain)


def _given(overrides: list[str], key: str) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def target_job(name: str, overrides: list[str], identity: dict[str, Any], world_size: int) -> JobSpec:
    """The target job: the source's model and precision, the source's world size unless given, and
    the layout/options given as ``backend.*`` overrides; validated as bench run validates it."""
    model_overrides = [o for o in overrides if o.lstrip("+~").startswith("model")]
    plain = _plain(name, [o for o in overrides if o not in model_overrides])
    source_model = {"name": identity.get("model_name") or "model", **identity["model"]}
    if model_overrides:  # a model named for the target must be the checkpoint's
        asked = to_dict(prepare({**_plain(name, model_overrides), "tracking": {"enabled": False}}).model)
        for key, value in identity["model"].items():
            if asked.get(key) != value:
                raise SpecError(
                    f"model.{key}",
                    f"the checkpoint holds another model ({source_model['name']}: {key}={value}; asked: {asked.get(key)})",
                )
    plain["model"] = source_model
    if name == identity["backend"]:  # the same stack: the source's options unless given (a layout change)
        plain["backend"].update({k: v for k, v in identity["options"].items() if not _given(overrides, f"backend.{k}")})
    if not _given(overrides, "run.precision"):
        plain["run"]["precision"] = identity["precision"]
    if not _given(overrides, "launcher.nproc_per_node"):
        plain["launcher"]["nproc_per_node"] = world_size
    plain["tracking"] = {**plain.get("tracking", {}), "enabled": False}
    return prepare(plain)


def _check_convertible(job: JobSpec, role: str) -> None:
    support = get_adapter(job.backend.name).capabilities.convert
    for key in sorted(support.unsupported_options if support else ()):
        if getattr(job.backend.options, key):
            raise SpecError(
                f"backend.{key}", f"{job.backend.name} with {key}=true is not converted yet (docs/convert.md)"
            )
    if support is None:
        raise SpecError(
            "--to" if role == "target" else "SRC",
            f"backend {job.backend.name} has no canonical export/import yet (docs/convert.md)",
        )


def layout_text(identity: dict[str, Any]) -> str:
    support = get_adapter(identity["backend"]).capabilities.checkpoint
    fmt = support.format if support else "?"
    layout = " ".join(
        f"{k}={identity['layout'][k]}"
        for k in LAYOUT_KEYS
        if identity["layout"].get(k) not in (None, 1) or k == "world_size"
    )
    opts = " ".join(f"{k}={identity['options'].get(k)}" for k in sorted(support.options if support else ()))
    return f"{identity['backend']} ({fmt}; {layout}{' ' + opts if opts else ''}; {identity['precision']})"


# --------------------------------------------------------------------------------------------
# Launching one side.
# --------------------------------------------------------------------------------------------
def launch(job: JobSpec, run_dir: Path, request: dict[str, Any]) -> dict[str, Any]:
    """Run the convert workers of ``job`` through its backend's launcher; rank 0's result."""
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "spec.json").write_text(job.to_json())
    (run_dir / REQUEST).write_text(json.dumps(request, indent=1))
    for name, text in get_adapter(job.backend.name).bundle_files(job).items():
        (run_dir / name).write_text(text)
    launcher = get_launcher(get_adapter(job.backend.name).capabilities.launcher)
    cmd = launcher.command(job, job.launch.master_port or free_port(), str(run_dir), entry=ENTRY)
    with open(run_dir / "logs" / "launcher.log", "w") as log:
        try:
            rc = subprocess.run(
                cmd,
                env={**os.environ, **launch_env(job)},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=job.launch.setup_timeout_s,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    if rc != 0 or not (run_dir / RESULT).exists():
        raise RunFailed(f"{request['mode']} on {job.backend.name} failed (exit {rc}); logs in {run_dir / 'logs'}")
    return json.loads((run_dir / RESULT).read_text())


def write_hf(out: Path, canon: Path, job_model) -> dict[str, Any]:
    """config.json + model.safetensors under Hugging Face Llama names (the canonical names)."""
    (out / "config.json").write_text(json.dumps(hf_config(job_model), indent=1))
    shutil.copyfile(canon / canonical.WEIGHTS, out / SINGLE)
    return {"files": ["config.json", SINGLE]}


# --------------------------------------------------------------------------------------------
# The command.
# --------------------------------------------------------------------------------------------
def plan(args) -> dict[str, Any]:
    """Everything checked, nothing written: the two jobs and where things go."""
    kind, src, meta = find_source(args.src)
    if kind == "canonical":
        identity, world = meta["source"]["job"], int(meta["source"]["world_size"])
        sjob = None
    else:
        identity, world = meta["job"], int(meta["world_size"])
        sjob = source_job(identity, world)
        _check_convertible(sjob, "source")
    out = Path(args.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecError("--out", f"{out} exists and is not empty: choose a new directory")
    if args.to in NON_BACKENDS:
        if args.overrides:
            raise SpecError(args.overrides[0].split("=", 1)[0], f"--to {args.to} takes no overrides")
        tjob = None
    else:
        tjob = target_job(args.to, list(args.overrides), identity, world)
        _check_convertible(tjob, "target")
    return {
        "kind": kind,
        "src": src,
        "meta": meta,
        "identity": identity,
        "source_job": sjob,
        "target_job": tjob,
        "out": out,
    }


def _optimizer_line(p: dict[str, Any], manifest: dict[str, Any]) -> str:
    if not manifest["optimizer"]:
        return f"optimizer state: not included ({manifest.get('no_optimizer') or 'the source has none'})"
    if p["target_job"] is None:
        if p["args_to"] == "hf":
            return "optimizer state: not included in the hf export (transformers checkpoints hold weights only); kept in canonical/"
        return f"optimizer state: included (AdamW exp_avg, exp_avg_sq, step {manifest['step']})"
    why = get_adapter(p["target_job"].backend.name).capabilities.convert.optimizer
    return f"optimizer state: {'not included (' + why + ')' if why else 'included'} (AdamW exp_avg, exp_avg_sq, step {manifest['step']})"


def run(p: dict[str, Any]) -> dict[str, Any]:
    out, work = p["out"], p["out"] / WORK
    canon = out / "canonical"
    t0 = time.monotonic()
    if p["kind"] == "native":
        launch(p["source_job"], work / "export", {"mode": "export", "source": str(p["src"]), "canonical": str(canon)})
    else:
        shutil.copytree(p["src"], canon)
    manifest = canonical.read_manifest(canon)
    record = {
        "source": {
            "path": str(p["src"]),
            "format": p["kind"],
            "layout": layout_text(p["identity"]),
            "step": manifest["step"],
        },
        "tensors": manifest["tensors"],
        "bytes": manifest["bytes"],
        "checksum_before": manifest["checksum"],
        "optimizer": manifest["optimizer"],
    }
    tjob = p["target_job"]
    if tjob is not None:
        weights = str(canon / canonical.WEIGHTS)
        job = dataclasses.replace(tjob, model=dataclasses.replace(tjob.model, weights=weights))
        result = launch(job, work / "import", {"mode": "import", "canonical": str(canon), "out": str(out)})
        record.update(
            target={"format": "native", "layout": layout_text(job_identity(tjob)), "checkpoint": result["checkpoint"]}
        )
        record["checksum_after"] = result["checksum"]
    elif p["args_to"] == "hf":
        record.update(target={"format": "hf", **write_hf(out, canon, _model_spec(p["identity"]))})
        record["checksum_after"] = manifest["checksum"]
    else:
        record.update(target={"format": "canonical", "path": str(canon)})
        record["checksum_after"] = manifest["checksum"]
    record["optimizer_line"] = _optimizer_line(p, manifest)
    record["seconds"] = round(time.monotonic() - t0, 2)
    (out / RECORD).write_text(json.dumps(record, indent=1))
    return record


def _model_spec(identity: dict[str, Any]):
    return model_spec({"name": identity.get("model_name") or "model", **identity["model"]})


def report(record: dict[str, Any]) -> None:
    match = record["checksum_before"] == record["checksum_after"]
    lines = [
        f"bench convert: {record['source']['format']} {record['source']['layout']} step {record['source']['step']}",
        f"  -> {record['target']['format']} {record['target'].get('layout', '')}".rstrip(),
        f"  tensors converted: {record['tensors']} ({record['bytes'] / 2**20:.2f} MiB as fp32)",
        f"  canonical checksum: before {record['checksum_before']}, after {record['checksum_after']} "
        f"({'match' if match else 'MISMATCH'})",
        f"  {record['optimizer_line']}",
        f"  written: {record['target'].get('checkpoint') or record['target'].get('path') or ', '.join(record['target'].get('files', []))}"
        f" ({record['seconds']:.1f} s)",
    ]
    print("\n".join(lines), flush=True)


def main(argv: list[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_intermixed_args(argv)
    except SystemExit as exc:  # argparse printed the reason
        return 0 if exc.code == 0 else 2
    try:
        p = plan(args)
    except UserError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return exc.exit_code
    p["args_to"] = args.to
    try:
        record = run(p)
    except RunFailed as exc:
        print(f"bench: convert failed: {exc}", file=sys.stderr)
        return 1
    report(record)
    if record["checksum_before"] != record["checksum_after"]:
        shutil.rmtree(record["target"].get("checkpoint") or "/nonexistent", ignore_errors=True)
        print(
            "bench: convert failed: the canonical checksum changed; the converted checkpoint was removed",
            file=sys.stderr,
        )
        return 1
    return 0
