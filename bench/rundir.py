"""The run directory a job launches from, written before any process starts: ``config.resolved.yaml``
(what was composed, without credentials), ``spec.json`` (what the workers read), the staged data, the
resume file, and the launch bundle ``launch.sh`` (the exact, relocatable command and environment;
``pytorchjob.yaml`` beside it for Kubernetes). ``bench run`` writes it before it launches
(parabench.run.command) and ``bench plan --emit`` writes a row's as a dry run does (:func:`dry_run`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from pathlib import Path
from typing import Any

from parabench import __version__, k8s
from parabench.launchers import get_launcher, launch_env
from parabench.resilience.checkpoint import (
    checkpoint_root,
    checkpointing,
    link_default_root,
    plan_resume,
    write_resume_file,
)
from parabench.spec import JobSpec
from parabench.tracking import store as trackstore
from parabench.tracking.runs import is_secret


def dry_run(job: JobSpec, plain: dict[str, Any], run_dir: Path, repeat: Any = None) -> Path:
    """What ``bench run ... launcher.dry_run=true`` writes: the run directory and its launch bundle."""
    resume_from = plan_resume(job, repeat, warn=lambda msg: None)
    prepare(job, plain, run_dir, repeat, resume_from)
    return write_bundle(job, run_dir, launch_env(job), job.launch.master_port or 29500)


def _export(key: str, value: str) -> str:
    """One ``export`` line; a PATH-like value that extends this machine's keeps ``$KEY`` so the
    bundle extends the target machine's instead."""
    here = os.environ.get(key, "")
    if here and value.endswith(here) and value != here:
        return f'export {key}={shlex.quote(value[: -len(here)])}"${key}"'
    return f"export {key}={shlex.quote(value)}"


def write_bundle(job: JobSpec, run_dir: Path, env: dict[str, str], port: int) -> Path:
    """``launch.sh``: the exact, relocatable command a user can run on the target machine."""
    launcher = get_launcher(job.backend.adapter.capabilities.launcher)
    lines = [
        "#!/usr/bin/env bash",
        f"# parabench {__version__} launch bundle: backend={job.backend.name} model={job.model.name} "
        f"device={job.device.type} nnodes={job.launch.nnodes} nproc_per_node={job.launch.nproc_per_node}",
        "# Needs parabench installed; reads spec.json from this directory. On node N of a multi-node",
        "# job run it with NODE_RANK=N (and MASTER_ADDR of node 0).",
        "set -euo pipefail",
        'RUN_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
    ]
    lines += [_export(k, v) for k, v in sorted(env.items()) if not is_secret(k)]
    for name, text in job.backend.adapter.bundle_files(job).items():
        (run_dir / name).write_text(text)
        lines.insert(4, f"# {name}: written beside this script for the backend")
    lines.append("exec " + launcher.bundle_command(job, port))
    path = run_dir / "launch.sh"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    if job.launch.k8s.pytorchjob:
        write_pytorchjob(job, run_dir, env, launcher.bundle_command(job, port), port)
    return path


def write_pytorchjob(job: JobSpec, run_dir: Path, env: dict[str, str], command: str, port: int) -> Path:
    """``pytorchjob.yaml`` beside ``launch.sh`` (launcher.k8s.pytorchjob=true): the bundle's files in a
    ConfigMap and a Kubeflow PyTorchJob running ``command`` (parabench.k8s)."""
    names = ["spec.json", "config.resolved.yaml", *job.backend.adapter.bundle_files(job)]
    files = {n: (run_dir / n).read_text() for n in names if (run_dir / n).is_file()}
    path = run_dir / k8s.MANIFEST
    path.write_text(k8s.render(k8s.manifests(job, env, command, port, files)))
    print(f"dry run: Kubeflow PyTorchJob written to {path} (kubectl apply -f {path.name})")
    return path


def prepare(
    job: JobSpec, plain: dict[str, Any], run_dir: Path, repeat: Any, resume_from: Path | None
) -> dict[str, Any]:
    """The run directory before launch: the resume marker, config.resolved.yaml and spec.json (both
    without credentials: returned, the config as recorded) and the staged data."""
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    link_default_root(job, run_dir, repeat)
    write_resume_file(run_dir, resume_from)
    _say_where_it_starts(job, run_dir, resume_from)
    (run_dir / "logs").mkdir(exist_ok=True)
    plain = _without_credentials(plain, run_dir)  # what is written or recorded never has them
    (run_dir / "config.resolved.yaml").write_text(yaml.safe_dump(plain, sort_keys=False))
    public = dataclasses.replace(
        job.tracking, uri=job.tracking.uri and trackstore.without_credentials(job.tracking.uri)
    )
    (run_dir / "spec.json").write_text(dataclasses.replace(job, tracking=public).to_json())
    stage_data(job, run_dir)
    return plain


def _say_where_it_starts(job: JobSpec, run_dir: Path, resume_from: Path | None) -> None:
    """One line for a job that checkpoints or resumes: which checkpoint it continues, or none."""
    if resume_from is not None:
        step = json.loads((resume_from / "COMPLETE").read_text()).get("step")
        print(f"parabench: resuming from step {step} of {resume_from}", flush=True)
    elif checkpointing(job):
        root = checkpoint_root(job, run_dir).resolve()
        print(f"parabench: no checkpoint found in {root}, starting at step 0", flush=True)


def _without_credentials(plain: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The composed config with ``tracking.uri``'s ``user:password@`` left out; the same for the
    copies Hydra wrote beside the run (``.hydra/``, a sweep's ``multirun.yaml``)."""
    uri = (plain.get("tracking") or {}).get("uri")
    if not uri or trackstore.without_credentials(uri) == uri:
        return plain
    for folder in (run_dir, run_dir.parent, run_dir.parent.parent):
        for path in [*(folder / ".hydra").glob("*.yaml"), folder / "multirun.yaml"]:
            if path.is_file():
                path.write_text(trackstore.redact(path.read_text()))
    return {**plain, "tracking": {**plain["tracking"], "uri": trackstore.without_credentials(uri)}}


def stage_data(job: JobSpec, run_dir: Path) -> None:
    from parabench.data import stage_data

    stage_data(job, Path(job.run.results_dir) / ".cache", run_dir)
