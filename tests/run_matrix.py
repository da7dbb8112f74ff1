"""The shared run matrix: one `bench run -m` per world size at one geometry, whose runs feed the parity,
formula, resilience-reference and sweep tests of every backend module (conftest's ``matrix`` fixture).

A test names the runs it reads with ``@pytest.mark.matrix("ddp", "zero3", ...)``; the session runs one
sweep holding exactly the variants the selected tests name (the default tier's few, the full tier's
all), so a configuration trains once per session however many modules compare with it. A test that
needs a run of its own (another geometry, a fault, 4 ranks) starts it itself and says why.

The geometry is the resilience tests' job (``TWENTY``: the llama model, 64-token sequences, global
batch 4 in micro-batches of 2, 20 fp32 steps, no warm-up, 2 ranks), recorded in MLflow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

# variant -> the `backend=` value that selects it in the sweep (the presets of conf/backend/)
VARIANTS = {
    "ddp": "ddp",
    "fsdp": "fsdp",
    "zero0": "deepspeed/zero0",
    "zero1": "deepspeed/zero1",
    "zero2": "deepspeed/zero2",
    "zero3": "deepspeed/zero3",
    "zero2_offload": "deepspeed/zero2_offload",
    "megatron_tp": "megatron/tp",
    "megatron_tp_sp": "megatron/tp_sp",
    "megatron_pp": "megatron/pp",
    "megatron_pp_vpp": "megatron/pp_vpp",
    "megatron_distopt": "megatron/dp_overlap",
    "mindspore": "mindspore",
}
# variants at 1 rank (grad accumulation 2): world-size invariance
ONE_RANK = {"ddp@1": "ddp", "fsdp@1": "fsdp", "mindspore@1": "mindspore"}
# The sweeps the matrix trains, each one `bench run -m` with a results dir (and MLflow store) of its
# own: (name, world size, variants). Under pytest-xdist a worker that finds a shard being trained by
# the other trains the next one instead of waiting (it waited 198 s for a single sweep in a full tier,
# 2026-12-06). ddp is in the sweep of the variants compared with it through the sweep's store (the
# DeepSpeed stages' parent/children and config artifacts), fsdp beside it (the ddp/fsdp sweep test);
# the Megatron layouts and MindSpore (read through summaries and their own store) are the other half.
SHARDS = (
    ("x2-torch", 2, ("ddp", "fsdp", "zero0", "zero1", "zero2", "zero3", "zero2_offload")),
    (
        "x2-mcore",
        2,
        ("megatron_tp", "megatron_tp_sp", "megatron_pp", "megatron_pp_vpp", "megatron_distopt", "mindspore"),
    ),
    ("x1", 1, ("ddp@1", "fsdp@1", "mindspore@1")),
)
# 20 steps, no checkpoints: every consumer reads summaries, and the resilience tests checkpoint their
# own killed and resumed runs (the distributed optimizer's too, in fully_reshardable format on 0.16:
# docs/megatron.md#checkpoints-with-the-distributed-optimizer).
STEPS = 20

NEEDED = pytest.StashKey[set]()


@dataclass(frozen=True)
class MatrixRun:
    """One job of the matrix: its summary, run directory and the sweep's results directory."""

    summary: dict
    run_dir: Path
    results: Path

    @classmethod
    def read(cls, run_dir: Path, results: Path) -> MatrixRun:
        """The run of ``run_dir`` (its summary.json), in the sweep of ``results``."""
        return cls(json.loads((run_dir / "summary.json").read_text()), run_dir, results)

    @property
    def spec(self) -> dict:
        return json.loads((self.run_dir / "spec.json").read_text())


def needed_variants(items: list[pytest.Item]) -> set[str]:
    """Every variant the selected tests name with @pytest.mark.matrix (unknown names fail collection)."""
    names = {name for item in items for mark in item.iter_markers("matrix") for name in mark.args}
    unknown = names - set(VARIANTS) - set(ONE_RANK)
    if unknown:
        raise pytest.UsageError(
            f"@pytest.mark.matrix names unknown variants {sorted(unknown)}; see tests/run_matrix.py"
        )
    return names


def shards_needed(needed: set[str]) -> list[tuple[str, int, list[str]]]:
    """The shards holding a needed variant, each with only its needed variants (in sweep order)."""
    chosen = [(name, world, [v for v in variants if v in needed]) for name, world, variants in SHARDS]
    return [shard for shard in chosen if shard[2]]


def pair(matrix: dict[str, MatrixRun], backends: tuple[str, ...], world: int) -> tuple[Path, dict[str, dict]]:
    """(the sweep's results dir, backend -> summary) of these backends' runs at world size 1 or 2."""
    at = "@1" if world == 1 else ""
    return matrix[f"{backends[0]}{at}"].results, {b: matrix[f"{b}{at}"].summary for b in backends}


def assert_parity(reference: dict, summary: dict, first: float, after_ten: float) -> None:
    """``summary`` trained like ``reference`` (the ddp run): the same canonical start and step count,
    step 0's loss within ``first`` relative, step 10's (after 10 optimizer steps) within ``after_ten``,
    and both trained (the loss fell by more than 0.1 in 10 steps)."""
    ref, got = reference["losses"], summary["losses"]
    assert summary["initial_checksum"] == reference["initial_checksum"]  # identical canonical start
    assert len(got) == len(ref) == STEPS
    for step, bound in ((0, first), (10, after_ten)):
        assert abs(got[step] - ref[step]) <= bound * max(abs(got[step]), abs(ref[step])), (step, got[step], ref[step])
    assert ref[10] < ref[0] - 0.1 and got[10] < got[0] - 0.1


def sweep_jobs(results: Path) -> list[Path]:
    """The sweep's run directories in sweep order (Hydra numbers the jobs: 0_ddp, 1_fsdp, ...)."""
    dirs = [p.parent for p in results.glob("runs/*/*/*/summary.json")]
    return sorted(dirs, key=lambda d: int(d.name.split("_", 1)[0]))
