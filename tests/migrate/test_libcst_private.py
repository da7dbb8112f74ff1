"""LibCST's private API, used in parabench.migrate.libcst_private only: pinned to the LibCST versions
it was checked on; the unvalidated parse changes nothing but the skipped validation; the code
generation agrees with LibCST's public ``code_for_node``."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import libcst as cst
import pytest

from parabench.migrate.libcst_private import CHECKED_LIBCST_VERSIONS, RECHECK, code_at, parse_module_unvalidated

MIGRATE = Path(__file__).resolve().parents[2] / "migrate"
FIXTURES = sorted((Path(__file__).parent / "fixtures" / "rules").glob("*/before.py"))


def test_installed_libcst_is_a_checked_version():
    version = metadata.version("libcst")
    assert version in CHECKED_LIBCST_VERSIONS, (
        f"libcst {version} is not among the versions parabench.migrate.libcst_private was checked on "
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


def test_code_at_is_the_statements_text_at_its_indent():
    """Column 0: exactly LibCST's public code_for_node; a statement one block down: exactly its text
    inside its parent's (what apply_rules splices in)."""
    nested = 0
    for path in FIXTURES:
        module = cst.parse_module(path.read_text())
        for stmt in module.body:
            assert code_at(module, (), stmt) == module.code_for_node(stmt), path
            block = getattr(stmt, "body", None)
            if not isinstance(block, cst.IndentedBlock):
                continue
            indent = module.default_indent if block.indent is None else block.indent
            for child in block.body:
                assert "\n" + code_at(module, (indent,), child) in "\n" + module.code_for_node(stmt), path
                nested += 1
    assert nested > 50  # the fixtures hold enough nested statements to mean something


def test_no_other_module_uses_libcst_private_api():
    """Imports of ``libcst._*`` and calls of ``._codegen`` live in libcst_private.py alone, so the
    version pin above covers every one of them."""
    import ast

    found = []
    for path in sorted(MIGRATE.rglob("*.py")):
        if path.name == "libcst_private.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            private = [n for n in names if n.startswith("libcst._")]
            if private or (isinstance(node, ast.Attribute) and node.attr == "_codegen"):
                found.append(f"{path.relative_to(MIGRATE.parent)}:{node.lineno}")
    assert not found, f"LibCST's private API outside migrate/libcst_private.py: {found}"
