"""`bench smoke`: a migrated NPU script runs on the CPU, in a child process, and learns like its CPU run."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import socket
import sys
from pathlib import Path

import pytest
import torch

from parabench import redirect as rt
from parabench.migrate.smoke import main

FIXTURES = Path(__file__).parent / "fixtures" / "smoke"
SCRIPT = FIXTURES / "train_npu.py"


def _summary(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith('{"losses"')][-1])


def _smoke(capfd, *argv: str) -> tuple[int, str, str]:
    code = main(["--cwd", str(FIXTURES), *argv])
    out, err = capfd.readouterr()
    return code, out, err


def _plain_cpu_losses(monkeypatch, steps: int) -> list[float]:
    """The fixture's plain CPU run (`--device cpu`), in this process: no redirection involved."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--device", "cpu", "--steps", str(steps)])
    buf = io.StringIO()
    with torch.random.fork_rng(devices=[]), contextlib.redirect_stdout(buf):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    summary = _summary(buf.getvalue())
    assert summary["torch_npu"] is None and summary["param_device"] == "cpu"
    return summary["losses"]


def test_smoke_fp32_equals_plain_cpu_run(capfd, monkeypatch):
    code, out, err = _smoke(capfd, "--env", "MAX_STEPS=5", "--", "python", "train_npu.py")
    assert code == 0, err[-3000:]
    assert "CPU SMOKE TEST (npu emulated on CPU) - numbers are not NPU numbers" in err
    assert "[bench smoke] npu emulated on CPU" in err
    smoke = _summary(out)
    assert smoke["torch_npu"] == "0+parabench.emulated" and smoke["param_device"] == "cpu"
    assert len(smoke["losses"]) == 5  # MAX_STEPS reached the child
    assert smoke["losses"] == _plain_cpu_losses(monkeypatch, 5)
    # The emulation lived only in the child.
    assert rt.current() is None and "torch_npu" not in sys.modules and not hasattr(torch, "npu")


def test_smoke_bf16_autocast_within_one_percent(capfd, monkeypatch):
    code, out, err = _smoke(capfd, "--", "python", "train_npu.py", "--dtype", "bfloat16", "--steps", "5")
    assert code == 0, err[-3000:]
    smoke, plain = _summary(out)["losses"], _plain_cpu_losses(monkeypatch, 5)
    assert smoke != plain  # bf16 autocast really ran on the npu path
    assert all(abs(s - p) <= 0.01 * abs(p) for s, p in zip(smoke, plain, strict=True))


@pytest.mark.full
def test_smoke_torchrun_two_workers_hccl_ddp(capfd):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = _smoke(
        capfd, "--", "torchrun", "--nproc_per_node", "2", "--master_port", str(port), "train_npu.py", "--steps", "3"
    )
    assert code == 0, err[-3000:]
    assert "npu emulated on CPU (pid" in err and ", rank 0)" in err and ", rank 1)" in err
    smoke = _summary(out)
    assert smoke["world"] == 2 and smoke["backend"] == "gloo" and len(smoke["losses"]) == 3


def test_exit_status_is_the_childs(capfd):
    code, _, err = _smoke(capfd, "--", "sh", "-c", "exit 3")
    assert code == 3 and "(exit 3)" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no COMMAND"),
        (["--", "python", "missing.py"], "no such script: missing.py"),
        (["--", "torchrun", "--nproc_per_node", "2", "missing.py"], "no such script"),
        (["--env", "NOEQUALS", "--", "python", "train_npu.py"], "NAME=VALUE"),
        (["--source", "rocm", "--", "python", "train_npu.py"], "invalid choice"),
        (["--bogus", "--", "python", "train_npu.py"], "unrecognized arguments"),
        (["--", "/nonexistent/binary"], "cannot run"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capfd, argv, message):
    code = main(["--cwd", str(FIXTURES), *argv])
    out, err = capfd.readouterr()
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("bench smoke: error:")]
    assert len(errors) == 1 and message in errors[0], err


def test_bad_cwd(capfd):
    assert main(["--cwd", "/nonexistent-dir", "--", "python", "x.py"]) == 2
    assert capfd.readouterr().err.strip().startswith("bench smoke: error: --cwd")


def test_command_without_double_dash_and_help(capfd):
    assert main(["--cwd", str(FIXTURES), "sh", "-c", "exit 0"]) == 0
    capfd.readouterr()
    assert main(["--help"]) == 0
    assert "usage: bench smoke" in capfd.readouterr().out
