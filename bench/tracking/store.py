"""The MLflow store a job records into: checked before launch, and opened safely when many jobs
share it.

- :func:`check` refuses, before anything starts, a ``tracking.uri`` whose scheme MLflow has no store
  for, and probes an MLflow server (``http(s)://``) once with a short timeout: a server that does
  not answer, refuses the credentials (401/403) or is not an MLflow server is one line, exit 2,
  within seconds (MLflow's own client would retry for minutes first).
- :func:`experiment_id` gets or creates the experiment. Several ``bench run`` writing into one new
  experiment at once race in MLflow's create-experiment (the name is UNIQUE) and, on a new SQLite
  file, in its schema creation: a local SQLite store is opened under a file lock beside the
  database, and a create that lost the race to another job takes the experiment that job created.
- A new local SQLite store starts as a copy of an empty store (:func:`seed_sqlite_store`): MLflow
  creates a new database by running every schema migration since its first release, ~3 CPU-seconds
  of each new results directory; the empty, migrated database is kept once per MLflow version under
  ``~/.cache/parabench/mlflow-stores/`` and copied. MLflow still verifies the copy's schema revision
  and creates its Default experiment (left out of the copy) when it opens it.
- Experiments are created as model-training experiments (docs/sources.md#mlflow-experiment-kind),
  so that MLflow 3's UI opens them on the runs table instead of its GenAI overview.

Credentials for a server come from MLflow's standard variables (``MLFLOW_TRACKING_USERNAME`` /
``MLFLOW_TRACKING_PASSWORD``, ``MLFLOW_TRACKING_TOKEN``), read by MLflow itself; a
``user:password@`` in the URI is moved into those variables (:func:`credentials_to_env`) and never
written: files and MLflow get :func:`without_credentials`, messages :func:`shown` / :func:`redact`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import sqlite3
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from parabench.errors import SpecError
from parabench.spec import TrackingSpec

# The schemes MLflow 3 has a tracking store for (mlflow/tracking/_tracking_service/utils.py,
# _register_tracking_stores; database schemes may carry a driver: postgresql+psycopg2://).
SCHEMES = ("", "file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks", "databricks-uc", "uc")
PROBE_TIMEOUT_S = 5.0
PROBE_ENDPOINT = "/api/2.0/mlflow/experiments/get-by-name"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # docs/sources.md#mlflow-experiment-kind
TRAINING_KIND = "custom_model_development"
# The user-info of a URI: up to its last '@' before the path, as urlsplit takes it; also as Hydra
# escapes a URI in the overrides it saves and prints (``http\://user\:pw@host``).
USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*\\*://)([^/\s]+)@")
HYDRA_ESCAPE = re.compile(r"\\(.)")  # an escaped character of a Hydra override value: \: \= \, ...
URI_KEY = "tracking.uri"
HTTP_RETRIES = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
}


class Unreachable(SpecError):
    """No MLflow server answers at the URI (refused, timed out, unknown host)."""


def scheme(uri: str) -> str:
    """The store scheme of a tracking URI: ``postgresql+psycopg2://h/db`` -> ``postgresql``."""
    return urlsplit(uri).scheme.lower().split("+", 1)[0]


def shown(uri: str) -> str:
    """A URI as it may be printed: without ``user:password@``."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def ui_link(uri: str, experiment_id: str) -> str | None:
    """The page of an experiment's runs table on an MLflow server (None for a local store). MLflow
    3's UI opens its GenAI overview unless the URL asks for the model-training view
    (docs/sources.md#mlflow-ui-workflow)."""
    if scheme(uri) not in ("http", "https"):
        return None
    return f"{shown(uri).rstrip('/')}/#/experiments/{experiment_id}?workflowType=machine_learning"


def without_credentials(uri: str) -> str:
    """A URI as it may be written to a file: the ``user:password@`` part left out."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def credentials_to_env(uri: str, environ: MutableMapping[str, str]) -> str:
    """A URI's ``user:password@`` moved into MLflow's standard variables (MLFLOW_TRACKING_USERNAME /
    MLFLOW_TRACKING_PASSWORD, read by its client for HTTP basic auth), and the URI without them:
    MLflow prints the tracking URI it was given (docs/sources.md#mlflow-http-retries)."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc or scheme(uri) not in ("http", "https"):
        return uri
    _userinfo_to_env(parts.netloc.rsplit("@", 1)[0], environ)
    return without_credentials(uri)


def _userinfo_to_env(userinfo: str, environ: MutableMapping[str, str]) -> None:
    user, _, password = userinfo.partition(":")
    environ["MLFLOW_TRACKING_USERNAME"] = unquote(user)
    if password:
        environ["MLFLOW_TRACKING_PASSWORD"] = unquote(password)


def overrides_without_credentials(overrides: list[str], environ: MutableMapping[str, str]) -> list[str]:
    """Command-line overrides with the ``user:password@`` of an http(s) ``tracking.uri`` moved into
    MLflow's variables (as :func:`credentials_to_env`). Called before Hydra sees the overrides: Hydra
    saves them (``.hydra/``, ``multirun.yaml``), prints a sweep's job lines, and hands them to the
    sweep's parent run and to submitit's pickles, escaped (``http\\://user\\:pw@``). A database
    URI keeps its login (its store needs it there); a sweep over several logins is refused."""
    out = []
    for override in overrides:
        name, eq, value = override.partition("=")
        if not eq or name.lstrip("+~") != URI_KEY:
            out.append(override)
            continue
        logins = {HYDRA_ESCAPE.sub(r"\1", m.group(2)) for m in USERINFO.finditer(value) if _is_http(m)}
        if len(logins) > 1:
            raise SpecError(
                URI_KEY,
                "a sweep over URIs with different user:password@ parts; give one login in "
                "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD instead",
            )
        for login in logins:
            _userinfo_to_env(login, environ)
        out.append(name + "=" + USERINFO.sub(lambda m: m.group(1) if _is_http(m) else m.group(0), value))
    return out


def _is_http(userinfo: re.Match[str]) -> bool:
    """Whether a :data:`USERINFO` match is that of an http(s) URI (escaped or not)."""
    return scheme(HYDRA_ESCAPE.sub(r"\1", userinfo.group(1))) in ("http", "https")


def redact(text: str) -> str:
    """``text`` with the user-info part of every URI in it replaced by ``***`` (also in the escaped
    form of Hydra's saved overrides)."""
    return USERINFO.sub(r"\1***@", text)


def bound_retries(environ: MutableMapping[str, str]) -> None:
    """MLflow's HTTP client retries a failing request 7 times with a backoff factor of 2 and a 120 s
    timeout (docs/sources.md#mlflow-http-retries): minutes before a server that went away is noticed. A run spools instead: a few seconds of retries (unless the user set them)."""
    for key, value in HTTP_RETRIES.items():
        environ.setdefault(key, value)


def check(tracking: TrackingSpec, probe: bool = True, key: str = "tracking.uri", unreachable_ok: bool = False) -> None:
    """Refuse a tracking store that cannot take the run, before anything starts (one line, exit 2).
    ``key``: the setting the user gave the URI with, named in the message. ``unreachable_ok``: a
    server that does not answer is let through (the run spools; :class:`parabench.tracking.runs.JobRun`
    says so), one that answers wrongly (credentials refused, not MLflow) is still refused."""
    if not tracking.enabled or not tracking.uri:
        return
    kind = scheme(tracking.uri)
    if kind not in SCHEMES:
        raise SpecError(
            key,
            f"MLflow has no tracking store for the scheme '{kind}:' ({shown(tracking.uri)}); use http(s)://host:port "
            "(an MLflow server), sqlite:///path.db, postgresql://..., mysql://... or a directory",
        )
    if probe and kind in ("http", "https"):
        try:
            probe_server(tracking.uri, tracking.experiment, key)
        except Unreachable:
            if not unreachable_ok:
                raise


def probe_server(uri: str, experiment: str, key: str = "tracking.uri", timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """One request, no retries, ``timeout_s``: is an MLflow server there that takes our credentials?"""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    where = shown(uri)
    uri = credentials_to_env(uri, os.environ)
    try:
        resp = http_request(
            get_default_host_creds(uri),
            PROBE_ENDPOINT,
            "GET",
            max_retries=0,
            backoff_factor=0,
            timeout=timeout_s,
            raise_on_status=False,
            params={"experiment_name": experiment},
        )
    except MlflowException as exc:  # MLflow wraps the connection error (refused, timed out, DNS)
        raise Unreachable(key, f"no MLflow server answers at {where} ({_why(str(exc), timeout_s)})") from None
    code = resp.status_code
    if code in (401, 403):
        raise SpecError(
            key,
            f"the MLflow server at {where} refused the credentials (HTTP {code}); set MLFLOW_TRACKING_USERNAME "
            "and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)",
        )
    if code == 200 or (code == 404 and _error_code(resp) == "RESOURCE_DOES_NOT_EXIST"):
        return
    raise SpecError(key, f"{where} answered HTTP {code} to MLflow's {PROBE_ENDPOINT}: not a working MLflow server")


def _why(message: str, timeout_s: float) -> str:
    if "refused" in message.lower():
        return "connection refused"
    if "timed out" in message.lower() or "timeout" in message.lower():
        return f"no answer within {timeout_s:g} s"
    if "name or service not known" in message.lower() or "resolve" in message.lower():
        return "host name not found"
    return message.splitlines()[0][:200]


def _error_code(resp) -> str | None:
    try:
        return resp.json().get("error_code")
    except ValueError:  # not JSON: not an MLflow server
        return None


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` store (None for any other store or an in-memory one)."""
    if scheme(uri) != "sqlite" or not uri.startswith("sqlite:///") or uri == "sqlite:///:memory:":
        return None
    return Path(uri[len("sqlite:///") :].split("?", 1)[0])


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Exclusive while held, across processes, for a local SQLite store (its schema creation and the
    first experiment); a no-op for any other store."""
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def seed_sqlite_store(uri: str, cache_dir: Path) -> None:
    """Create the missing database of a ``sqlite:///`` store as a copy of the empty migrated store of
    this MLflow version in ``cache_dir`` (made here the first time). Any other store, an existing
    database, or a cache that cannot be written: nothing (MLflow then creates the schema itself).
    Call under :func:`store_lock`."""
    db = sqlite_path(uri)
    if db is None or (db.exists() and db.stat().st_size > 0):
        return
    try:
        template = _empty_store(cache_dir)
    except OSError:  # a read-only or full home: MLflow migrates the new database itself
        return
    partial = db.with_name(f".{db.name}.{os.getpid()}.seeding")
    shutil.copyfile(template, partial)
    os.replace(partial, db)


def _empty_store(cache_dir: Path) -> Path:
    """An MLflow SQLite database with every migration of the installed MLflow applied and no
    experiment: made once per MLflow version, atomically (concurrent makers each rename a complete
    file over the same name)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    template = cache_dir / f"mlflow-{mlflow.__version__}-empty.db"
    if template.exists():
        return template
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = cache_dir / f".{template.name}.{os.getpid()}"
    partial.unlink(missing_ok=True)
    MlflowClient(tracking_uri=f"sqlite:///{partial}").search_experiments()  # migrates, adds Default
    with contextlib.closing(sqlite3.connect(partial)) as con, con:
        # MLflow re-creates experiment 0 with the copy's own artifact root and time when it opens it
        con.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
        con.execute("DELETE FROM experiments WHERE experiment_id = 0")
    os.replace(partial, template)
    return template


def experiment_id(client, name: str, artifact_location: str | None) -> str:
    """Get or create the experiment ``name`` (restored if deleted); safe when other jobs do the same.
    Call under :func:`store_lock` for a local SQLite store."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(
                name, artifact_location=artifact_location, tags={EXPERIMENT_KIND_TAG: TRAINING_KIND}
            )
        except MlflowException:
            # Another job created it between our look-up and our create (a server answers
            # RESOURCE_ALREADY_EXISTS or, if its database raised at commit, an internal error).
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    return exp.experiment_id
