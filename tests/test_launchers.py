"""The one launcher (parabench.launchers.supervise) that starts, watches and stops the workers of
`bench run`, `bench comm` and `bench convert`: the setup/hang watchdog kills the launcher's whole
process group and says why, a stop signal is acted on between polls (never inside the command's own
poll), the graceful stop comes before the kill, a failed launch names its exit code. Then `bench comm`
and `bench convert`, which had no watchdog or signal handling of their own: a launch that does not
finish is killed with the reason, SIGTERM leaves no worker behind, nor does a SIGKILLed torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, alive, alive_with, bench
from parabench.errors import Interrupted
from parabench.launchers import Launch, Torchrun, supervise


def _launch(tmp_path: Path, script: str, **kw) -> Launch:
    """``sh -c SCRIPT`` standing in for the launcher (its children for the workers), torchrun's stop signal."""
    limits = {"setup_timeout_s": 60.0, "hang_timeout_s": 60.0, **kw.pop("limits", {})}
    return Launch(Torchrun, ("sh", "-c", script), {}, tmp_path, **limits, **kw)


def _worker(tmp_path: Path) -> str:
    """The "worker": a child of the "launcher" in its process group, which a kill of the launcher alone misses."""
    return f"sleep 300 & echo $! > {tmp_path}/worker.pid; "


def _worker_pid(tmp_path: Path) -> int:
    return int((tmp_path / "worker.pid").read_text())


def _worker_ended(tmp_path: Path) -> bool:
    """The worker has ended (the kill reached it; it may take a moment to go once the launcher is gone)."""
    deadline = time.monotonic() + 5
    while alive(_worker_pid(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(_worker_pid(tmp_path))


def test_the_watchdog_kills_a_launch_that_does_not_finish_and_its_whole_group(tmp_path):
    start = time.monotonic()
    rc, reason = supervise(_launch(tmp_path, _worker(tmp_path) + "wait", limits={"setup_timeout_s": 1.0}))
    assert reason == "not finished after 1 s (launcher.setup_timeout_s): killed"
    assert rc == -signal.SIGTERM and time.monotonic() - start < 10
    assert _worker_ended(tmp_path)  # the worker went with the launcher's group
    assert (tmp_path / "command.txt").read_text().startswith("sh -c ")
    assert (tmp_path / "logs" / "launcher.log").exists()


def test_the_watchdog_times_each_step_after_the_first_with_the_hang_limit(tmp_path):
    """Steps 0, 1, 2 within the (long) setup limit, then none: the hang limit ends it."""
    steps = iter([0, 1, 2])
    polled = []

    def poll() -> int | None:
        polled.append(time.monotonic())
        return next(steps, None)  # None: no news (the step file unchanged)

    limits = {"setup_timeout_s": 60.0, "hang_timeout_s": 1.0}
    rc, reason = supervise(_launch(tmp_path, _worker(tmp_path) + "wait", limits=limits, poll=poll))
    assert reason == "no step finished for 1 s (launcher.hang_timeout_s): killed"
    assert rc == -signal.SIGTERM and polled[-1] - polled[0] < 10 and _worker_ended(tmp_path)


def test_what_a_launcher_leaves_in_its_group_ends_with_it(tmp_path):
    """A process left in the launcher's process group when the launcher exits ends with it."""
    assert supervise(_launch(tmp_path, _worker(tmp_path) + "exit 0")) == (0, "")
    assert _worker_ended(tmp_path)


def test_what_a_killed_rank_leaves_in_its_own_group_ends_with_the_launch(tmp_path):
    """A rank is its own group leader (torchrun); its child (Megatron's async checkpoint process)
    outlives a SIGKILL of the rank, orphaned in the rank's group: it ends when the launch does."""
    record = f"echo $$ > {tmp_path}/pids/rank0; echo $$ >> {tmp_path}/pids/incarnations"  # as record_pid does
    rank = f"{record}; sleep 300 & echo $! > {tmp_path}/worker.pid; kill -9 $$"
    script = f"mkdir -p {tmp_path}/pids; setsid sh -c '{rank}'; sleep 0.5; exit 1"
    assert supervise(_launch(tmp_path, script))[0] == 1
    assert _worker_ended(tmp_path)


def test_what_an_earlier_incarnation_of_a_restarted_rank_leaves_ends_with_the_launch(tmp_path):
    """A rank killed and restarted (launcher.max_restarts): its first incarnation's child sits in the
    first pid's group, while pids/rank0 holds the second's pid; the incarnations file reaches it
    (seen: Megatron's async-checkpoint process of the killed rank of test_moe's kill-and-restart test)."""
    record = f"echo $$ > {tmp_path}/pids/rank0; echo $$ >> {tmp_path}/pids/incarnations"
    first = f"{record}; sleep 300 & echo $! > {tmp_path}/worker.pid; kill -9 $$"
    script = f"mkdir -p {tmp_path}/pids; setsid sh -c '{first}'; sleep 0.5; setsid sh -c '{record}'; exit 1"
    assert supervise(_launch(tmp_path, script))[0] == 1
    assert _worker_ended(tmp_path)


def test_a_rank_records_its_pid_now_and_among_every_incarnation(tmp_path):
    from parabench.launchers import record_pid

    record_pid(tmp_path, 1)
    record_pid(tmp_path, 1)  # restarted (the same pid here: the format is what matters)
    assert (tmp_path / "pids" / "rank1").read_text() == str(os.getpid())
    assert (tmp_path / "pids" / "incarnations").read_text() == f"{os.getpid()}\n" * 2


def test_a_failed_launch_names_its_launcher_and_exit_code(tmp_path):
    assert supervise(_launch(tmp_path, "echo broken; exit 3")) == (3, "a worker failed (torchrun exit code 3)")
    assert (tmp_path / "logs" / "launcher.log").read_text() == "broken\n"


def test_a_tool_runs_through_the_same_supervisor_without_the_tracking_credentials(tmp_path, monkeypatch):
    """Launch.program (DeepSpeed's ds_to_universal in bench convert): one process, its command and
    output under the folder given, its exit code returned, MLflow's login not in its environment."""
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "tool-must-not-see")
    script = "import os, sys; print(os.environ.get('MLFLOW_TRACKING_PASSWORD')); sys.exit(3)"
    rc, _ = supervise(Launch.program([sys.executable, "-c", script], tmp_path))
    assert rc == 3
    assert (tmp_path / "logs" / "launcher.log").read_text() == "None\n"
    assert (tmp_path / "command.txt").read_text().startswith(sys.executable)
    limited = Launch.program(["sh", "-c", _worker(tmp_path) + "wait"], tmp_path / "slow", timeout_s=1.0)
    assert supervise(limited)[1] == "not finished after 1 s (launcher.setup_timeout_s): killed"
    assert _worker_ended(tmp_path)


def test_a_stop_signal_is_raised_between_polls_after_the_graceful_stop_and_the_group_is_killed(tmp_path):
    """SIGTERM arrives inside the command's poll (as amid a live MLflow write): the poll finishes, the
    graceful stop gets its grace period while the workers run, the group is killed, the signal handlers
    are restored, and the command sees Interrupted."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    events = []

    def poll() -> int | None:
        if not events:
            os.kill(os.getpid(), signal.SIGTERM)
            events.append("poll finished")
        return None

    def on_stop() -> float:
        events.append(("on_stop", alive(_worker_pid(tmp_path))))
        return 0.2

    with pytest.raises(Interrupted) as raised:
        supervise(_launch(tmp_path, _worker(tmp_path) + "wait", poll=poll, on_stop=on_stop))
    assert raised.value.signum == signal.SIGTERM
    assert events == ["poll finished", ("on_stop", True)]
    assert _worker_ended(tmp_path)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


SLOW_COMM = ["launcher.nproc_per_node=2", "comm.ops=[all_reduce]", "comm.min_bytes=1K", "comm.max_bytes=1K"]
SLOW_COMM += ["comm.warmup_iters=1", "comm.iters=1000000000", "tracking.enabled=false"]


def _run_dir(results: Path, marker: str, timeout: float = 300) -> Path:
    deadline = time.monotonic() + timeout
    while not list(results.glob(f"runs/*/*/*/{marker}")):
        assert time.monotonic() < deadline, f"no {marker} under {results}"
        time.sleep(0.2)
    (found,) = results.glob(f"runs/*/*/*/{marker}")
    return found.parent


def _no_orphans(where: Path) -> list[int]:
    """The processes still running from ``where`` (killed here, so a failing test leaves none)."""
    deadline = time.monotonic() + 30
    while alive_with(str(where)) and time.monotonic() < deadline:
        time.sleep(0.5)
    orphans = alive_with(str(where))
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    return orphans


@pytest.mark.full
def test_a_comm_launch_that_does_not_finish_is_killed_by_the_watchdog(results):
    """bench comm waited on its launcher with a timeout but had no signal handling and no shared
    watchdog; a launch that runs past launcher.setup_timeout_s is killed, with the reason, and no
    rank trains on."""
    proc = bench(["comm", *SLOW_COMM, "launcher.setup_timeout_s=30", f"run.results_dir={results}"], results)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "not finished after 30 s (launcher.setup_timeout_s): killed" in proc.stderr, proc.stderr[-3000:]
    run_dir = _run_dir(results, "comm.json")
    assert (run_dir / "logs" / "rank1.log").exists()  # the ranks had started
    assert _no_orphans(run_dir) == []


def _comm_running(results: Path) -> tuple[subprocess.Popen, Path, list[int]]:
    """`bench comm` in the background until its launcher and its two ranks run: it, its run dir, their pids."""
    cmd = [sys.executable, "-m", "parabench", "comm", *SLOW_COMM, f"run.results_dir={results}"]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run_dir = _run_dir(results, "comm.json")
    deadline = time.monotonic() + 300
    while len(alive_with(str(run_dir))) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    return proc, run_dir, alive_with(str(run_dir))


@pytest.mark.full
def test_sigterm_to_bench_comm_stops_its_workers(results):
    proc, run_dir, started = _comm_running(results)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    orphans = _no_orphans(run_dir)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "bench comm: interrupted by SIGTERM: workers stopped" in err, err[-3000:]
    assert orphans == [], f"bench comm's workers run on after SIGTERM: {orphans} (started: {started})"


@pytest.mark.full
def test_a_killed_comm_launcher_takes_its_workers_with_it(results):
    """kill -9 of the launcher (the OOM killer, a node agent): its comm ranks end at once (stop_with_launcher),
    where they had gone on measuring, and bench comm reports the failure."""
    proc, run_dir, _ = _comm_running(results)
    ranks = _rank_pids(run_dir, 2)
    (launcher,) = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in ranks}
    assert "parabench.localrun" in Path(f"/proc/{launcher}/cmdline").read_text()  # one node: forked ranks
    os.kill(launcher, signal.SIGKILL)
    _, err = proc.communicate(timeout=90)
    orphans = _no_orphans(run_dir)
    assert orphans == [], f"comm ranks run on after kill -9 of their launcher: {orphans}"
    assert proc.returncode == 1 and "a worker failed (localrun exit code -9)" in err, err[-3000:]


def _rank_pids(run_dir: Path, world: int) -> list[int]:
    """The pids the ranks recorded (parabench.launchers.record_pid), once all ``world`` have."""
    deadline = time.monotonic() + 120
    while len(found := sorted((run_dir / "pids").glob("rank*"))) < world:
        assert time.monotonic() < deadline, f"{len(found)} of {world} ranks recorded their pid"
        time.sleep(0.2)
    return [int(p.read_text()) for p in found]


@pytest.mark.full
def test_a_convert_launch_that_does_not_finish_is_killed_by_the_watchdog(tmp_path):
    """bench convert ran its launcher with a timeout that killed torchrun alone, its ranks orphaned."""
    from test_convert import TINY, _tiny_hf

    hf, out = _tiny_hf(tmp_path / "hf"), tmp_path / "ddp"
    args = ["convert", str(hf), "--to", "ddp", "--out", str(out), *TINY[-2:], "launcher.setup_timeout_s=1"]
    proc = bench(args, tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "import on ddp failed (not finished after 1 s (launcher.setup_timeout_s): killed)" in proc.stderr
    assert _no_orphans(out) == []


def test_workers_never_inherit_the_tracking_servers_credentials():
    """Only `bench` talks to MLflow: the launcher and its workers start without the password or token
    this shell holds (issue 33, item 7); the job's own environment and the rest of the shell's stay."""
    from parabench.launchers import Msrun

    here = {"PATH": "/usr/bin", "MLFLOW_TRACKING_PASSWORD": "pw", "MLFLOW_TRACKING_TOKEN": "tok", "HOME": "/h"}
    for launcher in (Torchrun, Msrun):
        env = launcher.process_env({"PYTHONUNBUFFERED": "1"}, here)
        assert "MLFLOW_TRACKING_PASSWORD" not in env and "MLFLOW_TRACKING_TOKEN" not in env, launcher.name
        assert env["HOME"] == "/h" and env["PYTHONUNBUFFERED"] == "1"
