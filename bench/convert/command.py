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
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from parabench import canonical, hostmem, untrusted
from parabench.adapters.registry import capabilities
from parabench.convert import deepspeed_checkpoint, files, megatron_checkpoint, megatron_legacy
from parabench.convert.worker import REQUEST, RESULT
from parabench.errors import RunFailed, SpecError, UserError, stopped_by
from parabench.hf import CONFIG, SINGLE, hf_config, load_weights, spec_fields
from parabench.hydraconfig import compose, to_plain
from parabench.jobs import model_spec, prepare
from parabench.launchers import Launch, supervise
from parabench.resilience.checkpoint import (
    LAYOUT_KEYS,
    MARKER,
    MODEL_IGNORED,
    TMP,
    CheckpointError,
    fsync_dir,
    job_identity,
    newest_complete,
    read_marker,
    write_marker,
)
from parabench.spec import JobSpec, TrackingSpec, to_dict
from parabench.tracking import store as trackstore
from parabench.tracking.runs import JobRun

ENTRY = ["-m", "parabench.convert.worker"]
WORK = "convert"  # <out>/convert/{export,import}/: each launch's spec, request and logs
RECORD = "convert.json"
NON_BACKENDS = ("canonical", "hf")
FOREIGN = ("hf", "deepspeed", "megatron")  # sources parabench did not write: read in the command, no export launch
HF_NO_OPTIMIZER = "the source is a Hugging Face checkpoint: weights only, no optimizer state to carry"
MEGATRON_NO_OPTIMIZER = "the Megatron checkpoint holds no optimizer state (saved with --no-save-optim)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench convert", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "src",
        help="a parabench checkpoint (step_N), a directory of them, a run directory, a canonical dir, "
        "a Hugging Face directory (config.json + safetensors; weights only), or a checkpoint DeepSpeed's "
        "engine.save_checkpoint or Megatron-LM's save_checkpoint (torch_dist or the legacy torch format) wrote",
    )
    p.add_argument("--to", required=True, help="target backend (ddp, fsdp, deepspeed, ...), canonical or hf")
    p.add_argument("--out", required=True, help="new directory for the converted checkpoint")
    p.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI"),
        help="also record the conversion as an MLflow run there (default: $MLFLOW_TRACKING_URI; unset: "
        "convert.json only)",
    )
    p.add_argument("--experiment", default="convert", help="MLflow experiment of that run (default: convert)")
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="unpickle the source with code allowed: only for a checkpoint whose source you trust that "
        "holds globals beyond parabench's allowlist (docs/security.md); default: every pickle is checked first",
    )
    p.add_argument(
        "--via",
        choices=("auto", "files", "launch"),
        default="auto",
        help="files: read and write the checkpoint files without launching the frameworks (ZeRO-3 -> "
        "megatron tp, docs/convert.md); launch: through the frameworks' own load and save; auto (default): "
        "files where both ends allow it",
    )
    p.add_argument("overrides", nargs="*", help="the target's layout and options, as bench run takes them")
    return p


# --------------------------------------------------------------------------------------------
# The source: what it is and the job that wrote it.
# --------------------------------------------------------------------------------------------
def _canonical_source(path: Path) -> tuple[str, Path, dict[str, Any]]:
    try:
        manifest = canonical.read_manifest(path)
        canonical.tensor_files(path, canonical.WEIGHTS)  # an index naming files elsewhere is refused here
        if manifest.get("optimizer"):
            canonical.tensor_files(path, canonical.OPTIMIZER)
        return "canonical", path, manifest
    except ValueError as exc:
        raise SpecError("SRC", str(exc)) from None


def _identity(spec) -> dict[str, Any]:
    """The job identity of a source parabench did not write (Hugging Face, DeepSpeed's own): its model,
    fp32 (every reader widens to fp32 exactly), no backend layout or options."""
    return {
        "backend": None,
        "precision": "fp32",
        "model_name": spec.name,
        "model": {k: v for k, v in to_dict(spec).items() if k not in MODEL_IGNORED},
        "layout": {"world_size": None},
        "options": {},
    }


def _hf_source(path: Path) -> tuple[str, Path, dict[str, Any]]:
    """A Hugging Face directory, read as ``+model=hf model.path=...`` reads it (parabench.hf): its
    config.json gives the model, its safetensors the weights (names, shapes, dtypes checked)."""
    try:
        spec = model_spec(spec_fields({"path": str(path)}))  # checks the weights against the config
    except SpecError as exc:
        raise SpecError("SRC", exc.message) from None
    if spec.weights is None:
        raise SpecError("SRC", f"{path} has a {CONFIG} but no {SINGLE} (or its index): no weights to convert")
    layout = f"(safetensors; {hf_config(spec)['architectures'][0]}; weights only)"
    return "hf", path, {"identity": _identity(spec), "spec": spec, "layout": layout, "world_size": None}


def _deepspeed_source(path: Path, trusted: bool) -> tuple[str, Path, dict[str, Any]]:
    """A checkpoint DeepSpeed's ``engine.save_checkpoint`` wrote, its config.json beside (parabench.convert.deepspeed_checkpoint)."""
    meta = deepspeed_checkpoint.inspect(path, trusted)
    layout = (
        f"(engine.save_checkpoint {meta['tag_dir'].name}; ZeRO-{meta['stage'] if meta['stage'] == 3 else '1/2'}; "
        f"world_size={meta['world_size']}; DeepSpeed {meta['ds_version']})"
    )
    return "deepspeed", path, {**meta, "identity": _identity(meta["spec"]), "layout": layout}


def _megatron_source(path: Path, trusted: bool) -> tuple[str, Path, dict[str, Any]]:
    """A checkpoint Megatron-LM's ``save_checkpoint`` wrote (torch_dist, or the legacy torch format), its
    args giving the model (parabench.convert.megatron_checkpoint, parabench.convert.megatron_legacy)."""
    if megatron_checkpoint.is_legacy(path):
        directory = megatron_checkpoint.iteration_dir(path)
        meta = megatron_legacy.inspect(directory, (path if path != directory else path.parent).name, trusted)
    else:
        meta = megatron_checkpoint.inspect(path, trusted)
    distopt = f"; distributed optimizer {meta['distributed_optimizer']}" if meta.get("distributed_optimizer") else ""
    layout = (
        f"(Megatron-LM {meta['directory'].name}; {meta.get('format', 'torch_dist')}; saved at tp={meta['tp']} pp={meta['pp']}{distopt}; "
        f"{meta['precision']}; iteration {meta['iteration']})"
    )
    return "megatron", path, {**meta, "identity": _identity(meta["spec"]), "layout": layout}


def find_source(text: str, trusted: bool = False) -> tuple[str, Path, dict[str, Any]]:
    """("native", step dir, marker), ("canonical", dir, manifest) or ("hf", dir, {identity, spec}): a
    canonical directory itself, a Hugging Face directory, else the native checkpoint (the newest
    complete one of a directory), else a conversion's canonical/. Every pickle a reader of it will
    unpickle is checked first (parabench.untrusted) unless ``trusted``."""
    path = Path(text).expanduser()
    if not path.is_dir():
        raise SpecError("SRC", f"no such checkpoint directory: {path}")
    if (path / canonical.MANIFEST).exists():
        return _canonical_source(path)
    if deepspeed_checkpoint.is_checkpoint(path):  # DeepSpeed's own (its `latest` file), possibly beside a config.json
        return _deepspeed_source(path, trusted)
    if megatron_checkpoint.is_checkpoint(
        path
    ):  # Megatron-LM's own (latest_checkpointed_iteration.txt, or an iter_N dir)
        return _megatron_source(path, trusted)
    if (path / CONFIG).is_file() and not (path / MARKER).exists():  # parabench checkpoints hold no config.json
        return _hf_source(path)
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
    untrusted.check_checkpoint(found[0], trusted=trusted)
    return "native", found[0], marker


def _plain(backend: str, overrides: list[str]) -> dict[str, Any]:
    named = any(o.lstrip("+~").startswith("model=") for o in overrides)
    return to_plain(compose([*([] if named else ["+model=llama"]), f"backend={backend}", *overrides]))


def source_job(identity: dict[str, Any], world_size: int, trusted: bool = False) -> JobSpec:
    """The job that wrote a checkpoint, rebuilt from its marker (backend, options, model, precision,
    world size): the export launches exactly that layout, loading it as ``--trust-checkpoint`` says."""
    plain = _plain(identity["backend"], [])
    plain["backend"].update(identity["options"])
    plain["model"] = {"name": identity.get("model_name") or "model", **identity["model"]}
    plain["run"]["precision"] = identity["precision"]
    plain["run"]["trust_checkpoint"] = trusted
    plain["launcher"]["nproc_per_node"] = world_size
    plain["tracking"] = {**plain.get("tracking", {}), "enabled": False}
    return prepare(plain)


def _given(overrides: list[str], key: str) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def target_job(
    name: str, overrides: list[str], identity: dict[str, Any], world_size: int | None, optim: dict | None = None
) -> JobSpec:
    """The target job: the source's model and precision, the source's world size unless given, the
    AdamW settings its optimizer state holds (``optim``, from its marker) unless given, and the
    layout/options given as ``backend.*`` overrides; validated as bench run validates it."""
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
    plain["optim"].update({k: v for k, v in (optim or {}).items() if not _given(overrides, f"optim.{k}")})
    if not _given(overrides, "launcher.nproc_per_node") and world_size:  # a Hugging Face source has none
        plain["launcher"]["nproc_per_node"] = world_size
    plain["tracking"] = {**plain.get("tracking", {}), "enabled": False}
    return prepare(plain)


def _check_convertible(job: JobSpec, role: str) -> None:
    support = job.backend.adapter.capabilities.convert
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
    support = capabilities(identity["backend"]).checkpoint
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
    """Run the convert workers of ``job`` through its backend's launcher (parabench.launchers); rank 0's result."""
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "spec.json").write_text(job.to_json())
    (run_dir / REQUEST).write_text(json.dumps(request, indent=1))
    for name, text in job.backend.adapter.bundle_files(job).items():
        (run_dir / name).write_text(text)
    rc, reason = supervise(Launch.of(job, run_dir, entry=ENTRY))  # launcher.setup_timeout_s bounds it
    if rc != 0 or not (run_dir / RESULT).exists():
        why = reason or f"exit {rc}, no {RESULT}"
        raise RunFailed(f"{request['mode']} on {job.backend.name} failed ({why}); logs in {run_dir / 'logs'}")
    return json.loads((run_dir / RESULT).read_text())


def write_hf(out: Path, canon: Path, job_model) -> dict[str, Any]:
    """config.json + model.safetensors (or its shards and index, canonical.ShardedWriter: Hugging
    Face's own layout) under Hugging Face Llama names (the canonical names)."""
    (out / "config.json").write_text(json.dumps(hf_config(job_model), indent=1))
    files = canonical.read_manifest(canon).get("files", {}).get("weights") or [canonical.WEIGHTS]
    for name in files:
        shutil.copyfile(canon / name, out / name)
    return {"files": ["config.json", *files]}


def write_foreign_canonical(canon: Path, kind: str, src: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The canonical directory of a source parabench did not write, without harness state (the target
    starts a fresh one at the source's optimizer step). A Hugging Face checkpoint: its weights read as
    every backend reads them (parabench.model.initial_weights, the +model=hf reader), AdamW moments as a
    fresh AdamW starts them (zeros, step 0: torch.optim.AdamW's lazy state init,
    docs/sources.md#canonical-conversion). DeepSpeed's own: weights, moments and step (parabench.convert.deepspeed_checkpoint);
    Megatron-LM's own likewise (parabench.convert.megatron_checkpoint), fresh moments where it saved none."""
    import numpy as np

    from parabench.model import initial_weights

    extra: dict[str, Any] = {}
    if kind == "hf":  # read one tensor at a time (the seed is not used: the weights come from spec.weights)
        shapes = meta["spec"].parameter_shapes()
        weights = canonical.Lazy(shapes, lambda n: initial_weights(meta["spec"], seed=0, names=[n])[n])
        zeros = canonical.Lazy(shapes, lambda n: np.zeros(shapes[n], dtype=np.float32))
        moments = {key: zeros for key in canonical.MOMENTS}
        state, extra["fresh_optimizer"] = canonical.CanonicalState(weights, moments, 0), HF_NO_OPTIMIZER
    elif kind == "megatron":
        state = (megatron_legacy if meta.get("format") == "torch" else megatron_checkpoint).read(meta)
        if meta["step"] is None:
            extra["fresh_optimizer"] = MEGATRON_NO_OPTIMIZER
    else:
        state = deepspeed_checkpoint.read(meta, canon.parent / WORK)
    keys = ("identity", "world_size", "layout")
    job, world, layout = (meta[k] for k in keys)
    info = {"source": {"path": str(src), "format": kind, "job": job, "world_size": world, "layout": layout}}
    return canonical.write(canon, state, [], {**info, **extra})


# --------------------------------------------------------------------------------------------
# The command.
# --------------------------------------------------------------------------------------------
def plan(args) -> dict[str, Any]:
    """Everything checked, nothing written: the two jobs and where things go."""
    kind, src, meta = find_source(args.src, args.trust_checkpoint)
    if kind == "canonical":  # world_size and layout None/absent unless the source was a Hugging Face one
        identity, world, sjob = meta["source"]["job"], meta["source"]["world_size"], None
        layout = meta["source"].get("layout") or layout_text(identity)
    elif kind in FOREIGN:
        identity, world, sjob, layout = meta["identity"], meta["world_size"], None, meta["layout"]
    else:
        identity, world = meta["job"], int(meta["world_size"])
        sjob, layout = source_job(identity, world, args.trust_checkpoint), layout_text(identity)
        _check_convertible(sjob, "source")
    # a login in the URI goes to MLflow's variables: convert.json, the spool and the messages get the rest
    uri = trackstore.credentials_to_env(args.tracking_uri, os.environ) if args.tracking_uri else None
    tracking = TrackingSpec(uri=uri, experiment=args.experiment) if uri else None
    if tracking is not None:  # a server that does not answer is let through: the record is spooled in --out
        trackstore.check(tracking, key="--tracking-uri", unreachable_ok=True)
    out = Path(args.out).expanduser()
    check_apart(src, out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecError("--out", f"{out} exists and is not empty: choose a new directory")
    if args.to in NON_BACKENDS:
        if args.overrides:
            raise SpecError(args.overrides[0].split("=", 1)[0], f"--to {args.to} takes no overrides")
        tjob = None
    else:
        held = meta.get("optim") if kind == "native" else None  # the AdamW settings in its param_groups
        tjob = target_job(args.to, list(args.overrides), identity, world, held)
        _check_convertible(tjob, "target")
    return {
        "via": _via(args.via, kind, identity, tjob),
        "kind": kind,
        "src": src,
        "meta": meta,
        "identity": identity,
        "source_layout": layout,
        "source_job": sjob,
        "target_job": tjob,
        "out": out,
        "tracking": tracking,
    }


def _via(asked: str, kind: str, identity: dict[str, Any], tjob: JobSpec | None) -> str:
    """ "files" where the conversion can go from files to files (parabench.convert.files) and
    ``--via launch`` was not given, else "launch"; ``--via files`` where it cannot is refused."""
    why = files.refusal(kind, identity, tjob)
    if asked == "files" and why:
        raise SpecError("--via", f"files: not for this conversion ({why}); --via launch or auto")
    return "launch" if asked == "launch" or why else "files"


def check_apart(src: Path, out: Path) -> None:
    """--out neither is, nor lies inside, nor holds the source: a canonical source is copied into
    ``out/canonical`` (inside the source it copied itself until a RecursionError), and a native one
    would get files that are not its own."""
    source, target = src.resolve(), out.resolve()
    where = (
        "is the source"
        if source == target
        else "is inside the source"
        if source in target.parents
        else "holds the source"
        if target in source.parents
        else None
    )
    if where:
        raise SpecError("--out", f"{out} {where} {src}: choose a directory apart from it")


def _optimizer_line(p: dict[str, Any], manifest: dict[str, Any]) -> str:
    if not manifest["optimizer"]:
        return f"optimizer state: not included ({manifest.get('no_optimizer') or 'the source has none'})"
    if p["target_job"] is None and p["args_to"] == "hf":
        return "optimizer state: not included in the hf export (transformers checkpoints hold weights only); kept in canonical/"
    if manifest.get("fresh_optimizer"):  # a weights-only source: what a new AdamW starts from
        return f"optimizer state: fresh AdamW, zero moments at step 0 ({manifest['fresh_optimizer']})"
    if p["target_job"] is None:
        return f"optimizer state: included (AdamW exp_avg, exp_avg_sq, step {manifest['step']})"
    why = p["target_job"].backend.adapter.capabilities.convert.optimizer
    return f"optimizer state: {'not included (' + why + ')' if why else 'included'} (AdamW exp_avg, exp_avg_sq, step {manifest['step']})"


def run(p: dict[str, Any]) -> dict[str, Any]:
    """The conversion, measured: its seconds, the bytes of the source's files and of those written to
    --out and their rates, and the peak host memory of bench and its workers (parabench.hostmem)."""
    t0 = time.monotonic()
    with hostmem.PeakHostMemory() as peak:
        record = _convert(p)
    seconds = time.monotonic() - t0
    read, written = _file_bytes(_read_dir(p)), _file_bytes(p["out"], skip=p["out"] / WORK)
    record.update(
        seconds=round(seconds, 2),
        source_file_bytes=read,
        written_file_bytes=written,
        read_bytes_per_s=round(read / seconds),
        written_bytes_per_s=round(written / seconds),
        peak_host_memory_bytes=peak.bytes,
        peak_host_memory_method=hostmem.METHOD,
    )
    (p["out"] / RECORD).write_text(json.dumps(record, indent=1))
    return record


def _read_dir(p: dict[str, Any]) -> Path:
    """The directory a conversion reads: DeepSpeed's tag and Megatron-LM's iteration directory, else SRC."""
    return (
        Path(p["meta"].get("tag_dir") or p["meta"].get("directory") or p["src"]) if p["kind"] in FOREIGN else p["src"]
    )


def _file_bytes(root: Path, skip: Path | None = None) -> int:
    """The bytes of the regular files under ``root`` (links not followed), ``skip``'s left out."""
    files = (f for f in root.rglob("*") if f.is_file() and not f.is_symlink())
    return sum(f.stat().st_size for f in files if skip is None or skip not in f.parents)


def _convert(p: dict[str, Any]) -> dict[str, Any]:
    if p["via"] == "files":
        return _convert_files(p)
    out, work = p["out"], p["out"] / WORK
    canon = out / "canonical"
    if p["kind"] == "native":
        launch(p["source_job"], work / "export", {"mode": "export", "source": str(p["src"]), "canonical": str(canon)})
    elif p["kind"] in FOREIGN:
        write_foreign_canonical(canon, p["kind"], p["src"], p["meta"])
    else:
        shutil.copytree(p["src"], canon)
    manifest = canonical.read_manifest(canon)
    record = {
        "source": {
            "path": str(p["src"]),
            "format": p["kind"],
            "layout": p["source_layout"],
            "step": manifest["step"],
        },
        "via": "launch",
        "tensors": manifest["tensors"],
        "bytes": manifest["bytes"],
        "checksum_before": manifest["checksum"],
        "optimizer": manifest["optimizer"],
        "fresh_optimizer": manifest.get("fresh_optimizer"),
    }
    tjob = p["target_job"]
    if tjob is not None:
        weights = str(canonical.weights_file(canon))  # the single file or the shards' index
        job = dataclasses.replace(tjob, model=dataclasses.replace(tjob.model, weights=weights))
        result = import_verified(job, canon, out, manifest["checksum"])
        record.update(
            target={"format": "native", "layout": layout_text(job_identity(tjob)), "checkpoint": result["checkpoint"]}
        )
        record["checksum_after"] = result["checksum"]
    elif p["args_to"] == "hf":
        record.update(target={"format": "hf", **write_hf(out, canon, _model_spec(p["identity"]))})
        record.update(_hf_checksums(out, canon, manifest["step"]))
    else:
        record.update(target={"format": "canonical", "path": str(canon)})
        record["checksum_after"] = canonical.checksum(canonical.load(canon)[0])  # read back from the files
    record["optimizer_line"] = _optimizer_line(p, manifest)
    return record


def _convert_files(p: dict[str, Any]) -> dict[str, Any]:
    """From the source's files to the target's (parabench.convert.files), published as an import is."""
    tjob, found = p["target_job"], {}

    def produce() -> dict[str, Any]:
        found.update(files.convert(p["src"], p["meta"], tjob, p["out"]))
        return dict(found)

    result = published(tjob, p["out"], lambda: found["checksum_before"], produce)
    manifest = {"optimizer": True, "step": found["optimizer_step"]}
    return {
        "source": {"path": str(p["src"]), "format": p["kind"], "layout": p["source_layout"], "step": found["step"]},
        "via": "files",
        "tensors": found["tensors"],
        "bytes": found["bytes"],
        "checksum_before": found["checksum_before"],
        "optimizer": True,
        "fresh_optimizer": None,
        "target": {"format": "native", "layout": layout_text(job_identity(tjob)), "checkpoint": result["checkpoint"]},
        "checksum_after": result["checksum"],
        "optimizer_line": _optimizer_line(p, manifest),
    }


def import_verified(job: JobSpec, canon: Path, out: Path, expected: str) -> dict[str, Any]:
    """The target's import through its framework (the launched workers), published once verified."""
    request = {"mode": "import", "canonical": str(canon), "out": str(out)}
    return published(job, out, lambda: expected, lambda: launch(job, out / WORK / "import", request))


def published(job: JobSpec, out: Path, expected, produce) -> dict[str, Any]:
    """``produce()`` writes ``step_N.tmp`` without a COMPLETE marker (nothing run.resume accepts) and
    returns its checksum read back; when it equals ``expected()`` the command writes the marker naming
    the target job and renames it to ``step_N``. A failure, an interrupt or a mismatch leaves no
    checkpoint under ``out``: the staging directory is removed (a SIGKILL leaves it, unmarked)."""
    try:
        result = produce()
        staging, result["checkpoint"] = Path(result["staging"]), None
        if result["checksum"] == expected():
            ctx = SimpleNamespace(job=job, world_size=job.parallel.world_size)
            result["checkpoint_bytes"] = write_marker(staging, int(result["step"]), ctx, None, converted=True)
            final = staging.with_name(staging.name.removesuffix(TMP))
            os.rename(staging, final)
            fsync_dir(out)
            result["checkpoint"] = str(final)
    finally:
        for leftover in out.glob(f"step_*{TMP}"):
            shutil.rmtree(leftover, ignore_errors=True)
    return result


def _hf_checksums(out: Path, canon: Path, step: int) -> dict[str, Any]:
    """An hf export holds the weights only: the weights' checksum in the canonical directory against
    the one of the export read back as ``+model=hf`` reads it (config.json, then the safetensors). The
    canonical moments are not read: they are not exported."""
    source = canonical.load(canon)[0].weights
    spec = model_spec(spec_fields({"path": str(out)}))
    path = str(canonical.weights_file(out))
    written = canonical.Lazy(spec.parameter_shapes(), lambda n: load_weights(path, [n])[n])
    return {
        "checksum_scope": "weights",
        "checksum_before": canonical.checksum(canonical.CanonicalState(source, None, step)),
        "checksum_after": canonical.checksum(canonical.CanonicalState(written, None, step)),
    }


def _model_spec(identity: dict[str, Any]):
    return model_spec({"name": identity.get("model_name") or "model", **identity["model"]})


def report(record: dict[str, Any]) -> None:
    match = record["checksum_before"] == record["checksum_after"]
    lines = [
        f"bench convert: {record['source']['format']} {record['source']['layout']} step {record['source']['step']}",
        f"  -> {record['target']['format']} {record['target'].get('layout', '')}".rstrip(),
        f"  tensors converted: {record['tensors']} ({record['bytes'] / 2**20:.2f} MiB as fp32)",
        f"  {'weights' if record.get('checksum_scope') == 'weights' else 'canonical'} checksum: "
        f"before {record['checksum_before']}, after {record['checksum_after']} "
        f"({'match' if match else 'MISMATCH'})",
        f"  {record['optimizer_line']}",
        f"  written: {record['target'].get('checkpoint') or record['target'].get('path') or ', '.join(record['target'].get('files', []))}"
        f" ({record['seconds']:.1f} s)",
        f"  files: read {record['source_file_bytes'] / 2**20:.2f} MiB ({record['read_bytes_per_s'] / 2**20:.1f} MiB/s), "
        f"wrote {record['written_file_bytes'] / 2**20:.2f} MiB ({record['written_bytes_per_s'] / 2**20:.1f} MiB/s); "
        f"peak host memory {record['peak_host_memory_bytes'] / 2**20:.0f} MiB (bench and its workers)",
    ]
    print("\n".join(lines), flush=True)


def log_to_mlflow(tracking: TrackingSpec, out: Path, record: dict[str, Any], status: str) -> str | None:
    """The conversion as one MLflow run: formats, layouts and step as params, tensors/bytes/seconds as
    metrics, both checksums and the checkpoint as tags, convert.json as its artifact. Spooled in
    ``out`` first (``bench sync OUT`` uploads it if the store failed). Returns the run id."""
    src, tgt = record["source"], record["target"]
    params = {
        "source.format": src["format"],
        "source.layout": src["layout"],
        "source.step": str(src["step"]),
        "source.path": src["path"],
        "target.format": tgt["format"],
        "target.layout": tgt.get("layout", ""),
        "optimizer": record["optimizer_line"],
    }
    tags = {
        "parabench.kind": "convert",
        "parabench.checksum_before": record["checksum_before"],
        "parabench.checksum_after": record["checksum_after"],
        "parabench.written": tgt.get("checkpoint") or tgt.get("path") or ",".join(tgt.get("files", [])),
    }
    # a local store keeps the experiment's artifacts beside it (as results/ does for bench run)
    db = trackstore.sqlite_path(str(tracking.uri))
    run = JobRun(tracking, results_dir=str(db.parent if db else out), run_dir=out)
    run_id = run.start(f"convert {src['format']} -> {tgt['format']} {tgt.get('layout', '')}".rstrip(), params, tags)
    run.log_metrics(
        [
            (key, record[key], 0)
            for key in ("tensors", "bytes", "seconds", "source_file_bytes", "written_file_bytes")
            + ("read_bytes_per_s", "written_bytes_per_s", "peak_host_memory_bytes")
        ]
    )
    run.log_artifacts([out / RECORD], out)
    run.end(status)
    return run_id


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
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (parabench.errors.Interrupted): workers stopped
        signum = stopped_by(exc)
        print(
            f"bench: convert interrupted by {signum.name}: workers stopped; {p['out']} is incomplete", file=sys.stderr
        )
        return 128 + signum
    report(record)
    match = record["checksum_before"] == record["checksum_after"]
    if p["tracking"] is not None:
        run_id = log_to_mlflow(p["tracking"], p["out"], record, "FINISHED" if match else "FAILED")
        if run_id:
            print(
                f"  mlflow: run {run_id} in experiment {p['tracking'].experiment} ({trackstore.shown(p['tracking'].uri)})"
            )
    if not match:
        print(
            "bench: convert failed: the canonical checksum changed; no converted checkpoint was published",
            file=sys.stderr,
        )
        return 1
    return 0
