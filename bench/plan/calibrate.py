"""``bench plan --calibrate EXPERIMENT``: fit the planner's free parameters to recorded runs.

Per ``backend/device kind``:
* a framework cost per micro-batch k (the operators, hooks and copies a forward/backward pass
  dispatches whatever its size): least squares of T - E = (C x + k m)(1 + bubble) over the runs,
  x = 1 / efficiency per layout and thread count, m the passes of the whole model a rank makes in a
  step (micro-batches / pipeline stages: ``estimate.model_passes``), C the model FLOPs of
  a device's step at the peak, E the predicted exposed communication. Fitted for each layout whose
  own runs determine it (two micro-batch counts: ``backend/kind/<layout>``, CPU runs per thread
  count ``.../tN``), over the backend's runs (``backend/kind[/tN]``) and over all runs
  (``*/kind[/tN]``, only for a backend without runs); a prediction uses the most specific, else 0
  (one parameter, the efficiency, as without k); k < 0 is clamped to 0;
* efficiency: eff = C / ((T - E) / (1 + bubble) - k m), the median over the runs of each key:
  the layout at the thread count (``backend/cpu/<layout>/tN``), the backend at the thread count
  (``backend/cpu/tN``, ``*/cpu/tN``), the backend, all backends; a prediction uses the most specific;
* overhead: measured peak memory minus the predicted model states, activations and buffers
  (runtime, framework, allocator caching; on CPU the process's libraries).
``*/<kind>`` holds the fit over all backends, used for a backend without runs of its own.
The fit error (median |predicted - measured| / measured over the fitted runs) goes with the
calibration, and every plan made with it prints it.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from parabench.commvolume import bus_factor, ring_steps
from parabench.errors import UserError
from parabench.jobs import job_from_json
from parabench.plan import cluster as clusters
from parabench.plan.estimate import Calibration, efficiency_keys, estimate, layout_key, model_passes, plan_profile
from parabench.spec import JobSpec

STORE = Path("results") / "plan"  # fitted calibrations, <name>.json


@dataclass(frozen=True)
class Record:
    """One recorded run, as the fit needs it."""

    run_id: str
    job: JobSpec
    step_s: float  # measured: median over steps of the slowest rank's step time
    peak_bytes: float  # measured: max over ranks of the peak memory
    peak_tflops: float  # the peak the run's MFU used
    kind: str
    threads: int | None = None  # intra-op threads per rank (CPU runs: derived.threads_per_rank)


def _client(tracking_uri: str | None):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri or f"sqlite:///{Path('results').resolve() / 'mlflow.db'}")


LINK_OPS = ("all_reduce", "all_gather", "reduce_scatter")  # the collectives the planner's model calls


def comm_links(experiment: str, tracking_uri: str | None) -> dict[str, list[float]]:
    """Per device kind (the all-reduce's) and ``kind/collective``, the link (latency, bandwidth) that
    ``bench comm``'s fits imply: t = alpha + beta S for a collective of S bytes over n ranks is alpha =
    ring steps x link latency and beta = bus factor / bandwidth (all-reduce 2 (n - 1) and 2 (n - 1) / n,
    all-gather and reduce-scatter n - 1 and (n - 1) / n; docs/sources.md#communication-volume)."""
    client = _client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    found: dict[str, list[tuple[float, float]]] = {}
    for run in client.search_runs([exp.experiment_id], "tags.`parabench.kind` = 'comm'") if exp else []:
        p, n = run.data.params, int(run.data.tags.get("world_size", "1"))
        for op in LINK_OPS if n >= 2 else ():
            if float(p.get(f"fit.{op}.beta_ns_per_byte", 0)) <= 0:
                continue
            beta, alpha = float(p[f"fit.{op}.beta_ns_per_byte"]) * 1e-9, float(p[f"fit.{op}.alpha_us"]) * 1e-6
            kind = run.data.tags.get("device", "cpu")
            key = kind if op == "all_reduce" else f"{kind}/{op}"
            found.setdefault(key, []).append((alpha / ring_steps(op, n), bus_factor(op, n) / beta))
    return {k: [statistics.median(a for a, _ in v), statistics.median(b for _, b in v)] for k, v in found.items()}


def records(experiment: str, tracking_uri: str | None) -> list[Record]:
    import os

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import mlflow

    client = _client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise UserError(f"--calibrate: no experiment {experiment!r} in {client.tracking_uri}")
    out = []
    for run in client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'", max_results=5000):
        m = run.data.metrics
        if "step_time_median_s" not in m or not m.get("peak_tflops_per_device"):
            continue  # a sweep's parent run, a plan, or a run without a known peak
        spec = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="spec.json",
                                                   tracking_uri=client.tracking_uri)  # fmt: skip
        job = job_from_json(Path(spec).read_text())
        threads = run.data.params.get("derived.threads_per_rank") or ""
        out.append(Record(run.info.run_id, job, m["step_time_median_s"], m["peak_memory_bytes_max"],
                          m["peak_tflops_per_device"], job.device.type,
                          int(threads) if threads.isdigit() and job.device.type == "cpu" else None))  # fmt: skip
    if not out:
        raise UserError(f"--calibrate: experiment {experiment!r} holds no finished run with a step time and a peak")
    return out


def cluster_for(kind: str) -> clusters.Cluster:
    """The cluster whose links a recorded run's communication is predicted over."""
    for name in clusters.available():
        c = clusters.load(name)
        if c.device_kind == kind:
            return c
    raise UserError(f"--calibrate: no conf/cluster file for device kind {kind}")


@dataclass(frozen=True)
class _Row:
    """One run in the fit's terms: work = compute x (1 / efficiency) + k x passes."""

    backend: str
    layout: str  # layout_key: runs of one layout run the same framework code
    threads: str  # "/tN" for a CPU run, else ""
    compute: float  # the device's step compute at the peak (efficiency 1)
    passes: float  # estimate.model_passes: micro-batches x the share of the layers the rank runs
    work: float  # (T - exposed communication and offload) / (1 + bubble share): one pipeline slot's work
    memory: float  # predicted peak memory without the overhead


def _row(r: Record, links: dict[str, list[float]]) -> _Row:
    name = r.job.backend.name
    unit = Calibration(efficiency={f"{name}/{r.kind}": 1.0}, overhead={f"{name}/{r.kind}": 0.0}, links=links)
    e = estimate(r.job, cluster_for(r.kind), r.peak_tflops, unit, r.threads)
    layout = layout_key(plan_profile(r.job).layout(r.job))
    work = (r.step_s - e.exposed_comm_s - e.offload_s) / (1 + e.bubble_s / e.compute_s)
    return _Row(
        name, layout, f"/t{r.threads}" if r.threads else "", e.compute_s, model_passes(r.job), work, e.device_bytes
    )


def micro_batch_cost(rows: list[_Row], group: Callable[[_Row], str]) -> float | None:
    """Least squares of work = compute x_g + k passes, one x per ``group`` (a layout at a
    thread count runs at one efficiency) and one k; None when the runs cannot separate k from the
    x's (no group with two micro-batch counts). k >= 0: a negative optimum is clamped to 0, where the
    x's are the one-parameter fit."""
    import numpy as np

    groups = sorted({group(r) for r in rows})
    a = np.array([[r.compute * (group(r) == g) for g in groups] + [r.passes] for r in rows])
    if np.linalg.matrix_rank(a) < len(groups) + 1:
        return None
    solution = np.linalg.lstsq(a, np.array([r.work for r in rows]), rcond=None)[0]
    return max(float(solution[-1]), 0.0)


def _micro_batch_costs(recs: list[Record], rows: list[_Row]) -> dict[str, float]:
    """k for every key a run has (efficiency_keys: its layout, its backend, all backends; CPU runs
    only at their thread count: a rank with more threads dispatches its operators at another speed)
    whose runs determine it."""
    members: dict[str, list[_Row]] = {}
    for r, row in zip(recs, rows, strict=True):
        keys = efficiency_keys(row.backend, r.kind, r.threads, row.layout)
        for key in keys[:3]:  # with threads: layout/tN, backend/tN, */tN; without: layout, backend, *
            members.setdefault(key, []).append(row)
    costs = {key: micro_batch_cost(m, lambda r: f"{r.backend}/{r.layout}{r.threads}") for key, m in members.items()}
    return {key: k for key, k in costs.items() if k is not None}


def fit_records(recs: list[Record], name: str, links: dict[str, list[float]] | None = None) -> Calibration:
    links = links or {}
    rows = [_row(r, links) for r in recs]
    micro = _micro_batch_costs(recs, rows)
    # the k each run's prediction will use (its backend has runs: never another backend's k)
    shell = Calibration(
        name, {f"{row.backend}/{r.kind}": 1.0 for r, row in zip(recs, rows, strict=True)}, micro_batch=micro
    )
    eff: dict[str, list[float]] = {}
    over: dict[str, list[float]] = {}
    for r, row in zip(recs, rows, strict=True):
        compute = row.work - shell.per_micro_batch(row.backend, r.kind, r.threads, row.layout) * row.passes
        for key in efficiency_keys(row.backend, r.kind, r.threads, row.layout):
            if compute > 0:
                eff.setdefault(key, []).append(row.compute / compute)
        for key in (f"{row.backend}/{r.kind}", f"*/{r.kind}"):
            over.setdefault(key, []).append(r.peak_bytes - row.memory)
    cal = Calibration(
        name,
        {k: statistics.median(v) for k, v in eff.items()},
        {k: statistics.median(v) for k, v in over.items()},
        runs=len(recs),
        links=links,
        micro_batch=micro,
    )
    predicted = [predict(r, cal) for r in recs]  # (step time, peak memory) of each run
    t_err = [abs(step - r.step_s) / r.step_s for r, (step, _) in zip(recs, predicted, strict=True)]
    m_err = [abs(mem - r.peak_bytes) / r.peak_bytes for r, (_, mem) in zip(recs, predicted, strict=True)]
    return dataclasses.replace(cal, time_error=statistics.median(t_err), memory_error=statistics.median(m_err))


def predict(r: Record, cal: Calibration) -> tuple[float, float]:
    """(step time, peak memory per device) the calibration predicts for a recorded run's job."""
    e = estimate(r.job, cluster_for(r.kind), r.peak_tflops, cal, r.threads)
    return e.step_s, e.device_bytes


def fit(experiment: str, tracking_uri: str | None) -> Calibration:
    cal = fit_records(records(experiment, tracking_uri), experiment, comm_links(experiment, tracking_uri))
    STORE.mkdir(parents=True, exist_ok=True)
    (STORE / f"{experiment}.json").write_text(json.dumps(asdict(cal), indent=2, sort_keys=True))
    return cal


def load(name: str, tracking_uri: str | None = None) -> Calibration:
    path = STORE / f"{name}.json"
    if not path.is_file():
        raise UserError(
            f"plan.calibration: no calibration {name!r} in {STORE} (make it: bench plan --calibrate {name})"
        )
    return Calibration(**json.loads(path.read_text()))


def describe(cal: Calibration) -> str:
    lines = [f"calibration {cal.name}: {cal.runs} runs, stored in {STORE / (cal.name + '.json')}"]
    lines += [f"  efficiency {k}: {100 * v:.1f}% of peak" for k, v in sorted(cal.efficiency.items())]
    lines += [f"  overhead   {k}: {v / 2**20:.0f} MiB" for k, v in sorted(cal.overhead.items())]
    lines += [f"  per micro-batch {k}: {v * 1e3:.2f} ms (framework)" for k, v in sorted(cal.micro_batch.items())]
    lines += [f"  link       {k}: {a * 1e6:.1f} us, {b / 1e9:.3g} GB/s (bench comm)" for k, (a, b) in cal.links.items()]
    if not cal.links:
        lines.append("  links: the cluster files' figures (no bench comm run with an all-reduce fit in the experiment)")
    lines.append(
        f"  fit error (median over the runs): step time {100 * (cal.time_error or 0):.1f}%, "
        f"peak memory {100 * (cal.memory_error or 0):.1f}%"
    )
    return "\n".join(lines)
