"""What every native loop of benchmarks/fairness.py shares with `bench run`, and nothing else.

A native loop is ``SCRIPT OUT_DIR OVERRIDES_JSON``: the job comes from parabench's composed config
with the same overrides `bench run` gets (model shapes, batch, optimizer hyper-parameters, steps,
threads per rank), the batches from ``parabench.data.TokenSource`` (the rows `bench run` gives this
data-parallel rank at each step). The loop itself, the model wrapping and the optimizer step are
the framework's own, written in each script as its documentation writes them. Each step is timed
from the moment its batch is ready until its optimizer update is done (the batch is built before
the clock starts, as `bench run` times it: parabench.loop); each rank writes its step times to
``OUT_DIR/rank<R>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load_job(argv: list[str] | None = None):
    """(output directory, JobSpec) from ``OUT_DIR OVERRIDES_JSON``: the spec `bench run` would train."""
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config

    argv = sys.argv[1:] if argv is None else argv
    out, overrides = Path(argv[0]), json.loads(argv[1])
    job = from_config(to_plain(compose(overrides)))
    if job.grad_accum != 1:
        raise SystemExit(
            f"the native loops train one micro-batch per rank and step; data.global_batch_size="
            f"{job.data.global_batch_size} needs {job.grad_accum}: set it to data.micro_batch_size x data-parallel ranks"
        )
    return out, job


def threads(job) -> int:
    """Intra-op threads per rank: the count `bench run` gives its workers (parabench.devices.cpu_threads)."""
    from parabench.devices import cpu_threads

    return cpu_threads(job.launch.nproc_per_node, job.device.threads_per_rank)


def batches(job, rank: int, world: int):
    """step -> this rank's (inputs, targets) NumPy arrays: the one micro-batch `bench run` gives it."""
    from parabench.data import TokenSource

    source = TokenSource(job.data, job.model.vocab_size)

    def batch(step: int):
        ((inputs, targets),) = source.rank_micro_batches(step, rank, world)
        return inputs, targets

    return batch


def write_times(out: Path, rank: int, job, step_times: list[float], first_loss: float) -> None:
    """This rank's measured step times (warm-up steps left out), its loss at step 0 (the same job
    starts from the same loss on both sides) and the tokens of one global step."""
    if len(step_times) != job.run.steps:
        raise RuntimeError(f"measured {len(step_times)} steps, expected run.steps={job.run.steps}")
    out.mkdir(parents=True, exist_ok=True)
    payload = {"step_times": step_times, "first_loss": first_loss, "tokens_per_step": job.tokens_per_step}
    (out / f"rank{rank}.json").write_text(json.dumps(payload))
