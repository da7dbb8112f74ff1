"""Typed records shared by the migration engine, the rules and the report."""

from __future__ import annotations

import dataclasses

SAFE = "safe"  # meaning-preserving mechanical rewrite
REVIEW = "review"  # applied, flagged for a human look
MANUAL = "manual"  # reported with guidance, never rewritten

TARGETS = ("npu", "mindspeed")
MODES = ("static", "runtime")


@dataclasses.dataclass(frozen=True)
class FixedValues:
    """A parser's set of accepted values that the migration does not extend (an enum, computed
    choices): a value rewrite into a flag, field or key of one of ``names`` must stay in it."""

    names: frozenset[str]  # flag/field/key names as argparse derives them (rules/_values.flag_name)
    values: frozenset[str]
    where: str  # file:line of the parser
    why: str  # "choices from enum Backend", ...


@dataclasses.dataclass(frozen=True)
class Options:
    """What one migration run does (everything the CLI decides, nothing more)."""

    target: str = "npu"
    mode: str = "static"
    safe_only: bool = False
    select: frozenset[str] | None = None  # rule codes or prefixes; None = all
    ignore: frozenset[str] = frozenset()
    # found by the engine over the whole run before migrating (rules/_values.py), not by the CLI
    fixed_values: tuple[FixedValues, ...] = ()
    # --mode runtime, set per file: why it is an entry point although it has no `__main__` guard
    # (a launch script or the package metadata starts it, or it trains at top level: migrate.entries)
    entry: str = ""
    # the migrated tree's own top-level packages and modules, found by the engine: an import of
    # one of them is the project's code, never a CUDA-only package of the same name (a local `nvidia/`)
    local_packages: frozenset[str] = frozenset()

    def rule_enabled(self, code: str, targets: frozenset[str], modes: frozenset[str]) -> bool:
        if self.target not in targets or self.mode not in modes:
            return False
        if self.select is not None and not any(code.startswith(s) for s in self.select):
            return False
        return not any(code.startswith(s) for s in self.ignore)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One change (applied) or one manual item (not applied), at original line numbers."""

    rule: str
    safety: str
    line: int
    end_line: int
    message: str
    op: str = ""  # the API / construct concerned
    tip: str = ""
    before: str = ""
    after: str = ""
    applied: bool = True
    file: str = ""  # posix path relative to the source root, filled by the engine

    def with_file(self, file: str) -> Finding:
        return dataclasses.replace(self, file=file)


@dataclasses.dataclass
class FileResult:
    """Outcome for one file. ``status``: changed | unchanged | skipped | copied."""

    path: str  # relative posix path (with the source root name when several sources are given)
    kind: str
    status: str
    reason: str = ""
    findings: list[Finding] = dataclasses.field(default_factory=list)
    diff: str = ""
    full_parse: bool = False
    may_hold_cuda: bool = False  # skipped, and its bytes hold a trigger word: `--check` fails on it
    # where source lines moved in the output, when lines were added or removed: (first source line,
    # output line - source line) from that line on; empty = the same line numbers (engine.line_shifts)
    line_shifts: tuple[tuple[int, int], ...] = ()

    def output_line(self, line: int) -> int:
        """The output line that source line ``line`` became (its first line when it was replaced)."""
        shift = 0
        for first, delta in self.line_shifts:
            if first > line:
                break
            shift = delta
        return line + shift
