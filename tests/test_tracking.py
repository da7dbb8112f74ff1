from parabench.spec import TrackingSpec
from parabench.tracking import flatten, is_secret, store_uri


def test_secrets_never_become_params():
    flat = flatten({"tracking": {"uri": "x", "api_token": "s3cret"}, "a": {"PASSWORD": "p", "b": [1, 2]}})
    assert flat == {"tracking.uri": "x", "a.b": "[1, 2]"}
    assert is_secret("HF_TOKEN") and is_secret("AWS_SECRET_ACCESS_KEY") and not is_secret("OMP_NUM_THREADS")


def test_launch_env_never_carries_secrets(monkeypatch, tmp_path):
    from parabench.confutil import compose, to_plain
    from parabench.runner import launch_env, prepare, write_bundle

    monkeypatch.setenv("HF_TOKEN", "s3cret")
    job = prepare(to_plain(compose(["+model=llama", "launcher.dry_run=true"])))
    env = {**launch_env(job), "MY_API_KEY": "s3cret"}
    text = write_bundle(job, tmp_path, env, 29500).read_text()
    assert "s3cret" not in text and "OMP_NUM_THREADS" in text


def test_default_store_is_local_sqlite_under_results(tmp_path):
    uri = store_uri(TrackingSpec(), str(tmp_path / "results"))
    assert uri == f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}"
    assert store_uri(TrackingSpec(uri="http://127.0.0.1:5000"), "results") == "http://127.0.0.1:5000"


def test_dry_run_bundle_is_deterministic_and_starts_nothing(tmp_path):
    import subprocess, sys, os

    args = [sys.executable, "-m", "parabench", "run", "+model=llama", "launcher.dry_run=true", "launcher.nproc_per_node=2",
            "device=cpu", f"run.results_dir={tmp_path}", "hydra.run.dir=" + str(tmp_path / "bundle")]
    out = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    assert out.returncode == 0, out.stderr
    bundle = (tmp_path / "bundle" / "launch.sh").read_text()
    assert "--nproc-per-node=2" in bundle and "-m parabench.worker" in bundle and "export OMP_NUM_THREADS=1" in bundle
    assert (tmp_path / "bundle" / "spec.json").exists() and not (tmp_path / "mlflow.db").exists()
    assert str(tmp_path) not in bundle  # relocatable
