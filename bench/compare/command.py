"""``bench compare``: read runs back from MLflow, group them, and put comparable ones side by side.

The grouping, ratios and scaling efficiency are the runs table's (parabench.runtable: sections of
runs that may share a ratio, rows of one configuration with their repeats, baseline ratios and
E(N) = throughput(N) / (N x throughput(1)) with their noise bands); this module reads the runs,
refuses an explicit ``--runs`` list that mixes sections, and renders the report (text, markdown,
CSV, HTML with plots) and its MLflow record, with bench plan's predictions beside the measurements
(parabench.compare.versus).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import html
import io
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from parabench.compare import versus
from parabench.errors import UserError
from parabench.plots import bar_stack_svg, line_svg
from parabench.resilience import stability
from parabench.runnames import comparison_experiment, stamp
from parabench.runtable import (
    SECTION_KEYS,
    RunRecord,
    build_sections,
    grouping_note,
    load_comm_curves,
    load_runs,
    report_dict,
)
from parabench.spec import TrackingSpec
from parabench.tracking import store as trackstore
from parabench.tracking.runs import close_abandoned, default_store_uri, results_dir_of

# --------------------------------------------------------------------------------------------
# Rendering.
# --------------------------------------------------------------------------------------------
COLUMNS = [
    ("variant", "backend"),
    ("world_size", "N"),
    ("layout", "layout"),
    ("global_batch", "batch"),
    ("micro_batch", "micro"),
    ("repeats", "reps"),
    ("tokens_per_s", "tokens/s"),
    ("tokens_per_s_per_device", "tok/s/dev"),
    ("mfu", "MFU"),
    ("step_time_median_s", "step s"),
    ("rank_spread_s", "spread s"),
    ("peak_memory_bytes", "peak mem"),
    ("model_state_bytes", "states/rank"),
    ("loss_final", "final loss"),
    ("comm_bytes_per_step", "comm/step"),
    ("comm_formula_bytes_per_step", "formula/step"),
    ("comm_share_of_step", "comm %"),
    ("moe_load_imbalance", "expert load"),
    ("efficiency", "eff."),
    ("ratio", "ratio"),
]


def _fmt(key: str, value: Any, row: dict) -> str:
    if value is None:
        return "-"
    if key in ("peak_memory_bytes", "model_state_bytes"):
        return f"{value / 2**20:.1f} MiB"
    if key in ("comm_bytes_per_step", "comm_formula_bytes_per_step"):
        return f"{value / 2**20:.3f} MiB"
    if key == "moe_load_imbalance":
        worst = row.get("moe_load_imbalance_max")
        return f"{value:.3f}" + (f" (max {worst:.3f})" if worst is not None else "")
    if key in ("mfu", "comm_share_of_step"):
        return f"{100 * value:.1f}%"
    if key == "efficiency":
        band = row.get("efficiency_band")
        s = f"{100 * value:.1f}% {row['efficiency_kind']}"
        if band and row["repeats"] > 1:
            s += f" [{100 * band[0]:.0f}-{100 * band[1]:.0f}]"
        return s + (" *" if row.get("efficiency_note") else "")
    if key == "ratio":
        return f"{value:.3f}x" + (" ~" if row.get("ratio_note") else "")
    if key == "tokens_per_s" and row["repeats"] > 1:
        return f"{value:.1f} [{row['tokens_per_s_min']:.0f}-{row['tokens_per_s_max']:.0f}]"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def _row_notes(sec: dict[str, Any]) -> list[str]:
    """The ratio and efficiency notes of a section's rows, and rows whose runs' lengths differ."""
    notes = [
        f"{r['variant']} x{r['world_size']}: {n}"
        for r in sec["rows"]
        for n in (r["ratio_note"], r["efficiency_note"])
        if n
    ]
    notes += [
        f"{r['variant']} x{r['world_size']}: no final loss (its runs' loss histories differ in length)"
        for r in sec["rows"]
        if r["loss_final"] is None
    ]
    return notes


def _legend(meta: dict[str, Any]) -> list[str]:
    return [
        meta.get("grouping") or grouping_note(False),
        "tokens/s: median over repeats [min-max]; MFU against each run's recorded peak ("
        + meta.get("peak_sources", "")
        + ")",
        "eff.: E(N) = tokens/s(N) / (N x tokens/s(1)); weak = same per-device batch, strong = same global batch; * = "
        + "band overlaps 1.0 or another backend's band (within noise)",
        f"ratio: tokens/s / baseline ({meta.get('baseline') or 'none'}) at the same N and global batch; ~ = within noise",
        "comm/step: bus bytes (sizes x nccl-tests' bus factor) the busiest rank moved in collectives per step, "
        + "scalars apart; formula/step: the layout's formula with the backend's padding; comm %: time inside "
        + "collective calls / step time (docs/comm.md)",
        "expert load (MoE): max_e c_e / mean_e c_e, c_e = tokens routed to expert e (each of a token's k slots) "
        + "summed over the ranks, mean = k x tokens / E; per step its worst layer, here the mean over the steps "
        + "(max: the worst step); 1 = balanced, E/k = every token on the same k experts (docs/moe.md#tokens-per-expert)",
    ]


def render_text(report: dict[str, Any], markdown: bool = False) -> str:
    out = io.StringIO()
    for sec in report["sections"]:
        title = ", ".join(f"{k}={v}" for k, v in sec["key"].items())
        out.write(("### " if markdown else "== ") + title + ("\n\n" if markdown else "\n"))
        if sec["note"]:
            out.write(f"({sec['note']})\n\n" if markdown else f"({sec['note']})\n")
        cells = [[_fmt(k, r.get(k) if k != "repeats" else r["repeats"], r) for k, _ in COLUMNS] for r in sec["rows"]]
        heads = [h for _, h in COLUMNS]
        if markdown:
            out.write("| " + " | ".join(heads) + " |\n|" + "---|" * len(heads) + "\n")
            for c in cells:
                out.write("| " + " | ".join(c) + " |\n")
        else:
            widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
            out.write("  ".join(h.ljust(w) for h, w in zip(heads, widths)) + "\n")
            for c in cells:
                out.write("  ".join(v.ljust(w) for v, w in zip(c, widths)) + "\n")
        for n in _row_notes(sec):
            out.write(("- " if markdown else "  note: ") + n + "\n")
        out.write(stability.table(sec["rows"], markdown))
        out.write("\n")
    for line in versus.render_lines(report.get("predicted") or [], report.get("plans", 0), markdown):
        out.write(line + "\n")
    for line in _legend(report["meta"]):
        out.write(("- " if markdown else "") + line + "\n")
    return out.getvalue()


def render_csv(report: dict[str, Any]) -> str:
    out = io.StringIO()
    keys = list(report["sections"][0]["rows"][0].keys()) if report["sections"] and report["sections"][0]["rows"] else []
    w = csv.writer(out)
    w.writerow([*SECTION_KEYS, *keys])
    for sec in report["sections"]:
        for r in sec["rows"]:
            w.writerow(
                [
                    *(sec["key"][k] for k in SECTION_KEYS),
                    *(json.dumps(r[k]) if isinstance(r[k], (list, dict)) else r[k] for k in keys),
                ]
            )
    return out.getvalue()


def render_html(report: dict[str, Any]) -> str:
    parts = [
        f"<h1>parabench comparison</h1><p class='meta'>{html.escape(report['meta']['created'])} &middot; "
        f"{html.escape(report['meta']['tracking_uri'])} &middot; {len(report['meta']['run_ids'])} runs</p>"
    ]
    for i, sec in enumerate(report["sections"]):
        title = ", ".join(f"{k}={v}" for k, v in sec["key"].items())
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if sec["note"]:
            parts.append(f"<p class='note'>{html.escape(sec['note'])}</p>")
        parts.append(_section_table(sec, i))
        parts += [f"<p class='note'>{html.escape(n)}</p>" for n in _row_notes(sec)]
        parts += _stability_table(sec["rows"], i)
        parts += _section_plots(sec, i)
    parts += _versus_table(report.get("predicted") or [])
    parts += _comm_plots(report.get("comm") or {})
    legend = "".join(f"<li>{html.escape(line)}</li>" for line in _legend(report["meta"]))
    data = html.escape(json.dumps(report), quote=False)
    style = (
        "body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0 16px}"
        "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:right}th{background:#f3f3f3}"
        ".plots{display:flex;flex-wrap:wrap;gap:12px}.note{color:#a40}.meta{color:#666}.ids{font-size:11px;text-align:left}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>parabench comparison</title><style>{style}</style>"
        f"</head><body>{''.join(parts)}<ul>{legend}</ul>"
        f"<script type='application/json' id='report-data'>{data}</script></body></html>"
    )


def _section_table(sec: dict[str, Any], index: int) -> str:
    """One section's rows: every column, then the run ids."""
    heads = "".join(f"<th>{html.escape(h)}</th>" for _, h in COLUMNS)
    body = ""
    for r in sec["rows"]:
        tds = "".join(
            f"<td data-key='{k}'>{html.escape(_fmt(k, r.get(k) if k != 'repeats' else r['repeats'], r))}</td>"
            for k, _ in COLUMNS
        )
        ids = html.escape(" ".join(r["run_ids"]))
        tds += f"<td data-key='run_ids' class='ids'>{ids}</td>"
        body += f"<tr data-variant='{html.escape(r['variant'])}' data-world='{r['world_size']}'>{tds}</tr>"
    return f"<table id='table-{index}'><tr>{heads}<th>run ids</th></tr>{body}</table>"


def _section_plots(sec: dict[str, Any], i: int) -> list[str]:
    """One section's plots: throughput and scaling efficiency against devices, model-state memory per
    rank, the loss curves."""
    series_tp: dict[str, list[tuple[float, float]]] = {}
    series_eff: dict[str, list[tuple[float, float]]] = {}
    for r in sec["rows"]:
        series_tp.setdefault(r["variant"], []).append((r["world_size"], r["tokens_per_s"]))
        if r["efficiency"] is not None:
            series_eff.setdefault(r["variant"], []).append((r["world_size"], 100 * r["efficiency"]))
        elif r["world_size"] == 1:
            series_eff.setdefault(r["variant"], []).append((1, 100.0))
    bars = {}
    for label, ranks in sec["state_per_rank"].items():
        for rank, st in enumerate(ranks):
            bars[f"{label} r{rank}"] = {k: v / 2**20 for k, v in st.items()}
    curves = {label: list(enumerate(losses)) for label, losses in sec["loss_curves"].items() if losses}
    return [
        "<div class='plots'>",
        line_svg("Throughput vs devices", "devices (world size)", "tokens/s", series_tp, plot_id=f"throughput-{i}"),
        line_svg(
            "Scaling efficiency vs devices",
            "devices (world size)",
            "efficiency %",
            series_eff,
            plot_id=f"efficiency-{i}",
        ),
        bar_stack_svg("Model-state memory per rank", "MiB", bars, plot_id=f"memory-{i}"),
        line_svg("Loss curves", "step", "loss", curves, plot_id=f"loss-{i}", from_zero=False),
        "</div>",
    ]


def _stability_table(rows: list[dict[str, Any]], index: int) -> list[str]:
    """The stability table of a section, as the text report has it."""
    heads, body = stability.cells(rows)
    if not body:
        return []
    head = "".join(f"<th>{html.escape(h)}</th>" for h in heads)
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
    return [
        f"<h3>stability (checkpoints and recovery)</h3><table id='stability-{index}'><tr>{head}</tr>{cells}</table>"
    ]


def _versus_table(entries: list[dict[str, Any]]) -> list[str]:
    """Predicted (bench plan) vs measured, as the text report has it."""
    if not entries:
        return []
    heads, cells = versus.table(entries)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in heads)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in cells)
    return [f"<h2>Predicted (bench plan) vs measured</h2><table id='predicted'><tr>{head}</tr>{body}</table>"]


def _comm_plots(curves: dict[str, dict[str, list[list[float]]]]) -> list[str]:
    """Bus bandwidth vs size per operation, one line per (stack, world size) of ``bench comm``."""
    if not curves:
        return []
    parts = [
        "<h2>Collectives (bench comm): bus bandwidth vs size</h2><p class='meta'>busbw = size / time x "
        "nccl-tests' factor of the operation (docs/comm.md); x: log2 of the size in bytes (10 = 1 KiB, 20 = 1 MiB)</p>"
        "<div class='plots'>"
    ]
    for op, series in curves.items():
        log_series = {label: [(math.log2(s), bw) for s, bw in pts if s > 0] for label, pts in series.items()}
        parts.append(
            line_svg(f"{op} bus bandwidth", "size (log2 bytes)", "busbw GB/s", log_series, plot_id=f"busbw-{op}")
        )
    parts.append("</div>")
    return parts


# --------------------------------------------------------------------------------------------
# CLI.
# --------------------------------------------------------------------------------------------
def _parse_baseline(text: str | None) -> tuple[str, str] | None:
    if not text:
        return None
    key, sep, value = text.partition("=")
    if not sep or key not in ("backend", "variant", "device", "precision"):
        raise UserError(
            f"--baseline: expected KEY=VALUE with KEY one of backend, variant, device, precision (got {text!r})"
        )
    return key, value


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench compare", description="Compare parabench runs recorded in MLflow.")
    p.add_argument("--experiment", help="MLflow experiment name (tracking.experiment of the runs)")
    p.add_argument("--runs", nargs="+", metavar="ID", help="explicit run ids (all must be comparable)")
    p.add_argument("--filter", default="", help="an MLflow search filter, e.g. \"tags.backend = 'fsdp'\"")
    p.add_argument("--tracking-uri", default=None, help="default: sqlite:///results/mlflow.db")
    p.add_argument("--baseline", help="ratios against this row, e.g. backend=ddp")
    p.add_argument(
        "--pool-resumed",
        action="store_true",
        help="count a resumed run as a repeat of the fresh runs of its configuration (default: a section of its own)",
    )
    p.add_argument("--format", choices=["table", "md", "csv", "json", "html"], default="table")
    p.add_argument("--out", help="report directory (default results/reports/compare-<timestamp>)")
    p.add_argument("--no-log", action="store_true", help="do not log the report as an MLflow comparison run")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except UserError as exc:
        print(f"bench compare: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from mlflow.tracking import MlflowClient

    # a login in the URI goes to MLflow's variables: the report, its MLflow copy and the messages get the rest
    uri = trackstore.credentials_to_env(args.tracking_uri or default_store_uri("results"), os.environ)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).exists():
        raise UserError(f"--tracking-uri: no MLflow store at {uri} (run `bench run` first or pass --tracking-uri)")
    # an unknown scheme, or a server that does not answer or refuses us: one line, not minutes of retries
    trackstore.check(TrackingSpec(uri=uri, experiment=args.experiment or "Default"), key="--tracking-uri")
    for line in close_abandoned(results_dir_of(uri), uri):  # a killed bench's run is not compared as RUNNING
        print(line, file=sys.stderr)
    client = MlflowClient(tracking_uri=uri)
    baseline = _parse_baseline(args.baseline)
    records = load_runs(client, args.runs, args.experiment, args.filter)
    comm = {} if args.runs else load_comm_curves(client, args.experiment)  # bench comm runs: bandwidth plots
    pool = args.pool_resumed
    sections = (
        build_sections(records, baseline, strict=bool(args.runs), pool_resumed=pool) if records or not comm else []
    )
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    meta = {
        "created": created,
        "tracking_uri": uri,
        "experiment": args.experiment,
        "filter": args.filter,
        "baseline": args.baseline,
        "run_ids": [r.run_id for r in records],
        "grouping": grouping_note(pool),
        "peak_sources": "; ".join(sorted({r.peak_source for r in records if r.peak_source})),
    }
    report = report_dict(sections, meta)
    report["comm"] = comm
    plans = versus.load_plans(client, args.experiment)  # bench plan runs: predicted vs measured
    report["plans"], report["predicted"] = len(plans), versus.versus(plans, records)
    out = Path(args.out) if args.out else Path("results/reports") / f"compare-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    rendered = {
        "table": render_text(report),
        "md": render_text(report, markdown=True),
        "csv": render_csv(report),
        "json": json.dumps(report, indent=2),
        "html": render_html(report),
    }
    files = {}
    for fmt, ext in (("md", "md"), ("csv", "csv"), ("json", "json"), ("html", "html")):
        files[fmt] = out / f"report.{ext}"
        files[fmt].write_text(rendered[fmt])
    print(rendered[args.format] if args.format != "html" else f"HTML report: {files['html']}")
    print(f"reports written to {out}/ (report.md, report.csv, report.json, report.html)", file=sys.stderr)
    if not args.no_log:
        _log_comparison(client, args, records, out)
    return 0


def _log_comparison(client, args, records: list[RunRecord], out: Path) -> None:
    # in an experiment of its own beside the compared one: the training experiment lists training runs
    compared = args.experiment or "parabench"
    exp_name = comparison_experiment(compared)
    exp = client.get_experiment_by_name(exp_name)
    exp_id = exp.experiment_id if exp else client.create_experiment(exp_name)
    tags = {"parabench.kind": "compare", "baseline": args.baseline or "", "experiment": compared}
    run = client.create_run(exp_id, run_name=f"compare-{compared}-{stamp()}", tags=tags)
    client.log_param(run.info.run_id, "compared_runs", ",".join(r.run_id for r in records)[:6000])
    for f in sorted(out.glob("report.*")):
        client.log_artifact(run.info.run_id, str(f))
    client.set_terminated(run.info.run_id, "FINISHED")
    print(f"comparison logged as MLflow run {run.info.run_id}", file=sys.stderr)
