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
STEPS = 20
# No checkpoints: megatron-core 0.16's distributed optimizer cannot save through dist_checkpointing yet
# (CheckpointingException: ShardedTensor.flattened_range is not supported; issue #30), and a sweep
# fails whole. Every consumer of the matrix reads its summaries; the resilience tests checkpoint their
# own killed and resumed runs.
CHECKPOINT: list[str] = []

NEEDED = pytest.StashKey[set]()


@dataclass(frozen=True)
class MatrixRun:
    """One job of the matrix: its summary, run directory and the sweep's results directory."""

    summary: dict
    run_dir: Path
    results: Path

    @property
    def losses(self) -> list[float]:
        return self.summary["losses"]

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


def pair(matrix: dict[str, MatrixRun], backends: tuple[str, ...], world: int) -> tuple[Path, dict[str, dict]]:
    """(the sweep's results dir, backend -> summary) of these backends' runs at world size 1 or 2."""
    at = "@1" if world == 1 else ""
    return matrix[f"{backends[0]}{at}"].results, {b: matrix[f"{b}{at}"].summary for b in backends}


def sweep_jobs(results: Path) -> list[Path]:
    """The sweep's run directories in sweep order (Hydra numbers the jobs: 0_ddp, 1_fsdp, ...)."""
    dirs = [p.parent for p in results.glob("runs/*/*/*/summary.json")]
    return sorted(dirs, key=lambda d: int(d.name.split("_", 1)[0]))
