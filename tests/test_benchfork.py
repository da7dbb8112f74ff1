"""The tests' `bench` fork server (tests/benchfork.py) behaves as a fresh `python -m parabench`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import BENCHFORK, FAST, REPO, alive, bench_fork_server


def _server() -> str:
    sock = bench_fork_server()
    if sock is None:
        pytest.skip("PARABENCH_TEST_FORK=0: no fork server in this session")
    deadline = time.monotonic() + 120
    while not os.path.exists(sock):  # the server imports before it listens
        assert time.monotonic() < deadline, "the fork server did not listen within 120 s"
        time.sleep(0.2)
    return sock


def _one(forked: bool, args: list[str], cwd: Path, env: dict | None = None) -> tuple:
    front = [sys.executable, "-S", str(BENCHFORK), "run", _server()] if forked else [sys.executable]
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([*front, "-m", "parabench", *args], capture_output=True, text=True, cwd=cwd, env=full_env)
    return proc.returncode, proc.stdout, proc.stderr


def _both(args: list[str], cwd: Path, env: dict | None = None) -> tuple:
    return _one(True, args, cwd, env), _one(False, args, cwd, env)


def test_a_forked_command_prints_and_exits_as_a_fresh_interpreter(tmp_path):
    """Exit code, stdout and stderr of a refused and of a finished command, in the client's directory."""
    refused_forked, refused_direct = _both(["compare", "no-such-dir"], cwd=tmp_path)
    assert refused_forked == refused_direct and refused_forked[0] == 2, refused_forked
    for forked in (True, False):  # run dirs are named by the second: one experiment each
        args = [
            "run",
            "+model=llama",
            "launcher.dry_run=true",
            "run.results_dir=x",
            f"tracking.experiment=forked-{forked}",
        ]
        code, out, err = _one(forked, args, tmp_path)
        assert code == 0 and "launch bundle written" in out, err
    for forked in ("forked-True", "forked-False"):  # relative to the client's directory
        assert len(list((tmp_path / "x" / "runs" / forked).glob("*/*/launch.sh"))) == 1, forked


def test_an_interpreter_setting_the_fork_cannot_apply_starts_a_fresh_interpreter(tmp_path):
    """PYTHONPATH differs from the server's: the client runs the command itself (site ran: marker)."""
    (tmp_path / "sitecustomize.py").write_text(f"open({str(tmp_path / 'fresh')!r}, 'w').close()\n")
    forked, _ = _both(["compare", "no-such-dir"], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert forked[0] == 2 and (tmp_path / "fresh").exists()


@pytest.mark.e2e
def test_sigterm_reaches_the_forked_run_and_a_killed_client_takes_it_along(tmp_path):
    """SIGTERM to the client ends the run as SIGTERM to a fresh bench does (the same exit status and
    files); SIGKILL to the client kills the forked bench it stands for."""
    sock = _server()
    args = ["run", *FAST, "run.steps=2000", "launcher.nproc_per_node=1", "tracking.enabled=false"]

    def start(results: Path, forked: bool) -> tuple[subprocess.Popen, int]:
        front = [sys.executable, "-S", str(BENCHFORK), "run", sock] if forked else [sys.executable]
        cmd = [*front, "-m", "parabench", *args, f"run.results_dir={results}"]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not list(results.glob("runs/*/*/*/steps.jsonl")):  # training has started
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            time.sleep(0.2)
        if not forked:
            return proc, proc.pid
        (bench_pid,) = _children_of_server(sock)
        return proc, bench_pid

    ended = {}
    for forked in (True, False):
        results = tmp_path / f"term-{forked}"
        proc, _ = start(results, forked)
        proc.send_signal(signal.SIGTERM)
        code, last_line = proc.wait(timeout=120), proc.stderr.read().splitlines()[-1:]
        ended[forked] = (code, last_line, sorted(p.name for p in results.glob("runs/*/*/*/*")))
    assert ended[True] == ended[False], ended
    proc, bench_pid = start(tmp_path / "kill", forked=True)
    proc.kill()
    deadline = time.monotonic() + 30
    while alive(bench_pid):
        assert time.monotonic() < deadline, "the forked bench outlived its client"
        time.sleep(0.2)


def _children_of_server(sock: str) -> list[int]:
    """Pids of the commands the server forked (grandchildren: server -> handler -> command; the forks
    keep the server's command line, so the server is the one this test process started)."""
    server = [p for p in _pids() if _ppid(p) == os.getpid() and _cmdline(p).endswith(f"serve {sock}")]
    handlers = [p for p in _pids() if _ppid(p) in server]
    return [p for p in _pids() if _ppid(p) in handlers]


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return -1
