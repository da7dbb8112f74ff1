"""The test tiers' rules (tests/tiers.py), checked on small test files run by a separate pytest: an
unmarked test that starts workers fails, `full` tests run only with --full, and under CI=true a skip
fails unless it names hardware."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from tiers import starts_processes

HERE = Path(__file__).resolve().parent

# A command line the guard counts as starting workers, which runs nothing heavy when it is allowed.
FAKE_TORCHRUN = '["sh", "-c", "true torchrun --nproc-per-node 2 train.py"]'


@pytest.mark.parametrize(
    ("argv", "what"),
    [
        ([sys.executable, "-m", "parabench", "run", "+model=llama"], "bench run"),
        (["/venv/bin/bench", "comm", "launcher.nproc_per_node=2"], "bench comm"),
        ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "x.py"], "torch.distributed.run"),
        (["/usr/local/bin/msrun", "--worker_num=2"], "msrun"),
        (["runuser", "-u", "pg", "--", "/usr/lib/postgresql/15/bin/pg_ctl", "start"], "pg_ctl"),
        (["unshare", "--mount", "sh", "-c", "mount x && { python -m parabench run +model=llama; }"], "bench run"),
        ([sys.executable, "-m", "mlflow", "server", "--port", "5000"], "mlflow"),
        ("chromium --headless --dump-dom file:///x", "chromium"),
        ([sys.executable, "-m", "parabench", "run", "+model=llama", "--cfg", "job"], None),
        ([sys.executable, "-m", "parabench", "run", "launcher.dry_run=true"], None),
        ([sys.executable, "-m", "parabench", "plan", "+model=llama"], None),
        ([sys.executable, "-c", "import parabench"], None),
        (["git", "commit", "-qm", "x"], None),
    ],
)
def test_what_needs_a_tier_marker(argv, what):
    assert starts_processes(argv) == what


def _project(pytester: pytest.Pytester, body: str) -> None:
    """A pytest project with this suite's conftest.py (and the modules it imports), its markers and one test module."""
    for name in ("conftest.py", "tiers.py", "run_matrix.py", "schedule.py", "benchfork.py"):
        shutil.copy(HERE / name, pytester.path / name)
    pytester.makeini("[pytest]\naddopts = --strict-markers\nmarkers =\n    e2e: x\n    full: x\n")
    pytester.makepyfile(test_sample=body)


SAMPLE = f"""
import subprocess
import pytest

def test_unit():
    assert True

def test_unmarked_starts_workers():
    subprocess.run({FAKE_TORCHRUN}, check=True)

@pytest.mark.e2e
def test_default_tier_e2e():
    subprocess.run({FAKE_TORCHRUN}, check=True)

@pytest.mark.full
def test_full_tier_only():
    subprocess.run({FAKE_TORCHRUN}, check=True)
"""


def test_unmarked_worker_test_fails_and_full_runs_only_with_the_flag(pytester: pytest.Pytester):
    _project(pytester, SAMPLE)
    default = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    default.assert_outcomes(passed=2, failed=1, deselected=1)
    default.stdout.fnmatch_lines(["*test_unmarked_starts_workers starts torchrun but carries no tier marker*"])
    full = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--full")
    full.assert_outcomes(passed=3, failed=1)


SKIPS = """
import pytest

def test_server_missing():
    pytest.skip("PostgreSQL is not installed")

def test_no_npu():
    pytest.skip("hardware: no Ascend NPU on this machine")
"""


@pytest.mark.parametrize(("ci", "outcomes"), [("true", {"failed": 1, "skipped": 1}), ("", {"skipped": 2})])
def test_under_ci_a_skip_fails_unless_it_names_hardware(pytester: pytest.Pytester, monkeypatch, ci, outcomes):
    monkeypatch.setenv("CI", ci)
    _project(pytester, SKIPS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(**outcomes)
    if ci:
        result.stdout.fnmatch_lines(["*CI=true: skipped tests fail CI*PostgreSQL is not installed*"])


def test_a_module_level_skip_fails_under_ci(pytester: pytest.Pytester, monkeypatch):
    monkeypatch.setenv("CI", "true")
    _project(pytester, 'import pytest\npytest.importorskip("no_such_module_here")\n\ndef test_x():\n    pass\n')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*CI=true: skipped tests fail CI*no_such_module_here*"])


def test_matrix_shards_hold_every_variant_once_at_its_world_size():
    import run_matrix

    placed = [(v, world) for _, world, variants in run_matrix.SHARDS for v in variants]
    assert sorted(v for v, _ in placed) == sorted([*run_matrix.VARIANTS, *run_matrix.ONE_RANK])
    assert all(world == (1 if v in run_matrix.ONE_RANK else 2) for v, world in placed)
    assert run_matrix.shards_needed({"zero3", "mindspore@1"}) == [
        ("x2-torch", 2, ["zero3"]),
        ("x1", 1, ["mindspore@1"]),
    ]


def test_a_matrix_shard_another_worker_trains_is_skipped_then_read_once_it_is_done(tmp_path, monkeypatch):
    import fcntl
    import json

    import conftest

    def no_training(*_):
        raise AssertionError("the shard was trained twice")

    monkeypatch.setattr(conftest, "_train_shard", no_training)
    shard = ("x1", 1, ["ddp@1"])
    run_dir = tmp_path / "matrix" / "x1" / "0_ddp"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"losses": [1.0]}))
    with open(tmp_path / "matrix-x1.lock", "w") as held:  # the other worker, training it
        fcntl.flock(held, fcntl.LOCK_EX)
        assert conftest._shard_runs(shard, tmp_path, wait=False) is None
        (tmp_path / "matrix-x1.json").write_text(json.dumps({"ddp@1": [str(run_dir), str(run_dir.parent)]}))
    runs = conftest._shard_runs(shard, tmp_path, wait=True)
    assert runs["ddp@1"].summary == {"losses": [1.0]} and runs["ddp@1"].results == run_dir.parent


class _Item:
    def __init__(self, nodeid: str, marker: str | None = None):
        self.nodeid, self.marker = nodeid, marker

    def get_closest_marker(self, name: str):
        return name if name == self.marker else None


def test_modules_go_to_the_workers_longest_first_and_keep_their_own_order():
    from schedule import UNMEASURED_PROCESS_TEST_S, longest_modules_first

    items = [
        _Item("tests/test_a.py::test_unit"),
        _Item("tests/test_a.py::test_unit2"),
        _Item("tests/test_b.py::test_slow"),  # measured: 100 s
        _Item("tests/test_b.py::test_unit"),
        _Item("tests/test_c.py::test_runs", "full"),  # never measured: one bench run
        _Item("tests/test_c.py::test_first_in_c"),
    ]
    measured = {"tests/test_b.py::test_slow": 100.0, "tests/test_a.py::test_unit": 2.0}
    assert UNMEASURED_PROCESS_TEST_S < 100.0
    ordered = [i.nodeid for i in longest_modules_first(items, measured, ("e2e", "full"))]
    assert ordered == [
        "tests/test_b.py::test_slow",
        "tests/test_b.py::test_unit",
        "tests/test_c.py::test_runs",
        "tests/test_c.py::test_first_in_c",
        "tests/test_a.py::test_unit",
        "tests/test_a.py::test_unit2",
    ]
