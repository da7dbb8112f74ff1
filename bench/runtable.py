"""Runs of ``bench run`` read back from MLflow and put side by side: the model of ``bench compare``'s
report and of a sweep's parent run (its scaling metrics), without rendering.

Grouping: by everything that changes the numbers. A *section* holds rows that may share a ratio:
same model, device, precision, sequence length, data (source, path and seed, and the checksum of the
rows trained on), measured and warm-up steps, and start (fresh, or resumed from step N: a resumed
run measured other steps than a fresh one, so it is never a repeat of it unless ``--pool-resumed``
asks for that). A *row* is one configuration inside it: backend variant (backend name plus the
``backend.*`` options that differ between runs of that backend), world size, layout (dp/tp/pp/cp
degrees and nodes), global and micro batch; repeated runs of a row are aggregated (median, with the
min-max band). Runs that differ in any section key never meet in one ratio: they go to separate
sections, whose note names the runs set apart and why.

Ratios against a baseline ``KEY=VALUE`` compare a row with the baseline row of the same section,
world size and global batch. Scaling efficiency (per backend variant, against its world-size-1
row): E(N) = throughput(N) / (N x throughput(1)) - weak scaling when the per-device batch is the
same at N and 1, strong scaling when the global batch is the same (docs/sources.md#scaling-efficiency).
With repeats, the band of a ratio is [min/max, max/min]; a ratio whose band contains 1.0 is
marked as within noise, and so are efficiencies whose bands overlap 1.0 or each other.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from parabench.errors import UserError
from parabench.resilience import stability

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
    stability: dict[str, float] = field(default_factory=dict)  # parabench.resilience.stability: checkpoints, recovery
    comm_bytes_per_step: float | None = None  # bus bytes of the busiest rank per step (parabench.run.comm_report)
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
    (MLflow params of the composed config, tags of bench run; parabench.run.command._run_metadata)."""
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
