"""``bench plan`` against published training runs (benchmarks/data/published_runs.yaml, docs/plan.md).

Every row the harness can express is planned twice: forced to its published layout (the knobs a
source does not publish - micro-batch size, virtual pipeline stages - take the planner's best), and
free (every layout of the row's backend the harness accepts, with the stack's published features:
``estimate.Features``). Printed: predicted vs published tokens/s per device, the error, the rank of
the published layout (its tp, cp, pp, dp) in the free search, and the mean and max |error| per
device kind and overall. ``--fit`` refits the GEMM efficiency curve (e_max, x0, beta) of each device
kind on its rows and prints a leave-one-source-out figure (on a kind with one source: leave one model
family out); ``--leave-one-source-out`` prints that figure beside the shipped curves' table.

    python benchmarks/plan_published.py [--fit | --leave-one-source-out] [--no-free] [--rows ID,...]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from parabench.errors import UserError
from parabench.hydraconfig import compose, to_plain
from parabench.jobs import prepare
from parabench.plan import cluster as clusters
from parabench.plan.estimate import Calibration, Estimate, Features, estimate
from parabench.plan.gemms import CURVES, FITTED
from parabench.plan.search import search

DATA = Path(__file__).parent / "data" / "published_runs.yaml"
OPTION_KEYS = ("tp", "pp", "vpp", "cp", "sequence_parallel", "distributed_optimizer", "overlap_grad_reduce")


@dataclass(frozen=True)
class Row:
    raw: dict[str, Any]
    cluster: clusters.Cluster
    published: float  # tokens/s per device
    features: Features

    @property
    def id(self) -> str:
        return self.raw["id"]


def gpt_flops_per_token(heads: int, hidden: int, layers: int, vocab: int, seq: int) -> float:
    """Model FLOPs per token of Megatron's GPT (4h MLP), Narayanan et al. 2021 (docs/sources.md#megatron-parameter-count):
    72 B s l h^2 (1 + s / 6h + V / 12 l h) per batch of B sequences, i.e. 72 l h^2 + 12 l h s + 6 V h per token."""
    return 72 * layers * hidden**2 + 12 * layers * hidden * seq + 6 * vocab * hidden


def published_tokens(raw: dict[str, Any]) -> float:
    pub = raw["published"]
    if "tokens_per_s_per_device" in pub:
        return float(pub["tokens_per_s_per_device"])
    gpt = raw["model"]["gpt"]
    fpt = gpt_flops_per_token(gpt["heads"], gpt["hidden"], gpt["layers"], raw["model"]["vocab"], raw["seq_len"])
    return pub["tflops_per_device"] * 1e12 / fpt


def model_overrides(raw: dict[str, Any]) -> list[str]:
    """The harness model of a row: a preset, or a Llama of the published shape. Megatron's GPT (4h
    GELU MLP) becomes a Llama whose SwiGLU MLP has the same GEMM FLOPs (3 h i = 8 h^2: i = 8h/3,
    rounded to a multiple of tp x 8), with as many key/value heads as heads (no GQA)."""
    m, seq, tp = raw["model"], raw["seq_len"], raw["layout"].get("tp", 1)
    if "preset" in m:
        # rope scaling changes no FLOP or byte: dropped where the backend does not implement it
        return [f"+model={m['preset']}", f"model.max_position_embeddings={max(seq, 4096)}", "++model.rope_scaling=null"]
    shape = m.get("gpt") or m["llama"]
    heads, hidden, layers = shape["heads"], shape["hidden"], shape["layers"]
    ffn = shape.get("ffn") or tp * 8 * round(8 * hidden / 3 / (tp * 8))
    return [
        "+model=llama", f"model.hidden_size={hidden}", f"model.intermediate_size={ffn}",
        f"model.num_hidden_layers={layers}", f"model.num_attention_heads={heads}",
        f"model.num_key_value_heads={shape.get('kv_heads', heads)}", f"model.vocab_size={m['vocab']}",
        f"model.tie_word_embeddings={str(m.get('tied', False)).lower()}", f"model.max_position_embeddings={seq}",
    ]  # fmt: skip


def base_config(row: Row) -> dict[str, Any]:
    raw = row.raw
    gbs = raw.get("global_batch") or raw["micro_batch"] * raw["devices"]
    overrides = [*model_overrides(raw), f"backend={raw['backend']}", f"data.seq_len={raw['seq_len']}",
                 f"data.global_batch_size={gbs}", f"run.precision={raw['precision']}"]  # fmt: skip
    if raw["backend"] == "megatron" and raw["source"] == "megatron-readme":  # the README's overlap flags
        overrides += ["backend.distributed_optimizer=true", "backend.overlap_grad_reduce=true",
                      "backend.overlap_param_gather=true"]  # fmt: skip
    return to_plain(compose(overrides))


def place(cfg: dict[str, Any], row: Row, options: dict[str, Any], mbs: int) -> dict[str, Any]:
    cfg = copy.deepcopy(cfg)
    per_node = min(row.raw["devices"], row.cluster.devices_per_node)
    nnodes = row.raw["devices"] // per_node
    cfg["backend"].update(options)
    cfg["data"]["micro_batch_size"] = mbs
    cfg["device"]["type"] = row.cluster.device_kind
    cfg["launcher"].update(nproc_per_node=per_node, nnodes=nnodes, dry_run=True)
    if nnodes > 1:
        cfg["launcher"]["master_port"] = 29500
    return cfg


def forced_jobs(row: Row) -> list:
    """Jobs of the published layout: its published options; an unpublished micro-batch size and
    virtual pipeline depth (Megatron README rows) over the values the harness accepts (vpp: every
    divisor of the layers per stage)."""
    lay = row.raw["layout"]
    options = {k: v for k, v in lay.items() if k in OPTION_KEYS}
    if row.raw["backend"] == "megatron" and lay.get("tp", 1) > 1:
        options.setdefault("sequence_parallel", True)  # tp_comm_overlap needs sequence parallelism
    if row.raw["backend"] == "fsdp":
        options = {"activation_checkpointing": lay.get("activation_checkpointing", "none") != "none"}
    mbs_values = [row.raw["micro_batch"]] if row.raw.get("micro_batch") else [1, 2, 4]
    # a launch script publishes its whole layout (no --num-layers-per-virtual-pipeline-stage: vpp 1)
    published_all = bool(row.raw.get("micro_batch"))
    per_stage = _layers(row) // lay.get("pp", 1)
    unpublished = [v for v in range(1, per_stage + 1) if per_stage % v == 0] if lay.get("pp", 1) > 1 else [1]
    vpp_values = [lay.get("vpp", 1)] if published_all else unpublished
    base = base_config(row)
    jobs = []
    for mbs, vpp in itertools.product(mbs_values, vpp_values):
        opts = {**options, "vpp": vpp} if row.raw["backend"] in ("megatron", "mindspeed") else options
        try:
            jobs.append(prepare(place(base, row, opts, mbs)))
        except UserError as exc:
            last = exc
    if not jobs:
        raise UserError(f"{row.id}: the harness refuses the published layout: {last}")
    return jobs


def _layers(row: Row) -> int:
    m = row.raw["model"]
    shape = m.get("gpt") or m.get("llama")
    return shape["layers"] if shape else 0


def peak_of(row: Row) -> float:
    return clusters.peak(row.cluster, row.raw["precision"], Path(".cache")).tflops


def best(row: Row, jobs: list, cal: Calibration) -> Estimate:
    ests = [estimate(j, row.cluster, peak_of(row), cal, features=row.features) for j in jobs]
    fitting = [e for e in ests if e.fits] or ests
    return max(fitting, key=lambda e: e.tokens_per_s_per_device)


def degrees(e: Estimate) -> tuple:
    o, par = e.job.backend.options, e.job.parallel
    return (e.job.backend.name, getattr(o, "tp", 1), getattr(o, "cp", 1), getattr(o, "pp", 1), par.dp)


def free_rank(row: Row, forced: Estimate, cal: Calibration) -> tuple[int | None, Estimate | None, int]:
    """(rank of the published degrees among the fitting candidates, the top candidate, how many fit)."""
    base = {row.raw["backend"]: base_config(row)}
    mbs = [row.raw["micro_batch"]] if row.raw.get("micro_batch") else [1, 2, 4]
    found = search(base, row.cluster, row.raw["devices"], mbs, peak_of(row), cal, row.features)
    want, seen, rank = degrees(forced), [], None
    for e in found.ranked:  # rank by distinct degrees: a layout's unpublished knobs are not a new layout
        if degrees(e) not in seen:
            seen.append(degrees(e))
            if degrees(e) == want and rank is None:
                rank = len(seen)
    return rank, (found.ranked[0] if found.ranked else None), len(seen)


def load_rows(only: set[str] | None) -> tuple[list[Row], list[dict[str, Any]]]:
    doc = yaml.safe_load(DATA.read_text())
    rows, skipped = [], []
    for raw in doc["rows"]:
        if only and raw["id"] not in only:
            continue
        if raw.get("inexpressible"):
            skipped.append(raw)
            continue
        lay = raw["layout"]
        feats = Features(
            tp_overlap=bool(lay.get("mc2") or raw["source"] == "megatron-readme"),
            recompute="selective_op" if lay.get("activation_checkpointing") == "selective" else None,
            ops=lay.get("ops", "fused"),
        )
        rows.append(Row(raw, clusters.load(raw["cluster"]), published_tokens(raw), feats))
    return rows, skipped


def errors(rows: list[Row], jobs: dict[str, list], cal: Calibration) -> dict[str, float]:
    return {r.id: best(r, jobs[r.id], cal).tokens_per_s_per_device / r.published - 1 for r in rows}


def fit_curve(rows: list[Row], jobs: dict[str, list], kind: str) -> list[float]:
    """(e_max, x0, beta) minimising the mean |error| of ``rows`` at their published layouts: a grid,
    then a finer grid around each of its three best points (the special-function ratio is the
    device's published one, ``gemms.CURVES``, not fitted)."""

    def score(p: tuple[float, float, float]) -> float:
        cal = Calibration("fit", curves={kind: list(p)})
        return statistics.mean(abs(v) for v in errors(rows, jobs, cal).values())

    coarse = itertools.product(
        [0.4 + 0.1 * i for i in range(7)],
        [50 * 2**i for i in range(7)],
        [0.0, 2e-13, 5e-13, 1e-12, 2e-12],  # beta: s per byte (1/beta: 5 to 0.5 TB/s)
    )
    # the finer grid around each of the three best coarse points (one basin's best can lose to another's)
    starts = sorted(coarse, key=score)[:3]
    fine = [
        p
        for e0, x0, b0 in starts
        for p in itertools.product(
            [e0 + 0.02 * i for i in range(-3, 4)],
            [x0 * 2 ** (i / 4) for i in range(-2, 3)],
            [b0 * f for f in (0.7, 1, 1.4)],
        )
    ]
    return list(min(fine, key=score))


def fit_all(rows: list[Row], jobs: dict[str, list]) -> dict[str, list[float]]:
    curves = {}
    for kind in sorted({r.cluster.device_kind for r in rows}):
        mine = [r for r in rows if r.cluster.device_kind == kind]
        curves[kind] = fit_curve(mine, jobs, kind)
        print(f"fitted {kind}: e_max {curves[kind][0]:.3f}, x0 {curves[kind][1]:.1f}, beta {curves[kind][2]:.3g} s "
              f"on {len(mine)} rows "
              f"({', '.join(sorted({r.raw['source'] for r in mine}))})")  # fmt: skip
    return curves


def family(row: Row) -> str:
    """The model family of a row (``ms-qwen15-7b`` -> ``qwen``): llama, codellama, qwen, codeqwen, yi, ..."""
    return re.sub(r"[0-9.]+$", "", row.id.split("-")[1])


def leave_one_source_out(rows: list[Row], jobs: dict[str, list]) -> None:
    """Fit each kind's curve without one source's rows and predict them; a kind with one source:
    without one model family at a time."""
    for kind in sorted({r.cluster.device_kind for r in rows}):
        mine = [r for r in rows if r.cluster.device_kind == kind]
        sources = sorted({r.raw["source"] for r in mine})
        key = (lambda r: r.raw["source"]) if len(sources) > 1 else family
        groups = [[r for r in mine if key(r) == g] for g in sorted({key(r) for r in mine})]
        left: dict[str, float] = {}
        for out in groups:
            rest = [r for r in mine if r not in out]
            cal = Calibration("loso", curves={kind: fit_curve(rest, jobs, kind)})
            left.update(errors(out, jobs, cal))
        how = "leave one source out" if len(sources) > 1 else f"leave one model family out ({len(groups)} families)"
        vals = [abs(v) for v in left.values()]
        print(
            f"{kind} {how}: mean |error| {100 * statistics.mean(vals):.1f}%, max {100 * max(vals):.1f}% "
            f"over {len(vals)} rows"
        )


def report(rows: list[Row], jobs: dict[str, list], cal: Calibration, free: bool) -> None:
    print(f"{'row':24} {'device':14} {'published':>9} {'forced':>9} {'error':>7}  {'rank':>6}  forced layout / free #1")
    errs, ranks = {}, []
    for r in rows:
        e = best(r, jobs[r.id], cal)
        errs[r.id] = e.tokens_per_s_per_device / r.published - 1
        rank, top, n = free_rank(r, e, cal) if free else (None, None, 0)
        ranks.append((rank, n))
        shown = f"{rank}/{n}" if rank else ("-" if not free else f">{n}")
        print(f"{r.id:24} {r.cluster.name:14} {r.published:9.0f} {e.tokens_per_s_per_device:9.0f} "
              f"{100 * errs[r.id]:+6.1f}%  {shown:>6}  {_layout(e)}" + (f" / {_layout(top)}" if top else ""))  # fmt: skip
        fit = "fits" if e.fits else f"does NOT fit ({e.device_bytes / 2**30:.1f} of {e.memory_bytes / 2**30:.0f} GiB)"
        print(f"{'':24} {fit}; overlap: {e.overlap.describe() or 'no communication'}")
    for kind in sorted({r.cluster.device_kind for r in rows}):
        vals = [abs(errs[r.id]) for r in rows if r.cluster.device_kind == kind]
        print(f"{kind}: mean |error| {100 * statistics.mean(vals):.1f}%, max {100 * max(vals):.1f}% ({len(vals)} rows)")
    vals = [abs(v) for v in errs.values()]
    print(f"all: mean |error| {100 * statistics.mean(vals):.1f}%, max {100 * max(vals):.1f}% ({len(vals)} rows)")
    if free:
        top3 = sum(1 for k, _ in ranks if k and k <= 3)
        print(
            f"published layout in the free search's top 3: {top3} of {len(ranks)} rows ({100 * top3 / len(ranks):.0f}%)"
        )
        # a row with at most 3 fitting degree sets is in the top 3 whatever the model says
        open_rows = [(k, n) for k, n in ranks if n > 3]
        hits = sum(1 for k, _ in open_rows if k and k <= 3)
        print(
            f"  of the {len(open_rows)} rows with more than 3 fitting degree sets: {hits} ({100 * hits / len(open_rows):.0f}%)"
        )


def _layout(e: Estimate) -> str:
    name, tp, cp, pp, dp = degrees(e)
    vpp = getattr(e.job.backend.options, "vpp", 1)
    return f"{name} tp{tp} cp{cp} pp{pp}{f' v{vpp}' if vpp > 1 else ''} dp{dp} mbs{e.job.data.micro_batch_size}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit", action="store_true", help="refit each device kind's GEMM curve (and leave one source out)")
    p.add_argument(
        "--leave-one-source-out",
        action="store_true",
        help="the held-out figure (refits without each source) beside the shipped curves' table",
    )
    p.add_argument("--no-free", action="store_true", help="skip the free search (the rank column)")
    p.add_argument("--rows", help="comma-separated row ids")
    args = p.parse_args()
    rows, skipped = load_rows(set(args.rows.split(",")) if args.rows else None)
    jobs = {}
    for r in list(rows):
        try:
            jobs[r.id] = forced_jobs(r)
        except UserError as exc:
            rows.remove(r)
            skipped.append({"id": r.id, "inexpressible": str(exc)})
    print(f"{len(rows)} expressible rows; {len(skipped)} not expressible by the harness:")
    for raw in skipped:
        print(f"  {raw['id']}: {raw['inexpressible']}")
    curves = {k: [getattr(c, name) for name in FITTED] for k, c in CURVES.items()}
    if args.fit:
        curves = fit_all(rows, jobs)
    if args.fit or args.leave_one_source_out:
        leave_one_source_out(rows, jobs)
    report(rows, jobs, Calibration("published", curves=curves), not args.no_free)


if __name__ == "__main__":
    main()
