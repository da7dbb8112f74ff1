"""The order in which pytest-xdist hands whole modules to the workers: longest first.

`./dev test` distributes whole modules (``--dist loadfile``), each to the next idle worker, in the
order of the collection (``--no-loadscope-reorder``; xdist's own reorder puts the modules with the
most tests first - the migrate rule tables - and left the few-test, many-minute end-to-end modules for
last, where one worker ran them alone while the other had nothing left). Handing out the longest first
(Graham's LPT rule: Graham, "Bounds on Multiprocessing Timing Anomalies", SIAM J. Appl. Math. 17(2),
1969) keeps the finish within the longest module of the ideal split.

A module's length is the sum of its selected tests' seconds, measured (``test_seconds.json``, written
by ``benchmarks/test_seconds.py`` from a full tier's JUnit XML) or, for a test not measured yet,
estimated: a test that starts processes (tier marker) as one ``bench run``, any other as a unit test.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pytest

SECONDS_FILE = Path(__file__).with_name("test_seconds.json")
UNMEASURED_PROCESS_TEST_S = 30.0  # about one end-to-end `bench run` under two workers
UNMEASURED_UNIT_TEST_S = 0.05


def measured_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


def item_seconds(item: pytest.Item, measured: dict[str, float], tier_markers: Iterable[str]) -> float:
    if item.nodeid in measured:
        return measured[item.nodeid]
    starts_processes = any(item.get_closest_marker(m) is not None for m in tier_markers)
    return UNMEASURED_PROCESS_TEST_S if starts_processes else UNMEASURED_UNIT_TEST_S


def longest_modules_first(
    items: list[pytest.Item], measured: dict[str, float], tier_markers: Iterable[str]
) -> list[pytest.Item]:
    """``items`` with whole modules in decreasing total seconds; the tests of a module keep their
    order (its module-scoped fixtures are shared in that order). Deterministic, as xdist requires
    every worker to collect the same list."""
    markers = tuple(tier_markers)
    module_s: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        module_s[module] = module_s.get(module, 0.0) + item_seconds(item, measured, markers)
    rank = {m: i for i, m in enumerate(sorted(module_s, key=lambda m: (-module_s[m], m)))}
    return sorted(items, key=lambda item: rank[item.nodeid.split("::", 1)[0]])
