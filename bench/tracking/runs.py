"""MLflow logging: one run per job; a parent run with a child per job for multirun sweeps (the
parent is opened by :mod:`parabench.run.sweep`).

Default store: embedded and local, ``sqlite:///<results_dir>/mlflow.db`` with artifacts under
``<results_dir>/mlartifacts`` (open it with ``mlflow ui --backend-store-uri sqlite:///results/mlflow.db``).
Nothing is written to MLflow before a job has passed validation.

A job's run is spooled (docs/tracking.md#outages): every record (the run's creation, params, tags,
metrics, artifacts, status) is appended to ``<run_dir>/tracking/spool.jsonl`` before it is sent,
and ``tracking/state.json`` says how many the store has. When the store cannot be reached (at the
start or later) the job goes on, records are only spooled, and :func:`sync` (``bench sync``) sends
the rest later: a metric (key, step) the run already has is never sent twice.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from parabench import expertload
from parabench.errors import SpecError
from parabench.spec import TrackingSpec
from parabench.tracking import store as trackstore

PARENT_ENV = "PARABENCH_PARENT_RUN_ID"
SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
MAX_PARAM_LEN = 6000  # MLflow's param value limit
SPOOL_DIR = "tracking"  # in the run directory
SPOOL_FILE = "spool.jsonl"
STATE_FILE = "state.json"
SPOOL_ID_TAG = "parabench.spool_id"  # finds the run a spool belongs to, on the store
CONNECT_TIMEOUT_S = 15.0  # a server that answers slower when the job starts: spooled
SYNC_PROBE_TIMEOUT_S = 60.0  # bench sync: how long a just-restarted server may take to answer its first request
STORE_CACHE = Path.home() / ".cache" / "parabench" / "mlflow-stores"  # trackstore.seed_sqlite_store
METRIC_BATCH = 500  # log_batch: at most 1000 metrics a call (MLflow's limit), 100 params


def is_secret(name: str) -> bool:
    return bool(SECRET.search(name))


def default_store_uri(results_dir: str) -> str:
    """The local MLflow store of a results directory (``tracking.uri`` unset)."""
    return f"sqlite:///{(Path(results_dir).resolve() / 'mlflow.db')}"


def store_uri(tracking: TrackingSpec, results_dir: str) -> str:
    return tracking.uri or default_store_uri(results_dir)


def artifact_root(results_dir: str) -> str:
    return (Path(results_dir).resolve() / "mlartifacts").as_uri()


def _client(uri: str):
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = trackstore.credentials_to_env(uri, os.environ)  # MLflow prints the URI it is given
    mlflow.set_tracking_uri(uri)
    with trackstore.store_lock(uri):  # a new SQLite file's schema is created here, once
        trackstore.seed_sqlite_store(uri, STORE_CACHE)
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


def _store_errors() -> tuple[type[BaseException], ...]:
    """What a store that is down or failing raises: MLflow wraps HTTP and database errors in
    MlflowException; an artifact upload through a server raises requests' errors (OSError)."""
    from mlflow.exceptions import MlflowException

    return (MlflowException, OSError)


def _now_ms() -> int:
    return int(time.time() * 1000)


# ------------------------------------------------------------------------------------------------
# The spool of one run.
# ------------------------------------------------------------------------------------------------
class Spool:
    """``<run_dir>/tracking/``: ``spool.jsonl``, one record a line in the order they were made, and
    ``state.json``: the spool id, the store (without credentials), the run id once created, and
    ``sent``, how many records the store has."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.folder = self.run_dir / SPOOL_DIR
        self.path = self.folder / SPOOL_FILE
        self.state_path = self.folder / STATE_FILE

    def exists(self) -> bool:
        return self.state_path.is_file()

    def create(self, state: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.save(state)

    def append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a torn last line: the job was killed while writing it
                break
        return out

    def state(self) -> dict[str, Any]:
        return json.loads(self.state_path.read_text())

    def save(self, state: dict[str, Any]) -> None:
        tmp = self.state_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.state_path)


def _apply(client, state: dict[str, Any], record: dict[str, Any], run_dir: Path, seen: set | None) -> None:
    """Send one spooled record to the store. ``seen``: the (key, step) pairs of metrics the run has
    (None: a live run, which sends each record once)."""
    from mlflow.entities import Metric, Param, RunTag

    op, run_id = record["op"], state.get("run_id")
    if op == "start":
        exp = _experiment_id(client, state["experiment"], state["results_dir"])
        state["experiment_id"] = exp
        if run_id is None:
            run = client.create_run(exp, run_name=record["run_name"], tags=record["tags"], start_time=record["time"])
            state["run_id"] = run.info.run_id
    elif op == "params":
        have = client.get_run(run_id).data.params if seen is not None else {}
        items = [Param(k, v) for k, v in sorted(record["params"].items()) if k not in have]
        for i in range(0, len(items), 100):
            client.log_batch(run_id, params=items[i : i + 100])
    elif op == "metrics":
        batch = [Metric(k, float(v), ts, step) for k, v, step, ts in record["metrics"]]
        if seen is not None:
            batch = [m for m in batch if (m.key, m.step) not in seen]
            seen.update((m.key, m.step) for m in batch)
        for i in range(0, len(batch), METRIC_BATCH):
            client.log_batch(run_id, metrics=batch[i : i + METRIC_BATCH])
    elif op == "tags":
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in record["tags"].items()])
    elif op == "artifacts":  # log_artifact replaces a file of the same path: sending twice is harmless
        for rel in record["files"]:
            _upload_confined(client, run_id, run_dir, str(rel))
    elif op == "end":
        client.set_terminated(run_id, record["status"], end_time=record["time"])


def _open_confined(run_dir: Path, rel: str) -> int:
    """A read-only descriptor of the regular file ``rel`` inside ``run_dir``, opened one path component
    at a time without following a link (``O_NOFOLLOW``, relative to the folder's descriptor: nothing
    can be swapped in between); OSError naming why not. A spool is data: its file list may name a
    link, a ``..`` or an absolute path (a spool on a shared disk), and nothing outside the run
    directory is ever uploaded."""
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or ".." in parts:
        raise OSError("outside the run directory")
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | (0 if last else os.O_DIRECTORY)
            try:
                child = os.open(part, flags | getattr(os, "O_NONBLOCK", 0), dir_fd=fd)
            except OSError as exc:
                link = os.path.islink(os.path.join(run_dir, *parts[: i + 1]))
                raise OSError("a symbolic link" if link else exc.strerror) from None
            os.close(fd)
            fd = child
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:  # a hard link can name a file elsewhere
            raise OSError("not a regular file" if not stat.S_ISREG(st.st_mode) else "a hard link")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _upload_confined(client: Any, run_id: str | None, run_dir: Path, rel: str) -> None:
    """Upload ``run_dir/rel`` as the artifact ``rel`` if it is a file of the run directory (a copy of
    what was opened, so the upload is what was checked); else one line saying why not."""
    import tempfile

    try:
        fd = _open_confined(run_dir, rel)
    except FileNotFoundError:
        return  # listed but gone (a log rotated away): nothing to send
    except OSError as exc:
        print(
            f"parabench: tracking: {_printable(rel)} of {run_dir}: not uploaded ({exc.strerror or exc}); only "
            "files inside the run directory are, never links",
            file=sys.stderr,
            flush=True,
        )
        return
    with os.fdopen(fd, "rb") as src, tempfile.TemporaryDirectory(prefix="parabench-artifact-") as tmp:
        copy = Path(tmp) / Path(rel).name
        with open(copy, "wb") as dst:
            shutil.copyfileobj(src, dst)
        folder = str(Path(rel).parent)
        client.log_artifact(run_id, str(copy), None if folder == "." else folder)


def _printable(text: str, limit: int = 200) -> str:
    """Text from a spool as one line of a message: control characters shown as '?', cut to ``limit``."""
    return "".join(c if c.isprintable() else "?" for c in str(text))[:limit]


class JobRun:
    """The MLflow run of one job. Use ``start``, log, then ``end(status)``. With ``run_dir`` every
    record is spooled there first, and a store that fails turns the rest of the job offline."""

    def __init__(self, tracking: TrackingSpec, results_dir: str, run_dir: Path | None = None):
        self.tracking = tracking
        self.results_dir = results_dir
        self.client = None
        self.run_id: str | None = None
        self.spool = Spool(run_dir) if run_dir is not None else None
        self.state: dict[str, Any] = {}
        self.offline: str | None = None  # why records are only spooled now (None: sent as they come)
        self.logged: set[tuple[str, int]] = set()  # metric (key, step) pairs recorded: never twice

    @property
    def active(self) -> bool:
        return bool(self.run_id or self.offline)

    def start(self, run_name: str, params: Mapping[str, str], tags: Mapping[str, str]) -> str | None:
        if not self.tracking.enabled:
            return None
        uri = store_uri(self.tracking, self.results_dir)
        all_tags = {k: str(v) for k, v in tags.items() if v is not None}
        parent = os.environ.get(PARENT_ENV)
        if parent:
            all_tags["mlflow.parentRunId"] = parent
        self.state = {
            "spool_id": uuid.uuid4().hex,
            "store": trackstore.without_credentials(uri),
            "experiment": self.tracking.experiment,
            "results_dir": str(Path(self.results_dir).resolve()),
            "run_id": None,
            "sent": 0,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        all_tags[SPOOL_ID_TAG] = self.state["spool_id"]
        if self.spool is not None:
            self.spool.create(self.state)
            self._connect(uri)
        else:
            self.client = _client(uri)
        self._record({"op": "start", "run_name": run_name, "tags": all_tags, "time": _now_ms()})
        self._record({"op": "params", "params": {k: v[:MAX_PARAM_LEN] for k, v in params.items()}})
        return self.run_id

    def _connect(self, uri: str) -> None:
        """Open the store; a server that does not answer (one short request) makes the job offline."""
        try:
            if trackstore.scheme(uri) in ("http", "https"):
                # the run starts anyway: wait as long as one of MLflow's requests may (bound_retries)
                trackstore.probe_server(uri, self.tracking.experiment, timeout_s=CONNECT_TIMEOUT_S)
            self.client = _client(uri)
        except SpecError as exc:
            self._go_offline(exc.message)
        except _store_errors() as exc:
            self._go_offline(str(exc).splitlines()[0][:300])

    def _record(self, record: dict[str, Any]) -> None:
        if self.spool is None:  # a sweep's parent run: no run directory, sent or failed at once
            _apply(self.client, self.state, record, Path("."), None)
            self.run_id = self.state["run_id"]
            return
        self.spool.append(record)
        if self.offline:
            return
        try:
            _apply(self.client, self.state, record, self.spool.run_dir, None)
        except _store_errors() as exc:
            self._go_offline(str(exc).splitlines()[0][:300])
            return
        self.run_id = self.state["run_id"]
        self.state["sent"] += 1
        self.spool.save(self.state)

    def _go_offline(self, why: str) -> None:
        self.offline = trackstore.redact(why)
        where = self.spool.run_dir if self.spool else "?"
        print(
            f"parabench: tracking: {trackstore.shown(store_uri(self.tracking, self.results_dir))} failed "
            f"({self.offline}); the run goes on, its tracking is spooled in {where}/{SPOOL_DIR}; "
            f"upload it later with: {self._sync_command(where)}",
            file=sys.stderr,
            flush=True,
        )

    def _sync_command(self, run_dir: Path | str) -> str:
        """What uploads this spool: bench sync sends only to the store the user names."""
        return f"bench sync {run_dir} --tracking-uri {trackstore.without_credentials(store_uri(self.tracking, self.results_dir))}"

    def log_metrics(self, metrics: Iterable[tuple[str, float, int]]) -> None:
        """Record (key, value, step) triples; a (key, step) pair this run already has is left out."""
        if not self.active:
            return
        now = _now_ms()
        batch = []
        for k, v, step in metrics:
            if v is not None and (k, step) not in self.logged:
                self.logged.add((k, step))
                batch.append([k, float(v), int(step), now])
        if batch:
            self._record({"op": "metrics", "metrics": batch})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.active:
            self._record({"op": "tags", "tags": {k: str(v) for k, v in tags.items() if v is not None}})

    def log_artifacts(self, paths: Iterable[Path], run_dir: Path) -> None:
        if self.active:
            self._record({"op": "artifacts", "files": [str(p.relative_to(run_dir)) for p in paths if p.is_file()]})

    def end(self, status: str) -> None:
        if not self.active:
            return
        self._record({"op": "end", "status": status, "time": _now_ms()})
        if self.offline and self.spool is not None:
            print(
                f"parabench: tracking: the run ({status}) is spooled in {self.spool.folder}, not in MLflow; "
                f"upload it with: {self._sync_command(self.spool.run_dir)}",
                file=sys.stderr,
                flush=True,
            )


class StepTail:
    """The steps rank 0 has finished (``steps.jsonl``, appended during the run), read as they come:
    each call of :meth:`new` returns the metrics of the lines added since the last one (per step:
    loss, a MoE model's tokens per expert; for measured steps also the slowest rank's step time and
    tokens/s from it)."""

    def __init__(self, path: Path, warmup_steps: int, tokens_per_step: int):
        self.path = path
        self.warmup_steps = warmup_steps
        self.tokens_per_step = tokens_per_step
        self.offset = 0

    def new(self) -> list[tuple[str, float, int]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:  # no step finished yet
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written is read next time
        self.offset += len(complete)
        out: list[tuple[str, float, int]] = []
        for line in complete.decode().splitlines():
            if line.strip():
                out += step_metrics(json.loads(line), self.warmup_steps, self.tokens_per_step)
        return out


def step_metrics(step: Mapping[str, Any], warmup_steps: int, tokens_per_step: int) -> list[tuple[str, float, int]]:
    """One finished step's metrics, as the end of the run logs them too (runner._log_results)."""
    i = int(step["step"])
    out = [("loss", float(step["loss"]), i)]
    if i >= warmup_steps and step.get("step_time_s"):
        t = float(step["step_time_s"])
        out += [("step_time_s", t, i), ("step_tokens_per_s", tokens_per_step / t, i)]
    if step.get("moe_tokens_per_expert"):  # MoE: tokens per expert and load imbalance, warm-up included
        out += expertload.step_metrics(i, step["moe_tokens_per_expert"])
    return out


# ------------------------------------------------------------------------------------------------
# bench sync: what a spool has and its store has not.
# ------------------------------------------------------------------------------------------------
def _writer_alive(state: Mapping[str, Any]) -> bool:
    """Is the `bench run` that writes this spool still running (on this host)?"""
    if state.get("host") != socket.gethostname() or not state.get("pid"):
        return False
    try:
        cmdline = Path(f"/proc/{int(state['pid'])}/cmdline").read_bytes()
    except OSError:
        return False
    return b"parabench" in cmdline or b"bench" in cmdline


def _find_run(client, state: Mapping[str, Any]) -> str | None:
    """The run a spool created earlier (a sync that stopped before it saved the run id)."""
    exp = client.get_experiment_by_name(state["experiment"])
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{SPOOL_ID_TAG}` = '{state['spool_id']}'")
    return runs[0].info.run_id if runs else None


def _metrics_on_store(client, run_id: str, records: list[dict[str, Any]]) -> set[tuple[str, int]]:
    keys = {m[0] for r in records if r["op"] == "metrics" for m in r["metrics"]}
    return {(k, m.step) for k in sorted(keys) for m in client.get_metric_history(run_id, k)}


def _check_spool_target(run_dir: Path, state: dict[str, Any], uri: str, named: bool) -> None:
    """A spool is data: the store its ``state.json`` names is never where it is sent (a crafted spool
    on a shared disk would receive the user's credentials at its own server). ``uri`` is the store the
    user configured; unless the user named it (``named``: --tracking-uri), a spool written for another
    store is refused, naming both. A local store's experiment name becomes a folder of artifacts:
    one that leaves it is refused."""
    written, target = str(state.get("store")), trackstore.without_credentials(uri)
    if not named and written.rstrip("/") != target.rstrip("/"):
        raise SpecError(
            "RUN_DIR",
            f"{run_dir}: its spool was written for the store {_printable(trackstore.shown(written))}, not the "
            f"configured {trackstore.shown(uri)} (--tracking-uri, else $MLFLOW_TRACKING_URI, else --results-dir's "
            "store); bench sync never takes the store from the spool: if that store is yours, name it "
            "with --tracking-uri",
        )
    name = Path(str(state.get("experiment")))
    if trackstore.scheme(uri) not in ("http", "https") and (name.is_absolute() or ".." in name.parts):
        raise SpecError("RUN_DIR", f"{run_dir}: experiment name {_printable(str(name))!r} leaves the artifact folder")


def sync(run_dir: Path, uri: str, named: bool = True) -> str:
    """Send the records of ``run_dir``'s spool that the store ``uri`` has not got; one line saying
    what was done. ``uri`` is the user's store, never the spool's (:func:`_check_spool_target`;
    ``named``: the user gave it explicitly, so a spool written for another store goes there too).
    Running it again sends nothing: ``state.json`` counts what the store has, and a metric (key,
    step) the run already has is left out."""
    spool = Spool(run_dir)
    if not spool.exists():
        raise SpecError("RUN_DIR", f"{run_dir}: no tracking spool ({SPOOL_DIR}/{STATE_FILE}): not a run directory")
    state, records = spool.state(), spool.records()
    _check_spool_target(run_dir, state, uri, named)
    db = trackstore.sqlite_path(uri)  # a local store's artifacts go beside it, not where the spool says
    state["results_dir"] = str(db.parent.resolve()) if db else state.get("results_dir", str(Path("results").resolve()))
    if state.get("pid") != os.getpid() and _writer_alive(state):
        return f"{run_dir}: still being written by bench run (pid {state['pid']}): left for later"
    ended = bool(records) and records[-1]["op"] == "end"
    if state["sent"] >= len(records) and ended:
        return f"{run_dir}: up to date (run {state['run_id']}, {len(records)} records)"
    if not ended:  # killed before it could record its status (SIGKILL, the OOM killer, a lost node)
        why = (
            f"bench (pid {state.get('pid')} on {state.get('host')}) ended without recording a status "
            "(killed: SIGKILL, the OOM killer or a lost node); closed later by bench"
        )
        for extra in (
            {"op": "tags", "tags": {"failure_reason": why}},
            {"op": "end", "status": "KILLED", "time": _now_ms()},
        ):
            spool.append(extra)
            records.append(extra)
    target = uri
    if trackstore.scheme(target) in ("http", "https"):
        # a server started moments ago (the usual case: sync runs once it is back) builds its store on
        # the first request (MLflow's SqlAlchemyStore connects and checks the schema): longer than the
        # 5 s a run waits at its start, on a loaded machine; sync is run by hand and can wait
        trackstore.probe_server(target, state["experiment"], key="--tracking-uri", timeout_s=SYNC_PROBE_TIMEOUT_S)
    client = _client(target)
    if state["run_id"] is None:
        state["run_id"] = _find_run(client, state)
    seen = _metrics_on_store(client, state["run_id"], records) if state["run_id"] else set()
    first = state["sent"]
    for i in range(first, len(records)):
        _apply(client, state, records[i], spool.run_dir, seen)
        state["sent"] = i + 1
        spool.save(state)
    return f"{run_dir}: uploaded {len(records) - first} records to run {state['run_id']} in {trackstore.shown(target)}"


def spools_under(results_dir: Path) -> list[Path]:
    """The run directories under ``results_dir`` whose spool has records the store has not got."""
    out = []
    for state_path in sorted(results_dir.glob(f"runs/**/{SPOOL_DIR}/{STATE_FILE}")):
        spool = Spool(state_path.parent.parent)
        records = spool.records()
        if spool.state()["sent"] < len(records) or not records or records[-1]["op"] != "end":
            out.append(spool.run_dir)
    return out


def results_dir_of(store: str) -> Path:
    """Where the spools of ``store``'s runs live: beside a local SQLite store, else ``results``."""
    prefix = "sqlite:///"
    return Path(store[len(prefix) :]).parent if store.startswith(prefix) else Path("results")


def close_abandoned(results_dir: Path, store: str) -> list[str]:
    """Close the runs of ``store`` that a killed ``bench`` on this host left RUNNING (its spool under
    ``results_dir`` has no end and its process is gone): each is synced, which records it KILLED
    with the reason. Every bench command that writes to a store calls this first, so a killed run
    does not stay RUNNING until someone runs ``bench sync``. One line per run closed or not closed;
    a store that fails leaves the run for later. Another host's runs are never touched (it may be
    a node of a running multi-node job on a shared file system)."""
    lines = []
    wanted = trackstore.without_credentials(store)
    for run_dir in spools_under(results_dir):
        spool = Spool(run_dir)
        state, records = spool.state(), spool.records()
        mine = state.get("pid") == os.getpid()  # this process's own runs (bench called in-process)
        if state.get("store") != wanted or state.get("host") != socket.gethostname() or mine or _writer_alive(state):
            continue
        if records and records[-1]["op"] == "end":  # ended, only not uploaded: bench sync's business
            continue
        try:
            lines.append("parabench: closed a run left RUNNING by a killed bench: " + sync(run_dir, store))
        except SpecError as exc:
            lines.append(f"parabench: {run_dir}: left RUNNING by a killed bench, not closed: {exc}")
        except _store_errors() as exc:
            why = trackstore.redact(str(exc).splitlines()[0][:300])
            lines.append(f"parabench: {run_dir}: left RUNNING by a killed bench, not closed: {why}")
    return lines


def end_own_runs(results_dir: Path, store: str, status: str, why: str) -> list[str]:
    """End the runs of ``store`` that this process opened and has not ended (a sweep's parent when
    SIGTERM or Ctrl-C stops the sweep: Hydra calls no end callback then) with ``status`` and ``why``."""
    lines = []
    wanted = trackstore.without_credentials(store)
    for run_dir in spools_under(results_dir):
        spool = Spool(run_dir)
        state, records = spool.state(), spool.records()
        if state.get("store") != wanted or state.get("pid") != os.getpid() or (records and records[-1]["op"] == "end"):
            continue
        spool.append({"op": "tags", "tags": {"failure_reason": why}})
        spool.append({"op": "end", "status": status, "time": _now_ms()})
        try:
            lines.append(sync(run_dir, store))
        except (SpecError, *_store_errors()) as exc:
            lines.append(
                f"parabench: {run_dir}: {status} not recorded yet ({exc}); "
                f"bench sync {run_dir} --tracking-uri {trackstore.without_credentials(store)} uploads it"
            )
    return lines


def sync_main(argv: list[str]) -> int:
    """``bench sync [RUN_DIR...] [--tracking-uri URI] [--results-dir DIR]``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="bench sync",
        description="Upload what runs spooled while their MLflow store was unreachable (running it twice "
        "uploads nothing twice). Credentials: MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD.",
    )
    p.add_argument(
        "run_dirs", nargs="*", type=Path, help="run directories (default: every spooled run under --results-dir)"
    )
    p.add_argument(
        "--tracking-uri",
        help="the store to upload to (default: $MLFLOW_TRACKING_URI, else --results-dir's local store); never the "
        "one a spool names: a spool written for another store is refused unless this flag names the target",
    )
    p.add_argument(
        "--results-dir", type=Path, default=Path("results"), help="where to look without RUN_DIR; its mlflow.db"
    )
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    dirs = args.run_dirs or spools_under(args.results_dir)
    if not dirs:
        print(f"bench sync: nothing to upload under {args.results_dir}")
        return 0
    rc = 0
    store = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_store_uri(str(args.results_dir))
    for run_dir in dirs:  # one line each; a failed one is left for the next sync
        try:
            print(sync(run_dir, store, named=args.tracking_uri is not None))
        except SpecError as exc:
            print(f"bench sync: error: {exc}", file=sys.stderr)
            rc = max(rc, 2 if exc.key == "RUN_DIR" else 1)
        except _store_errors() as exc:
            print(
                f"bench sync: {run_dir}: failed: {trackstore.redact(str(exc).splitlines()[0][:300])}", file=sys.stderr
            )
            rc = max(rc, 1)
    return rc
