"""backend=mindspore checkpoints (issue 14; docs/resilience.md#mindspore): mindspore.save_checkpoint /
load_checkpoint (weights, both AdamW moments and the step) through the real `bench run` under msrun.
Acceptance: a 20-step fp32 run on 2 ranks, checkpointed every 5 steps, killed at step 12 and resumed
with run.resume=auto, gives the losses of steps 13-20 bitwise equal to the uninterrupted run. msrun,
not torchrun, starts the workers and parabench does not restart them: launcher.max_restarts is refused
before launch, and a hung rank ends the job through the runner's watchdog (tested here)."""

import json
from pathlib import Path

import pytest
from test_resilience import FAST, TWENTY, assert_bitwise_after_resume, kill_and_resume, run_ok

from conftest import assert_refused_before_launch, bench, mlflow_runs

pytest.importorskip("mindspore")


@pytest.mark.matrix("mindspore")
@pytest.mark.full
def test_killed_resumed_bitwise_and_its_async_saves_resume_bitwise(tmp_path, uninterrupted):
    """Killed before step 13 and resumed with run.resume=auto: bitwise. The resuming command saves with
    run.checkpoint.async=true (MindSpore's writer thread, save_checkpoint(async_save="thread")): each
    marker is written only after the thread has ended (steps 15 and 20, the last, complete), and its
    step-15 checkpoint resumes bitwise as well."""
    args = [*TWENTY, "backend=mindspore"]
    full = uninterrupted("mindspore")
    resumed, ckpt = kill_and_resume(args, tmp_path, resumed_with=("run.checkpoint.async=true",))
    assert_bitwise_after_resume(full, resumed)
    native = ckpt / "step_000010" / "native"
    assert sorted(p.name for p in native.iterdir()) == ["rank0.ckpt", "rank1.ckpt"]
    assert (ckpt / "step_000015" / "COMPLETE").is_file()
    assert (ckpt / "step_000020" / "COMPLETE").is_file()  # the last step, saved too
    again = run_ok([*args, f"run.resume={ckpt / 'step_000015'}", "tracking.enabled=false"], tmp_path / "again")
    assert again["resumed_step"] == 15
    assert again["losses"] == full["losses"]
    # backend.compile_cache: the matrix run of this shape published its compiled graphs; the resumed
    # runs loaded them, and resumed bitwise all the same
    (artifacts,) = (tmp_path / "again").glob("runs/*/*/*/backend_artifacts.json")
    assert json.loads(artifacts.read_text())["mindspore_graphs"]["reused"] is True


@pytest.mark.full
def test_hang_is_refused_for_restart_and_ended_by_the_watchdog(results, tmp_path, capsys):
    """fault.kind=hang on mindspore. With launcher.max_restarts=1: refused before launch (exit 2)
    naming the key and msrun. Without: MindSpore's CPU AllReduce on rank 0 gives up on its own
    (measured ~30 s; launcher.collective_timeout_s is a torch.distributed setting), but msrun
    keeps the hung rank 1 alive, so the runner's launcher.hang_timeout_s watchdog ends the job: exit
    1 with a last line naming that key, MLflow FAILED, no worker left behind."""
    hang = ["backend=mindspore", "launcher.nproc_per_node=2", "fault.kind=hang", "fault.rank=1", "fault.step=3"]
    line = assert_refused_before_launch(
        ["+model=llama", *hang, "run.checkpoint.every=2", "launcher.max_restarts=1"],
        "launcher.max_restarts",
        tmp_path,
        capsys,
    )
    assert "launched by msrun, which parabench does not restart" in line
    proc = bench(["run", *FAST, "run.steps=6", *hang, "launcher.hang_timeout_s=45"], results)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]  # after the tails of the rank logs: the one reason
    assert last.startswith("bench: run failed: no step finished for 45 s (launcher.hang_timeout_s): killed"), last
    (run_dir,) = (p.parent for p in results.glob("runs/*/*/*/spec.json"))
    fired = json.loads((run_dir / "faults" / "fired.json").read_text())
    detected = [json.loads(x) for x in (run_dir / "faults" / "detected.jsonl").read_text().splitlines()]
    first = next(d for d in detected if d["rank"] == 0)  # rank 0's AllReduce failed; rank 1 slept on
    assert "AllReduce" in first["what"] and 0 < first["time"] - fired["time"] < 45
    for pid in (int(p.read_text()) for p in (run_dir / "pids").glob("rank*")):
        assert not _alive(pid), pid
    (run,) = (row for _, row in mlflow_runs(results).iterrows())
    assert run["status"] == "FAILED"


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text()
    except OSError:
        return False
