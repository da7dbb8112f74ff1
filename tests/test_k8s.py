"""The dry-run bundle's Kubeflow PyTorchJob (launcher.k8s.pytorchjob=true), validated against the
published CRD schema (tests/data/k8s, kubeflow/training-operator release-1.9) and the rules of the
operator's admission webhook. No cluster needed: `bench run` writes the manifest, the test reads it.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from conftest import REPO, assert_refused_before_launch

jsonschema = pytest.importorskip("jsonschema", reason="the test extra (pip install -e .[test]) brings jsonschema")

SCHEMA = json.loads((REPO / "tests" / "data" / "k8s" / "pytorchjob-v1.openapi.json").read_text())
SECRET = "s3cr3t-Pa55word-k8s"
IMAGE = "registry.example/parabench:0.1"
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def strict(node):
    """The CRD schema with unknown fields refused: the API server prunes unknown fields silently, so
    a misspelt key would vanish on the cluster; here it fails the test."""
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


STRICT = strict(SCHEMA)


def write_manifest(tmp_path: Path, monkeypatch, capsys, *overrides: str) -> tuple[list[dict], Path]:
    from parabench.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    args = ["run", "+model=llama", "launcher.dry_run=true", "launcher.k8s.pytorchjob=true", *overrides]
    code = main([*args, f"launcher.k8s.image={IMAGE}", f"run.results_dir={tmp_path / 'results'}"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "pytorchjob.yaml" in out.out and SECRET not in out.out + out.err
    (path,) = (tmp_path / "results").glob("runs/*/*/*/pytorchjob.yaml")
    return list(yaml.safe_load_all(path.read_text())), path.parent


def check_webhook_rules(job: dict) -> None:
    """What training-operator's validating webhook refuses (pkg/webhooks/pytorch/pytorchjob_webhook.go)."""
    assert DNS1035.fullmatch(job["metadata"]["name"]) and len(job["metadata"]["name"]) <= 63
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) <= {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    assert specs.get("Worker", {"replicas": 1})["replicas"] >= 1
    for spec in specs.values():
        assert spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        containers = spec["template"]["spec"]["containers"]
        assert all(c["image"] for c in containers) and [c["name"] for c in containers] == ["pytorch"]
        assert containers[0]["ports"][0]["name"] == "pytorchjob-port"  # the operator's MASTER_PORT
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] in ("All", "Running", "None")


def check_bundle(docs: list[dict], run_dir: Path) -> tuple[dict, dict]:
    """Shared by every job: the schema, the webhook rules, the ConfigMap with the bundle, the launch
    line of launch.sh, and no secret anywhere. Returns (PyTorchJob, its Master container)."""
    config_map, job = docs
    jsonschema.validate(job, STRICT)
    check_webhook_rules(job)
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert config_map["kind"] == "ConfigMap" and config_map["metadata"]["name"] == job["metadata"]["name"] + "-bundle"
    assert config_map["data"]["spec.json"] == (run_dir / "spec.json").read_text()
    assert all(isinstance(v, str) for v in config_map["data"].values())
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert {v["configMap"]["name"] for v in master["volumes"] if "configMap" in v} == {config_map["metadata"]["name"]}
    container = master["containers"][0]
    assert container["image"] == IMAGE and container["command"][:2] == ["bash", "-c"]
    launch_line = (run_dir / "launch.sh").read_text().splitlines()[-1]
    assert launch_line.startswith("exec ") and container["command"][2].splitlines()[-1] == launch_line
    text = (run_dir / "pytorchjob.yaml").read_text()
    assert SECRET not in text and "alice" not in text and "MLFLOW_TRACKING_PASSWORD" not in text
    return job, container


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


def test_gpu_job_two_nodes(tmp_path, monkeypatch, capsys):
    docs, run_dir = write_manifest(
        tmp_path,
        monkeypatch,
        capsys,
        "backend=ddp",
        "device=cuda",
        "launcher.nnodes=2",
        "launcher.nproc_per_node=8",
        "launcher.master_port=29500",
        "data.global_batch_size=32",
        "launcher.k8s.namespace=team-a",
        "launcher.k8s.volume_claim=bench-runs",
    )
    job, container = check_bundle(docs, run_dir)
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Worker"]["replicas"] == 1 and job["spec"]["nprocPerNode"] == "8"
    assert job["metadata"]["namespace"] == "team-a" and job["metadata"]["name"] == "parabench-ddp-llama"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8} == container["resources"]["requests"]
    assert container["ports"][0]["containerPort"] == 29500
    script = container["command"][2]
    assert 'export NODE_RANK="${PET_NODE_RANK:-0}"' in script and "MASTER_ADDR=127.0.0.1" not in script
    torchrun = shlex.split(script.splitlines()[-1])
    assert torchrun[:2] == ["exec", "torchrun"] and "--nnodes=2" in torchrun and "--nproc-per-node=8" in torchrun
    assert "parabench.worker" in torchrun and "--master-port=29500" in torchrun
    env = env_of(container)
    assert env["RUN_DIR"] == "/parabench/runs/parabench-ddp-llama" and not any(k.startswith("HCCL_") for k in env)
    volumes = {v["name"]: v for v in specs["Worker"]["template"]["spec"]["volumes"]}
    assert volumes["runs"]["persistentVolumeClaim"] == {"claimName": "bench-runs"}


def test_npu_job_asks_for_ascend_devices_with_the_hccl_env(tmp_path, monkeypatch, capsys):
    docs, run_dir = write_manifest(
        tmp_path,
        monkeypatch,
        capsys,
        "backend=fsdp",
        "device=npu",
        "launcher.nnodes=2",
        "launcher.nproc_per_node=8",
        "launcher.master_port=29500",
        "data.global_batch_size=32",
        "launcher.collective_timeout_s=600",
    )
    job, container = check_bundle(docs, run_dir)
    assert container["resources"]["limits"] == {"huawei.com/Ascend910": 8}
    assert "nvidia.com/gpu" not in (run_dir / "pytorchjob.yaml").read_text()
    env = env_of(container)
    assert env["HCCL_CONNECT_TIMEOUT"] == "600"  # launcher.collective_timeout_s, in CANN's [120, 7200]
    assert env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"  # the launch bundle's own environment
    volumes = {v["name"]: v for v in job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"]}
    assert volumes["runs"] == {"name": "runs", "emptyDir": {}} and volumes["dshm"]["emptyDir"] == {"medium": "Memory"}


def test_single_node_mindspore_npu_job_is_a_master_only(tmp_path, monkeypatch, capsys):
    """One node: no Worker (the webhook refuses 0 replicas); msrun's line; the backend's env is kept,
    this machine's PATH is not (it names this venv)."""
    docs, run_dir = write_manifest(
        tmp_path,
        monkeypatch,
        capsys,
        "backend=mindspore",
        "device=npu",
        "launcher.nproc_per_node=4",
        "data.global_batch_size=8",
    )
    job, container = check_bundle(docs, run_dir)
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master"}
    assert container["resources"]["limits"] == {"huawei.com/Ascend910": 4}
    script = container["command"][2]
    assert "export MASTER_ADDR=127.0.0.1" in script and script.splitlines()[-1].startswith("exec msrun ")
    env = env_of(container)
    assert env["HCCL_CONNECT_TIMEOUT"] == "180" and env["GLOG_v"] == "3" and "PATH" not in env


@pytest.mark.parametrize("backend", ["mindspore", "ddp"])
def test_the_manifest_does_not_depend_on_the_submitting_shell(backend, tmp_path, monkeypatch, capsys):
    """The same job submitted from a shell with this venv active (its bin first on PATH, as a user
    usually has it), without it, and with other local variables set: the same PyTorchJob, and no
    PATH in the container (the image has its own)."""
    import os
    import sys

    here = os.path.dirname(sys.executable)
    rest = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != here)
    jobs = []
    for name, path in (("active", os.pathsep.join([here, rest])), ("inactive", rest)):
        monkeypatch.setenv("PATH", path)
        monkeypatch.setenv("VIRTUAL_ENV", os.path.dirname(here) if name == "active" else "/elsewhere")
        (tmp_path / name).mkdir()
        docs, run_dir = write_manifest(
            tmp_path / name, monkeypatch, capsys, f"backend={backend}", "device=npu", "data.global_batch_size=8"
        )
        job, container = check_bundle(docs, run_dir)
        assert "PATH" not in env_of(container) and here not in (run_dir / "pytorchjob.yaml").read_text()
        jobs.append(job)
    assert jobs[0] == jobs[1]


def test_the_schema_check_has_teeth(tmp_path, monkeypatch, capsys):
    """A misspelt field, a wrong type and a missing required field each fail the validation used above."""
    docs, _ = write_manifest(tmp_path, monkeypatch, capsys, "backend=ddp", "device=cuda")
    job = docs[1]
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    for broken in (
        {**job, "spec": {**job["spec"], "nprocPerNode": 8}},  # the CRD has it as a string
        {**job, "spec": {k: v for k, v in job["spec"].items() if k != "pytorchReplicaSpecs"}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, STRICT)
    container["resource"] = container.pop("resources")
    with pytest.raises(jsonschema.ValidationError, match="resource"):
        jsonschema.validate(job, STRICT)
    jsonschema.validate(job, SCHEMA)  # the published schema alone lets it through: the API server would prune it


def test_secret_names_never_reach_the_container_env():
    from parabench.k8s import portable_env

    env = {
        "MLFLOW_TRACKING_PASSWORD": SECRET,
        "HF_TOKEN": SECRET,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "OMP_NUM_THREADS": "4",
    }
    here = {"PATH": "/usr/bin"}
    assert portable_env({**env, "PATH": "/venv/bin:/usr/bin"}, here) == {"OMP_NUM_THREADS": "4"}


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["launcher.k8s.image=x"], "launcher.k8s.pytorchjob"),  # no dry run
        (["launcher.dry_run=true"], "launcher.k8s.image"),
        (["launcher.dry_run=true", "launcher.k8s.image=x", "launcher.k8s.name=1job"], "launcher.k8s.name"),
        (["launcher.dry_run=true", "launcher.k8s.image=x", "launcher.k8s.namespace=Team_A"], "launcher.k8s.namespace"),
        (["launcher.dry_run=true", "launcher.k8s.image=x", "launcher.k8s.mount_path=runs"], "launcher.k8s.mount_path"),
        (["launcher.dry_run=true", "launcher.k8s.image=x", "launcher.k8s.replicas=2"], "launcher.k8s.replicas"),
    ],
)
def test_bad_k8s_settings_are_refused_before_launch(overrides, key, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_refused_before_launch(["+model=llama", "launcher.k8s.pytorchjob=true", *overrides], key, tmp_path, capsys)
