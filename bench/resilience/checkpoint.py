"""Step-level checkpoints around the backend's native format (docs/resilience.md).

Layout of one checkpoint, ``<run.checkpoint.dir>/step_000012/``::

    native/              the backend's own files (Checkpointing.save_checkpoint: DCP, DeepSpeed, ...)
    harness/rank<R>.pt   per rank: completed steps, RNG streams, data ledger, loss/time history
    COMPLETE             JSON written last by rank 0: the job it belongs to and every file's size

It is written under ``step_000012.tmp/`` and made visible by one ``os.rename`` after the marker is
on disk, so a crash at any moment leaves either the previous complete checkpoint or a new one, never
a half-written directory under a final name. Saving a step that already exists (a resume from an
older checkpoint) first renames the old one to ``step_000012.old``, which discovery uses while
``step_000012`` is not visible and which is deleted only after the new one is. Discovery takes the newest directory whose marker is
readable and whose files have the sizes it records; anything else is reported and skipped, and
nothing but older *complete* checkpoints beyond ``run.checkpoint.keep`` is ever deleted.

The runner calls :func:`plan_resume` before launch (refusing an incompatible checkpoint with exit 2,
naming the key); every worker calls :func:`resume_source` and drives a :class:`Checkpointer`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parabench import untrusted
from parabench.adapters.base import Checkpointing
from parabench.errors import SpecError
from parabench.resilience.faults import fire_fault
from parabench.spec import JobSpec, to_dict

MARKER = "COMPLETE"
PREFIX = "step_"
TMP = ".tmp"
OLD = ".old"  # a complete checkpoint moved aside while the same step is published again
RUN_ID_ENV = "PARABENCH_MLFLOW_RUN_ID"  # the job's MLflow run, recorded in each checkpoint's marker
RESUME_FILE = "resume.json"
STOP_FILE = "stop.json"  # written by the runner on SIGINT/SIGTERM with run.checkpoint.on_signal
STEPS_FILE = "steps.jsonl"  # rank 0 appends each finished step (an interrupted run logs them)  # written by the runner into the run directory: the checkpoint to start from
LAYOUT_KEYS = ("tp", "pp", "cp", "world_size", "dp", "dp_shard")  # checked in this order
MODEL_IGNORED = ("name", "source", "weights")  # where the shape came from does not change the state


class StopRequested(Exception):
    """The runner asked the workers to stop after a last checkpoint (run.checkpoint.on_signal)."""


class CheckpointError(Exception):
    """A checkpoint cannot be written or read: one line, never a traceback (the worker exits 1)."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:06d}"


def checkpoint_root(job: JobSpec, run_dir: Path) -> Path:
    """Where the workers save and look: run.checkpoint.dir, else ``<run dir>/checkpoints`` (locally a
    link to :func:`default_root`; in a launch bundle moved elsewhere, a folder of its own)."""
    return Path(job.run.checkpoint.dir) if job.run.checkpoint.dir else run_dir / "checkpoints"


def checkpointing(job: JobSpec) -> bool:
    return job.run.checkpoint.every > 0 or job.run.checkpoint.on_signal


def default_root(job: JobSpec, repeat: int | None = None) -> Path | None:
    """The stable checkpoint folder of this job when run.checkpoint.dir is unset and the job saves:
    ``<results_dir>/checkpoints/<experiment>/<backend>-<model>-x<world>-<hash>``, the hash over what
    makes it the same job (model, layout, backend options, precision, data, optimizer, seed; not the
    step count, so a longer run continues), so the same command with run.resume=auto continues where
    it stopped (as Megatron-LM's --save or torchtitan's dump folder). Repeats keep one each. None when
    the job does not checkpoint: the same command twice is then two fresh measurements."""
    if job.run.checkpoint.dir or not checkpointing(job):
        return None
    same = {**job_identity(job), "data": to_dict(job.data), "optim": to_dict(job.optim), "seed": job.run.seed}
    digest = hashlib.sha256(json.dumps(same, sort_keys=True, default=str).encode()).hexdigest()[:10]
    name = f"{job.backend.name}-{job.model.name}-x{job.parallel.world_size}-{digest}"
    name += f"-rep{repeat}" if repeat is not None and job.run.repeats > 1 else ""
    return Path(job.run.results_dir) / "checkpoints" / job.tracking.experiment / name


def link_default_root(job: JobSpec, run_dir: Path, repeat: int | None = None) -> None:
    """``<run dir>/checkpoints`` -> the job's stable folder (:func:`default_root`), where it has one."""
    root = default_root(job, repeat)
    if root is None:
        return
    root.mkdir(parents=True, exist_ok=True)
    link = run_dir / "checkpoints"
    if link.is_symlink():  # the run directory of a run started within the same second
        link.unlink()
    link.symlink_to(root.resolve(), target_is_directory=True)


def job_identity(job: JobSpec) -> dict[str, Any]:
    """What a checkpoint must agree with to be loaded (stored in its marker)."""
    model = {k: v for k, v in to_dict(job.model).items() if k not in MODEL_IGNORED}
    return {
        "backend": job.backend.name,
        "precision": job.run.precision,
        "model_name": job.model.name,
        "model": model,
        "layout": {k: getattr(job.parallel, k) for k in LAYOUT_KEYS},
        "options": to_dict(job.backend.options),
    }


# --------------------------------------------------------------------------------------------
# Discovery and validation (runner and workers; no torch).
# --------------------------------------------------------------------------------------------
def read_marker(path: Path) -> dict[str, Any]:
    """The marker of a complete checkpoint, its files checked against the sizes it records."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {MARKER} marker (a partial checkpoint)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable {MARKER} marker ({exc})") from None
    for name, size in marker.get("files", {}).items():
        try:
            actual = (path / name).stat().st_size
        except OSError:
            raise CheckpointError(f"{path}: {name} is missing (corrupt checkpoint)") from None
        if actual != size:
            raise CheckpointError(f"{path}: {name} has {actual} bytes, the marker says {size} (corrupt checkpoint)")
    return marker


def _stderr(msg: str) -> None:
    print(f"parabench: warning: {msg}", file=sys.stderr, flush=True)


def newest_complete(root: Path, warn=None, saved_since: float = 0.0) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete checkpoint under ``root`` and its marker; partial or corrupt ones are
    reported through ``warn`` (default: stderr) and skipped, and so (silently) are those whose
    marker was written before ``saved_since`` (a time.time())."""
    warn = warn or _stderr
    if not root.is_dir():
        return None
    names = {p.name for p in root.iterdir()}
    # a set-aside step_N.old sorts just after step_N: it is used only where step_N is not visible
    candidates = sorted((p for p in root.iterdir() if p.name.startswith(PREFIX)), key=lambda p: p.name, reverse=True)
    for path in candidates:
        if path.name.endswith(TMP):
            warn(f"{path}: an unfinished save (skipped)")
            continue
        if path.name.endswith(OLD) and path.name.removesuffix(OLD) in names:
            continue  # superseded: the new step_N is visible (pruned at the next save)
        try:
            marker = read_marker(path)
        except CheckpointError as exc:
            warn(f"{exc}; skipped")
            continue
        if float(marker.get("time", 0)) >= saved_since:
            return path, marker
    return None


def _final_dirs(root: Path) -> list[Path]:
    """Checkpoint directories under their final name (not .tmp, not .old)."""
    return [p for p in root.iterdir() if p.name.startswith(PREFIX) and not p.name.endswith((TMP, OLD))]


def _resolve_path(text: str, warn=None) -> tuple[Path, dict[str, Any]]:
    """run.resume=<path>: a checkpoint, a directory of checkpoints, or a run directory."""
    path = Path(text).expanduser()
    if not path.exists():
        raise SpecError("run.resume", f"no such checkpoint or directory: {path}")
    if not os.access(path, os.R_OK | os.X_OK) or not path.is_dir():
        raise SpecError("run.resume", f"{path} is not a readable directory")
    if (path / MARKER).exists() or path.name.startswith(PREFIX):
        try:
            return path, read_marker(path)
        except CheckpointError as exc:
            raise SpecError("run.resume", str(exc)) from None
    for root in (path, path / "checkpoints"):
        found = newest_complete(root, warn)
        if found:
            return found
    raise SpecError("run.resume", f"no complete checkpoint in {path}")


def check_compatible(job: JobSpec, marker: dict[str, Any], path: Path) -> None:
    """Refuse (SpecError naming the differing key) a checkpoint this job cannot load."""
    saved, here = marker.get("job", {}), job_identity(job)
    if saved.get("backend") != here["backend"]:
        raise SpecError(
            "backend", f"checkpoint {path} was written by backend {saved.get('backend')}, not {here['backend']}"
        )
    if saved.get("precision") != here["precision"]:
        raise SpecError(
            "run.precision", f"checkpoint {path} was written in {saved.get('precision')}, not {here['precision']}"
        )
    for key, value in here["model"].items():
        if saved.get("model", {}).get(key) != value:
            raise SpecError(
                f"model.{key}",
                f"checkpoint {path} belongs to another model ({saved.get('model_name')}: {key}="
                f"{saved.get('model', {}).get(key)}; this job: {job.model.name}: {key}={value})",
            )
    support = job.backend.adapter.capabilities.checkpoint
    reshard = support.reshard if support else frozenset()
    for key in LAYOUT_KEYS:
        old, new = saved.get("layout", {}).get(key), here["layout"][key]
        if old != new and key not in reshard:
            user_key = "launcher.nproc_per_node" if key in ("world_size", "dp", "dp_shard") else f"backend.{key}"
            raise SpecError(
                user_key,
                f"checkpoint {path} was saved with {key}={old}, this job has {key}={new}, and "
                f"{job.backend.name}'s {support.format if support else 'checkpoint'} cannot reshard {key}",
            )
    for key in sorted(support.options if support else ()):
        if saved.get("options", {}).get(key) != here["options"].get(key):
            raise SpecError(f"backend.{key}", f"checkpoint {path} was saved with {key}={saved['options'].get(key)}")
    _check_optimizer_held(job, marker, path)


def _check_optimizer_held(job: JobSpec, marker: dict[str, Any], path: Path) -> None:
    """The AdamW settings a checkpoint's optimizer state holds (torch's param_groups keep lr, betas, eps
    and weight_decay, and a resume restores them) must be this job's: else the run would train with
    the checkpoint's values while recording its own. Markers from before parabench wrote them pass."""
    saved, here = marker.get("optim"), optimizer_held(job)
    for key in OPTIMIZER_HELD if isinstance(saved, dict) else ():
        if saved.get(key) != here[key]:
            raise SpecError(
                f"optim.{key}",
                f"checkpoint {path} holds AdamW's {key}={saved.get(key)} in its optimizer state, which a resume "
                f"restores, and this job has {here[key]}: give optim.{key}={saved.get(key)} (or convert it with "
                f"optim.{key}={here[key]})",
            )


def optimizer_held(job: JobSpec) -> dict[str, Any]:
    """:data:`OPTIMIZER_HELD` of the job, as its marker records them (JSON: betas a list)."""
    optim = to_dict(job.optim)
    return json.loads(json.dumps({key: optim[key] for key in OPTIMIZER_HELD}))


def check_support(job: JobSpec) -> None:
    """run.checkpoint/run.resume/fault/max_restarts against what the backend declares."""
    adapter = job.backend.adapter
    support, ckpt = adapter.capabilities.checkpoint, job.run.checkpoint
    wants = ckpt.every > 0 or ckpt.on_signal or job.run.resume not in ("auto", "never")
    if wants and support is None:
        key = "run.checkpoint.every" if ckpt.every else "run.checkpoint.on_signal" if ckpt.on_signal else "run.resume"
        raise SpecError(key, f"backend {adapter.name} has no checkpoint support (docs/resilience.md)")
    if ckpt.async_ and support is not None and support.async_save is not None:
        raise SpecError("run.checkpoint.async", f"{adapter.name}: {support.async_save}")
    if job.launch.max_restarts and adapter.capabilities.launcher != "torchrun":
        raise SpecError(
            "launcher.max_restarts",
            f"workers are restarted by torchrun's elastic agent; {adapter.name} is launched by "
            f"{adapter.capabilities.launcher}, which parabench does not restart (docs/resilience.md)",
        )


def plan_resume(job: JobSpec, repeat: int | None = None, warn=None) -> Path | None:
    """Before launch: the checkpoint this job starts from (or None), checked against the job. Looked
    for in run.checkpoint.dir, else the job's stable folder (:func:`default_root`; ``repeat``: which
    of run.repeats), or at the run.resume path. ``warn``: where skipped partial or corrupt
    checkpoints are reported (default: stderr)."""
    check_support(job)
    resume = job.run.resume
    root = Path(job.run.checkpoint.dir) if job.run.checkpoint.dir else default_root(job, repeat)
    if root and root.exists() and not (root.is_dir() and os.access(root, os.R_OK | os.W_OK | os.X_OK)):
        raise SpecError("run.checkpoint.dir", f"{root} is not a readable and writable directory")
    supported = job.backend.adapter.capabilities.checkpoint is not None
    own = newest_complete(root, warn) if root and supported else None
    if resume == "never":
        if own:
            raise SpecError(
                "run.resume",
                f"never, but {root} already holds checkpoint {own[0].name}: resume with run.resume=auto "
                "or choose another run.checkpoint.dir",
            )
        return None
    found = own if resume == "auto" else _resolve_path(resume, warn)
    if found is None:
        return None
    if own and own[0].resolve() != found[0].resolve():
        (warn or _stderr)(
            f"run.resume={resume}: starting from {found[0]} as asked, although the job's folder {root} holds "
            f"{own[0].name} of an earlier run; this run saves beside it (another run.checkpoint.dir keeps them apart)"
        )
    check_compatible(job, found[1], found[0])
    check_work_left(job, found[1], found[0])
    untrusted.check_checkpoint(found[0], key="run.resume", trusted=job.run.trust_checkpoint)
    return found[0]


def check_work_left(job: JobSpec, marker: dict[str, Any], path: Path) -> None:
    """Refuse a resume at or past the job's last step: it would train nothing and end as a run whose
    figures look measured."""
    total, step = job.run.warmup_steps + job.run.steps, int(marker.get("step", 0))
    if step >= total:
        raise SpecError(
            "run.resume",
            f"nothing left to train: checkpoint {path} is at step {step} and this job ends at step {total}; "
            "to measure again from step 0 use run.resume=never with another run.checkpoint.dir "
            "(or raise run.steps to train on)",
        )


def write_resume_file(run_dir: Path, path: Path | None) -> None:
    """The planned checkpoint for the workers, and when this launch began (what the job saves from
    then on is its own: :func:`resume_source`); a stop request of an earlier run of this directory goes."""
    (run_dir / STOP_FILE).unlink(missing_ok=True)
    step = int(read_marker(path)["step"]) if path else 0  # kept here: keep= may prune that checkpoint later
    plan = {"path": str(path.resolve()) if path else None, "step": step, "launched": time.time()}
    (run_dir / RESUME_FILE).write_text(json.dumps(plan))


def write_stop_request(run_dir: Path, step: int) -> None:
    tmp = run_dir / (STOP_FILE + ".part")
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, run_dir / STOP_FILE)


def stop_step(run_dir: Path) -> int | None:
    """The step after which the workers save and stop (run.checkpoint.on_signal), if requested."""
    try:
        return int(json.loads((run_dir / STOP_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError):
        return None


def planned_step(run_dir: Path) -> int:
    """The step this `bench run` started from: that of the checkpoint the runner planned
    (``resume.json``), else 0. A restarted worker resumes later, from steps this run executed."""
    try:
        return int(json.loads((run_dir / RESUME_FILE).read_text()).get("step", 0))
    except (OSError, ValueError, TypeError):
        return 0


def resume_source(job: JobSpec, run_dir: Path) -> Path | None:
    """Worker side: a restarted worker continues from the newest checkpoint this launch saved in the
    job's folder; otherwise (the first start, or a restart before any save) from what the runner
    planned (``resume.json``). A checkpoint an earlier run left in that (stable) folder is not this
    launch's: it never overrides the run.resume path the runner planned."""
    try:
        plan = json.loads((run_dir / RESUME_FILE).read_text())
    except (OSError, ValueError):
        plan = {}
    root, launched = checkpoint_root(job, run_dir), float(plan.get("launched", 0))
    own = newest_complete(root, warn=lambda msg: print(f"[parabench] warning: {msg}"), saved_since=launched)
    if own:
        return own[0]
    planned = plan.get("path")
    return Path(planned) if planned else None


# --------------------------------------------------------------------------------------------
# Writing and reading (workers).
# --------------------------------------------------------------------------------------------
@dataclass
class SaveRecord:
    step: int
    blocking_s: float
    total_s: float | None = None  # async: until the background write ended
    bytes_total: int = 0  # every file of the checkpoint (rank 0's record)
    started: float = 0.0


@dataclass
class CheckpointStats:
    """What the harness measured about checkpoints in this process (rank-local)."""

    saves: list[SaveRecord] = field(default_factory=list)
    load_s: float | None = None
    resumed_step: int | None = None
    resumed_from: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "saves": [vars(s) for s in self.saves],
            "load_s": self.load_s,
            "resumed_step": self.resumed_step,
            "resumed_from": self.resumed_from,
        }


def _free(path: Path) -> str:
    """The free space beside a failed write (torch's writers report a full disk as a bare position
    mismatch: "unexpected pos")."""
    try:
        return f" ({shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free on that file system)"
    except OSError:
        return ""


def fsync_dir(path: Path) -> None:
    """A directory's entries (a rename, a new file) made durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    """Every random stream of this process: python, numpy, torch CPU, and the accelerator's."""
    import random

    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, [int(k) for k in keys], pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    for name in ("cuda", "npu"):  # only where the runtime is loaded and initialised in this process
        mod = getattr(torch, name, None)
        if mod is not None and mod.is_available() and mod.is_initialized():
            state[name] = mod.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    for name in ("cuda", "npu"):
        mod = getattr(torch, name, None)
        if name in state and mod is not None and mod.is_available():
            mod.set_rng_state_all(state[name])


# the AdamW settings torch keeps in an optimizer's param_groups, restored with its state on resume
OPTIMIZER_HELD = ("lr", "betas", "eps", "weight_decay")


def write_marker(tmp: Path, step: int, ctx, run_id: str | None, **extra: Any) -> int:
    """Write ``COMPLETE`` into the checkpoint directory ``tmp``, last and fsynced: the step, the time,
    the job identity, the world size, the MLflow run id and the size of every file. Returns the files'
    bytes."""
    files = {
        str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file() and p != tmp / MARKER
    }
    marker = {"step": step, "time": time.time(), "job": job_identity(ctx.job), "files": files}
    marker["optim"] = optimizer_held(ctx.job)
    marker.update(world_size=ctx.world_size, mlflow_run_id=run_id, **extra)
    with open(tmp / MARKER, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return sum(files.values())


class Checkpointer:
    """One rank's side of saving and resuming (every call is collective over the job's ranks)."""

    def __init__(self, engine: Checkpointing, ctx, run_id: str | None = None):
        job = ctx.job
        self.engine, self.ctx, self.comm = engine, ctx, ctx.comm
        self.root = checkpoint_root(job, ctx.run_dir)
        self.every, self.keep, self.async_ = (
            job.run.checkpoint.every,
            job.run.checkpoint.keep,
            job.run.checkpoint.async_,
        )
        self.run_id = run_id
        self.stats = CheckpointStats()
        self._pending: tuple[SaveRecord, Path] | None = None

    # -- saving ------------------------------------------------------------------------------
    def due(self, completed: int, total: int) -> bool:
        """Every ``every`` steps and after the last step, so the run's end state can be continued or
        converted."""
        return self.every > 0 and (completed % self.every == 0 or completed == total)

    def save(self, completed: int, harness: dict[str, Any]) -> SaveRecord:
        """Write checkpoint ``step_<completed>`` (async: its marker follows at the next save/close)."""
        self.finish()
        t0 = time.perf_counter()
        tmp = self.root / f"{step_dir(self.root, completed).name}{TMP}"
        try:
            if self.ctx.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / "harness").mkdir(parents=True)
            self.comm.barrier()
            self.engine.save_checkpoint(tmp / "native", async_save=self.async_)
            fire_fault(self.ctx.job, self.ctx.run_dir, self.ctx.rank, completed, at="save")  # fault.at=save
            _save_torch(harness, tmp / "harness" / f"rank{self.ctx.rank}.pt")
        except OSError as exc:
            raise CheckpointError(f"checkpoint step {completed}: writing {tmp} failed: {exc}{_free(tmp)}") from None
        record = SaveRecord(completed, time.perf_counter() - t0, started=t0)
        self.stats.saves.append(record)
        self._pending = (record, tmp)
        if not self.async_:
            self.finish()
        return record

    def finish(self) -> None:
        """Complete the pending save: wait for its files, then marker + rename + prune on rank 0."""
        if self._pending is None:
            return
        record, tmp = self._pending
        self._pending = None
        done = self.engine.finish_checkpoint()
        self.comm.barrier()
        record.total_s = (done or time.perf_counter()) - record.started
        if self.ctx.rank == 0:
            try:
                record.bytes_total = self._publish(record.step, tmp)
            except OSError as exc:
                raise CheckpointError(
                    f"checkpoint step {record.step}: finishing {tmp} failed: {exc}{_free(tmp)}"
                ) from None
        self.comm.barrier()

    def _publish(self, step: int, tmp: Path) -> int:
        total = write_marker(tmp, step, self.ctx, self.run_id)
        final = step_dir(self.root, step)
        aside = final.with_name(final.name + OLD)
        if final.exists():  # the same step saved again (a resume from an older checkpoint):
            shutil.rmtree(aside, ignore_errors=True)  # moved aside, deleted once the new one is visible
            os.rename(final, aside)
            fsync_dir(self.root)
        os.rename(tmp, final)
        fsync_dir(self.root)
        shutil.rmtree(aside, ignore_errors=True)
        self._prune()
        return total

    def _prune(self) -> None:
        """Older complete checkpoints beyond ``keep``, and set-aside copies whose step is visible again."""
        for old in self.root.glob(f"{PREFIX}*{OLD}"):
            if old.with_name(old.name.removesuffix(OLD)).exists():
                shutil.rmtree(old, ignore_errors=True)
        if self.keep <= 0:
            return
        complete = sorted(p for p in _final_dirs(self.root) if (p / MARKER).exists())
        for old in complete[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # -- what the loop calls --------------------------------------------------------------------
    def after_step(self, completed: int, total: int, history: dict[str, list], ledger) -> None:
        """After a step, outside its timed region: save when ``completed`` is a multiple of every or
        the last step, or when it is the step the runner asked to stop at (then raise StopRequested)."""
        stop = stop_step(self.ctx.run_dir) == completed
        if not (stop or self.due(completed, total)):
            return
        harness = {
            "step": completed,
            "rng": rng_state(),
            "ledger": {"dp_rank": ledger.dp_rank, "dp_size": ledger.dp_size, "checksum": ledger.checksum},
            "history": {k: list(v) for k, v in history.items()},
        }
        self.save(completed, harness)
        if stop:
            self.finish()
            raise StopRequested(f"stopped by a signal after a last checkpoint at step {completed}")

    def resume(self, ledger, history: dict[str, list]) -> int:
        """Restore from the planned/newest checkpoint, if any: the first step to run (0 if none)."""
        path = resume_source(self.ctx.job, self.ctx.run_dir)
        if path is None:
            return 0
        state = self.load(path)
        set_rng_state(state["rng"])
        for key, values in state["history"].items():
            history[key][:] = values
        ledger.checksum = _ledger_checksum(state["ledgers"], ledger)
        return int(state["step"])

    # -- resuming ----------------------------------------------------------------------------
    def load(self, path: Path) -> dict[str, Any]:
        """Restore the engine from ``path`` and return this rank's harness state."""
        t0 = time.perf_counter()
        marker = read_marker(path)
        try:
            self.engine.load_checkpoint(path / "native")
        except OSError as exc:
            raise CheckpointError(f"loading {path}: {exc}") from None
        saved_world = int(marker["world_size"])
        states = [_load_torch(path / "harness" / f"rank{r}.pt") for r in range(saved_world)]
        mine = states[self.ctx.rank % saved_world]
        mine["history"] = states[0]["history"]
        mine["ledgers"] = [s["ledger"] for s in states]
        self.comm.barrier()
        self.stats.load_s = time.perf_counter() - t0
        self.stats.resumed_step, self.stats.resumed_from = int(marker["step"]), str(path)
        return mine


def _save_torch(obj: Any, path: Path) -> None:
    import torch

    part = path.with_name(path.name + ".part")
    torch.save(obj, part)
    os.replace(part, path)


def _load_torch(path: Path) -> dict[str, Any]:
    import torch

    try:
        return torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from None


def _ledger_checksum(saved: list[dict[str, Any]], ledger) -> int:
    """This rank's data-ledger checksum after a resume: its own when the data-parallel layout is
    unchanged; resharded, data-parallel rank 0 carries the sum over the saved ranks (the run's
    checksum is the sum over data-parallel ranks, parabench.data.combined_checksum)."""
    from parabench.data import CHECKSUM_MOD

    if saved[0]["dp_size"] == ledger.dp_size:
        return next(int(s["checksum"]) for s in saved if s["dp_rank"] == ledger.dp_rank)
    if ledger.dp_rank != 0:
        return 0
    per_dp = {s["dp_rank"]: int(s["checksum"]) for s in saved}
    return sum(per_dp.values()) % CHECKSUM_MOD
