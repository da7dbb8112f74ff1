"""Rule base classes and the registry.

A rule has a code, a name, a one-line description, a safety level (safe / review / manual), the
file kind it applies to, and the targets/modes it runs for. Python rules are LibCST batchable
visitors that record edits keyed by original node; text rules record span edits on the original
text. Neither ever executes or imports the code being migrated.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import ClassVar

import parabench.migrate.rules as pkg
from parabench.migrate.core import MANUAL, REVIEW, SAFE, Finding, Options

_REGISTRY: dict[str, type[Rule]] = {}


class Rule:
    code: ClassVar[str]
    name: ClassVar[str]
    description: ClassVar[str]
    safety: ClassVar[str]
    kind: ClassVar[str]
    targets: ClassVar[frozenset[str]] = frozenset({"npu", "mindspeed"})
    modes: ClassVar[frozenset[str]] = frozenset({"static"})
    source: ClassVar[str] = (
        ""  # where the mapping comes from: entries of docs/sources.md, "docs/sources.md#<anchor>, ..."
    )

    @classmethod
    def enabled(cls, options: Options) -> bool:
        return options.rule_enabled(cls.code, cls.targets, cls.modes)


def register(cls: type[Rule]) -> type[Rule]:
    if cls.code in _REGISTRY and _REGISTRY[cls.code] is not cls:
        raise ValueError(f"duplicate rule code {cls.code}: {_REGISTRY[cls.code].__name__} and {cls.__name__}")
    assert cls.safety in (SAFE, REVIEW, MANUAL), cls
    _REGISTRY[cls.code] = cls
    return cls


def all_rules() -> dict[str, type[Rule]]:
    """Import every module of this package once and return code -> rule class, sorted by code."""
    if not getattr(all_rules, "_loaded", False):
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{pkg.__name__}.{info.name}")
        all_rules._loaded = True  # type: ignore[attr-defined]
    return dict(sorted(_REGISTRY.items()))


def rules_for(kind: str, options: Options) -> list[type[Rule]]:
    return [r for r in all_rules().values() if r.kind == kind and r.enabled(options)]


# --- text rules ------------------------------------------------------------------------------


class TextDoc:
    """A non-Python file being migrated: span edits against the original text, findings."""

    def __init__(self, text: str, path: str, options: Options):
        self.text = text
        self.path = path
        self.options = options
        self.edits: list[tuple[int, int, str]] = []
        self.findings: list[Finding] = []
        self._line_starts = [0]
        for i, ch in enumerate(text):
            if ch == "\n":
                self._line_starts.append(i + 1)
        self.cache: dict[str, object] = {}

    def line_of(self, offset: int) -> int:
        import bisect

        return bisect.bisect_right(self._line_starts, offset)

    def line_span(self, lineno: int) -> tuple[int, int]:
        """Offsets of line ``lineno`` (1-based) without its newline."""
        start = self._line_starts[lineno - 1]
        end = self.text.find("\n", start)
        return start, (len(self.text) if end < 0 else end)

    def lines(self) -> list[str]:
        return self.text.split("\n")

    def _overlaps(self, start: int, end: int) -> bool:
        for s, e, _ in self.edits:
            if start < e and s < end or (start == end == s == e):
                return True
        return False

    def change(
        self, rule: type[Rule], start: int, end: int, new: str, message: str, op: str = "", tip: str = ""
    ) -> bool:
        """Replace text[start:end] with ``new``. Review rules under --safe-only are reported, not applied."""
        before = self.text[start:end]
        line = self.line_of(start)
        applied = not (rule.safety == REVIEW and self.options.safe_only)
        if applied and self._overlaps(start, end):
            return False
        if applied:
            self.edits.append((start, end, new))
        msg = message if applied else f"not applied (--safe-only): {message}"
        self.findings.append(
            Finding(rule.code, rule.safety, line, self.line_of(max(start, end - 1)), msg, op, tip, before, new, applied)
        )
        return applied

    def manual(self, rule: type[Rule], offset: int, message: str, op: str = "", tip: str = "") -> None:
        line = self.line_of(offset)
        self.findings.append(Finding(rule.code, MANUAL, line, line, message, op, tip, applied=False))

    def result(self) -> str:
        out, pos = [], 0
        for s, e, new in sorted(self.edits, key=lambda t: (t[0], t[1])):
            out.append(self.text[pos:s])
            out.append(new)
            pos = e
        out.append(self.text[pos:])
        return "".join(out)


class TextRule(Rule):
    def apply(self, doc: TextDoc) -> None:  # pragma: no cover - interface
        raise NotImplementedError


# --- Python rules ----------------------------------------------------------------------------

Edit = Callable[[object], object]


def statement_first_line(stmt, lines: list[str] | None) -> int:
    """First line of a statement: the line of its first decorator's ``@`` (the ast gives the
    decorator expression's line, a later one for ``@(`` + newline + expression), else its own."""
    decorators = getattr(stmt, "decorator_list", None)
    if not decorators:
        return stmt.lineno
    d = decorators[0]
    if lines is not None:
        for k in range(d.lineno, max(0, d.lineno - 20), -1):
            text = lines[k - 1] if k != d.lineno else lines[k - 1].encode()[: d.col_offset].decode("utf-8", "ignore")
            if text.lstrip().startswith("@"):
                return k
    return d.lineno
