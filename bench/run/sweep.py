"""The sweep around jobs: a Hydra callback that opens a parent MLflow run for a multirun sweep
(the jobs' runs attach to it as children) and, when the sweep ends, records its outcome and the
scaling efficiency of its jobs (computed by :mod:`parabench.runtable`, as ``bench compare`` computes it).

Hydra builds it from ``hydra.callbacks.mlflow_parent`` in ``conf/config.yaml``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from parabench.resilience import stability
from parabench.runnames import stamp
from parabench.runtable import build_sections, load_runs, metric_key, report_dict, scaling_metrics
from parabench.spec import tracking_from_config
from parabench.tracking.runs import PARENT_ENV, JobRun, git_sha
from parabench.tracking.store import redact


class MultirunCallback(Callback):
    """Hydra callback: a parent MLflow run around a multirun sweep; children attach to it."""

    def __init__(self) -> None:
        self._parent: JobRun | None = None

    def on_multirun_start(self, config, **kwargs) -> None:
        raw = {k: OmegaConf.to_container(config[k], resolve=True) for k in ("tracking", "run") if k in config}
        raw["experiment"] = config.get("experiment")
        tracking, results_dir = tracking_from_config(raw)
        if not tracking.enabled or config.get("launcher", {}).get("dry_run"):  # a dry run records no runs
            return
        sweep = config.hydra.sweep.dir
        overrides = [redact(o) for o in config.hydra.overrides.task]  # the cli moved a login out already
        self._parent = JobRun(tracking, results_dir, Path(sweep))  # spooled in the sweep directory
        experiment = raw.get("experiment") if isinstance(raw.get("experiment"), str) else None
        run_id = self._parent.start(
            run_name=f"sweep {(experiment or ' '.join(overrides))[:220]} {stamp()}",
            params={"sweep.overrides": " ".join(overrides), "sweep.dir": str(sweep)},
            tags={
                "parabench.kind": "sweep",
                "host": socket.gethostname(),
                "git_sha": git_sha(),
                "experiment": experiment,
            },
        )
        os.environ[PARENT_ENV] = run_id or ""

    def on_multirun_end(self, config, **kwargs) -> None:
        parent = self._parent
        os.environ.pop(PARENT_ENV, None)
        if parent is None or not parent.active:
            return
        if parent.offline:  # the store was not reached: each job is in its own spool (bench sync)
            parent.set_tags({"children": "unknown: the tracking store was not reached during the sweep"})
            parent.end("FINISHED")
            return
        children = parent.client.search_runs(
            [parent.client.get_run(parent.run_id).info.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}'",
        )
        failed = [c for c in children if c.info.status != "FINISHED"]
        parent.set_tags({"children": len(children), "children_failed": len(failed)})
        try:
            self._log_scaling(parent, [c.info.run_id for c in children if c.info.status == "FINISHED"])
        finally:
            parent.end("FAILED" if failed or not children else "FINISHED")

    @staticmethod
    def _log_scaling(parent: JobRun, run_ids: list[str]) -> None:
        """Scaling efficiency per backend variant and world size (see parabench.runtable)."""
        if not run_ids:
            return
        sections = build_sections(load_runs(parent.client, run_ids), baseline=None, strict=False)
        metrics, flags = scaling_metrics(sections)
        parent.log_metrics((k, v, 0) for k, v in metrics.items())
        if flags:
            parent.set_tags({"scaling_flags": "; ".join(flags)[:5000]})
        report = report_dict(sections, {"run_ids": run_ids})
        parent.client.log_dict(parent.run_id, report, "scaling.json")
        table = "".join(stability.table(sec["rows"], markdown=True) for sec in report["sections"])
        if table:  # checkpoints or faults in the sweep (e.g. +experiment=resilience_cpu)
            parent.client.log_text(parent.run_id, table, "stability.md")
            parent.log_metrics(
                (metric_key(f"stability/{row['variant']}/N{row['world_size']}/{k}"), v, 0)
                for sec in report["sections"]
                for row in sec["rows"]
                for k, v in row["stability"].items()
            )
