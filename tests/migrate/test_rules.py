"""Fixture tests for every `bench migrate` rule.

tests/migrate/fixtures/rules/<CODE>/: before.<ext> (input), after.<ext> (expected output with only
this rule selected; absent = no change expected), unchanged.<ext> (must-not-change), expected.txt
(one line per finding: line, rule, safety, applied|manual), options.txt (target=/mode=).
Every fixture is also checked for idempotence (rerun on the output changes nothing) and, for
Python, that the output compiles. BENCH_MIGRATE_REGEN=1 rewrites after/expected files.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import SOURCE_CITATION, source_anchors
from parabench.migrate.core import Options
from parabench.migrate.engine import classify, migrate_text, run
from parabench.migrate.rules._base import all_rules

FIXTURES = Path(__file__).parent / "fixtures" / "rules"
KINDS = {".py": "python", ".sh": "shell", ".json": "json", ".yaml": "yaml", ".txt": "requirements", ".cu": "cuda"}
REGEN = os.environ.get("BENCH_MIGRATE_REGEN") == "1"


def _options(code: str, directory: Path, **extra) -> Options:
    kw: dict = {"select": frozenset({code})}
    opt_file = directory / "options.txt"
    if opt_file.exists():
        for line in opt_file.read_text().split():
            k, v = line.split("=", 1)
            kw[k] = frozenset(v.split(",")) if k == "select" else v
    kw.update(extra)
    return Options(**kw)


def _file(directory: Path, stem: str) -> Path | None:
    found = [p for p in directory.iterdir() if p.stem == stem and p.suffix in KINDS]
    return found[0] if found else None


def _describe(findings) -> str:
    return "".join(f"{f.line} {f.rule} {f.safety} {'applied' if f.applied else 'manual'}\n" for f in findings)


CODES = sorted(all_rules())


def test_every_rule_has_fixtures_and_metadata():
    dirs = {p.name for p in FIXTURES.iterdir() if p.is_dir()}
    assert set(CODES) <= dirs, f"rules without fixtures: {sorted(set(CODES) - dirs)}"
    anchors = source_anchors()
    for code, rule in all_rules().items():
        assert rule.description and rule.name and rule.safety in ("safe", "review", "manual"), code
        cited = SOURCE_CITATION.findall(rule.source)
        assert cited, f"{code}: source must cite entries of docs/sources.md, got {rule.source!r}"
        assert set(cited) <= anchors, f"{code}: no such entry in docs/sources.md: {sorted(set(cited) - anchors)}"
        rest = SOURCE_CITATION.sub("", rule.source).replace(",", "").strip()
        assert not rest, f"{code}: source holds citations only (docs/sources.md#<anchor>, ...), got {rest!r}"


@pytest.mark.parametrize("code", CODES)
def test_rule_fixture(code: str):
    directory = FIXTURES / code
    before_path = _file(directory, "before")
    assert before_path is not None, f"{code}: before.* missing"
    kind = KINDS[before_path.suffix]
    rule = all_rules()[code]
    assert rule.kind == kind, f"{code}: fixture kind {kind} != rule kind {rule.kind}"
    options = _options(code, directory)
    before = before_path.read_text()
    new, findings, reason = migrate_text(kind, before, before_path.name, options)
    assert not reason, reason
    after_path = directory / f"after{before_path.suffix}"
    expected_path = directory / "expected.txt"
    if REGEN:
        if new != before:
            after_path.write_text(new)
        elif after_path.exists():
            after_path.unlink()
        expected_path.write_text(_describe(findings))
    expected_after = after_path.read_text() if after_path.exists() else before
    assert new == expected_after
    assert _describe(findings) == expected_path.read_text()
    mine = [f for f in findings if f.rule == code]
    assert mine, f"{code}: the fixture must trigger the rule"
    if rule.safety == "manual":
        assert new == before and all(not f.applied for f in mine)
    else:
        assert new != before and any(f.applied for f in mine)
    # idempotence: the migrated text has nothing left for this rule to change
    again, findings2, reason2 = migrate_text(kind, new, before_path.name, options)
    assert not reason2 and again == new
    assert not [f for f in findings2 if f.applied]
    if kind == "python":
        compile(new, str(after_path), "exec", dont_inherit=True)


def _cuda_rule_ignores_host_code(code: str, directory: Path) -> None:
    """A .cu/.cuh rule fires on the file type alone; its must-not-change fixture is C++ host code
    of the extension (unchanged.cpp): migrated as in a tree, it gets no finding of the rule."""
    (path,) = directory.glob("unchanged.*")
    assert classify(path) != "cuda" and classify(path.with_suffix(".cuh")) == "cuda"
    result = run([path], Options(), None, jobs=1, progress=False)
    assert [r.path for r in result.files] == [path.name]
    assert not [f for f in result.findings if f.rule == code], f"{code} fired on host code {path.name}"


@pytest.mark.parametrize("code", CODES)
def test_rule_must_not_change(code: str):
    directory = FIXTURES / code
    if all_rules()[code].kind == "cuda":
        _cuda_rule_ignores_host_code(code, directory)
        return
    path = _file(directory, "unchanged")
    assert path is not None, f"{code}: unchanged.* (must-not-change fixture) missing"
    text = path.read_text()
    kind = KINDS[path.suffix]
    alone = _options(code, directory)
    new, _findings, reason = migrate_text(kind, text, path.name, alone)
    assert not reason
    assert new == text, f"{code} changed its must-not-change fixture"
    # with every rule enabled (as users run it), this rule must not fire at all
    full = Options(target=alone.target, mode=alone.mode)
    _new, findings, reason = migrate_text(kind, text, path.name, full)
    assert not reason
    mine = [f for f in findings if f.rule == code]
    assert not mine, f"{code} fired on its must-not-change fixture: {mine}"


@pytest.mark.parametrize("code", [c for c in CODES if all_rules()[c].safety == "review"])
def test_safe_only_reports_review_rules_instead_of_applying(code: str):
    directory = FIXTURES / code
    before_path = _file(directory, "before")
    kind = KINDS[before_path.suffix]
    before = before_path.read_text()
    new, findings, _ = migrate_text(kind, before, before_path.name, _options(code, directory, safe_only=True))
    assert new == before
    mine = [f for f in findings if f.rule == code]
    assert mine and all(not f.applied and f.message.startswith("not applied (--safe-only)") for f in mine)
