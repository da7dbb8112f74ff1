"""Communication of a ``bench run`` job: what the ranks measured (:mod:`parabench.commlog`) next to
the formula of its layout (:mod:`parabench.commvolume`, through the planner's backend profile).

Per collective kind the summary holds, for the busiest rank (the largest value over ranks; every
data-parallel rank moves the same, tensor and pipeline ranks need not), the mean per measured step
of: ``bytes`` (sum of the calls' nccl-tests sizes), ``bus_bytes`` (bytes x bus factor: what the rank
moves over its links, the ZeRO paper's "2 Psi") and ``seconds`` inside the calls. The formula is
evaluated twice: with the elements the backend really communicates (its padding: DeepSpeed's flat
buffers, FSDP2's dim-0 padding, Megatron's bucket padding) and without, so the padding is shown.
Calls of at most a few elements (losses, gradient norms, overflow flags) are reported apart as
``scalar``; the formulas have no term for them. Expert parallelism's all-to-all moves a routing-dependent
share of the tokens per rank: its formula is the mean over the ranks, compared with the measured
mean over the ranks (``comm_all_to_all_*``; the busiest rank moves at least as much).
"""

from __future__ import annotations

from typing import Any

from parabench.commlog import SCALAR_ELEMENTS
from parabench.commvolume import Batch, expert_data_parallel, moe_all_to_all, repeated_param_gathers, step_comm
from parabench.spec import JobSpec

FIELDS = ("calls", "bytes", "bus_bytes", "seconds", "async_calls")


def measured(job: JobSpec, results: list[dict[str, Any]]) -> dict[str, dict[str, float]] | None:
    """Per kind, the busiest rank's mean per measured step; None when no rank logged (MindSpore)."""
    logs = [r.get("comm") for r in results]
    if not logs or any(log is None for log in logs):
        return None
    out: dict[str, dict[str, float]] = {}
    for log in logs:
        steps = [s["kinds"] for s in log if s["step"] >= job.run.warmup_steps] or [s["kinds"] for s in log]
        kinds = {k for s in steps for k in s}
        for kind in kinds:
            mean = {f: sum(s.get(kind, {}).get(f, 0) for s in steps) / max(len(steps), 1) for f in FIELDS}
            prev = out.setdefault(kind, dict.fromkeys(FIELDS, 0.0))
            if mean["bus_bytes"] > prev["bus_bytes"] or (
                mean["bus_bytes"] == prev["bus_bytes"] and mean["bytes"] > prev["bytes"]
            ):
                out[kind] = mean
    return out


def formula(job: JobSpec, padded: bool = True) -> dict[str, dict[str, float]] | None:
    """Per kind, bytes and bus bytes per step of the layout's formula; None for a backend the
    planner has no profile of."""
    profile = job.backend.adapter.plan_profile
    if profile is None:
        return None
    batch = Batch(job.data.seq_len, job.data.micro_batch_size, job.grad_accum)
    states, layout, widths = profile.states(job), profile.layout(job), profile.widths(job)
    elements, experts = _dp_elements(states, padded, getattr(job.backend.options, "ep", 1))
    comm = step_comm(
        job.model, layout, batch, widths, dp_elements=elements or None, root_elements=profile.root_elements(job)
    )
    # a MoE model's experts are synchronised over the expert-data-parallel group where the backend
    # keeps them apart (megatron-core: dp / ep ranks), as bench plan prices them
    edp = expert_data_parallel(job.model, layout, batch, widths, experts) if experts else []
    data_parallel = repeated_param_gathers((*comm.collectives, *edp), profile.param_gathers(job))
    out: dict[str, dict[str, float]] = {}
    for c in (*data_parallel, *_expert_parallel(job, batch, widths)):
        rec = out.setdefault(c.kind, {"bytes": 0.0, "bus_bytes": 0.0, "calls": 0})
        rec["bytes"] += c.size_bytes * c.calls
        rec["bus_bytes"] += c.bus_bytes
        rec["calls"] += c.calls
    return out


def _dp_elements(states: Any, padded: bool, ep: int) -> tuple[int | None, int]:
    """(dense elements over dp, expert elements over the expert-data-parallel group) of a rank, padded
    as the backend pads or not; (None: the model's own count, 0) where the profile keeps no experts
    apart, or at ep = 1, where megatron-core keeps them in the dense buffers (measured: one
    reduce-scatter and one all-gather per step for moe-tiny with the distributed optimizer)."""
    if not states.expert_elements or ep == 1:
        return (states.elements if padded else None), 0
    if padded:
        return states.elements - states.expert_elements, states.expert_elements
    return states.exact_elements - states.exact_expert_elements, states.exact_expert_elements


def _expert_parallel(job: JobSpec, batch: Batch, widths: Any) -> list[Any]:
    """The all-to-all token dispatcher's collectives of megatron's ``backend.ep`` with
    ``moe_token_dispatcher=alltoall``; none for other dispatchers, ep = 1 or another backend
    (DeepSpeed-MoE's padded buffer depends on the routing: its engine reports its formula,
    :func:`_reported_all_to_all`)."""
    options = job.backend.options
    if getattr(options, "moe_token_dispatcher", None) != "alltoall":
        return []
    ep, par = getattr(options, "ep", 1), job.parallel
    return moe_all_to_all(
        job.model, batch, widths, ep, tp=par.tp, pp=par.pp, cp=par.cp, scalar_elements=SCALAR_ELEMENTS
    )


def all_to_all_rank_mean(job: JobSpec, results: list[dict[str, Any]]) -> float | None:
    """all-to-all bytes per measured step, averaged over the ranks; None when no rank logged one."""
    logs = [r.get("comm") or [] for r in results]
    per_rank = []
    for log in logs:
        steps = [s["kinds"] for s in log if s["step"] >= job.run.warmup_steps] or [s["kinds"] for s in log]
        per_rank.append(sum(s.get("all_to_all", {}).get("bytes", 0) for s in steps) / max(len(steps), 1))
    return sum(per_rank) / len(per_rank) if any(per_rank) else None


def _reported_all_to_all(results: list[dict[str, Any]]) -> float:
    """The all-to-all formula a backend's ranks evaluated on their own routing (DeepSpeed-MoE: 4 x E x
    C x h bytes per layer forward, C its dropless capacity; ``extra``
    ``moe.rank<i>.all_to_all_formula_bytes``, per measured step), mean over the ranks; 0 if none did."""
    values = [v for r in results for k, v in r.get("extra", {}).items() if k.endswith(".all_to_all_formula_bytes")]
    return sum(values) / len(values) if values else 0


def _all_to_all_summary(job: JobSpec, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The all-to-all bytes per step, mean over ranks, measured and by formula (MoE expert parallelism)."""
    profile = job.backend.adapter.plan_profile
    batch = Batch(job.data.seq_len, job.data.micro_batch_size, job.grad_accum)
    terms = _expert_parallel(job, batch, profile.widths(job)) if profile is not None else []
    want = sum(c.size_bytes * c.calls for c in terms if c.kind == "all_to_all") or _reported_all_to_all(results)
    got = all_to_all_rank_mean(job, results)
    if got is None and not want:
        return {}
    out: dict[str, Any] = {"comm_all_to_all_rank_mean_bytes": got, "comm_all_to_all_formula_bytes": want or None}
    if got is not None and want:
        out["comm_all_to_all_diff_bytes"] = got - want
    return out


def comm_summary(job: JobSpec, results: list[dict[str, Any]], step_time_s: float) -> dict[str, Any]:
    got = measured(job, results)
    want, unpadded = formula(job), formula(job, padded=False)
    out: dict[str, Any] = {"comm_measured": got, "comm_formula": want, **_all_to_all_summary(job, results)}
    if got is not None:
        main = {k: v for k, v in got.items() if k != "scalar"}
        out["comm_bytes_per_step"] = sum(v["bytes"] for v in main.values())
        out["comm_bus_bytes_per_step"] = sum(v["bus_bytes"] for v in main.values())
        out["comm_time_s"] = sum(v["seconds"] for v in got.values())
        out["comm_share_of_step"] = out["comm_time_s"] / step_time_s if step_time_s else None
    if want is not None:
        out["comm_formula_bus_bytes_per_step"] = sum(v["bus_bytes"] for v in want.values())
        out["comm_formula_bytes_per_step"] = sum(v["bytes"] for v in want.values())
        out["comm_padding_bytes"] = out["comm_formula_bytes_per_step"] - sum(
            v["bytes"] for v in (unpadded or {}).values()
        )
        if got is not None:
            out["comm_diff_bytes"] = out["comm_bytes_per_step"] - out["comm_formula_bytes_per_step"]
            out["comm_diff_bus_bytes"] = out["comm_bus_bytes_per_step"] - out["comm_formula_bus_bytes_per_step"]
    return out


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The communication lines of the printed summary."""
    got, want = s.get("comm_measured"), s.get("comm_formula")
    if got is None:
        return ["  communication  not measured for this backend (no torch.distributed calls to log)"]
    lines = [
        f"  communication  {s['comm_bytes_per_step'] / 2**20:.3f} MiB/step in collectives (busiest rank; bus "
        f"{s['comm_bus_bytes_per_step'] / 2**20:.3f} MiB), {1e3 * s['comm_time_s']:.1f} ms inside the calls = "
        f"{100 * (s['comm_share_of_step'] or 0):.1f}% of the step (blocking calls whole, async ones until enqueued)"
    ]
    for kind in sorted(set(got) | set(want or {})):
        g, w = got.get(kind), (want or {}).get(kind)
        meas = f"{g['bytes']:.0f} B (bus {g['bus_bytes']:.0f} B) in {g['calls']:.0f} calls" if g else "none"
        form = (
            "no formula term"
            if kind == "scalar"
            else (
                f"formula {w['bytes']:.0f} B (bus {w['bus_bytes']:.0f} B) in {w['calls']:.0f}" if w else "formula: none"
            )
        )
        lines.append(f"    {kind:<15} measured {meas}; {form}")
    if want is not None:
        lines.append(
            f"    bus bytes/step: measured {s['comm_bus_bytes_per_step']:.0f} B, formula "
            f"{s['comm_formula_bus_bytes_per_step']:.0f} B, measured - formula = {s['comm_diff_bus_bytes']:+.0f} B "
            f"(sizes: {s['comm_diff_bytes']:+.0f} B; scalars apart); padding in the formula {s['comm_padding_bytes']:.0f} B"
        )
    if s.get("comm_all_to_all_formula_bytes"):
        mean = s.get("comm_all_to_all_rank_mean_bytes") or 0.0
        lines.append(
            f"    all_to_all bytes/step, mean over ranks (dropless routing: the busiest rank moves more): measured "
            f"{mean:.0f} B, formula {s['comm_all_to_all_formula_bytes']:.0f} B, measured - formula = "
            f"{mean - s['comm_all_to_all_formula_bytes']:+.0f} B"
        )
    return lines
