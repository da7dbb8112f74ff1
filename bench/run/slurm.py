"""Slurm through Hydra's submitit launcher (``hydra/launcher=slurm_torchrun``): submit, watch, report.

Hydra builds :class:`SlurmLauncher` from ``conf/hydra/launcher/slurm_torchrun.yaml``. It is the
submitit launcher of ``hydra-submitit-launcher`` with three changes (docs/slurm.md):

- every job ends with a result submitit can read back: a job step stopped by SIGTERM (``scancel``,
  the time limit) returns a failed job instead of leaving no result behind;
- the submitting side waits on the result files and on ``scontrol show job`` (not on ``sacct``,
  which needs Slurm's accounting database: without it submitit waits forever on a job that died;
  docs/sources.md#slurm);
- failed jobs are reported one line each (``bench: failed jobs:``) with exit 1, and the sweep's
  parent MLflow run is still closed, instead of a traceback out of Hydra; the MLflow run of a job
  that ended without a result (SIGKILL, a failed node) is ended FAILED from here.

``bench run`` checks before submitting that ``sbatch`` is on PATH and the partition exists
(:func:`check_submission`).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from omegaconf import OmegaConf

from parabench.errors import RunFailed, UserError, stopped_by
from parabench.hydraconfig import register_resolvers
from parabench.spec import tracking_from_config
from parabench.tracking.runs import PARENT_ENV, store_uri
from parabench.tracking.store import redact

POLL_S = 1.0  # result files are looked for this often
STATE_EVERY_S = 5.0  # the controller is asked for a job's state at most this often
RESULT_GRACE_S = 10.0  # a job Slurm reports ended: how long its result file may take to appear
# Slurm job states of a job that has not ended (squeue(1), "JOB STATE CODES"; docs/sources.md#slurm)
ACTIVE = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "RESV_DEL_HOLD",
}


def _slurm_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise UserError(
            f"hydra/launcher=slurm_torchrun submits with Slurm's {name}, which is not on PATH "
            "(run bench on a Slurm login node, or drop hydra/launcher to run here)"
        )
    return path


def check_submission(partition: str | None) -> None:
    """Refuse before anything is submitted: no ``sbatch``, no controller, no such partition."""
    _slurm_tool("sbatch")
    proc = subprocess.run([_slurm_tool("sinfo"), "-h", "-o", "%R"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or ["no output"])[0]
        raise UserError(f"Slurm does not answer (sinfo: {first}); check the controller and SLURM_CONF")
    known = sorted(set(proc.stdout.split()))
    for name in (partition or "").split(","):
        if name and name not in known:
            raise UserError(
                f"hydra.launcher.partition={name}: no such Slurm partition (sinfo lists: {', '.join(known) or 'none'})"
            )


def register_launcher() -> None:
    """Make Hydra know the launcher class without its scan of ``hydra_plugins``, which does not see
    an editable install's mapped package (setuptools' finder lists no modules)."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.parabench_slurm import SlurmLauncher as Registered

    Plugins.instance().register(Registered)


def job_state(job_id: str) -> tuple[str, str]:
    """(state, reason) of a Slurm job from ``scontrol show job`` (kept MinJobAge after it ends);
    ("GONE", ...) once the controller has forgotten it."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    state = re.search(r"\bJobState=(\S+)", proc.stdout)
    if proc.returncode != 0 or not state:
        return "GONE", (proc.stderr.strip().splitlines() or ["not known to the controller"])[0]
    reason = re.search(r"\bReason=(\S+)", proc.stdout)
    return state.group(1), reason.group(1) if reason else "None"


def end_orphan_runs(config, job_num: int, why: str) -> int:
    """A job that ended without a result (SIGKILL, a failed node) could not end its MLflow run: the
    sweep's child runs of that job still RUNNING end FAILED with ``why``. Returns how many."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:  # tracking off, or the sweep's parent run was not opened
        return 0
    raw = {k: OmegaConf.to_container(config[k], resolve=True) for k in ("tracking", "run") if k in config}
    tracking, results_dir = tracking_from_config(raw)
    from mlflow import MlflowClient

    client = MlflowClient(store_uri(tracking, results_dir))
    experiment = client.get_run(parent).info.experiment_id
    query = f"tags.mlflow.parentRunId = '{parent}' and tags.job_num = '{job_num}' and attributes.status = 'RUNNING'"
    runs = client.search_runs([experiment], filter_string=query)
    for run in runs:
        client.set_tag(run.info.run_id, "failure_reason", why[:5000])
        client.set_terminated(run.info.run_id, "FAILED")
    return len(runs)


def _failed(overrides, exc: BaseException) -> JobReturn:
    ret = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
    ret.return_value = exc
    return ret


def _reason(ret: Any) -> str | None:
    """One line for a failed task's return (a JobReturn), None when it succeeded."""
    if isinstance(ret, JobReturn) and ret.status == JobStatus.FAILED:
        return (str(ret._return_value).strip().splitlines() or [type(ret._return_value).__name__])[0]
    return None


class SlurmLauncher(submitit_launcher.SlurmLauncher):
    """hydra-submitit-launcher's Slurm launcher; see the module docstring for what differs."""

    def __call__(self, sweep_overrides, job_dir_key, job_num, job_id, singleton_state) -> JobReturn:
        """One task of a job, on its node (unpickled by submitit)."""
        register_resolvers()  # the job's config is resolved again here
        try:
            return super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
        except KeyboardInterrupt as exc:  # SIGTERM (parabench.errors.Interrupted): the runner recorded FAILED
            name = stopped_by(exc).name
            why = f"interrupted by {name} on {socket.gethostname()} (scancel, or the job's time limit)"
            return _failed(sweep_overrides, RunFailed(why))
        except SystemExit as exc:
            return _failed(sweep_overrides, RunFailed(f"the job exited with status {exc.code}"))

    def launch(self, job_overrides, initial_job_idx: int):
        jobs = self._submit(job_overrides, initial_job_idx)
        failed = getattr(self.task_function, "failed", None)  # bench run's list of failed jobs
        returns = []
        for num, (overrides, job) in enumerate(zip(job_overrides, jobs), start=initial_job_idx):
            results, reason = self._wait(job)
            reason = reason or next(filter(None, map(_reason, results)), None)
            if reason is None:
                returns.append(results[0])
                continue
            if failed is not None:
                failed.append(f"{num}: Slurm job {job.job_id}: {reason}")
            if not results:  # nothing on the node could end its MLflow run
                end_orphan_runs(self.config, num, f"Slurm job {job.job_id} {reason}")
            # the sweep goes on (Hydra raises a failed job's exception); bench run exits 1
            returns.append(JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED))
        return returns

    @staticmethod
    def _wait(job) -> tuple[list[Any], str | None]:
        """Every task's result, or why there is none (the job ended without one, or raised)."""
        tasks = [job.task(k) for k in range(job.num_tasks)]
        ended_at, seen, asked = None, ("", ""), 0.0
        while not all(t.paths.result_pickle.exists() for t in tasks):
            time.sleep(POLL_S)
            if ended_at is None and time.monotonic() - asked >= STATE_EVERY_S:
                asked = time.monotonic()
                state, why = job_state(job.job_id)
                if (state, why) != seen:  # e.g. PENDING (Resources), RUNNING
                    print(f"parabench: Slurm job {job.job_id}: {state} ({why})", flush=True)
                    seen = (state, why)
                ended_at = None if state in ACTIVE else (time.monotonic(), state, why)
            elif ended_at is not None and time.monotonic() - ended_at[0] > RESULT_GRACE_S:
                log = Path(job.paths.stderr)
                return [], f"ended {ended_at[1]} (reason {ended_at[2]}) without a result; see {log}"
        from submitit.core.utils import UncompletedJobError

        try:
            return job.results(), None
        except UncompletedJobError as exc:  # FailedJobError: raised outside the Hydra job; its traceback
            lines = [line for line in str(exc).strip().splitlines() if line.strip()]
            return [], lines[-1] if lines else type(exc).__name__

    def _submit(self, job_overrides, initial_job_idx: int) -> list:
        """Submit one array job for the sweep (what hydra-submitit-launcher's launch() does first)."""
        import submitit
        from hydra.core.singleton import Singleton
        from hydra.core.utils import filter_overrides
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        assert self.config is not None
        init = {"folder": self.params["submitit_folder"]}
        if "max_num_timeout" in self.params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = self.params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{
                k if k in base else f"{self._EXECUTOR}_{k}": v
                for k, v in self.params.items()
                if k not in ("submitit_folder", "max_num_timeout") and v is not None
            }
        )
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            print(f"parabench: submitting #{idx}: {redact(' '.join(filter_overrides(overrides)))}", flush=True)
            params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs = executor.map_array(self, *zip(*params))
        print(f"parabench: Slurm job(s) {', '.join(j.job_id for j in jobs)}; logs in {init['folder']}", flush=True)
        return jobs
