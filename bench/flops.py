"""Model FLOPs per token, device peaks, and MFU.

MFU follows PaLM (Chowdhery et al. 2022, arXiv 2204.02311, Appendix B; docs/sources.md#flops-per-token):
    model FLOPs per token = 6 N + 12 L H Q T
with N the parameters that take part in matrix multiplies (we exclude the input-embedding lookup,
which is a gather; lm_head is counted; in a Mixture-of-Experts model only the router, the k experts a
token is routed to and the shared expert, docs/sources.md#moe), L layers, H attention heads, Q head dim, T sequence length.
No causal halving of the attention term (as in PaLM and torchtitan); recomputation is not counted
(that would be HFU). MFU = achieved model FLOP/s per device / peak FLOP/s per device.

The peak is never assumed: a known accelerator table (below, with sources), a CPU GEMM calibration
measured on this machine, or a user-supplied ``device.peak_tflops``. Unknown -> no MFU, said plainly.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parabench.spec import ModelSpec

FORMULA = (
    "PaLM: 6N + 12*L*H*Q*T per token (N = matmul parameters: input embedding excluded, lm_head included, "
    "MoE: active experts only; no recompute)"
)


def flops_per_token(model: ModelSpec, seq_len: int) -> float:
    # MoE: N counts the active parameters only (router, top-k routed experts, shared expert), the
    # experts a token is not routed to do no work for it (Jiang et al. 2024, Mixtral, arXiv 2401.04088
    # sec. 2; docs/sources.md#moe). Dense models: every matmul parameter.
    n = model.num_active_matmul_params()
    attention = 12 * model.num_hidden_layers * model.num_attention_heads * model.head_dim * seq_len
    return 6.0 * n + attention


@dataclass(frozen=True)
class Peak:
    tflops: float  # per device, dense
    source: str
    uncertain: bool = False
    measured_at: str | None = None  # a measured peak (CPU GEMM): when, UTC ISO 8601


# Dense peak TFLOP/s per device. Keys are matched against the device name (longest match first).
# NVIDIA: A100 datasheet (312 bf16/fp16 tensor core, 19.5 fp32 non-tensor), H100 SXM / H200
# datasheets (989 bf16 dense, 67 fp32); H100 PCIe 756 bf16, 51 fp32. Ascend 910B: MindSpeed's
# auto-tuning defaults (363.7 fp16/bf16), marked uncertain (docs/sources.md#peak-flops).
PEAKS: dict[str, dict[str, Peak]] = {
    "A100": {
        "bf16": Peak(312, "NVIDIA A100 datasheet"),
        "fp16": Peak(312, "NVIDIA A100 datasheet"),
        "fp32": Peak(19.5, "NVIDIA A100 datasheet (fp32 without TF32)"),
    },
    "H100 PCIe": {
        "bf16": Peak(756, "NVIDIA H100 datasheet (PCIe)"),
        "fp16": Peak(756, "NVIDIA H100 datasheet (PCIe)"),
        "fp32": Peak(51, "NVIDIA H100 datasheet (PCIe)"),
    },
    "H100": {
        "bf16": Peak(989, "NVIDIA H100 datasheet (SXM)"),
        "fp16": Peak(989, "NVIDIA H100 datasheet (SXM)"),
        "fp32": Peak(67, "NVIDIA H100 datasheet (SXM)"),
    },
    # The NVL card runs at its own (lower) clocks and power: no figure of it is carried here, so it
    # gets no MFU rather than the SXM peak that its "H100" name would otherwise match.
    "H100 NVL": {},
    "H200": {
        "bf16": Peak(989, "NVIDIA H200 datasheet"),
        "fp16": Peak(989, "NVIDIA H200 datasheet"),
        "fp32": Peak(67, "NVIDIA H200 datasheet"),
    },
    "910B": {
        "bf16": Peak(363.7, "MindSpeed auto-tuning default for 910B", True),
        "fp16": Peak(363.7, "MindSpeed auto-tuning default for 910B", True),
    },
    # Two dies per package; Huawei's CloudMatrix384 paper (arXiv 2506.12708, sec. 3), no datasheet.
    "910C": {
        "bf16": Peak(752, "Huawei CloudMatrix384 paper (Zuo et al. 2025) for 910C", True),
        "fp16": Peak(752, "Huawei CloudMatrix384 paper (Zuo et al. 2025) for 910C", True),
    },
}


def table_peak(device_name: str, precision: str) -> Peak | None:
    for key in sorted(PEAKS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return PEAKS[key].get(precision)
    return None


@dataclass(frozen=True)
class GemmReading:
    """One best-of-5 torch.mm measurement (:func:`read_gemm`): TFLOP/s and the torch it ran on."""

    tflops: float
    torch_version: str


def read_gemm(threads: int, precision: str) -> GemmReading:
    """Measure the GEMM of :func:`cpu_gemm_peak` now (imports torch)."""
    import torch

    return GemmReading(_gemm_tflops(threads, precision), torch.__version__)


def cpu_gemm_peak(
    threads: int, precision: str, cache_dir: Path, cpu_name: str, reading: GemmReading | None = None
) -> Peak:
    """The highest torch.mm throughput seen at ``threads`` intra-op threads on this CPU model.

    Measured on every call (best of 5 at 1024^3, 2 * 1024^3 FLOPs each; docs/sources.md#cpu-gemm-peak)
    and kept in ``cache_dir`` only when it beats the stored one: a measurement taken under load never
    lowers the peak, so MFU does not move with the machine's other work. ``reading``: a measurement
    a process that had torch loaded took already (rank 0 of a run, after its last step: the bench
    parent then imports no torch); None measures here.
    """
    reading = reading or read_gemm(threads, precision)
    now = reading.tflops
    key = f"{cpu_name}|threads={threads}|{precision}|torch={reading.torch_version}"
    best = keep_highest(cache_dir / "cpu_gemm_peak.json", key, now, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    when = best["measured_at"] or "before measurement times were recorded"
    return Peak(
        best["tflops"],
        f"measured: torch.mm 1024^3 {precision}, {threads} thread(s), best of 5; the highest seen on this CPU, "
        f"measured {when} (this run: {now:.4g}; kept in {cache_dir / 'cpu_gemm_peak.json'})",
        measured_at=best["measured_at"],
    )


def _gemm_tflops(threads: int, precision: str) -> float:
    """Best-of-5 torch.mm TFLOP/s of a 1024^3 GEMM at ``threads`` intra-op threads."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 1024
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        for _ in range(3):
            torch.mm(a, b)
        best = 0.0
        for _ in range(5):
            reps, t0 = 0, time.perf_counter()
            while True:
                torch.mm(a, b)
                reps += 1
                elapsed = time.perf_counter() - t0
                if elapsed > 0.15:
                    break
            best = max(best, 2 * n**3 * reps / elapsed)
    finally:
        torch.set_num_threads(previous)
    return best / 1e12


def keep_highest(cache: Path, key: str, tflops: float, now: str) -> dict[str, Any]:
    """The stored peak of ``key`` ({"tflops", "measured_at"}), replaced only by a higher ``tflops``
    (measured at ``now``). Written atomically; an entry of the older format (a bare number) has no time."""
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    found: object = known.get(key)
    stored: dict[str, Any] | None
    if isinstance(found, (int, float)):  # the older format: a bare number, no time
        stored = {"tflops": float(found), "measured_at": None}
    else:
        stored = found if isinstance(found, dict) else None
    if stored is not None and stored["tflops"] >= tflops:
        return stored
    entry: dict[str, Any] = {"tflops": tflops, "measured_at": now}
    known[key] = entry
    cache.parent.mkdir(parents=True, exist_ok=True)
    part = cache.with_name(f"{cache.name}.{os.getpid()}.part")
    part.write_text(json.dumps(known, indent=2, sort_keys=True))
    os.replace(part, cache)
    return entry
