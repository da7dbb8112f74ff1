"""Tracking against real stores: refusals before launch, concurrent runs into one new experiment
(local SQLite and a real `mlflow server` on a PostgreSQL backend store), and `bench compare`
reading from the server.

The server fixture starts Debian's PostgreSQL (initdb + pg_ctl, as the `postgres` user when the
tests run as root: PostgreSQL refuses root) on a free loopback port with a temporary data
directory, then `mlflow server` on it. `.ci/run` installs the postgresql package when it is missing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import FAST, REPO, assert_refused_before_launch, bench

CONCURRENT = 8
TINY = [*FAST, "run.steps=2", "run.checksum=false", "device=cpu"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return found[-1].parent if found else None


def _as_postgres(cmd: list[str]) -> list[str]:
    """PostgreSQL will not run as root: drop to its own system user there."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL 15 cluster on a free loopback port; yields its SQLAlchemy URI."""
    pg = _pg_bin()
    if pg is None:
        pytest.skip("PostgreSQL server binaries not installed (Debian: apt-get install postgresql; .ci/run does)")
    root = Path(tempfile.mkdtemp(prefix="parabench-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    port = _free_port()
    data = root / "data"
    init = [str(pg / "initdb"), "-D", str(data), "-U", "mlflow", "--auth=trust", "-E", "UTF8", "--no-sync"]
    subprocess.run(_as_postgres(init), check=True, capture_output=True, timeout=120)
    opts = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off"
    ctl = [str(pg / "pg_ctl"), "-D", str(data), "-l", str(root / "postgres.log"), "-o", opts, "-w"]
    subprocess.run(_as_postgres([*ctl, "start"]), check=True, capture_output=True, timeout=120)
    try:
        create = [str(pg / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "mlflow", "mlflow"]
        subprocess.run(_as_postgres(create), check=True, capture_output=True, timeout=60)
        yield f"postgresql://mlflow@127.0.0.1:{port}/mlflow"
    finally:
        subprocess.run(_as_postgres([*ctl, "-m", "fast", "stop"]), capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def mlflow_server(postgres, tmp_path_factory):
    """`mlflow server` on the PostgreSQL store, artifacts under a temporary folder; yields its URL."""
    port = _free_port()
    artifacts = tmp_path_factory.mktemp("server-artifacts")
    log = open(artifacts.parent / "mlflow-server.log", "w")
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", postgres]
    cmd += ["--artifacts-destination", str(artifacts), "--host", "127.0.0.1", "--port", str(port), "--workers", "2"]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, Path(log.name))
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:  # not listening yet
            time.sleep(0.5)
    pytest.fail(f"mlflow server not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}")


def _runs(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment} in {uri}"
    return exp, client.search_runs([exp.experiment_id])


def _concurrent_runs(tmp_path: Path, uri_args: list[str], experiment: str) -> list[subprocess.CompletedProcess]:
    """CONCURRENT `bench run` started at once into the same new experiment, each with its own results dir
    (their default store is then the shared one only when ``uri_args`` names it)."""
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    procs = []
    for i in range(CONCURRENT):
        results = tmp_path / f"r{i}"
        cmd = [sys.executable, "-m", "parabench", "run", *TINY, f"tracking.experiment={experiment}", *uri_args]
        cmd += [f"run.results_dir={results}", f"hydra.run.dir={tmp_path / f'out{i}'}"]
        procs.append(
            subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    done = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


# What each of the store-level racers does: the runner's tracking calls, without training.
JOB_RUN = """
import sys
from parabench.spec import TrackingSpec
from parabench.tracking import JobRun
t = JobRun(TrackingSpec(uri=sys.argv[1], experiment=sys.argv[2]), sys.argv[3])
t.start("racer", {"a": "1"}, {"k": "v"})
t.log_metrics([("loss", 1.0, 0)])
t.end("FINISHED")
"""


def _concurrent_job_runs(tmp_path: Path, uri: str, experiment: str) -> list[subprocess.CompletedProcess]:
    """CONCURRENT processes open the store, get or create the experiment and record a run, at once."""
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    cmd = [sys.executable, "-c", JOB_RUN, uri, experiment, str(tmp_path)]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(CONCURRENT)
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def _assert_all_landed(done: list[subprocess.CompletedProcess], uri: str, experiment: str) -> None:
    for d in done:
        assert d.returncode == 0 and "Traceback" not in d.stderr, d.stderr[-3000:]
    exp, runs = _runs(uri, experiment)
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * CONCURRENT
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"


# ------------------------------------------------------------------------------------------------
# Refusals before launch: one line, exit 2, nothing written, within seconds.
# ------------------------------------------------------------------------------------------------
def test_unknown_scheme_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = assert_refused_before_launch([*TINY, "tracking.uri=ftp://x"], "tracking.uri", tmp_path, capsys)
    assert "'ftp:'" in err


def test_unreachable_server_is_refused_within_seconds(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    uri = f"http://someone:pw-not-shown@127.0.0.1:{_free_port()}"
    err = assert_refused_before_launch([*TINY, f"tracking.uri={uri}"], "no MLflow server answers", tmp_path, capsys)
    assert time.monotonic() - started < 20
    assert "pw-not-shown" not in err and "connection refused" in err


def test_compare_refuses_an_unreachable_server(tmp_path):
    out = bench(["compare", "--tracking-uri", f"http://127.0.0.1:{_free_port()}"], tmp_path, timeout=60, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().startswith("bench compare: error: --tracking-uri: no MLflow server answers")


def test_experiments_are_created_as_model_training(tmp_path):
    """MLflow 3's UI opens an experiment tagged custom_model_development on its runs table."""
    from mlflow.tracking import MlflowClient

    from parabench.spec import TrackingSpec
    from parabench.tracking import JobRun

    tracker = JobRun(TrackingSpec(experiment="kind"), str(tmp_path))
    tracker.start("r", {}, {})
    tracker.end("FINISHED")
    exp = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").get_experiment_by_name("kind")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


# ------------------------------------------------------------------------------------------------
# Concurrent runs into one new experiment.
# ------------------------------------------------------------------------------------------------
def test_concurrent_job_runs_create_a_new_sqlite_store_and_experiment(tmp_path):
    """Without the store lock, all eight died here in MLflow's schema migration of the new file."""
    uri = f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}"
    _assert_all_landed(_concurrent_job_runs(tmp_path, uri, "race"), uri, "race")


def test_concurrent_job_runs_on_the_server(mlflow_server, tmp_path):
    _assert_all_landed(_concurrent_job_runs(tmp_path, mlflow_server, "job-race"), mlflow_server, "job-race")


def test_concurrent_runs_into_a_new_experiment_on_sqlite(tmp_path):
    store = tmp_path / "shared" / "mlflow.db"  # new: its schema and the experiment are created by the race
    done = _concurrent_runs(tmp_path, [f"tracking.uri=sqlite:///{store}"], "race")
    _assert_all_landed(done, f"sqlite:///{store}", "race")


def test_run_lands_on_server_and_compare_reads_it(mlflow_server, tmp_path):
    out = bench(["run", *TINY, f"tracking.uri={mlflow_server}", "tracking.experiment=served"], tmp_path / "r")
    assert out.returncode == 0, out.stderr[-3000:]
    _, runs = _runs(mlflow_server, "served")
    assert [r.info.status for r in runs] == ["FINISHED"]
    assert runs[0].data.metrics["tokens_per_s"] > 0
    report = tmp_path / "report"
    args = ["compare", "--tracking-uri", mlflow_server, "--experiment", "served", "--format", "json"]
    cmp = bench([*args, "--out", str(report), "--no-log"], tmp_path, timeout=300, cwd=tmp_path)
    assert cmp.returncode == 0, cmp.stderr[-3000:]
    assert runs[0].info.run_id in (report / "report.json").read_text()


def test_concurrent_runs_into_a_new_experiment_on_the_server(mlflow_server, tmp_path):
    done = _concurrent_runs(tmp_path, [f"tracking.uri={mlflow_server}"], "server-race")
    _assert_all_landed(done, mlflow_server, "server-race")
