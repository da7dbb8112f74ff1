"""End to end through the real CLI: torchrun workers on gloo, MLflow store in a temp dir."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from run_matrix import assert_parity, pair, sweep_jobs

from conftest import FAST, REPO, bench, mlflow_runs, summaries

TWO_RANKS = pytest.mark.matrix("ddp", "fsdp")
ONE_RANK = pytest.mark.matrix("ddp@1", "fsdp@1")


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b))


@pytest.mark.e2e
def test_readme_main_command_records_a_finished_mlflow_run(results):
    """... and the bench parent never imports torch (-X importtime lists the parent's imports only):
    rank 0 measured the CPU's GEMM peak for MFU, which was the parent's one use of it."""
    proc = bench(["run", "+model=llama"], results, python_args=("-X", "importtime"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens/s" in proc.stdout and "MFU" in proc.stdout
    parent_imports = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "import time:" in line}
    assert "mlflow" in parent_imports and "torch" not in parent_imports
    runs = mlflow_runs(results)
    assert len(runs) == 1
    run = runs.iloc[0]
    assert run["status"] == "FINISHED"
    for metric in (
        "tokens_per_s",
        "tokens_per_s_per_device",
        "step_time_median_s",
        "mfu",
        "peak_tflops_per_device",
        "achieved_tflops_per_device",
        "peak_memory_bytes_max",
        "model_state_bytes_max",
        "loss_final",
        "loss",
    ):
        assert run[f"metrics.{metric}"] > 0, metric
    assert "PaLM" in run["tags.flops_formula"] and "measured" in run["tags.peak_source"]
    assert (
        run["tags.backend"] == "ddp" and run["tags.world_size"] == "1" and run["tags.version.torch"].startswith("2.13")
    )
    assert run["params.model.hidden_size"] == "256"
    summary = next(iter(summaries(results).values()))
    (rank0,) = results.glob("runs/*/*/*/ranks/rank0.json")
    assert json.loads(rank0.read_text())["gemm"]["tflops"] == pytest.approx(run["metrics.peak_tflops_per_device"])
    assert summary["measured_steps"] == 10 and len(summary["losses"]) == 12
    assert summary["losses"][-1] < summary["losses"][0]  # it trains


@pytest.fixture
def sweep(matrix):
    """world size -> (results dir, backend -> summary) of ddp and fsdp in the shared run matrix (20 fp32
    steps each; the test's matrix marker names the world sizes it reads)."""

    return lambda world: pair(matrix, ("ddp", "fsdp"), world)


@TWO_RANKS
@ONE_RANK
@pytest.mark.full
def test_identical_initial_weights_for_every_backend_and_world_size(sweep):
    checksums = {(w, b): s["initial_checksum"] for w in (1, 2) for b, s in sweep(w)[1].items()}
    assert len(checksums) == 4 and len(set(checksums.values())) == 1, checksums


@pytest.mark.parametrize(
    "world",
    [pytest.param(1, marks=[ONE_RANK, pytest.mark.full]), pytest.param(2, marks=[TWO_RANKS, pytest.mark.e2e])],
)
def test_ddp_fsdp_loss_parity(sweep, world):
    by = sweep(world)[1]
    assert_parity(by["ddp"], by["fsdp"], first=1e-6, after_ten=1e-4)


@TWO_RANKS
@ONE_RANK
@pytest.mark.full
def test_world_size_does_not_change_the_math(sweep):
    # Same global batch, same data: DDP on 1 rank (grad accumulation 2) and on 2 ranks agree.
    one, two = sweep(1)[1]["ddp"]["losses"], sweep(2)[1]["ddp"]["losses"]
    assert rel(one[0], two[0]) <= 1e-6 and rel(one[10], two[10]) <= 1e-4


@TWO_RANKS
@pytest.mark.e2e
def test_exact_model_state_accounting(sweep):
    by = sweep(2)[1]
    n = by["ddp"]["num_params"]
    for rank in by["ddp"]["model_state_per_rank"]:
        assert rank["params"] + rank["grads"] + rank["optimizer"] == 16 * n  # fp32 AdamW, replicated
    shard = [r["params"] + r["grads"] + r["optimizer"] for r in by["fsdp"]["model_state_per_rank"]]
    assert all(8 * n <= s <= 8 * n + 16 * 1024 for s in shard), (shard, 8 * n)  # + FSDP2 padding only
    assert by["fsdp"]["model_state_expected_bytes"] == 8 * n


@TWO_RANKS
@pytest.mark.e2e
def test_multirun_is_one_parent_with_a_child_per_job(sweep):
    results = sweep(2)[0]
    runs = mlflow_runs(results)
    parents = runs[runs["tags.parabench.kind"] == "sweep"]
    children = runs[runs["tags.parabench.kind"] == "job"]
    assert len(parents) == 1 and len(children) == len(sweep_jobs(results))  # one child per job of the matrix
    assert set(children["tags.mlflow.parentRunId"]) == {parents.iloc[0]["run_id"]}
    assert {"ddp", "fsdp"} <= set(children["tags.backend"]) and set(runs["status"]) == {"FINISHED"}


@pytest.mark.full
def test_a_killed_rank_fails_the_run_quickly_and_is_recorded(results):
    cmd = [
        sys.executable,
        "-m",
        "parabench",
        "run",
        *FAST,
        "launcher.nproc_per_node=2",
        "run.steps=500",
        f"run.results_dir={results}",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"},
    )
    deadline = time.time() + 180
    progress = None
    while time.time() < deadline:
        found = list(results.glob("runs/*/*/*/progress.json"))
        if found and json.loads(found[0].read_text() or "{}").get("step", 0) >= 2:
            progress = found[0]
            break
        time.sleep(0.5)
    assert progress is not None, "the run never reached step 2"
    pid = int((progress.parent / "pids" / "rank1").read_text())
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    _, err = proc.communicate(timeout=120)
    assert time.time() - killed_at < 60
    assert proc.returncode == 1
    # one line naming a rank and its error (rank 1's SIGKILL, or rank 0's failed collective), no launcher
    # traceback; one node, no restarts: the forked ranks of parabench.localrun (launcher.start=fork)
    assert re.search(r"^parabench: run FAILED: a worker failed \(localrun exit code 1\): rank [01]: ", err, re.M), err
    assert "ChildFailedError" not in err and "logs in" in err
    runs = mlflow_runs(results)
    assert list(runs["status"]) == ["FAILED"]
    assert "worker failed" in runs.iloc[0]["tags.failure_reason"]
