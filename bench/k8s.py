"""A Kubeflow ``PyTorchJob`` for the dry-run bundle (``launcher.k8s.pytorchjob=true``): ``pytorchjob.yaml``.

Two documents, for ``kubectl apply -f pytorchjob.yaml``:

- a ConfigMap ``<name>-bundle`` with the bundle's files (``spec.json``, ``config.resolved.yaml``, the
  backend's own files), mounted read-only in every pod;
- the PyTorchJob (kubeflow.org/v1, training-operator's CRD): a ``Master`` (node 0) and, for
  ``launcher.nnodes`` > 1, ``nnodes - 1`` ``Worker`` replicas. Each pod copies the bundle into its run
  directory and runs the same launcher line as ``launch.sh`` (torchrun, or msrun for MindSpore),
  ``NODE_RANK`` taken from the operator's ``PET_NODE_RANK`` and ``MASTER_ADDR`` from the operator
  (docs/sources.md#kubeflow-pytorchjob).

Per device kind (``device.type``) the container asks for its accelerators by the resource name of
the device plugin and gets that device's collective environment (:data:`ACCELERATORS`). The
environment is the launch bundle's, with the same secret filter: no credential is ever written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from parabench import __version__
from parabench.spec import JobSpec
from parabench.tracking.runs import is_secret

API_VERSION = "kubeflow.org/v1"
CONTAINER = "pytorch"  # the operator's webhook needs one container of this name
PORT_NAME = "pytorchjob-port"  # the operator's MASTER_PORT is this container port of the Master
BUNDLE_MOUNT = "/parabench-bundle"
MANIFEST = "pytorchjob.yaml"


def _hccl_env(job: JobSpec) -> dict[str, str]:
    """Ascend: HCCL's link-setup timeout follows launcher.collective_timeout_s, within the range CANN
    accepts, [120, 7200] s (docs/sources.md#ascend-on-kubernetes). No rank table: torch_npu's
    process group sets HCCL up through torchrun's store (MASTER_ADDR:MASTER_PORT); MindCluster's rank
    table is an optimisation of its own AscendJob."""
    timeout = min(max(int(job.launch.collective_timeout_s), 120), 7200)
    return {"HCCL_CONNECT_TIMEOUT": str(timeout)}


def _no_env(job: JobSpec) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class Accelerator:
    resource: str | None  # the extended resource its device plugin advertises; None: no device to ask for
    env: Callable[[JobSpec], dict[str, str]]  # defaults the backend's own launch environment may override


# docs/sources.md#kubernetes-gpus (NVIDIA's device plugin), docs/sources.md#ascend-on-kubernetes (Ascend's).
ACCELERATORS: dict[str, Accelerator] = {
    "cpu": Accelerator(None, _no_env),
    "cuda": Accelerator("nvidia.com/gpu", _no_env),
    "npu": Accelerator("huawei.com/Ascend910", _hccl_env),
}


def job_name(job: JobSpec) -> str:
    """``launcher.k8s.name``, or parabench-<backend>-<model> made a DNS-1035 label."""
    if job.launch.k8s.name:
        return job.launch.k8s.name
    name = re.sub(r"[^a-z0-9-]+", "-", f"parabench-{job.backend.name}-{job.model.name}".lower())
    return name[: 63 - len(f"-worker-{job.launch.nnodes}")].rstrip("-")


def portable_env(env: dict[str, str], here: dict[str, str]) -> dict[str, str]:
    """The launch environment a container can use: no secrets, and no value that extends this
    machine's (a PATH with this venv's bin first means nothing in the image)."""
    out = {}
    for key, value in sorted(env.items()):
        mine = here.get(key, "")
        if is_secret(key) or (mine and value.endswith(mine) and value != mine):
            continue
        out[key] = value
    return out


def _script(job: JobSpec, command: str) -> str:
    lines = [
        "set -euo pipefail",
        'mkdir -p "$RUN_DIR/logs"',
        f'cp {BUNDLE_MOUNT}/* "$RUN_DIR"/',
        'export NODE_RANK="${PET_NODE_RANK:-0}"',  # set by the operator: 0 on the Master, i on Worker i-1
    ]
    if job.launch.nnodes == 1:  # one pod: no need to reach it through the operator's service
        lines.append("export MASTER_ADDR=127.0.0.1")
    return "\n".join([*lines, "exec " + command]) + "\n"


def _container(job: JobSpec, env: dict[str, str], command: str, port: int, run_dir: str) -> dict[str, Any]:
    k8s = job.launch.k8s
    accel = ACCELERATORS[job.device.type]
    values = {**accel.env(job), **env, "RUN_DIR": run_dir}
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": k8s.image,
        "command": ["bash", "-c", _script(job, command)],
        "env": [{"name": k, "value": v} for k, v in values.items()],
        "ports": [{"name": PORT_NAME, "containerPort": port}],
        "volumeMounts": [
            {"name": "bundle", "mountPath": BUNDLE_MOUNT, "readOnly": True},
            {"name": "runs", "mountPath": k8s.mount_path},
            {"name": "dshm", "mountPath": "/dev/shm"},  # docs/sources.md#kubernetes-gpus: NCCL's shared memory
        ],
    }
    if accel.resource:
        count = job.launch.nproc_per_node
        container["resources"] = {"limits": {accel.resource: count}, "requests": {accel.resource: count}}
    return container


def _pod(job: JobSpec, name: str, container: dict[str, Any]) -> dict[str, Any]:
    claim = job.launch.k8s.volume_claim
    runs = {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}
    return {
        "metadata": {"labels": _labels(name)},
        "spec": {
            "containers": [container],
            "volumes": [
                {"name": "bundle", "configMap": {"name": f"{name}-bundle"}},
                {"name": "runs", **runs},
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
        },
    }


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "parabench", "app.kubernetes.io/instance": name}


def manifests(
    job: JobSpec, env: dict[str, str], command: str, port: int, files: dict[str, str]
) -> list[dict[str, Any]]:
    """[ConfigMap, PyTorchJob] for ``job``: ``command`` is the launcher's bundle line (reads $RUN_DIR,
    $NODE_RANK, $MASTER_ADDR), ``files`` the bundle's files by name."""
    k8s, la = job.launch.k8s, job.launch
    name = job_name(job)
    meta = {"name": name, "namespace": k8s.namespace, "labels": _labels(name)}
    run_dir = f"{k8s.mount_path.rstrip('/')}/runs/{name}"
    pod = _pod(job, name, _container(job, portable_env(env, dict(os.environ)), command, port, run_dir))
    replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": pod}}
    if la.nnodes > 1:  # the webhook refuses a Worker with 0 replicas
        replicas["Worker"] = {"replicas": la.nnodes - 1, "restartPolicy": "Never", "template": pod}
    annotations = {
        "parabench/version": __version__,
        "parabench/job": f"backend={job.backend.name} model={job.model.name} device={job.device.type} "
        f"nnodes={la.nnodes} nproc_per_node={la.nproc_per_node}",
    }
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta, "name": f"{name}-bundle"}}
    config_map["data"] = {k: files[k] for k in sorted(files)}
    pytorchjob = {
        "apiVersion": API_VERSION,
        "kind": "PyTorchJob",
        "metadata": {**meta, "annotations": annotations},
        "spec": {
            "nprocPerNode": str(la.nproc_per_node),
            # Failures end the job: torchrun restarts ranks itself (launcher.max_restarts).
            "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": replicas,
        },
    }
    return [config_map, pytorchjob]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the pod script, spec.json) as YAML literal blocks, readable in review; the
    Worker's pod template written out in full, not as an alias of the Master's."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value and not value.endswith((" ", "\t")) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(docs: list[dict[str, Any]]) -> str:
    head = (
        f"# parabench {__version__}: Kubeflow PyTorchJob ({API_VERSION}) for this launch bundle.\n"
        f"# kubectl apply -f {MANIFEST}  (needs the Kubeflow training operator; see docs/kubernetes.md)\n"
    )
    body: str = yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=120)
    return head + body
