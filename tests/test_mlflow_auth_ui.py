"""Two things only a real MLflow server shows:

- MLflow's basic-auth app (``mlflow server --app-name basic-auth``) on a SQLite store: `bench run`
  records with a user's ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``, and the password
  is in nothing it writes, prints or records; wrong credentials are one line and exit 2 before launch.
- The MLflow UI in headless Chromium: a parabench sweep's experiment renders as the runs table (the
  parent with its children), not MLflow 3's GenAI overview. The screenshot is kept in the test's tmp
  directory (``ui-runs.png``).

Both servers listen on 127.0.0.1 only, on free ports, and are stopped by the fixtures.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import FAST, MLFLOW_SERVER_ENV, bench

pytestmark = pytest.mark.full  # one `mlflow server --app-name basic-auth` for the module

TINY = [*FAST, "run.steps=2", "run.checksum=false", "device=cpu"]
ADMIN_PASSWORD = "Adm1n-pw-7f3c91e2"
USER, PASSWORD = "alice", "Al1ce-pw-4b8d06a9"  # unique strings: a grep for them finds only leaks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(args: list[str], log: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """`mlflow server ARGS` on a free loopback port, in its own process group; returns it once /health answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", *args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "a") as out:
        proc = subprocess.Popen(
            [*cmd, "--workers", "1"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **MLFLOW_SERVER_ENV, **env},
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, url
        time.sleep(0.5)
    _stop(proc)
    pytest.fail(f"mlflow server not healthy after 240 s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # uvicorn's workers can outlast a SIGTERM on a loaded machine
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _request(url: str, user: str, password: str, body: dict | None = None) -> dict:
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Authorization": f"Basic {auth}"})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"{}")


@contextlib.contextmanager
def basic_auth_server(root: Path):
    """MLflow's basic-auth app on SQLite in ``root`` (runs and users in their own files), with the user
    alice created through the admin's REST API; yields the server's URL."""
    config = root / "basic_auth.ini"
    config.write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{root / 'users.db'}\nadmin_username = admin\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # Each request re-hashes the password (PBKDF2) unless checked credentials are cached: without
        # the cache a loaded 2-core machine answers slower than parabench's 5 s tracking timeout.
        "auth_cache_ttl_seconds = 600\n"
    )
    env = {
        "MLFLOW_AUTH_CONFIG_PATH": str(config),  # MLflow reads the auth app's settings from this file
        "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN_PASSWORD,  # MLflow 3.17 has no default admin password
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "parabench-test-csrf-key",  # the auth app's CSRF protection needs one
    }
    store = ["--app-name", "basic-auth", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"]
    proc, url = _serve([*store, "--artifacts-destination", str(root / "artifacts")], root / "server.log", env)
    (root / "url").write_text(url)  # which server this folder holds (server_root)
    try:
        _request(
            f"{url}/api/2.0/mlflow/users/create", "admin", ADMIN_PASSWORD, {"username": USER, "password": PASSWORD}
        )
        yield url
    finally:
        _stop(proc)


# The session's basic-auth server: this module and tests/test_slurm.py record into the same one
# (their experiments are apart: auth-*, slurm), so the full tier starts it once (~28 s under load).
SESSION_AUTH_SERVER = pytest.StashKey[str]()


def session_auth_server(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The URL of the basic-auth server shared by the session's modules: started by the first that
    asks, stopped when the session ends (a module-scoped fixture in each module would start its own)."""
    url = config.stash.get(SESSION_AUTH_SERVER, None)
    if url is None:
        stack = contextlib.ExitStack()
        url = stack.enter_context(basic_auth_server(tmp_path_factory.mktemp("auth-server")))
        config.add_cleanup(stack.close)
        config.stash[SESSION_AUTH_SERVER] = url
    return url


@pytest.fixture(scope="module")
def auth_server(request, tmp_path_factory):
    return session_auth_server(request.config, tmp_path_factory)


def server_root(tmp_path_factory, url: str) -> Path:
    """The folder of the server at ``url`` (its SQLite stores, artifacts and log)."""
    (root,) = [d for d in tmp_path_factory.getbasetemp().glob("auth-server[0-9]*") if (d / "url").read_text() == url]
    return root


def _leaks(root: Path, secret: str) -> list[str]:
    """Every file under ``root`` whose bytes contain ``secret``."""
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def _recorded(url: str, experiment: str, tmp_path: Path, monkeypatch):
    """(runs, text of every param, tag and artifact) of ``experiment`` on the server, read as admin."""
    from mlflow.artifacts import download_artifacts
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN_PASSWORD)
    client = MlflowClient(tracking_uri=url)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment} on {url}"
    runs = client.search_runs([exp.experiment_id])
    texts = [json.dumps(exp.tags)]
    for run in runs:
        texts += [json.dumps(run.data.params), json.dumps(run.data.tags)]
        dst = str(tmp_path / "artifacts" / run.info.run_id)
        where = download_artifacts(run_id=run.info.run_id, dst_path=dst, tracking_uri=url)
        files = [p for p in Path(where).rglob("*") if p.is_file()]
        assert files, f"run {run.info.run_id} has no artifacts to search"
        texts += [p.read_bytes().decode(errors="replace") for p in files]
    return runs, texts


def test_basic_auth_run_records_and_never_writes_the_password(auth_server, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    creds = {"MLFLOW_TRACKING_USERNAME": USER, "MLFLOW_TRACKING_PASSWORD": PASSWORD}
    args = ["run", *TINY, f"tracking.uri={auth_server}", "tracking.experiment=auth-e2e"]
    proc = bench(args, work / "results", timeout=600, env=creds, cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "spooled" not in proc.stdout + proc.stderr, proc.stdout[-2000:]  # it reached the server

    runs, recorded = _recorded(auth_server, "auth-e2e", tmp_path, monkeypatch)
    assert [r.info.status for r in runs] == ["FINISHED"]
    # the summary links the runs table (MLflow 3's UI would open its GenAI overview without the query)
    link = f"{auth_server}/#/experiments/{runs[0].info.experiment_id}?workflowType=machine_learning"
    assert f"MLflow UI      {link}" in proc.stdout, proc.stdout[-2000:]
    # It went in as alice: she created the experiment, so the auth app made her its manager.
    query = f"username={USER}&resource_type=experiment&resource_id={runs[0].info.experiment_id}"
    grant = _request(f"{auth_server}/api/3.0/mlflow/users/permissions/get?{query}", "admin", ADMIN_PASSWORD)
    assert grant["permission"] == "MANAGE", grant
    assert sum(1 for _ in (work / "results").rglob("*") if _.is_file()) > 5  # the grep below has files to read
    for secret in (PASSWORD, ADMIN_PASSWORD):
        assert secret not in proc.stdout + proc.stderr
        assert not _leaks(work, secret), f"password written to {_leaks(work, secret)}"
        assert not [t for t in recorded if secret in t], "password recorded in MLflow params, tags or artifacts"


def test_wrong_credentials_are_refused_before_launch(auth_server, tmp_path):
    wrong = "wr0ng-pw-1d5e7c3b"
    creds = {"MLFLOW_TRACKING_USERNAME": USER, "MLFLOW_TRACKING_PASSWORD": wrong}
    started = time.monotonic()
    proc = bench(
        ["run", *TINY, f"tracking.uri={auth_server}"], tmp_path / "results", timeout=300, env=creds, cwd=tmp_path
    )
    took = time.monotonic() - started
    err = proc.stderr.strip()
    assert proc.returncode == 2, err[-2000:]
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("bench: error: tracking.uri:") and "refused the credentials (HTTP 401)" in err, err
    assert wrong not in proc.stdout + err and not (tmp_path / "results").exists()
    assert took < 120, f"refusal took {took:.0f} s"


def test_login_in_the_uri_of_a_sweep_comm_and_compare_is_never_written(
    auth_server, tmp_path, tmp_path_factory, monkeypatch
):
    """Issue 33 items 3 and 5: the login given in the URI (``http://alice:PASSWORD@host``) instead of
    MLflow's variables. A ``-m`` sweep of two jobs (Hydra writes and prints its overrides, escaped),
    ``bench comm`` and ``bench compare`` of the sweep (its report logged as a comparison run) record
    as alice; the password is in no file under the working directory (bytes: YAML, JSON, spools,
    SQLite), no output, no param, tag, run name or artifact, nor anywhere in the server's own store
    (its SQLite file, artifact folder and log)."""
    work = tmp_path / "work"
    work.mkdir()
    uri = f"http://{USER}:{PASSWORD}@{auth_server.removeprefix('http://')}"
    sweep = [*TINY, "run.seed=1,2", f"tracking.uri={uri}", "tracking.experiment=auth-sweep"]
    procs = [bench(["run", "-m", *sweep, f"hydra.sweep.dir={work / 'sweep'}"], work / "results", 900, cwd=work)]
    comm = ["backend=ddp", "device=cpu", "launcher.nproc_per_node=2", "comm.max_bytes=4K", "comm.iters=2"]
    comm += [f"tracking.uri={uri}", "tracking.experiment=auth-comm", f"run.results_dir={work / 'results'}"]
    procs.append(bench(["comm", *comm], work / "results", 600, cwd=work))
    report = ["--experiment", "auth-sweep", "--tracking-uri", uri, "--format", "md", "--out", str(work / "report")]
    procs.append(bench(["compare", *report], work / "results", 600, cwd=work))
    for proc in procs:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert "spooled" not in proc.stdout + proc.stderr, proc.stderr[-2000:]  # each reached the server
        assert PASSWORD not in proc.stdout + proc.stderr
    assert "tracking.uri=http\\://127.0.0.1\\:" in procs[0].stdout  # Hydra's job lines: the URI, escaped

    recorded = []
    for experiment, count in (("auth-sweep", 3), ("auth-comm", 1), ("auth-sweep-comparisons", 1)):
        runs, texts = _recorded(auth_server, experiment, tmp_path / experiment, monkeypatch)
        assert len(runs) == count and {r.info.status for r in runs} == {"FINISHED"}, experiment
        recorded += [*texts, *(r.info.run_name for r in runs)]
        query = f"username={USER}&resource_type=experiment&resource_id={runs[0].info.experiment_id}"
        grant = _request(f"{auth_server}/api/3.0/mlflow/users/permissions/get?{query}", "admin", ADMIN_PASSWORD)
        assert grant["permission"] == "MANAGE", (experiment, grant)  # alice created it: the login was used
    assert not [t for t in recorded if PASSWORD in t], "password recorded in MLflow params, tags, names or artifacts"
    assert len(list((work / "sweep").rglob("overrides.yaml"))) == 2 and (work / "report" / "report.json").is_file()
    store = server_root(tmp_path_factory, auth_server)
    assert (store / "mlflow.db").is_file() and (store / "artifacts").is_dir()
    for root in (work, store):
        assert not _leaks(root, PASSWORD), f"password written to {_leaks(root, PASSWORD)}"


# --------------------------------------------------------------------------------------------
# The UI.
# --------------------------------------------------------------------------------------------
def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _browse(url: str, out: Path, profile: Path, *mode: str) -> subprocess.CompletedProcess:
    """Headless Chromium on ``url``, after the page's scripts ran (virtual time: no sleeping)."""
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]
    cmd += [f"--user-data-dir={profile}", "--window-size=1400,900", "--virtual-time-budget=25000", *mode, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=out)


@pytest.fixture(scope="module")
def sweep_ui(tmp_path_factory):
    """A two-job sweep (ddp, fsdp) into the default local store, and `mlflow server` on that store."""
    if _chromium() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; .ci/run does)")
    root = tmp_path_factory.mktemp("ui")
    proc = bench(["run", "-m", *TINY, "backend=ddp,fsdp"], root / "results", timeout=900, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    server, url = _serve(["--backend-store-uri", f"sqlite:///{root / 'results' / 'mlflow.db'}"], root / "ui.log", {})
    try:
        yield root, url
    finally:
        _stop(server)


def test_ui_opens_the_sweep_on_the_runs_table(sweep_ui):
    from mlflow.tracking import MlflowClient

    root, url = sweep_ui
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'results' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("parabench")
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 3 and len(children) == 2

    # MLflow 3.17's UI takes the experiment page's kind from its GenAI / Model training switch
    # (docs/sources.md#mlflow-ui-workflow), which this query sets.
    page = f"{url}/#/experiments/{exp.experiment_id}?workflowType=machine_learning"
    shot = _browse(page, root, root / "profile-shot", f"--screenshot={root / 'ui-runs.png'}")
    assert (root / "ui-runs.png").stat().st_size > 10_000, shot.stderr[-2000:]
    dom = _browse(page, root, root / "profile-dom", "--dump-dom").stdout
    (root / "ui-runs.html").write_text(dom)
    text = " ".join(re.sub(r"<[^>]+>", " ", dom).split())
    # The runs table: the parent's row (name and link) and its two children counted, children nested
    # under it (collapsed). MLflow's GenAI overview would show "Detect Issues" and empty trace charts.
    assert (
        parent.data.tags["mlflow.runName"] in text
        and f"#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}" in dom
    )
    assert "3 matching runs" in text, text[-3000:]
    assert "Detect Issues" not in text and "No data available for the selected time range" not in text
