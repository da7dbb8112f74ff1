"""Fixtures of the defect classes of issue #13, run with every rule (as users run `bench migrate`).

tests/migrate/fixtures/defects/<class>/: before.py -> after.py (the must-change half; absent = no
change), unchanged.py (the must-not-change half: its output must equal its input), expected.txt
(findings of before.py: line, rule, safety, message), options.txt (optional, as in test_rules).
Every output also compiles, is a fixed point of a second run, and keeps guard safety
(parabench.migrate.guardcheck). BENCH_MIGRATE_REGEN=1 rewrites after/expected (review the diff).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from parabench.migrate.core import Options
from parabench.migrate.engine import migrate_text
from parabench.migrate.guardcheck import violations

FIXTURES = Path(__file__).parent / "fixtures" / "defects"
CLASSES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and (p / "before.py").exists())
REGEN = os.environ.get("BENCH_MIGRATE_REGEN") == "1"


def _options(directory: Path) -> Options:
    kw: dict = {}
    opt_file = directory / "options.txt"
    if opt_file.exists():
        for item in opt_file.read_text().split():
            k, v = item.split("=", 1)
            kw[k] = frozenset(v.split(",")) if k in ("select", "ignore") else v
    return Options(**kw)


def _describe(findings) -> str:
    return "".join(
        f"{f.line} {f.rule} {f.safety} {'applied' if f.applied else 'manual'}: {f.message}\n" for f in findings
    )


def _migrate(text: str, name: str, options: Options) -> tuple[str, list]:
    new, findings, reason = migrate_text("python", text, name, options)
    assert not reason, reason
    compile(new, name, "exec", dont_inherit=True)
    again, findings2, _ = migrate_text("python", new, name, options)
    assert again == new and not [f for f in findings2 if f.applied], "a second run changed the output"
    assert violations(text, new) == [], "a fallback became a crash"
    return new, findings


@pytest.mark.parametrize("name", CLASSES)
def test_must_change(name: str):
    d = FIXTURES / name
    before = (d / "before.py").read_text()
    new, findings = _migrate(before, "before.py", _options(d))
    if REGEN:
        (d / "after.py").write_text(new)
        (d / "expected.txt").write_text(_describe(findings))
    assert new != before, "the must-change half changed nothing"
    assert new == (d / "after.py").read_text()
    assert _describe(findings) == (d / "expected.txt").read_text()


@pytest.mark.parametrize("name", CLASSES)
def test_must_not_change(name: str):
    d = FIXTURES / name
    text = (d / "unchanged.py").read_text()
    new, _findings = _migrate(text, "unchanged.py", _options(d))
    assert new == text
