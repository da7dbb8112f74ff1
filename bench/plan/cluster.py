"""Clusters the planner plans for: ``conf/cluster/<name>.yaml`` (docs/sources.md#cluster-nvidia,
#cluster-ascend, #cluster-cpu).

A cluster file gives the device (its name, kind and memory), devices per node, host memory for
offloaded states, the intra- and inter-node links (bandwidth per device per direction and a
latency) and, where states can be offloaded, the host link (device <-> host bandwidth per device
per direction, and the node's host memory bandwidth the host optimizer step is bound by), and the
device's dense peak FLOP/s per precision with its source (``peak_tflops``, ``peak_source``): a
device missing from ``parabench.flops``' table still gets a peak, and a cluster without one is
refused (a step time without a peak would be NaN). The CPU cluster measures its peak instead (the
GEMM peak at its threads per rank, ``measured``). Values without a solid public source are listed
under ``uncertain`` and every plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from parabench.errors import SpecError
from parabench.flops import Peak, cpu_gemm_peak, table_peak

GIB = 1024**3


@dataclass(frozen=True)
class Link:
    bytes_per_s: float
    latency_s: float
    uncertain: tuple[str, ...] = ()


@dataclass(frozen=True)
class HostLink:
    """Device <-> host transfers (PCIe) per device per direction, and the host's memory bandwidth
    per node (the offloaded optimizer step reads and writes every state once: docs/plan.md)."""

    bytes_per_s: float
    memory_bytes_per_s: float
    uncertain: tuple[str, ...] = ()


@dataclass(frozen=True)
class Cluster:
    name: str
    device_name: str
    device_kind: str  # cpu | cuda | npu: the device= of the bench run overrides
    memory_bytes: float  # per device
    devices_per_node: int
    host_memory_bytes: float  # per node
    intra: Link
    inter: Link
    uncertain: tuple[str, ...] = ()
    domain: int = 0  # devices reached over the intra-node fabric (a supernode); 0 = one node
    measured: dict[str, Any] | None = None  # CPU: how the figures were measured
    # None: nothing to offload to (the CPU cluster: host memory is the device's memory)
    host_link: HostLink | None = None
    # dense peak TFLOP/s per precision and where it comes from (None: measured, the CPU cluster)
    peak_tflops: dict[str, float] | None = None
    peak_source: str = ""

    def link(self, group_span: int) -> Link:
        """The link a group spanning ``group_span`` consecutive devices runs over."""
        return self.intra if group_span <= max(self.devices_per_node, self.domain) else self.inter

    def uncertain_values(self) -> list[str]:
        return [
            *self.uncertain,
            *(f"intra_node.{k}" for k in self.intra.uncertain),
            *(f"inter_node.{k}" for k in self.inter.uncertain),
            *(f"host_link.{k}" for k in (self.host_link.uncertain if self.host_link else ())),
        ]


def cluster_dir() -> Path:
    return Path(str(resources.files("parabench.conf") / "cluster"))


def available() -> list[str]:
    return sorted(p.stem for p in cluster_dir().glob("*.yaml"))


def load(name: str) -> Cluster:
    path = cluster_dir() / f"{name}.yaml"
    if not path.is_file():
        raise SpecError("cluster", f"unknown cluster {name!r} (available: {', '.join(available())})")
    raw = yaml.safe_load(path.read_text())
    _check_peak(name, raw)
    mem = raw["memory_gib"] * GIB if "memory_gib" in raw else raw["memory_gb"] * 1e9

    def link(node: dict[str, Any]) -> Link:
        return Link(node["gbytes_per_s"] * 1e9, node["latency_us"] * 1e-6, tuple(node.get("uncertain", ())))

    return Cluster(
        name=raw["name"],
        device_name=raw["device_name"],
        device_kind=raw["device_kind"],
        memory_bytes=mem,
        devices_per_node=int(raw["devices_per_node"]),
        host_memory_bytes=raw["host_memory_gib"] * GIB,
        intra=link(raw["intra_node"]),
        inter=link(raw["inter_node"]),
        uncertain=tuple(raw.get("uncertain", ())),
        domain=int(raw.get("supernode_devices", 0)),
        measured=raw.get("measured"),
        host_link=_host_link(raw.get("host_link")),
        peak_tflops={k: float(v) for k, v in raw["peak_tflops"].items()} if "peak_tflops" in raw else None,
        peak_source=str(raw.get("peak_source", "")),
    )


def _check_peak(name: str, raw: dict[str, Any]) -> None:
    """A cluster carries its device's peak with a source, unless it measures it (the CPU cluster)."""
    if raw.get("device_kind") == "cpu" and "measured" in raw:
        return
    if not raw.get("peak_tflops") or not raw.get("peak_source"):
        raise SpecError(
            "cluster",
            f"conf/cluster/{name}.yaml has no peak: add peak_tflops (dense TFLOP/s per precision, e.g. "
            "{bf16: 989}) and peak_source (the datasheet or paper it comes from)",
        )


def _host_link(node: dict[str, Any] | None) -> HostLink | None:
    if node is None:
        return None
    return HostLink(node["gbytes_per_s"] * 1e9, node["memory_gbytes_per_s"] * 1e9, tuple(node.get("uncertain", ())))


def peak(cluster: Cluster, precision: str, cache_dir: Path) -> Peak | None:
    """The device's dense peak for ``precision``: the MFU table, or on CPU the measured GEMM peak
    at the cluster's threads per rank (cached like ``bench run``'s)."""
    if cluster.device_kind == "cpu":
        threads = int((cluster.measured or {}).get("threads_per_rank", 1))
        return cpu_gemm_peak(threads, precision, cache_dir, cluster.device_name)
    if cluster.peak_tflops is None:
        return table_peak(cluster.device_name, precision)
    tflops = cluster.peak_tflops.get(precision)
    uncertain = "peak" in cluster.uncertain
    return Peak(tflops, f"{cluster.peak_source} (conf/cluster/{cluster.name}.yaml)", uncertain) if tflops else None
