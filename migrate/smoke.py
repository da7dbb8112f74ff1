"""``bench smoke``: run a migrated (NPU) training program on this machine, npu emulated on the CPU.

    bench smoke [--cwd DIR] [--env NAME=VALUE ...] [--source npu|cuda ...] -- COMMAND ARGS...

COMMAND is ``python script.py ...``, ``torchrun ... script.py ...`` or ``script.py ...``. It runs
in a child process whose start-up installs :mod:`parabench.redirect` (see
:mod:`parabench.migrate.smoke_boot`), so the emulation exists only inside the child and each of
its Python sub-processes (every torchrun worker), never in this process. A bare ``python``/
``python3`` and ``torchrun`` are run with this interpreter (``sys.executable``,
``-m torch.distributed.run``) so that the child sees the same environment. The exit status is
the child's. It is a smoke test: it shows the migrated code path runs and learns, and its numbers
are CPU numbers.

This module imports no torch and installs nothing: the ``bench`` process stays clean and fast.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from parabench.devices import AUTOLOAD_ENV
from parabench.migrate.smoke_boot import ENV_SOURCES, SITECUSTOMIZE

EMULATION_BANNER = "CPU SMOKE TEST (npu emulated on CPU) - numbers are not NPU numbers"

_PYTHONS = {"python", "python3", f"python3.{sys.version_info.minor}"}


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]  # one line, not usage + error
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="bench smoke",
        description="Run a migrated NPU training program on the CPU, npu emulated (a smoke test, not a benchmark).",
        epilog="example: bench smoke --env MAX_STEPS=5 -- torchrun --nproc_per_node 2 train.py --device npu",
    )
    p.add_argument("--cwd", metavar="DIR", help="directory to run COMMAND in (default: the current one)")
    p.add_argument(
        "--env", "--steps-env", dest="env", action="append", default=[], metavar="NAME=VALUE",
        help="environment variable for the child, e.g. a step cap the script reads (MAX_STEPS=5); repeatable",
    )  # fmt: skip
    p.add_argument(
        "--source", action="append", choices=("npu", "cuda"),
        help="accelerator API to emulate on the CPU (default: npu; give twice for both)",
    )  # fmt: skip
    return p


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    # Without "--", the command starts at the first word that is not one of our options.
    opts, i = [], 0
    while i < len(argv) and argv[i].startswith("-"):
        opts.append(argv[i])
        if argv[i] in ("--cwd", "--env", "--steps-env", "--source") and i + 1 < len(argv):
            opts.append(argv[i + 1])
            i += 1
        i += 1
    return opts, argv[i:]


def _command(command: list[str], cwd: str) -> list[str]:
    """The child's argv: the same interpreter for python and torchrun; scripts must exist."""
    if not command:
        raise _UsageError("no COMMAND given (bench smoke [options] -- python script.py ...)")
    head, rest = command[0], command[1:]
    if os.path.basename(head) in _PYTHONS and os.sep not in head:
        argv = [sys.executable, *rest]
        script = rest[0] if rest and not rest[0].startswith("-") else None
    elif os.path.basename(head) == "torchrun" and os.sep not in head:
        argv = [sys.executable, "-m", "torch.distributed.run", *rest]
        script = next((a for a in rest if a.endswith(".py")), None)
    elif head.endswith(".py"):
        argv, script = [sys.executable, *command], head
    else:
        argv, script = list(command), None
    if script is not None and not os.path.isfile(os.path.join(cwd, script)):
        raise _UsageError(f"no such script: {script} (in {cwd})")
    return argv


def _environment(pairs: list[str], boot_dir: str, sources: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip() or not name.replace("_", "a").isalnum():
            raise _UsageError(f"--env expects NAME=VALUE, got {pair!r}")
        env[name] = value
    env["PYTHONPATH"] = os.pathsep.join([boot_dir, *filter(None, [env.get("PYTHONPATH")])])
    env[ENV_SOURCES] = ",".join(sources)
    # An installed torch_npu without CANN breaks `import torch` (docs/sources.md#device-backend-autoload).
    for key, value in AUTOLOAD_ENV.items():
        env.setdefault(key, value)
    return env


def main(argv: list[str]) -> int:
    """Entry point of ``bench smoke``; returns the child's exit status (2 for bad input)."""
    opts, command = _split_argv(list(argv))
    try:
        try:
            args = _parser().parse_args(opts)
        except SystemExit as e:  # --help: argparse printed it
            return int(e.code or 0)
        cwd = os.path.abspath(args.cwd or os.getcwd())
        if not os.path.isdir(cwd):
            raise _UsageError(f"--cwd: no such directory: {args.cwd}")
        child = _command(command, cwd)
        sources = list(dict.fromkeys(args.source or ["npu"]))
        boot_dir = tempfile.mkdtemp(prefix="parabench-smoke-")
        try:
            env = _environment(args.env, boot_dir, sources)
        except _UsageError:
            shutil.rmtree(boot_dir, ignore_errors=True)
            raise
    except _UsageError as e:
        print(f"bench smoke: error: {e}", file=sys.stderr)
        return 2

    try:
        with open(os.path.join(boot_dir, "sitecustomize.py"), "w", encoding="utf-8") as f:
            f.write(SITECUSTOMIZE)
        banner = (
            EMULATION_BANNER
            if sources == ["npu"]
            else f"CPU SMOKE TEST ({'/'.join(sources)} emulated on CPU) - numbers are not {'/'.join(sources).upper()} numbers"
        )
        print(f"==== {banner} ====", file=sys.stderr)
        print(f"bench smoke: running {' '.join(command)} (in {cwd})", file=sys.stderr, flush=True)
        proc = subprocess.Popen(child, cwd=cwd, env=env)
        try:
            code = proc.wait()
        except KeyboardInterrupt:  # the child got the same SIGINT; let it finish its shutdown
            code = proc.wait()
    except OSError as e:
        print(f"bench smoke: error: cannot run {child[0]}: {e}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(boot_dir, ignore_errors=True)
    print(f"==== {banner} (exit {code}) ====", file=sys.stderr, flush=True)
    # A child killed by a signal reports -N; shells report 128 + N.
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main(sys.argv[1:]))
