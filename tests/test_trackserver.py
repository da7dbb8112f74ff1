"""Tracking against real stores: refusals before launch, concurrent runs into one new experiment
(local SQLite and a real `mlflow server` on a PostgreSQL backend store), and `bench compare`
reading from the server.

The server fixture starts Debian's PostgreSQL (initdb + pg_ctl, as the `postgres` user when the
tests run as root: PostgreSQL refuses root) on a free loopback port with a temporary data
directory, then `mlflow server` on it. `.ci/run` installs the postgresql package when it is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import FAST, MLFLOW_SERVER_ENV, REPO, assert_refused_before_launch, bench, bench_argv

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
    proc = _serve(postgres, artifacts, port, artifacts.parent / "mlflow-server.log")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop_server(proc)


def _serve(store: str, artifacts: Path, port: int, log: Path) -> subprocess.Popen:
    """`mlflow server` on ``store`` (its own process group: it runs uvicorn's workers), once healthy."""
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store]
    cmd += ["--artifacts-destination", str(artifacts), "--host", "127.0.0.1", "--port", str(port), "--workers", "2"]
    with open(log, "a") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **MLFLOW_SERVER_ENV},
            start_new_session=True,
        )
    _wait_healthy(f"http://127.0.0.1:{port}", proc, log)
    return proc


def _stop_server(proc: subprocess.Popen) -> None:
    """The server and its workers, gone: the port refuses connections afterwards."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:  # not listening yet
            time.sleep(0.5)
    else:
        pytest.fail(f"mlflow server not healthy after {timeout_s} s:\n{log.read_text()[-3000:]}")
    # /health answers before the tracking store exists; the first API request builds it (connects,
    # checks the schema): made here, so the test's own first request meets a ready server
    ready = url + "/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default"
    try:
        urllib.request.urlopen(ready, timeout=max(deadline - time.monotonic(), 1)).close()
    except urllib.error.HTTPError as exc:  # 404 (no such experiment) is an answer from the store
        assert exc.code == 404, exc


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
        cmd = bench_argv(["run", *TINY, f"tracking.experiment={experiment}", *uri_args])
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
from parabench.tracking.runs import JobRun
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
    """With tracking.on_unreachable=refuse; the default spools (test_unreachable_at_start_spools_...)."""
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    uri = f"http://someone:pw-not-shown@127.0.0.1:{_free_port()}"
    args = [*TINY, f"tracking.uri={uri}", "tracking.on_unreachable=refuse"]
    err = assert_refused_before_launch(args, "no MLflow server answers", tmp_path, capsys)
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
    from parabench.tracking.runs import JobRun

    tracker = JobRun(TrackingSpec(experiment="kind"), str(tmp_path))
    tracker.start("r", {}, {})
    tracker.end("FINISHED")
    exp = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").get_experiment_by_name("kind")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


# ------------------------------------------------------------------------------------------------
# Concurrent runs into one new experiment.
# ------------------------------------------------------------------------------------------------
@pytest.mark.full
def test_concurrent_job_runs_create_a_new_sqlite_store_and_experiment(tmp_path):
    """Without the store lock, all eight died here in MLflow's schema migration of the new file."""
    uri = f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}"
    _assert_all_landed(_concurrent_job_runs(tmp_path, uri, "race"), uri, "race")


@pytest.mark.full
def test_concurrent_job_runs_on_the_server(mlflow_server, tmp_path):
    _assert_all_landed(_concurrent_job_runs(tmp_path, mlflow_server, "job-race"), mlflow_server, "job-race")


@pytest.mark.full
def test_concurrent_runs_into_a_new_experiment_on_sqlite(tmp_path):
    store = tmp_path / "shared" / "mlflow.db"  # new: its schema and the experiment are created by the race
    done = _concurrent_runs(tmp_path, [f"tracking.uri=sqlite:///{store}"], "race")
    _assert_all_landed(done, f"sqlite:///{store}", "race")


@pytest.mark.e2e
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


@pytest.mark.full
def test_concurrent_runs_into_a_new_experiment_on_the_server(mlflow_server, tmp_path):
    done = _concurrent_runs(tmp_path, [f"tracking.uri={mlflow_server}"], "server-race")
    _assert_all_landed(done, mlflow_server, "server-race")


# ------------------------------------------------------------------------------------------------
# Live metrics, outages and `bench sync` (docs/tracking.md#outages), credentials never written.
# ------------------------------------------------------------------------------------------------
STEPS = [*TINY, "run.steps=3"]
PER_STEP = ("loss", "step_time_s", "step_tokens_per_s")
SECRETS = {"MLFLOW_TRACKING_USERNAME": "bob-env-user", "MLFLOW_TRACKING_PASSWORD": "env-secret-pw"}
URI_SECRET = "alice-uri-user:uri-secret-pw"


def _start_run(tmp_path: Path, name: str, uri: str, env: dict | None = None) -> subprocess.Popen:
    cmd = bench_argv(["run", *STEPS, f"tracking.uri={uri}", "tracking.experiment=outage"])
    cmd += [f"run.results_dir={tmp_path / name}", f"hydra.run.dir={tmp_path / name / 'run'}"]
    full_env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", **(env or {})}
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _history(client, run_id: str) -> dict[str, list[tuple[int, float]]]:
    run = client.get_run(run_id)
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in run.data.metrics}


def _run_by_dir(client, run_dir: Path):
    exp = client.get_experiment_by_name("outage")
    (run,) = client.search_runs([exp.experiment_id], filter_string=f"tags.run_dir = '{run_dir}'")
    return run


def _wait_live(client, run_dir: Path, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    """Until the run is RUNNING on the store with at least one live loss point."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        with contextlib.suppress(ValueError, AttributeError):  # not created yet
            run = _run_by_dir(client, run_dir)
            if client.get_metric_history(run.info.run_id, "loss"):
                assert client.get_run(run.info.run_id).info.status == "RUNNING"
                return
        time.sleep(0.5)
    steps = run_dir / "steps.jsonl"
    held = repr(steps.read_bytes()[:500]) if steps.exists() else "no steps.jsonl"
    pytest.fail(
        f"no live loss point in MLflow while the run was going; {steps.name}: {held}; in {run_dir}: {_listing(run_dir)}"
    )


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _has_a_whole_line(path: Path) -> bool:
    try:
        return b"\n" in path.read_bytes()
    except FileNotFoundError:
        return False


def _pause_after_first_step(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 300) -> int:
    """SIGSTOP rank 0 once it has finished a step (the run stays mid-way while the test looks). A
    step is finished when its line of ``steps.jsonl`` is whole: rank 0 creates the file before it
    writes the line, and stopped in between it would never give the parent a step to log live."""
    deadline = time.monotonic() + timeout_s
    while not (_has_a_whole_line(run_dir / "steps.jsonl") and (run_dir / "pids" / "rank0").exists()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    pid = int((run_dir / "pids" / "rank0").read_text())
    os.kill(pid, signal.SIGSTOP)
    return pid


def _assert_no_secret(texts: dict[str, str], secrets: list[str]) -> None:
    leaks = [f"{where} has {s!r}" for where, text in texts.items() for s in secrets if s in text]
    assert not leaks, leaks


def _written(folder: Path) -> dict[str, str]:
    return {str(p): p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file()}


def _on_store(client, run_id: str, into: Path) -> dict[str, str]:
    """Params, tags and every artifact of a run, as text."""
    run = client.get_run(run_id)
    out = {"params": json.dumps(run.data.params), "tags": json.dumps(run.data.tags)}
    client.download_artifacts(run_id, "", str(into))
    return {**out, **_written(into)}


@pytest.mark.full
def test_server_killed_mid_run_then_synced_equals_an_undisturbed_run(postgres, mlflow_server, tmp_path):
    """Acceptance (issue #17): live metrics while RUNNING; the server killed mid-run; the run
    finishes and spools; the server back on the same store; `bench sync` (twice) makes its history
    equal, step for step, to that of an undisturbed run (that one has credentials in its URI and
    in MLflow's variables: none of them is written anywhere)."""
    from mlflow.tracking import MlflowClient

    port = _free_port()
    url, artifacts, log = f"http://127.0.0.1:{port}", tmp_path / "artifacts", tmp_path / "own-server.log"
    server = _serve(postgres, artifacts, port, log)
    host = mlflow_server.removeprefix("http://")
    calm = _start_run(tmp_path, "calm", f"http://{URI_SECRET}@{host}", SECRETS)
    hit = _start_run(tmp_path, "hit", url)
    try:
        pid = _pause_after_first_step(tmp_path / "hit" / "run", hit)
        _wait_live(MlflowClient(tracking_uri=url), tmp_path / "hit" / "run", hit)
        _stop_server(server)
        os.kill(pid, signal.SIGCONT)
        out, err = hit.communicate(timeout=600)
        assert hit.returncode == 0 and "Traceback" not in err, err[-3000:]
        assert "spooled in" in err and "bench sync" in err and "not reached" in out
        server = _serve(postgres, artifacts, port, log)
        synced = [
            bench(["sync", str(tmp_path / "hit" / "run"), "--tracking-uri", url], tmp_path, timeout=300)
            for _ in range(2)
        ]
        calm_out, calm_err = calm.communicate(timeout=600)
        assert calm.returncode == 0, calm_err[-3000:]
        client, calm_client = MlflowClient(tracking_uri=url), MlflowClient(tracking_uri=mlflow_server)
        hit_run = _run_by_dir(client, tmp_path / "hit" / "run")
        calm_run = _run_by_dir(calm_client, tmp_path / "calm" / "run")
        got, want = _history(client, hit_run.info.run_id), _history(calm_client, calm_run.info.run_id)
        store_view = _on_store(calm_client, calm_run.info.run_id, tmp_path / "calm-artifacts")
    finally:
        for p in (hit, calm):
            p.kill()
        _stop_server(server)
    assert [s.returncode for s in synced] == [0, 0], synced[0].stderr[-3000:]
    assert "uploaded" in synced[0].stdout and "up to date" in synced[1].stdout, synced[1].stdout
    assert hit_run.info.status == "FINISHED"
    assert sorted(got) == sorted(want)
    assert [s for s, _ in got["loss"]] == [0, 1, 2] and got["loss"] == want["loss"]  # seeded: the same losses
    steps = [json.loads(line) for line in (tmp_path / "hit" / "run" / "steps.jsonl").read_text().splitlines()]
    assert got["step_time_s"] == [(s["step"], s["step_time_s"]) for s in steps]
    for key in got:  # every metric once per step, as in the undisturbed run
        assert [s for s, _ in got[key]] == [s for s, _ in want[key]], key
    secrets = [URI_SECRET, *URI_SECRET.split(":"), *SECRETS.values()]
    _assert_no_secret({"stdout": calm_out, "stderr": calm_err, **_written(tmp_path / "calm"), **store_view}, secrets)


@pytest.mark.full
def test_unreachable_at_start_spools_then_sync_uploads(mlflow_server, tmp_path):
    """The default tracking.on_unreachable=spool: a server down at the start is one line, the run
    trains and records into its spool, `bench sync --tracking-uri` uploads it. Neither the spool nor
    the launch bundle holds the credentials of the URI."""
    from mlflow.tracking import MlflowClient

    dead = f"http://{URI_SECRET}@127.0.0.1:{_free_port()}"
    run = _start_run(tmp_path, "down", dead)
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert "connection refused" in err and "bench sync" in err and "not reached (" in out
    run_dir = tmp_path / "down" / "run"
    synced = bench(["sync", str(run_dir), "--tracking-uri", mlflow_server], tmp_path, timeout=300)
    assert synced.returncode == 0 and "uploaded" in synced.stdout, synced.stderr[-3000:]
    client = MlflowClient(tracking_uri=mlflow_server)
    on_store = _run_by_dir(client, run_dir)
    assert on_store.info.status == "FINISHED"
    assert on_store.data.params["tracking.uri"] == dead.replace(URI_SECRET + "@", "")
    loss = [json.loads(line)["loss"] for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [
        m.value for m in sorted(client.get_metric_history(on_store.info.run_id, "loss"), key=lambda m: m.step)
    ] == loss
    bundle = bench(
        ["run", *STEPS, f"tracking.uri={dead}", "launcher.dry_run=true", f"hydra.run.dir={tmp_path / 'b'}"],
        tmp_path / "b",
    )
    assert bundle.returncode == 0, bundle.stderr[-3000:]
    texts = {"stdout": out + synced.stdout + bundle.stdout, "stderr": err + synced.stderr + bundle.stderr}
    _assert_no_secret(
        {**texts, **_written(tmp_path / "down"), **_written(tmp_path / "b")}, [URI_SECRET, "uri-secret-pw"]
    )


def _psql(postgres: str, database: str, sql: str) -> None:
    pg, where = _pg_bin(), postgres.rsplit("@", 1)[1].split("/", 1)[0]
    host, port = where.split(":")
    cmd = [str(pg / "psql"), "-h", host, "-p", port, "-U", "mlflow", "-d", database, "-v", "ON_ERROR_STOP=1", "-c", sql]
    subprocess.run(_as_postgres(cmd), check=True, capture_output=True, timeout=60)


@pytest.mark.full
def test_server_answering_an_error_mid_run_spools_then_sync_completes(postgres, tmp_path, monkeypatch, capsys):
    """A real `mlflow server` whose database loses a table mid-run answers log-batch with an error
    (MLflow maps the database's UndefinedTable to BAD_REQUEST): one line, the job records on into its
    spool, and `bench sync` (the table back) completes the history."""
    from mlflow.tracking import MlflowClient

    from parabench.spec import TrackingSpec
    from parabench.tracking.runs import JobRun, sync
    from parabench.tracking.store import HTTP_RETRIES

    for key, value in HTTP_RETRIES.items():  # what `bench` sets (cli._quiet_environment)
        monkeypatch.setenv(key, value)
    _psql(postgres, "mlflow", "CREATE DATABASE mlflow500")
    port = _free_port()
    server = _serve(postgres.rsplit("/", 1)[0] + "/mlflow500", tmp_path / "artifacts", port, tmp_path / "server.log")
    url, run_dir = f"http://127.0.0.1:{port}", tmp_path / "run"
    try:
        tracker = JobRun(TrackingSpec(uri=url, experiment="e500"), str(tmp_path), run_dir)
        assert tracker.start("r", {"a": "1"}, {}) is not None
        tracker.log_metrics([("loss", 1.0, 0)])
        _psql(postgres, "mlflow500", "ALTER TABLE latest_metrics RENAME TO latest_metrics_away")
        tracker.log_metrics([("loss", 0.5, 1)])
        assert tracker.offline and "latest_metrics" in tracker.offline, tracker.offline
        tracker.log_metrics([("loss", 0.25, 2)])
        tracker.end("FINISHED")
        err = capsys.readouterr().err
        assert err.count("parabench: tracking:") == 2 and "bench sync" in err  # the failure, then the end
        _psql(postgres, "mlflow500", "ALTER TABLE latest_metrics_away RENAME TO latest_metrics")
        first, second = sync(run_dir, url), sync(run_dir, url)
        client = MlflowClient(tracking_uri=url)
        run = client.get_run(tracker.run_id)
        history = sorted((m.step, m.value) for m in client.get_metric_history(tracker.run_id, "loss"))
    finally:
        _stop_server(server)
    assert "uploaded 3 records" in first and "up to date" in second, (first, second)
    assert run.info.status == "FINISHED" and history == [(0, 1.0), (1, 0.5), (2, 0.25)]
