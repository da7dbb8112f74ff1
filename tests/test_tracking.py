import json
import os
import subprocess
from pathlib import Path

from parabench.spec import TrackingSpec
from parabench.tracking.runs import flatten, is_secret, store_uri


def test_secrets_never_become_params():
    flat = flatten({"tracking": {"uri": "x", "api_token": "s3cret"}, "a": {"PASSWORD": "p", "b": [1, 2]}})
    assert flat == {"tracking.uri": "x", "a.b": "[1, 2]"}
    assert is_secret("HF_TOKEN") and is_secret("AWS_SECRET_ACCESS_KEY") and not is_secret("OMP_NUM_THREADS")


def _cpu_threads_per_rank(nproc_per_node: int) -> int:
    """The rule written out: the ranks of a node share its cores, at least one thread each."""
    return max(1, (os.cpu_count() or 1) // nproc_per_node)


def test_launch_bundle_never_carries_secrets(tmp_path):
    """Secrets in the environment handed to the workers (an adapter's or a user's) reach the
    workers but are never written to launch.sh; every other variable is exported."""
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import prepare
    from parabench.launchers import launch_env
    from parabench.rundir import write_bundle

    job = prepare(to_plain(compose(["+model=llama", "device=cpu", "launcher.dry_run=true"])))
    plain_env = launch_env(job)
    env = {**plain_env, "HF_TOKEN": "s3cret-hf", "MY_API_KEY": "s3cret-key", "DB_PASSWORD": "s3cret-pw"}
    text = write_bundle(job, tmp_path, env, 29500).read_text()
    assert "s3cret" not in text and "HF_TOKEN" not in text and "MY_API_KEY" not in text
    exported = {
        line.split("=", 1)[0].removeprefix("export ") for line in text.splitlines() if line.startswith("export ")
    }
    assert exported == set(plain_env)
    assert f"export OMP_NUM_THREADS={_cpu_threads_per_rank(1)}" in text.splitlines()


def test_cpu_threads_per_rank_split_the_cores_or_follow_the_user():
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import prepare
    from parabench.run.command import launch_env

    def omp(*overrides):
        return launch_env(prepare(to_plain(compose(["+model=llama", "device=cpu", *overrides]))))["OMP_NUM_THREADS"]

    assert omp("launcher.nproc_per_node=2") == str(_cpu_threads_per_rank(2))
    assert omp("launcher.nproc_per_node=2", "device.threads_per_rank=3") == "3"


def test_default_store_is_local_sqlite_under_results(tmp_path):
    uri = store_uri(TrackingSpec(), str(tmp_path / "results"))
    assert uri == f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}"
    assert store_uri(TrackingSpec(uri="http://127.0.0.1:5000"), "results") == "http://127.0.0.1:5000"


def test_dry_run_bundle_is_deterministic_and_starts_nothing(tmp_path):
    import subprocess
    import sys

    args = [
        sys.executable,
        "-m",
        "parabench",
        "run",
        "+model=llama",
        "launcher.dry_run=true",
        "launcher.nproc_per_node=2",
        "device=cpu",
        f"run.results_dir={tmp_path}",
        "hydra.run.dir=" + str(tmp_path / "bundle"),
    ]
    out = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    assert out.returncode == 0, out.stderr
    bundle = (tmp_path / "bundle" / "launch.sh").read_text()
    assert "--nproc-per-node=2" in bundle and "-m parabench.worker" in bundle
    assert f"export OMP_NUM_THREADS={_cpu_threads_per_rank(2)}" in bundle.splitlines()
    assert (tmp_path / "bundle" / "spec.json").exists() and not (tmp_path / "mlflow.db").exists()
    assert str(tmp_path) not in bundle  # relocatable


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_killed_spooled_run_syncs_once_and_ends_failed(tmp_path, capsys):
    """A job whose server never answered and that was killed before recording its status (SIGKILL):
    `bench sync` into a real SQLite store creates the run with every spooled step and KILLED; a
    second sync sends nothing; the run is never left RUNNING."""
    from mlflow.tracking import MlflowClient

    from parabench.tracking.runs import JobRun, sync

    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "rank0.log").write_text("step 1/3\n")
    tracker = JobRun(TrackingSpec(uri=f"http://127.0.0.1:{_free_port()}", experiment="spool"), str(tmp_path), run_dir)
    assert tracker.start("r", {"a": "1"}, {"k": "v"}) is None and tracker.offline
    assert "bench sync" in capsys.readouterr().err
    tracker.log_metrics([("loss", 2.0, 0), ("loss", 1.5, 1)])
    tracker.log_metrics([("loss", 2.0, 0), ("loss", 1.25, 2)])  # step 0 again: left out
    tracker.log_artifacts([run_dir / "logs" / "rank0.log"], run_dir)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first, second = sync(run_dir, store), sync(run_dir, store)
    # start, params, 2 metrics, artifacts; then the tag and the KILLED status a killed run lacks
    assert "uploaded 7 records" in first and "up to date" in second
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("spool").experiment_id])
    assert run.info.status == "KILLED" and "killed" in run.data.tags["failure_reason"]
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert history == [(0, 2.0), (1, 1.5), (2, 1.25)] and run.data.params == {"a": "1"}
    assert [a.path for a in client.list_artifacts(run.info.run_id, "logs")] == ["logs/rank0.log"]


def test_step_tail_reads_finished_lines_only(tmp_path):
    from parabench.tracking.runs import StepTail

    path = tmp_path / "steps.jsonl"
    tail = StepTail(path, warmup_steps=1, tokens_per_step=100)
    assert tail.new() == []
    path.write_text('{"step": 0, "loss": 3.0, "step_time_s": 0.5}\n{"step": 1, "loss": 2.0, "step_t')
    assert tail.new() == [("loss", 3.0, 0)]  # warm-up: loss only; step 1 is still being written
    with open(path, "a") as f:
        f.write('ime_s": 0.25}\n')
    assert tail.new() == [("loss", 2.0, 1), ("step_time_s", 0.25, 1), ("step_tokens_per_s", 400.0, 1)]


def test_credentials_are_left_out_of_what_is_written():
    from parabench.tracking.store import redact, shown, without_credentials

    uri = "http://alice:pw@host:5000/x"
    assert without_credentials(uri) == "http://host:5000/x" and shown(uri) == "http://***@host:5000/x"
    assert redact(f"tracking.uri={uri} and https://t0k3n@h") == "tracking.uri=http://***@host:5000/x and https://***@h"
    assert without_credentials("sqlite:////a/b.db") == "sqlite:////a/b.db"


def _killed_run(results: Path, store: str) -> str:
    """A run that a bench killed by SIGKILL left RUNNING: started, one step logged, no end, and its
    pid a process that has exited."""
    from parabench.tracking.runs import SPOOL_DIR, STATE_FILE, JobRun

    run_dir = results / "runs" / "parabench" / "20261205-120000" / "0_job"
    run_dir.mkdir(parents=True)
    tracker = JobRun(TrackingSpec(uri=store), str(results), run_dir)
    run_id = tracker.start("killed", {"a": "1"}, {"parabench.kind": "job"})
    tracker.log_metrics([("loss", 2.0, 0)])
    gone = subprocess.Popen(["true"])
    gone.wait()
    state_path = run_dir / SPOOL_DIR / STATE_FILE
    state_path.write_text(json.dumps({**json.loads(state_path.read_text()), "pid": gone.pid}))
    return run_id


def test_bench_compare_closes_a_run_a_killed_bench_left_running(tmp_path, capsys):
    """Issue 26 case 5: the next bench command that touches the store (here bench compare) records
    the killed run KILLED with the reason, not only bench sync."""
    from mlflow.tracking import MlflowClient

    from parabench.compare.command import main

    results = tmp_path / "results"
    store = f"sqlite:///{results / 'mlflow.db'}"
    run_id = _killed_run(results, store)
    client = MlflowClient(tracking_uri=store)
    assert client.get_run(run_id).info.status == "RUNNING"
    main(["--tracking-uri", store, "--no-log", "--out", str(tmp_path / "rep")])
    assert "closed a run left RUNNING by a killed bench" in capsys.readouterr().err
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and "ended without recording a status" in run.data.tags["failure_reason"]


def test_a_new_sqlite_store_is_a_copy_of_the_empty_migrated_one(tmp_path, monkeypatch):
    """The first new store of an MLflow version leaves an empty, migrated database in the cache; every
    later new store is a copy of it (MLflow's migrations do not run again), opens with MLflow's schema
    check, and gets its own Default experiment (artifact root, time); an existing database is never
    replaced, and a cache that cannot be written leaves the creation to MLflow."""
    import sqlite3

    import mlflow.store.db.utils as db_utils
    from mlflow.tracking import MlflowClient

    from parabench.tracking import store as trackstore

    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "cache"
    first = tmp_path / "a" / "mlflow.db"
    first.parent.mkdir()
    trackstore.seed_sqlite_store(f"sqlite:///{first}", cache)
    (template,) = cache.glob("mlflow-*-empty.db")
    assert first.read_bytes() == template.read_bytes()
    with sqlite3.connect(template) as con:  # Default is left out of the copy ...
        assert con.execute("SELECT count(*) FROM experiments").fetchone() == (0,)

    def no_migrations(engine):
        raise AssertionError("MLflow migrated a seeded store")

    monkeypatch.setattr(db_utils, "_initialize_tables", no_migrations)
    second = f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}"
    (tmp_path / "b").mkdir()
    trackstore.seed_sqlite_store(second, cache)
    client = MlflowClient(second)
    default = client.get_experiment("0")  # ... and made by MLflow when it opens the copy
    assert default.name == "Default" and default.artifact_location == str(tmp_path / "mlruns" / "0")
    client.create_experiment("x")
    before = (tmp_path / "b" / "mlflow.db").read_bytes()
    trackstore.seed_sqlite_store(second, cache)
    assert (tmp_path / "b" / "mlflow.db").read_bytes() == before
    assert [e.name for e in MlflowClient(second).search_experiments()] == ["x", "Default"]

    blocker = tmp_path / "a-file"  # a cache folder that cannot be made (root writes into read-only ones)
    blocker.write_text("")
    third = tmp_path / "c" / "mlflow.db"
    third.parent.mkdir()
    trackstore.seed_sqlite_store(f"sqlite:///{third}", blocker / "cache")
    assert not third.exists()
