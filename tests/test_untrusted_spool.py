"""A tracking spool is data (issue 33, item 4): `bench sync` sends it only to the store the user
configured, never to the one its own ``state.json`` names, and uploads only the run directory's own
files, never a link or a path that leaves it. The spools here are crafted by hand, as one found on a
shared disk would be; each payload can only touch a marker in the test's directory."""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path

import pytest

from parabench.tracking.runs import SPOOL_DIR, SPOOL_FILE, STATE_FILE, sync_main

SECRET = "private: must never reach a store\n"


def _spool(run_dir: Path, store: str, files: list[str], experiment: str = "spooled", results: str = "") -> Path:
    """A finished run's spool that no store has yet: start, params, one metric, artifacts, end."""
    (run_dir / SPOOL_DIR).mkdir(parents=True)
    now = int(time.time() * 1000)
    state = {
        "spool_id": "crafted",
        "store": store,
        "experiment": experiment,
        "results_dir": results or str(run_dir),
        "run_id": None,
        "sent": 0,
        "host": "elsewhere",
        "pid": None,
    }
    records = [
        {"op": "start", "run_name": "crafted", "tags": {}, "time": now},
        {"op": "params", "params": {"a": "1"}},
        {"op": "metrics", "metrics": [["loss", 2.5, 0, now]]},
        {"op": "artifacts", "files": files},
        {"op": "end", "status": "FINISHED", "time": now},
    ]
    (run_dir / SPOOL_DIR / STATE_FILE).write_text(json.dumps(state))
    (run_dir / SPOOL_DIR / SPOOL_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A server that only writes down what reached it (the request line and its Authorization)."""

    marker: Path

    def do_GET(self):
        self.marker.write_text(f"{self.path} {self.headers.get('Authorization')}\n")
        self.send_response(404)
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args):
        pass


def test_a_spool_naming_another_store_is_refused_and_that_store_hears_nothing(tmp_path, monkeypatch, capsys):
    marker = tmp_path / "reached"
    handler = type("Handler", (_Recorder,), {"marker": marker})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        run_dir = _spool(tmp_path / "shared" / "run", f"http://127.0.0.1:{server.server_port}", [])
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:s3cret@127.0.0.1:9")
        rc = sync_main([str(run_dir)])
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert not marker.exists(), marker.read_text()
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"127.0.0.1:{server.server_port}" in err and "http://***@127.0.0.1:9" in err and "s3cret" not in err


def test_sync_to_the_configured_store_uploads_only_the_run_directorys_own_files(tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # mlflow.set_tracking_uri sets it in-process
    results = tmp_path / "results"
    store = f"sqlite:///{(results / 'mlflow.db').resolve()}"
    private = tmp_path / "private.txt"
    private.write_text(SECRET)
    (tmp_path / "private_dir").mkdir()
    (tmp_path / "private_dir" / "key").write_text(SECRET)
    run_dir = tmp_path / "shared" / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "logs" / "rank0.log").write_text("step 1\n")
    (run_dir / "link.txt").symlink_to(private)  # a link to a file outside
    (run_dir / "dir").symlink_to(tmp_path / "private_dir")  # a link to a folder outside
    (run_dir / "hard.txt").hardlink_to(private)  # a second name of a file outside
    crafted = ["logs/rank0.log", "link.txt", "dir/key", "hard.txt", "../../private.txt", str(private)]
    # the spool also names a folder of its own choosing for a new experiment's artifacts
    _spool(run_dir, store, crafted, results=str(tmp_path / "elsewhere"))
    assert sync_main([str(run_dir), "--results-dir", str(results)]) == 0
    err = capsys.readouterr().err
    assert sum("not uploaded" in line for line in err.splitlines()) == 5, err
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("spooled").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params == {"a": "1"}  # the rest of the spool is recorded
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == [2.5]
    uploaded = [p for p in (results / "mlartifacts").rglob("*") if p.is_file()]
    assert [p.name for p in uploaded] == ["rank0.log"], uploaded
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize("name", ["../../escaped", "/abs/olute"])
def test_a_local_stores_experiment_name_cannot_leave_its_artifact_folder(tmp_path, monkeypatch, capsys, name):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    results = tmp_path / "results"
    store = f"sqlite:///{(results / 'mlflow.db').resolve()}"
    run_dir = _spool(tmp_path / "run", store, [], experiment=name)
    assert sync_main([str(run_dir), "--results-dir", str(results)]) == 2
    assert "leaves the artifact folder" in capsys.readouterr().err
