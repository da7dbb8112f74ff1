"""The stability table of `bench compare`: checkpoint cost and recovery per backend (docs/resilience.md).

The figures are the job summary's (parabench.resilience.faults.recovery_figures), logged as MLflow metrics
under these names; a run without checkpoints or faults simply lacks them and shows ``-``.
"""

from __future__ import annotations

import io
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

# (metric, column head, unit): every metric of the stability table, in its column order
STABILITY_METRICS: list[tuple[str, str, str]] = [
    ("ckpt_save_blocking_s", "save s (blocking)", "s"),
    ("ckpt_save_total_s", "save s (total)", "s"),
    ("ckpt_bytes_per_rank", "ckpt/rank", "bytes"),
    ("ckpt_bytes_total", "ckpt total", "bytes"),
    ("ckpt_load_s", "load s", "s"),
    ("restarts", "restarts", ""),
    ("time_to_detect_s", "detect s", "s"),
    ("time_to_first_step_after_fault_s", "fault->step s", "s"),
    ("steps_recomputed", "recomputed", ""),
    ("goodput", "goodput", "ratio"),
]
KEYS = [k for k, _, _ in STABILITY_METRICS]


def from_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The stability metrics of one MLflow run."""
    return {k: metrics[k] for k in KEYS if k in metrics}


def medians(per_run: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Median of each stability metric over a row's repeats (only the runs that have it)."""
    runs = list(per_run)
    out = {}
    for key in KEYS:
        values = [r[key] for r in runs if key in r]
        if values:
            out[key] = statistics.median(values)
    return out


def _fmt(unit: str, value: float | None) -> str:
    if value is None:
        return "-"
    if unit == "bytes":
        return f"{value / 2**20:.1f} MiB"
    if unit == "ratio":
        return f"{100 * value:.1f}%"
    if unit == "s":
        return f"{value:.3f}"
    return f"{value:g}"


def cells(rows: list[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Heads and formatted cells of the stability table (no cells when no row has a stability metric);
    the text, markdown and HTML reports all render these."""
    if not any(r.get("stability") for r in rows):
        return [], []
    heads = ["backend", "N", *(h for _, h, _ in STABILITY_METRICS)]
    body = [
        [str(r["variant"]), str(r["world_size"]), *(_fmt(u, r["stability"].get(k)) for k, _, u in STABILITY_METRICS)]
        for r in rows
    ]
    return heads, body


def table(rows: list[Mapping[str, Any]], markdown: bool = False) -> str:
    """The stability table of one comparison section ('' when no row has a stability metric)."""
    heads, body = cells(rows)
    if not body:
        return ""
    out = io.StringIO()
    if markdown:
        out.write(
            "\nstability (checkpoints and recovery)\n\n| " + " | ".join(heads) + " |\n|" + "---|" * len(heads) + "\n"
        )
        out.writelines("| " + " | ".join(c) + " |\n" for c in body)
        return out.getvalue()
    widths = [max(len(h), *(len(c[i]) for c in body)) for i, h in enumerate(heads)]
    out.write("  stability (checkpoints and recovery)\n")
    out.write("  " + "  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True)) + "\n")
    out.writelines("  " + "  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)) + "\n" for c in body)
    return out.getvalue()
