"""The rules behind the two test tiers (wired into pytest by conftest.py).

- A test that starts worker or server processes (torchrun, msrun, a `bench run|comm|convert|smoke`
  that may launch them, an MLflow/PostgreSQL/Slurm server, a browser) carries a tier marker:
  `e2e` (default tier) or `full` (only with `--full`). Without one it fails at the first such
  process, so nothing slow drifts into the default tier unnoticed.
- Under CI=true a skipped test is a failed test, unless its reason starts with ``hardware:`` (a
  device this machine can never have): a missing PostgreSQL, Slurm, Chromium or Python package
  must fail CI, not quietly shrink it.
"""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

TIER_MARKERS = ("e2e", "full")
HARDWARE_SKIP = "hardware:"

CURRENT_ITEM = pytest.StashKey["pytest.Item | None"]()
ORIGINAL_POPEN_INIT = pytest.StashKey[object]()

# Executables that start workers or servers, wherever they stand in a command line (runuser -u
# postgres -- pg_ctl ...), and `python -m MODULE` entries that do.
PROCESS_STARTERS = {
    "torchrun", "msrun", "deepspeed", "srun", "sbatch", "salloc", "slurmctld", "slurmd", "munged",
    "mlflow", "pg_ctl", "postgres", "chromium", "chromium-browser",
}  # fmt: skip
STARTING_MODULES = {"torch.distributed.run", "parabench.localrun", "parabench.worker", "mlflow"}
# bench commands that may launch workers, and the arguments with which they launch none.
LAUNCHING_COMMANDS = {"run", "comm", "convert", "smoke"}
NO_LAUNCH = {"--cfg", "--help", "-h", "launcher.dry_run=true"}


def _words(text: str) -> list[str]:
    """A shell string's words (``sh -c "... python -m parabench run ..."`` included)."""
    try:
        return shlex.split(text)
    except ValueError:  # unbalanced quotes: plain whitespace is enough to find a program's name
        return text.split()


def _argv(args: object) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        return _words(os.fsdecode(args))
    return [word for arg in args for word in _words(os.fsdecode(arg))]  # type: ignore[union-attr]


def _bench_command(argv: list[str], i: int) -> str | None:
    """``bench CMD ...`` / ``python -m parabench CMD ...`` with CMD at index i: the command if it may
    launch workers."""
    if i < len(argv) and argv[i] in LAUNCHING_COMMANDS and not NO_LAUNCH & set(argv):
        return f"bench {argv[i]}"
    return None


def starts_processes(args: object) -> str | None:
    """What a command line starts that needs a tier marker (a name for the message), or None."""
    argv = _argv(args)
    for i, word in enumerate(argv):
        name = os.path.basename(word)
        if name in PROCESS_STARTERS:
            return name
        if name == "bench" and (found := _bench_command(argv, i + 1)):
            return found
        if word == "-m" and i + 1 < len(argv):
            module = argv[i + 1]
            if module in STARTING_MODULES:
                return module
            if module == "parabench":
                return _bench_command(argv, i + 2)
    return None


def _untiered(item: pytest.Item | None) -> bool:
    return item is not None and not any(item.get_closest_marker(m) for m in TIER_MARKERS)


def install_process_guard(config: pytest.Config) -> None:
    """Fail a test without a tier marker at the first process it starts that needs one."""
    original = subprocess.Popen.__init__

    def guarded_init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        item = config.stash.get(CURRENT_ITEM, None)
        what = starts_processes(args[0] if args else kwargs.get("args", []))
        if what and _untiered(item):
            pytest.fail(
                f"{item.nodeid} starts {what} but carries no tier marker: mark it "
                "@pytest.mark.e2e (default tier) or @pytest.mark.full (./dev test --full); see tests/tiers.py",
                pytrace=False,
            )
        original(self, *args, **kwargs)

    config.stash[ORIGINAL_POPEN_INIT] = original
    subprocess.Popen.__init__ = guarded_init  # type: ignore[method-assign]


def uninstall_process_guard(config: pytest.Config) -> None:
    original = config.stash.get(ORIGINAL_POPEN_INIT, None)
    if original is not None:
        subprocess.Popen.__init__ = original  # type: ignore[method-assign]


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)


def promote_ci_skips(report: pytest.CollectReport | pytest.TestReport) -> None:
    """Under CI=true, turn a skip into a failure unless it names hardware this machine cannot have."""
    if os.environ.get("CI") != "true" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report).removeprefix("Skipped: ")
    if reason.startswith(HARDWARE_SKIP):
        return
    report.outcome = "failed"
    report.longrepr = f"CI=true: skipped tests fail CI unless the reason starts with {HARDWARE_SKIP!r}: {reason}"
