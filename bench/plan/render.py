"""A plan as a table, Markdown, JSON or CSV: the top rows, why each wins, the nearest rejected."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from parabench.plan.estimate import Estimate
from parabench.plan.search import Searched, describe, why_lost, why_wins
from parabench.spec import to_dict
from parabench.tracking.runs import flatten

GIB = 1024**3
REJECTED = 3  # nearest rejected rows shown of each kind (slower, does not fit)


def match_params(e: Estimate, plain: dict[str, Any]) -> dict[str, str]:
    """The MLflow params (as ``bench run`` logs them: runner's flatten of the composed config and the
    resolved model) and the ``device`` tag that a measured run of this row has: ``bench compare``
    puts the row beside the runs that carry all of them."""
    keys = flatten({"backend": plain["backend"], "model": to_dict(e.job.model)})
    for k in ("global_batch_size", "micro_batch_size", "seq_len"):
        keys[f"data.{k}"] = str(plain["data"][k])
    keys["run.precision"] = str(plain["run"]["precision"])
    keys["launcher.nproc_per_node"] = str(plain["launcher"]["nproc_per_node"])
    keys["launcher.nnodes"] = str(plain["launcher"]["nnodes"])
    keys["device"] = e.job.device.type
    return keys


def _row(e: Estimate, rank: int | str, why: str, overrides: list[str]) -> dict[str, Any]:
    return {
        "rank": rank,
        "layout": describe(e),
        "device_bytes": e.device_bytes,
        "device_gib": round(e.device_bytes / GIB, 3),
        "margin_gib": round(e.margin_bytes / GIB, 3),
        "states_gib": round((e.states.total - e.states.host) / GIB, 3),
        "activations_gib": round(e.activations / GIB, 3),
        "host_gib": round(e.host_bytes / GIB, 3),
        "step_s": e.step_s,
        "tokens_per_s_per_device": e.tokens_per_s_per_device,
        "mfu": e.mfu,
        "comm_share": e.comm_share,
        "bubble_share": e.bubble_share,
        "offload_share": e.offload_s / e.step_s,  # exposed host optimizer step + host link transfers
        "comm_bytes_per_step": e.comm.bus_bytes(),
        "why": why,
        "overrides": " ".join(overrides),
    }


def rows(found: Searched, top: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    best = found.ranked[0]

    def row(e: Estimate, rank: int | str, why: str) -> dict[str, Any]:
        return {**_row(e, rank, why, found.overrides[id(e)]), "match": match_params(e, found.plains[id(e)])}

    ranked = [row(e, i + 1, why_wins(e, best)) for i, e in enumerate(found.ranked[:top])]
    rejected = [row(e, "-", why_wins(e, best)) for e in found.ranked[top : top + REJECTED]]
    rejected += [row(e, "x", why_lost(e)) for e in found.unfit[:REJECTED]]
    return ranked, rejected


def render(found: Searched, top: int, context: dict[str, Any], fmt: str) -> str:
    ranked, rejected = rows(found, top)
    if fmt == "json":
        doc = {"context": context, "ranked": ranked, "rejected": rejected, "invalid_layouts": found.invalid}
        return json.dumps(doc, indent=2, default=str)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=[k for k in ranked[0] if k != "match"], extrasaction="ignore")
        w.writeheader()
        w.writerows(ranked + rejected)
        return buf.getvalue()
    return _text(ranked, rejected, found, context, md=fmt == "md")


def _text(ranked, rejected, found: Searched, context: dict[str, Any], md: bool) -> str:
    c = context
    head = [
        f"plan: {c['model']} on {c['devices']} x {c['cluster']} ({c['device_memory_gib']:.1f} GiB each), "
        f"global batch {c['global_batch_size']} x {c['seq_len']} tokens, {c['precision']}",
        f"peak: {c['peak_tflops']:.4g} TFLOP/s per device ({c['peak_source']})"
        if c["peak_tflops"]
        else f"peak: {c['peak_source']}",
        c["calibration"],
    ]
    if c["uncertain"]:
        head.append("uncertain cluster values (no solid public source): " + ", ".join(c["uncertain"]))
    cols = ["rank", "layout", "device_gib", "margin_gib", "step_s", "tokens_per_s_per_device", "mfu", "comm_share",
            "bubble_share", "why"]  # fmt: skip
    lines = [*head, ""]
    lines += _grid(cols, ranked, md)
    lines += ["", "bench run overrides:"] + [
        f"  {r['rank']}: bench run {c['job_overrides']} {r['overrides']}" for r in ranked
    ]
    if rejected:
        lines += ["", "nearest rejected:", *_grid(cols, rejected, md)]
    if found.invalid:
        lines += [
            "",
            "layouts the harness refuses: " + "; ".join(f"{k}: {n}" for k, n in sorted(found.invalid.items())),
        ]
    return "\n".join(lines)


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if key in ("mfu", "comm_share", "bubble_share"):
        return f"{100 * v:.1f}%"
    if key == "step_s":
        return f"{v:.4g}"
    if key == "tokens_per_s_per_device":
        return f"{v:.4g}"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def _grid(cols: list[str], data: list[dict[str, Any]], md: bool) -> list[str]:
    cells = [[_fmt(k, r[k]) for k in cols] for r in data]
    if md:
        out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        return out + ["| " + " | ".join(row) + " |" for row in cells]
    widths = [max(len(k), *(len(row[i]) for row in cells)) for i, k in enumerate(cols)]
    fmt = lambda row: "  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()  # noqa: E731
    return [fmt(cols), *(fmt(row) for row in cells)]
