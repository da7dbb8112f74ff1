"""MLflow run and experiment names: what a user reads in the run list to tell runs apart.

A job run is named ``<backend>-<model>-x<world>[-<layout>][-r<repeat>]-<UTC time>`` (e.g.
``megatron-llama-x4-tp2-pp2-20261205-230512``, ``deepspeed-llama-x2-zero3-...``): the layout holds
the parallel degrees above 1 and the backend's own layout words (``Adapter.layout_words``); the
repeat index only when the job repeats (``run.repeats > 1``). Plans
and comparisons are not training runs: they go to experiments of their own beside the training
experiment (``<experiment>-plan``, ``<experiment>-comparisons``), so the training experiment lists
training runs only and its charts compare like with like.
"""

from __future__ import annotations

import time

from parabench.spec import JobSpec

PLAN_SUFFIX = "-plan"
COMPARISON_SUFFIX = "-comparisons"


def stamp(now: float | None = None) -> str:
    """UTC time to the second, sortable: ``20261205-230512``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))


def layout_words(job: JobSpec) -> list[str]:
    """The degrees above 1 (tp, pp, cp, dp sharding) and the backend's own layout words."""
    dims = job.parallel
    words = [f"{key}{getattr(dims, key)}" for key in ("tp", "pp", "cp") if getattr(dims, key) > 1]
    return words + job.backend.adapter.layout_words(job.backend.options)


def job_run_name(job: JobSpec, repeat: int | None = None, now: float | None = None) -> str:
    parts = [job.backend.name, job.model.name, f"x{job.parallel.world_size}", *layout_words(job)]
    if repeat is not None and job.run.repeats > 1:
        parts.append(f"r{repeat}")
    return "-".join([*parts, stamp(now)])


def plan_experiment(experiment: str) -> str:
    return experiment + PLAN_SUFFIX


def comparison_experiment(experiment: str) -> str:
    return experiment + COMPARISON_SUFFIX
