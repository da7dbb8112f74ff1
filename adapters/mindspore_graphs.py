"""Compiled MindSpore graphs kept between runs of the same job shape (``backend.compile_cache``).

In graph mode MindSpore compiles the micro-step and the optimizer step before the first step runs:
on this project's 2-core CPU machines ~9 CPU-s per rank for the tests' 4-layer llama, 18-29 s of
wall time under load. MindSpore's compile cache (``MS_COMPILER_CACHE_ENABLE=1``,
``MS_COMPILER_CACHE_PATH``: the ``enable_compile_cache`` entry of ``mindspore.set_context``'s
documentation) saves the front-end graphs of a first run as MINDIR files and loads them in the next:
the first step of a 1-rank llama run fell from 28.9 s to 2.1 s, with the same losses bit for bit
under another seed (2026-12-07, MindSpore 2.10 on CPU).

MindSpore calls the cache experimental and says it detects changes of the Python scripts only in a
limited way, so parabench does not rely on that check alone: the graphs live in one folder per job
shape, named by a hash of everything the compiled graphs are built from (the model, the batch
geometry, the optimizer's settings, precision, the backend options, the world size, the device kind,
MindSpore's version and the source of parabench's cells), under
``~/.cache/parabench/mindspore_graphs/``. A rank that finds its graphs there loads them; otherwise it
compiles into its run directory and publishes that folder when it closes cleanly (moved under a
hidden name, then renamed: a run that published first wins, and no run ever reads a half-written
folder), so the run directory keeps no copy. A killed or failed run publishes nothing.

The cached optimizer graph holds a copy of the weights (16 MB of its 16.7 MB for a 3.9M-parameter
model), so ``backend.compile_cache=auto`` (the default) caches only models whose fp32 weights take
up to 256 MiB, the models a CPU run trains; ``always`` and ``never`` decide for every model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from parabench.devices import package_version
from parabench.spec import JobSpec

# parabench's code that the compiled graphs are traced from
_GRAPH_SOURCES = ("mindspore_cells.py", "mindspore.py")
LOCAL_DIR = "mindspore_graphs"  # in the run directory: what a rank compiles when nothing was cached
AUTO_MAX_WEIGHT_BYTES = 256 * 2**20  # compile_cache=auto: the largest fp32 weights cached


def graphs_cached(job: JobSpec) -> bool:
    """Whether ``job``'s ranks keep their compiled graphs (graph mode and backend.compile_cache)."""
    opts = job.backend.options
    if opts.mode != "graph" or opts.compile_cache == "never":
        return False
    return opts.compile_cache == "always" or 4 * job.model.num_params() <= AUTO_MAX_WEIGHT_BYTES


def shape_key(job: JobSpec) -> str:
    """A short hash of everything the compiled graphs of ``job`` depend on (not its seed, steps,
    data source, checkpoints or faults: those change values fed to the graphs, not the graphs)."""
    here = Path(__file__).resolve().parent
    shape = {
        "model": dataclasses.asdict(job.model),
        "batch": [job.data.seq_len, job.data.global_batch_size, job.data.micro_batch_size],
        "optim": dataclasses.asdict(job.optim),
        "precision": job.run.precision,
        "backend": dataclasses.asdict(job.backend.options),
        "world": [job.launch.nnodes, job.launch.nproc_per_node],
        "device": job.device.type,
        "python": [sys.prefix, sys.version],
        "mindspore": package_version("mindspore"),
        "sources": [hashlib.sha256((here / name).read_bytes()).hexdigest() for name in _GRAPH_SOURCES],
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_root() -> Path:
    return Path.home() / ".cache" / "parabench" / "mindspore_graphs"


@dataclass(frozen=True)
class GraphCache:
    """One rank's compile cache: MindSpore writes and reads ``<path>/rank_<rank>/``."""

    shared: Path  # the job shape's folder in the cache
    local: Path  # this run's folder, compiled into when the shared one lacked this rank at start
    rank: int
    reused: bool  # the shared folder held this rank's graphs when the run started

    @classmethod
    def of(cls, job: JobSpec, run_dir: Path, rank: int) -> GraphCache:
        shared = cache_root() / shape_key(job)
        return cls(shared, run_dir / LOCAL_DIR, rank, (shared / f"rank_{rank}").is_dir())

    @property
    def path(self) -> Path:
        return self.shared if self.reused else self.local

    def enable(self) -> None:
        """Point MindSpore at the cache, before the first graph compiles (it reads both then)."""
        os.environ["MS_COMPILER_CACHE_ENABLE"] = "1"
        os.environ["MS_COMPILER_CACHE_PATH"] = str(self.path)

    def publish(self) -> None:
        """Offer what this rank compiled to later runs of the same shape (once it ran cleanly)."""
        compiled = self.local / f"rank_{self.rank}"
        if self.reused or not compiled.is_dir():
            return
        self.shared.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".rank_{self.rank}-", dir=self.shared))
        # moved, not copied (a rename within one file system): the run directory keeps no second
        # model-sized copy; under a hidden name until whole, then renamed into place
        staged = Path(shutil.move(compiled, staging / "graphs"))
        try:
            staged.rename(self.shared / f"rank_{self.rank}")
        except OSError:  # another run of this shape published it meanwhile: keep theirs
            pass
        shutil.rmtree(staging, ignore_errors=True)
        with contextlib.suppress(OSError):  # the last rank to publish removes the emptied folder
            self.local.rmdir()
