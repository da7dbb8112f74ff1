"""MLflow logging: one run per job; a parent run with a child per job for multirun sweeps (the
parent is opened by :mod:`parabench.sweep`).

Default store: embedded and local, ``sqlite:///<results_dir>/mlflow.db`` with artifacts under
``<results_dir>/mlartifacts`` (open it with ``mlflow ui --backend-store-uri sqlite:///results/mlflow.db``).
Nothing is written to MLflow before a job has passed validation.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from parabench import trackstore
from parabench.spec import TrackingSpec

PARENT_ENV = "PARABENCH_PARENT_RUN_ID"
SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
MAX_PARAM_LEN = 6000  # MLflow's param value limit


def is_secret(name: str) -> bool:
    return bool(SECRET.search(name))


def default_store_uri(results_dir: str) -> str:
    """The local MLflow store of a results directory (``tracking.uri`` unset)."""
    return f"sqlite:///{(Path(results_dir).resolve() / 'mlflow.db')}"


def store_uri(tracking: TrackingSpec, results_dir: str) -> str:
    return tracking.uri or default_store_uri(results_dir)


def artifact_root(results_dir: str) -> str:
    return (Path(results_dir).resolve() / "mlartifacts").as_uri()


def _client(tracking: TrackingSpec, results_dir: str):
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = store_uri(tracking, results_dir)
    mlflow.set_tracking_uri(uri)
    with trackstore.store_lock(uri):  # a new SQLite file's schema is created here, once
        return MlflowClient(tracking_uri=uri)


def _experiment_id(client, name: str, results_dir: str) -> str:
    # a local store keeps artifacts beside it under results/; a server decides for itself
    artifacts = None if str(client.tracking_uri).startswith("http") else artifact_root(results_dir) + "/" + name
    with trackstore.store_lock(str(client.tracking_uri)):
        return trackstore.experiment_id(client, name, artifacts)


def flatten(node: Any, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    if isinstance(node, Mapping):
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}{k}."))
    else:
        key = prefix[:-1]
        if not is_secret(key.rsplit(".", 1)[-1]):
            out[key] = json.dumps(node) if isinstance(node, (list, tuple)) else str(node)
    return out


def git_sha() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


class JobRun:
    """The MLflow run of one job. Use ``start``, log, then ``end(status)``."""

    def __init__(self, tracking: TrackingSpec, results_dir: str):
        self.tracking = tracking
        self.results_dir = results_dir
        self.client = None
        self.run_id: str | None = None

    def start(self, run_name: str, params: Mapping[str, str], tags: Mapping[str, str]) -> str | None:
        if not self.tracking.enabled:
            return None
        from mlflow.entities import Param

        self.client = _client(self.tracking, self.results_dir)
        exp = _experiment_id(self.client, self.tracking.experiment, self.results_dir)
        all_tags = {k: str(v) for k, v in tags.items() if v is not None}
        parent = os.environ.get(PARENT_ENV)
        if parent:
            all_tags["mlflow.parentRunId"] = parent
        run = self.client.create_run(exp, run_name=run_name, tags=all_tags)
        self.run_id = run.info.run_id
        items = [Param(k, v[:MAX_PARAM_LEN]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])
        return self.run_id

    def log_metrics(self, metrics: Iterable[tuple[str, float, int]]) -> None:
        if not self.run_id:
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v, step in metrics if v is not None]
        for i in range(0, len(batch), 500):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 500])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if not self.run_id:
            return
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items() if v is not None])

    def log_artifacts(self, paths: Iterable[Path], run_dir: Path) -> None:
        if not self.run_id:
            return
        for p in paths:
            if p.is_file():
                rel = p.parent.relative_to(run_dir)
                self.client.log_artifact(self.run_id, str(p), None if str(rel) == "." else str(rel))

    def end(self, status: str) -> None:
        if self.run_id:
            self.client.set_terminated(self.run_id, status)
