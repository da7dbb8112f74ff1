"""Predicted (``bench plan``) vs measured (``bench run``), for ``bench compare`` (part of that command:
it reads the ``plan.json`` artifact ``bench plan`` logs, parabench.plan.render, and imports nothing of it).

A plan is an MLflow run (tag ``parabench.kind=plan``, experiment ``<experiment>-plan``) whose
``plan.json`` artifact lists every shown row with the params a run of that row logs (``match``:
backend options, the resolved model, batch, sequence length, precision, ranks, device). A
measured run belongs to a row when it carries all of them: same model, device, backend and layout.
For each such (plan, row) the report gives the predicted and the measured step time (median over
repeats of the run's median step), tokens/s per device and peak memory per device, and the error
(predicted - measured) / measured.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from parabench.runnames import plan_experiment

# (key of the prediction in plan.json, attribute of the measured record, label)
QUANTITIES = (
    ("step_s", "step_time_median_s", "step s"),
    ("tokens_per_s_per_device", "tokens_per_s_per_device", "tok/s/dev"),
    ("device_bytes", "peak_memory_bytes", "peak mem"),
)


class Measured(Protocol):
    run_id: str
    device: str
    params: dict[str, str]
    step_time_median_s: float
    tokens_per_s_per_device: float
    peak_memory_bytes: float


def load_plans(client, experiment: str | None) -> list[dict[str, Any]]:
    """The finished plan runs (of ``<experiment>-plan`` and ``experiment``, or of every experiment),
    newest first, each with its plan.json document."""
    names = [plan_experiment(experiment), experiment] if experiment else None
    exps = [client.get_experiment_by_name(n) for n in names] if names else client.search_experiments()
    ids = [e.experiment_id for e in exps if e is not None]
    flt = "tags.`parabench.kind` = 'plan' and attributes.status = 'FINISHED'"
    plans = []
    for run in client.search_runs(ids, filter_string=flt, order_by=["attributes.start_time DESC"]) if ids else []:
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(run.info.run_id, "plan.json", tmp)
            doc = json.loads(Path(path).read_text())
        plans.append({"run_id": run.info.run_id, "name": run.info.run_name, "doc": doc})
    return plans


def _holds(rec: Measured, match: dict[str, str]) -> bool:
    return all((rec.device if k == "device" else rec.params.get(k)) == v for k, v in match.items())


def versus(plans: list[dict[str, Any]], records: Iterable[Measured]) -> list[dict[str, Any]]:
    """One entry per (plan, row) that has measured runs."""
    records = list(records)
    out = []
    for plan in plans:
        doc = plan["doc"]
        for row in [*doc.get("ranked", []), *doc.get("rejected", [])]:
            runs = [r for r in records if row.get("match") and _holds(r, row["match"])]
            if not runs:
                continue
            entry: dict[str, Any] = {
                "plan_run_id": plan["run_id"],
                "plan": plan["name"],
                "calibration": doc["context"].get("calibration", ""),
                "rank": row["rank"],
                "layout": row["layout"],
                "overrides": row["overrides"],
                "run_ids": [r.run_id for r in runs],
            }
            for key, attr, _ in QUANTITIES:
                pred, meas = row.get(key), statistics.median(getattr(r, attr) for r in runs)
                ok = pred is not None and meas
                entry[key] = {"predicted": pred, "measured": meas, "error": (pred - meas) / meas if ok else None}
            out.append(entry)
    return out


def _cell(key: str, v: float | None) -> str:
    if v is None:
        return "-"
    if key == "device_bytes":
        return f"{v / 2**20:.1f} MiB"
    return f"{v:.4g}"


def table(entries: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    heads = ["plan", "row", "layout", "runs"]
    for _, _, label in QUANTITIES:
        heads += [f"{label} pred", f"{label} meas", "err"]
    cells = []
    for e in entries:
        row = [e["plan"], str(e["rank"]), e["layout"], str(len(e["run_ids"]))]
        for key, _, _ in QUANTITIES:
            q = e[key]
            err = f"{100 * q['error']:+.1f}%" if q["error"] is not None else "-"
            row += [_cell(key, q["predicted"]), _cell(key, q["measured"]), err]
        cells.append(row)
    return heads, cells


def render_lines(entries: list[dict[str, Any]], plans: int, markdown: bool) -> list[str]:
    if not plans:
        return []
    title = "predicted (bench plan) vs measured (bench run)"
    lines = [f"### {title}", ""] if markdown else [f"== {title}"]
    if not entries:
        return [*lines, f"({plans} plan run(s), none of whose rows has a measured run here)", ""]
    heads, cells = table(entries)
    if markdown:
        lines += ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
    else:
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
        lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in [heads, *cells]]
    lines += [
        ("- " if markdown else "  ") + "err = (predicted - measured) / measured; measured: median over the row's runs "
        "of the median step time, tokens/s per device and peak memory per device",
        *sorted({("- " if markdown else "  ") + f"{e['plan']}: {e['calibration']}" for e in entries}),
        "",
    ]
    return lines
