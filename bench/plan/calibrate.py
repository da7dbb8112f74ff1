"""``bench plan --calibrate EXPERIMENT``: fit the planner's free parameters to recorded runs.

Two parameters per ``backend/device kind``, each fitted as the median over that backend's runs:
* efficiency: the share of the peak the compute reaches, from the measured step time minus the
  predicted exposed communication: eff = C (1 + bubble) / (T - E), C the model FLOPs of a device's
  step at the peak, E the predicted exposed communication; CPU runs are fitted per intra-op thread
  count too (``backend/cpu/tN``, ``*/cpu/tN``), which a prediction for that count uses first;
* overhead: measured peak memory minus the predicted model states, activations and buffers
  (runtime, framework, allocator caching; on CPU the process's libraries).
``*/<kind>`` holds the median over all backends, used for a backend without runs of its own.
The fit error (median |predicted - measured| / measured over the fitted runs) goes with the
calibration, and every plan made with it prints it.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from parabench.errors import UserError
from parabench.jobs import job_from_json
from parabench.plan import cluster as clusters
from parabench.plan.estimate import Calibration, efficiency_keys, estimate
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


def comm_links(experiment: str, tracking_uri: str | None) -> dict[str, list[float]]:
    """Per device kind, the link (latency, bandwidth) that ``bench comm``'s all-reduce fits imply:
    t = alpha + beta S for an all-reduce of S bytes over n ranks is alpha = 2 (n - 1) link
    latencies and beta = 2 (n - 1) / n / bandwidth (a ring; docs/sources.md#communication-volume)."""
    client = _client(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    found: dict[str, list[tuple[float, float]]] = {}
    for run in client.search_runs([exp.experiment_id], "tags.`parabench.kind` = 'comm'") if exp else []:
        p, n = run.data.params, int(run.data.tags.get("world_size", "1"))
        if n < 2 or "fit.all_reduce.beta_ns_per_byte" not in p:
            continue
        beta = float(p["fit.all_reduce.beta_ns_per_byte"]) * 1e-9
        alpha = float(p["fit.all_reduce.alpha_us"]) * 1e-6
        if beta > 0:
            found.setdefault(run.data.tags.get("device", "cpu"), []).append(
                (alpha / (2 * (n - 1)), 2 * (n - 1) / n / beta)
            )
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


def _parts(r: Record) -> tuple[float, float, float, float]:
    """(compute at the peak x (1 + bubble), exposed comm, memory without overhead, step at eff 1)."""
    key = f"{r.job.backend.name}/{r.kind}"
    unit = Calibration(efficiency={key: 1.0}, overhead={key: 0.0})
    e = estimate(r.job, cluster_for(r.kind), r.peak_tflops, unit, r.threads)
    return e.compute_s + e.bubble_s, e.exposed_comm_s, e.device_bytes, e.step_s


def fit_records(recs: list[Record], name: str, links: dict[str, list[float]] | None = None) -> Calibration:
    eff: dict[str, list[float]] = {}
    over: dict[str, list[float]] = {}
    for r in recs:
        compute, exposed, memory, _ = _parts(r)
        for key in efficiency_keys(r.job.backend.name, r.kind, r.threads):
            if r.step_s > exposed:
                eff.setdefault(key, []).append(compute / (r.step_s - exposed))
        for key in (f"{r.job.backend.name}/{r.kind}", f"*/{r.kind}"):
            over.setdefault(key, []).append(r.peak_bytes - memory)
    cal = Calibration(
        name,
        {k: statistics.median(v) for k, v in eff.items()},
        {k: statistics.median(v) for k, v in over.items()},
        runs=len(recs),
        links=links or {},
    )
    t_err = [abs(predict(r, cal)[0] - r.step_s) / r.step_s for r in recs]
    m_err = [abs(predict(r, cal)[1] - r.peak_bytes) / r.peak_bytes for r in recs]
    return Calibration(
        name, cal.efficiency, cal.overhead, statistics.median(t_err), statistics.median(m_err), len(recs), cal.links
    )


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
    lines += [f"  link       {k}: {a * 1e6:.1f} us, {b / 1e9:.3g} GB/s (bench comm)" for k, (a, b) in cal.links.items()]
    if not cal.links:
        lines.append("  links: the cluster files' figures (no bench comm run with an all-reduce fit in the experiment)")
    lines.append(
        f"  fit error (median over the runs): step time {100 * (cal.time_error or 0):.1f}%, "
        f"peak memory {100 * (cal.memory_error or 0):.1f}%"
    )
    return "\n".join(lines)
