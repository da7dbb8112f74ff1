"""``bench compare``: read runs back from MLflow, group them, and put comparable ones side by side.

Grouping: by everything that changes the numbers. A *section* holds rows that may share a ratio:
same model, device, precision, sequence length, data (source, path and seed, and the checksum of the
rows trained on), measured and warm-up steps, and start (fresh, or resumed from step N: a resumed
run measured other steps than a fresh one, so it is never a repeat of it unless ``--pool-resumed``
asks for that). A *row* is one configuration inside it: backend variant (backend name plus the
``backend.*`` options that differ between runs of that backend), world size, layout (dp/tp/pp/cp
degrees and nodes), global and micro batch; repeated runs of a row are aggregated (median, with the
min-max band). Runs that differ in any section key never meet in one ratio: they go to separate
sections, whose note names the runs set apart and why (and an explicit ``--runs`` list that mixes
them is refused).

Ratios against ``--baseline KEY=VALUE`` compare a row with the baseline row of the same section,
world size and global batch. Scaling efficiency (per backend variant, against its world-size-1
row): E(N) = throughput(N) / (N x throughput(1)) - weak scaling when the per-device batch is the
same at N and 1, strong scaling when the global batch is the same (docs/sources.md#scaling-efficiency).
With repeats, the band of a ratio is [min/max, max/min]; a ratio whose band contains 1.0 is
marked as within noise, and so are efficiencies whose bands overlap 1.0 or each other.
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
import statistics
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parabench import stability, trackstore
from parabench.errors import UserError
from parabench.plan import versus
from parabench.plots import bar_stack_svg, line_svg
from parabench.runnames import comparison_experiment, stamp
from parabench.spec import TrackingSpec
from parabench.tracking import close_abandoned, default_store_uri, results_dir_of

SECTION_KEYS = ("model", "device", "precision", "seq_len", "data", "data_checksum", "steps", "warmup_steps", "start")
ROW_KEYS = ("variant", "world_size", "layout", "global_batch", "micro_batch")
POOLED_START = "fresh or resumed (--pool-resumed)"


@dataclass
class RunRecord:
    run_id: str
    backend: str
    variant: str
    world_size: int
    model: str
    device: str
    device_name: str
    precision: str
    global_batch: int
    seq_len: int
    tokens_per_s: float
    tokens_per_s_per_device: float
    mfu: float | None
    peak_tflops: float | None
    peak_source: str
    step_time_median_s: float
    rank_spread_s: float
    peak_memory_bytes: float
    model_state_bytes: float
    loss_final: float
    losses: list[float] = field(default_factory=list)
    state_per_rank: list[dict[str, float]] = field(default_factory=list)
    stability: dict[str, float] = field(default_factory=dict)  # parabench.stability: checkpoints, recovery
    comm_bytes_per_step: float | None = None  # bus bytes of the busiest rank per step (parabench.commreport)
    comm_formula_bytes_per_step: float | None = None
    comm_share_of_step: float | None = None
    # MoE (parabench.expertload): max/mean tokens per expert of the worst layer, mean over steps and worst step
    moe_load_imbalance: float | None = None
    moe_load_imbalance_max: float | None = None
    params: dict[str, str] = field(default_factory=dict)  # the run's MLflow params (plan rows match on them)
    data: str = ""  # data source[:path], seed
    data_checksum: str = ""  # of the rows the run trained on (parabench.data.combined_checksum)
    steps: int = 0  # measured steps of the job (run.steps)
    warmup_steps: int = 0
    micro_batch: int = 0
    layout: str = ""  # dp/tp/pp/cp degrees and nodes
    started_at_step: int = 0  # > 0: resumed from a checkpoint of that step
    started_from: str = ""

    @property
    def start(self) -> str:
        return f"resumed from step {self.started_at_step}" if self.started_at_step else "fresh"

    def section(self, rows_label: str, pool_resumed: bool = False) -> tuple:
        """The section key, with the rows checksum as ``rows_label`` (see _rows_labels); pooled, a
        resumed run meets fresh ones."""
        pooled = {"start": POOLED_START} if pool_resumed else {}
        return tuple(pooled.get(k, rows_label if k == "data_checksum" else getattr(self, k)) for k in SECTION_KEYS)

    def row(self) -> tuple:
        return tuple(getattr(self, k) for k in ROW_KEYS)


@dataclass
class Row:
    variant: str
    world_size: int
    global_batch: int
    runs: list[RunRecord]
    layout: str = ""
    micro_batch: int = 0
    tokens_per_s: float = 0.0
    tokens_min: float = 0.0
    tokens_max: float = 0.0
    ratio: float | None = None
    ratio_band: tuple[float, float] | None = None
    ratio_note: str = ""
    efficiency: float | None = None
    efficiency_band: tuple[float, float] | None = None
    efficiency_kind: str = ""
    efficiency_note: str = ""

    def __post_init__(self) -> None:
        tps = [r.tokens_per_s for r in self.runs]
        self.tokens_per_s, self.tokens_min, self.tokens_max = statistics.median(tps), min(tps), max(tps)

    def med(self, attr: str) -> float | None:
        vals = [getattr(r, attr) for r in self.runs if getattr(r, attr) is not None]
        return statistics.median(vals) if vals else None

    def final_loss(self) -> float | None:
        """Median final loss, only over runs of one length (a 4-step loss is no repeat of a 10-step one)."""
        if len({len(r.losses) for r in self.runs}) > 1 or len({r.warmup_steps + r.steps for r in self.runs}) > 1:
            return None
        return self.med("loss_final")

    def as_dict(self) -> dict[str, Any]:
        first = self.runs[0]
        return {
            "variant": self.variant,
            "backend": first.backend,
            "world_size": self.world_size,
            "layout": self.layout,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "repeats": len(self.runs),
            "run_ids": [r.run_id for r in self.runs],
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_min": self.tokens_min,
            "tokens_per_s_max": self.tokens_max,
            "tokens_per_s_per_device": self.tokens_per_s / self.world_size,
            "mfu": self.med("mfu"),
            "peak_tflops": first.peak_tflops,
            "peak_source": first.peak_source,
            "step_time_median_s": self.med("step_time_median_s"),
            "rank_spread_s": self.med("rank_spread_s"),
            "peak_memory_bytes": self.med("peak_memory_bytes"),
            "model_state_bytes": self.med("model_state_bytes"),
            "loss_final": self.final_loss(),
            "ratio": self.ratio,
            "ratio_band": list(self.ratio_band) if self.ratio_band else None,
            "ratio_note": self.ratio_note,
            "efficiency": self.efficiency,
            "efficiency_band": list(self.efficiency_band) if self.efficiency_band else None,
            "efficiency_kind": self.efficiency_kind,
            "efficiency_note": self.efficiency_note,
            "stability": stability.medians(r.stability for r in self.runs),
            "comm_bytes_per_step": self.med("comm_bytes_per_step"),
            "comm_formula_bytes_per_step": self.med("comm_formula_bytes_per_step"),
            "comm_share_of_step": self.med("comm_share_of_step"),
            "moe_load_imbalance": self.med("moe_load_imbalance"),
            "moe_load_imbalance_max": self.med("moe_load_imbalance_max"),
        }


@dataclass
class Section:
    key: dict[str, Any]
    rows: list[Row]
    note: str = ""


# --------------------------------------------------------------------------------------------
# Reading MLflow.
# --------------------------------------------------------------------------------------------
def _metric_or_none(metrics: dict, key: str) -> float | None:
    v = metrics.get(key)
    return float(v) if v is not None else None


def load_runs(
    client, run_ids: Iterable[str] | None = None, experiment: str | None = None, filter_string: str = ""
) -> list[RunRecord]:
    if run_ids:
        runs = []
        for rid in run_ids:
            try:
                runs.append(client.get_run(rid))
            except Exception as exc:  # MlflowException: unknown id
                raise UserError(
                    f"--runs: no run {rid!r} in {client.tracking_uri} ({str(exc).splitlines()[0]})"
                ) from None
    else:
        if experiment:
            exp = client.get_experiment_by_name(experiment)
            if exp is None:
                names = ", ".join(e.name for e in client.search_experiments())
                raise UserError(
                    f"--experiment: no experiment {experiment!r} in {client.tracking_uri} (have: {names or 'none'})"
                )
            exp_ids = [exp.experiment_id]
        else:
            exp_ids = [e.experiment_id for e in client.search_experiments()]
        flt = "tags.`parabench.kind` = 'job' and attributes.status = 'FINISHED'"
        if filter_string:
            flt += f" and {filter_string}"
        try:
            runs = client.search_runs(exp_ids, filter_string=flt, max_results=5000)
        except Exception as exc:
            raise UserError(f"--filter: {str(exc).splitlines()[0]}") from None
    records = [
        _record(client, r) for r in runs if r.data.tags.get("parabench.kind") == "job" and r.info.status == "FINISHED"
    ]
    return _label_variants(records, runs)


def _record(client, run) -> RunRecord:
    m, p, t = run.data.metrics, run.data.params, run.data.tags
    world = int(float(t.get("world_size", m.get("world_size", 1))))
    losses = [x.value for x in sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda x: x.step)]
    state = []
    for r in range(world):
        if f"rank{r}.total" in m:
            state.append({k: m.get(f"rank{r}.{k}", 0.0) for k in ("params", "grads", "optimizer", "optimizer_other")})
    return RunRecord(
        run_id=run.info.run_id,
        backend=t.get("backend", p.get("backend.name", "?")),
        variant=t.get("backend", "?"),
        world_size=world,
        model=t.get("model", p.get("model.name", "?")),
        device=t.get("device", "?"),
        device_name=t.get("device_name", ""),
        precision=t.get("precision", p.get("run.precision", "?")),
        global_batch=int(p.get("data.global_batch_size", 0)),
        seq_len=int(p.get("data.seq_len", 0)),
        tokens_per_s=m.get("tokens_per_s", 0.0),
        tokens_per_s_per_device=m.get("tokens_per_s_per_device", 0.0),
        mfu=_metric_or_none(m, "mfu"),
        peak_tflops=_metric_or_none(m, "peak_tflops_per_device"),
        peak_source=t.get("peak_source", ""),
        step_time_median_s=m.get("step_time_median_s", 0.0),
        rank_spread_s=m.get("rank_step_time_spread_s", 0.0),
        peak_memory_bytes=m.get("peak_memory_bytes_max", 0.0),
        model_state_bytes=m.get("model_state_bytes_max", 0.0),
        loss_final=m.get("loss_final", float("nan")),
        losses=losses,
        state_per_rank=state,
        stability=stability.from_metrics(m),
        comm_bytes_per_step=_metric_or_none(m, "comm_bus_bytes_per_step"),
        comm_formula_bytes_per_step=_metric_or_none(m, "comm_formula_bus_bytes_per_step"),
        comm_share_of_step=_metric_or_none(m, "comm_share_of_step"),
        moe_load_imbalance=_metric_or_none(m, "moe_load_imbalance_mean"),
        moe_load_imbalance_max=_metric_or_none(m, "moe_load_imbalance_max"),
        params=dict(p),
        **_conditions(m, p, t),
    )


def _int(value: Any) -> int:
    return int(float(value)) if value not in (None, "", "None") else 0


def _conditions(m: dict, p: dict, t: dict) -> dict[str, Any]:
    """What else changes a run's numbers: data, steps, micro batch, layout, fresh or resumed
    (MLflow params of the composed config, tags of bench run; parabench.runner._run_metadata)."""
    path = p.get("data.path")
    data = p.get("data.source", "?") + (f":{path}" if path not in (None, "", "None") else "")
    layout = " ".join(f"{k}{p[f'derived.{k}']}" for k in ("dp", "tp", "pp", "cp") if f"derived.{k}" in p)
    nodes = _int(p.get("launcher.nnodes"))
    return {
        "data": f"{data} seed {p.get('data.seed', '?')}",
        "data_checksum": t.get("data_checksum", "?"),
        "steps": _int(p.get("run.steps")),
        "warmup_steps": _int(p.get("run.warmup_steps")),
        "micro_batch": _int(p.get("data.micro_batch_size")),
        "layout": layout + (f" nodes{nodes}" if nodes > 1 else ""),
        "started_at_step": _int(t.get("parabench.resumed_step") or m.get("started_at_step")),
        "started_from": t.get("parabench.resumed_from_run") or t.get("parabench.resumed_from_checkpoint") or "",
    }


def load_comm_curves(client, experiment: str | None) -> dict[str, dict[str, list[list[float]]]]:
    """Bus bandwidth vs size of the finished ``bench comm`` runs (of ``experiment``, or all):
    op -> "stack xN" -> [[size in bytes, busbw GB/s], ...]."""
    exp = client.get_experiment_by_name(experiment) if experiment else None
    exp_ids = [exp.experiment_id] if exp else [e.experiment_id for e in client.search_experiments()]
    flt = "tags.`parabench.kind` = 'comm' and attributes.status = 'FINISHED'"
    curves: dict[str, dict[str, list[list[float]]]] = {}
    for run in client.search_runs(exp_ids, filter_string=flt, max_results=1000) if exp_ids else []:
        label = f"{run.data.tags.get('stack', '?')} x{run.data.tags.get('world_size', '?')}"
        for key in sorted(k for k in run.data.metrics if k.endswith(".busbw_GBps")):
            history = client.get_metric_history(run.info.run_id, key)
            points = sorted([float(m.step), m.value] for m in history)
            curves.setdefault(key[: -len(".busbw_GBps")], {})[label] = points
    return curves


def _label_variants(records: list[RunRecord], runs) -> list[RunRecord]:
    """The row label: the backend config chosen (``backend=deepspeed_z3`` -> deepspeed_z3), plus the
    backend.* options that differ between runs of that config at the same world size (so an option
    that follows the world size, like tp=N in a scaling series, does not split the series)."""
    info = {
        r.info.run_id: (r.data.params, r.data.tags.get("backend_config") or r.data.tags.get("backend", "?"))
        for r in runs
    }
    groups: dict[tuple[str, int], list[RunRecord]] = {}
    for rec in records:
        groups.setdefault((info[rec.run_id][1], rec.world_size), []).append(rec)
    for (config, _), recs in groups.items():
        params = [info[rec.run_id][0] for rec in recs]
        keys = sorted({k for p in params for k in p if k.startswith("backend.") and k != "backend.name"})
        varying = [k for k in keys if len({p.get(k) for p in params}) > 1]
        for rec, p in zip(recs, params):
            opts = ",".join(f"{k[len('backend.') :]}={p.get(k)}" for k in varying)
            rec.variant = f"{config}({opts})" if opts else config
    return records


# --------------------------------------------------------------------------------------------
# Grouping, ratios, efficiencies.
# --------------------------------------------------------------------------------------------
def build_sections(
    records: list[RunRecord], baseline: tuple[str, str] | None, strict: bool, pool_resumed: bool = False
) -> list[Section]:
    if not records:
        raise UserError("no finished parabench runs matched (check --experiment/--filter/--runs and --tracking-uri)")
    labels = _rows_labels(records, pool_resumed)
    by_section: dict[tuple, list[RunRecord]] = {}
    for rec in records:
        by_section.setdefault(rec.section(labels[rec.run_id], pool_resumed), []).append(rec)
    if strict and len(by_section) > 1:
        a, b = list(by_section)[:2]
        diffs = [f"{k} differs ({x} vs {y})" for k, x, y in zip(SECTION_KEYS, a, b) if x != y]
        hint = "; --pool-resumed counts resumed runs as repeats" if "start" in " ".join(diffs) else ""
        raise UserError(f"runs are not comparable: {'; '.join(diffs)}; compare them separately{hint}")
    # the section with the most runs comes first: the others are the runs set apart from it
    ordered = sorted(by_section.items(), key=lambda kv: -len(kv[1]))
    sections = [Section(dict(zip(SECTION_KEYS, key)), _rows(recs, baseline)) for key, recs in ordered]
    first = sections[0].key
    for sec in sections[1:]:
        ids = ", ".join(r.run_id for row in sec.rows for r in row.runs)
        why = "; ".join(f"{k} differs ({first[k]} vs {sec.key[k]})" for k in SECTION_KEYS if first[k] != sec.key[k])
        sec.note = f"set apart from the first section (runs {ids}): {why}"
    return sections


def _rows_labels(records: list[RunRecord], pool_resumed: bool) -> dict[str, str]:
    """The rows checksum covers every row of every step, so it differs with the global batch (a
    weak-scaling series) and the start: it is compared among the runs that must agree, those with
    the same other keys and global batch. The most common checksum there reads "agrees"; another
    one is data that changed under the same name (an edited text file) and is set apart."""
    groups: dict[tuple, list[RunRecord]] = {}
    for rec in records:
        groups.setdefault((rec.section("", pool_resumed), rec.global_batch), []).append(rec)
    labels = {}
    for recs in groups.values():
        sums = [r.data_checksum for r in recs]
        common = max(sums, key=sums.count)
        for r in recs:
            labels[r.run_id] = (
                "agrees" if r.data_checksum == common or pool_resumed else f"{r.data_checksum} (other rows)"
            )
    return labels


def _rows(recs: list[RunRecord], baseline: tuple[str, str] | None) -> list[Row]:
    rows_by: dict[tuple, list[RunRecord]] = {}
    for rec in recs:
        rows_by.setdefault(rec.row(), []).append(rec)
    rows = [Row(variant=k[0], world_size=k[1], layout=k[2], global_batch=k[3], micro_batch=k[4], runs=v)
            for k, v in rows_by.items()]  # fmt: skip
    rows.sort(key=lambda r: (r.variant, r.world_size, r.layout, r.global_batch, r.micro_batch))
    _ratios(rows, baseline)
    _efficiencies(rows)
    return rows


def grouping_note(pool_resumed: bool) -> str:
    """How bench compare grouped (printed with every report)."""
    resumed = (
        "resumed runs pooled with fresh ones as repeats (--pool-resumed; rows checksums not compared)"
        if pool_resumed
        else "a resumed run is never a repeat of a fresh one (--pool-resumed to pool them)"
    )
    keys = ", ".join(
        k if k != "data_checksum" else "data_checksum (among runs of one global batch)" for k in SECTION_KEYS
    )
    return (
        f"grouping: sections by {keys}; rows by {', '.join(ROW_KEYS)}; {resumed}; "
        "final loss: median only over runs of one length"
    )


def _matches(row: Row, baseline: tuple[str, str]) -> bool:
    key, value = baseline
    rec = row.runs[0]
    if key in ("backend", "variant"):
        return rec.backend == value or row.variant == value
    return str(getattr(rec, key, None)) == value


def _band(num: Row, den: Row) -> tuple[float, float]:
    return num.tokens_min / den.tokens_max, num.tokens_max / den.tokens_min


def _ratios(rows: list[Row], baseline: tuple[str, str] | None) -> None:
    if not baseline:
        return
    for row in rows:
        bases = [
            b
            for b in rows
            if _matches(b, baseline) and b.world_size == row.world_size and b.global_batch == row.global_batch
        ]
        if not bases:
            row.ratio_note = (
                f"no {baseline[0]}={baseline[1]} run at world size {row.world_size}, global batch {row.global_batch}"
            )
            continue
        base = bases[0]
        row.ratio = row.tokens_per_s / base.tokens_per_s
        row.ratio_band = _band(row, base)
        if base is not row and row.ratio_band[0] <= 1.0 <= row.ratio_band[1]:
            row.ratio_note = "within noise (min-max bands overlap)"


def _efficiencies(rows: list[Row]) -> None:
    by_variant: dict[str, list[Row]] = {}
    for row in rows:
        by_variant.setdefault(row.variant, []).append(row)
    for variant_rows in by_variant.values():
        ones = [r for r in variant_rows if r.world_size == 1]
        for row in variant_rows:
            if row.world_size == 1 or not ones:
                continue
            one = next((o for o in ones if o.global_batch == row.global_batch), None)
            kind = "strong"
            if one is None:
                one = next((o for o in ones if o.global_batch * row.world_size == row.global_batch), None)
                kind = "weak"
            if one is None:
                row.efficiency_note = "no world-size-1 run with the same global or per-device batch"
                continue
            n = row.world_size
            row.efficiency = row.tokens_per_s / (n * one.tokens_per_s)
            row.efficiency_band = (row.tokens_min / (n * one.tokens_max), row.tokens_max / (n * one.tokens_min))
            row.efficiency_kind = kind
    # flag bands that overlap 1.0 or another variant's band at the same world size
    for row in rows:
        if row.efficiency_band is None:
            continue
        lo, hi = row.efficiency_band
        notes = []
        if lo <= 1.0 <= hi and len(row.runs) > 1:
            notes.append("band overlaps 1.0")
        others = [
            o
            for o in rows
            if o is not row
            and o.world_size == row.world_size
            and o.efficiency_band
            and o.efficiency_kind == row.efficiency_kind
        ]
        overl = [o.variant for o in others if o.efficiency_band[0] <= hi and lo <= o.efficiency_band[1]]
        if overl and (len(row.runs) > 1):
            notes.append("band overlaps " + ", ".join(overl))
        row.efficiency_note = "; ".join(notes)


def metric_key(text: str) -> str:
    """MLflow metric names allow letters, digits, _ - . / and spaces."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in text)


def scaling_metrics(sections: list[Section]) -> tuple[dict[str, float], list[str]]:
    """``efficiency/<variant>/N<n>`` (+ _min/_max bands) and the flagged notes, for the parent run."""
    metrics: dict[str, float] = {}
    flags: list[str] = []
    for sec in sections:
        for row in sec.rows:
            base = metric_key(f"{row.variant}/N{row.world_size}")
            metrics[f"tokens_per_s/{base}"] = row.tokens_per_s
            if row.efficiency is not None:
                metrics[f"efficiency/{base}"] = row.efficiency
                metrics[f"efficiency/{base}_min"] = row.efficiency_band[0]
                metrics[f"efficiency/{base}_max"] = row.efficiency_band[1]
            if row.efficiency_note:
                flags.append(f"{row.variant} N={row.world_size}: {row.efficiency_note}")
    return metrics, flags


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


def report_dict(sections: list[Section], meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "meta": meta,
        "sections": [
            {
                "key": s.key,
                "note": s.note,
                "rows": [r.as_dict() for r in s.rows],
                "loss_curves": {f"{r.variant} x{r.world_size}": r.runs[0].losses for r in s.rows},
                "state_per_rank": {f"{r.variant} x{r.world_size}": r.runs[0].state_per_rank for r in s.rows},
            }
            for s in sections
        ],
    }


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
