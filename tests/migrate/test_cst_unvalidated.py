"""The one patch of LibCST's internals (parabench.migrate.cst_unvalidated): pinned to the LibCST
versions it was checked on, and checked to change nothing but the skipped validation."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import libcst as cst
import pytest

from parabench.migrate.cst_unvalidated import CHECKED_LIBCST_VERSIONS, RECHECK, parse_module_unvalidated

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "rules").glob("*/before.py"))


def test_installed_libcst_is_a_checked_version():
    version = metadata.version("libcst")
    assert version in CHECKED_LIBCST_VERSIONS, (
        f"libcst {version} is not among the versions parabench.migrate.cst_unvalidated was checked on "
        f"({', '.join(sorted(CHECKED_LIBCST_VERSIONS))}): re-check that {RECHECK}"
    )


def test_the_parse_skips_validation_and_nothing_else(monkeypatch):
    """The same trees as libcst.parse_module's (for every rule fixture), built without one _validate
    call (the patch still reaches the validation; an upgrade that moves it fails here)."""
    assert FIXTURES
    calls = []
    original = cst.CSTNode._validate

    def counted(self):
        calls.append(type(self).__name__)
        return original(self)

    monkeypatch.setattr(cst.CSTNode, "_validate", counted)
    for path in FIXTURES:
        text = path.read_text()
        calls.clear()
        fast = parse_module_unvalidated(text)
        assert calls == [], path
        assert fast.deep_equals(cst.parse_module(text)) and fast.code == text, path
        assert calls, path  # the ordinary parse does validate: the counter sees it


def test_validation_is_back_after_the_parse_and_after_a_failed_one():
    parse_module_unvalidated("x = 1\n")
    with pytest.raises(cst.CSTValidationError):
        cst.Name("")  # a hand-built, invalid node is refused again
    with pytest.raises(cst.ParserSyntaxError):
        parse_module_unvalidated("def (:\n")
    with pytest.raises(cst.CSTValidationError):
        cst.Name("")
