"""Every use of LibCST's private API in parabench, kept here so that a LibCST upgrade has one place
to re-check: the parse without per-node validation, and code generation through ``CodegenState``.

``parse_module_unvalidated``: every node's ``__post_init__`` runs ``_validate`` (the checks that
keep hand-built trees printable); for a tree the parser made from source they cannot fail, and they
cost a fifth of the parse (libcst/_nodes/base.py, ``CSTNode.__post_init__``: "PERF: ... avoid
validating the tree when parsing a file"). LibCST has no public switch for it (``parse_module`` takes only a ``PartialParserConfig``,
none of whose fields touches validation), so the hook is replaced for the one call and put back after
it; nodes the rules build later are validated as usual. The process pool of ``bench migrate`` runs
one file at a time per process, so no other thread builds nodes meanwhile.

``code_at`` and ``line_table``: LibCST's public ``Module.code_for_node`` generates a node at column 0
and ``PositionProvider`` costs ~7 parses; both run the code generation of ``CSTNode._codegen`` with a
``libcst._nodes.internal.CodegenState`` of their own instead.

CHECKED_LIBCST_VERSIONS are the LibCST releases this was checked on;
tests/migrate/test_libcst_private.py fails on any other, saying what to re-check (RECHECK).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import libcst as cst

CHECKED_LIBCST_VERSIONS = frozenset({"1.9.0"})
RECHECK = (
    "in libcst/_nodes/base.py, CSTNode.__post_init__ still does nothing but call self._validate(), "
    "and the parser still builds nodes through their dataclass __init__ (so __post_init__ runs); "
    "libcst._nodes.internal.CodegenState still takes default_indent and default_newline, has "
    "increase_indent, tokens, add_token and the before_codegen/after_codegen hooks, and "
    "CSTNode._codegen(state) still generates a node's code through them; "
    "then run tests/migrate/test_libcst_private.py and add the version to "
    "parabench.migrate.libcst_private.CHECKED_LIBCST_VERSIONS"
)


def parse_module_unvalidated(text: str) -> Any:
    """``libcst.parse_module(text)``, its nodes not validated (they came from the parser)."""
    import libcst as cst

    validate = cst.CSTNode.__dict__["__post_init__"]
    cst.CSTNode.__post_init__ = _unvalidated  # type: ignore[method-assign]
    try:
        return cst.parse_module(text)
    finally:
        cst.CSTNode.__post_init__ = validate  # type: ignore[method-assign]


def _unvalidated(self: object) -> None:
    return None


def code_at(module: cst.Module, indents: tuple[str, ...], node: cst.CSTNode) -> str:
    """Source of a statement nested in indented blocks (``code_for_node`` would generate it at
    column 0)."""
    from libcst._nodes.internal import CodegenState

    state = CodegenState(default_indent=module.default_indent, default_newline=module.default_newline)
    for indent in indents:
        state.increase_indent(indent)
    node._codegen(state)
    return "".join(state.tokens)


def line_table(
    node: cst.CSTNode, first_line: int = 1, module: cst.Module | None = None
) -> dict[cst.CSTNode, tuple[int, int]]:
    """(first, last) source line of every node under ``node`` (a module, or a top-level statement
    whose text starts at ``first_line``), from one code-generation pass.

    LibCST's PositionProvider computes columns and syntactic ranges too and costs ~7 parses;
    the rules only need lines. Statements start after their leading blank/comment lines."""
    module = module if module is not None else node
    state = _line_state_class()(default_indent=module.default_indent, default_newline=module.default_newline)
    state.line = first_line
    node._codegen(state)
    return state.table


@functools.cache
def _line_state_class() -> type:
    """The code-generation state of ``line_table``, made once: a class made per call (as a closure
    over the call's tables) cost its creation and left a reference cycle to collect, ~900 times on
    Megatron-Core."""
    from libcst._nodes.internal import CodegenState

    class LineState(CodegenState):
        line = 1

        def __init__(self, **fields: Any) -> None:
            super().__init__(**fields)
            self.table: dict[cst.CSTNode, tuple[int, int]] = {}
            self.starts: dict[cst.CSTNode, int] = {}

        def add_token(self, value: str) -> None:
            self.tokens.append(value)
            self.line += value.count("\n")

        def before_codegen(self, node: cst.CSTNode) -> None:
            self.starts[node] = self.line + len(getattr(node, "leading_lines", ()) or ())

        def after_codegen(self, node: cst.CSTNode) -> None:
            end = self.line
            if self.tokens and self.tokens[-1].endswith("\n"):
                end -= 1
            start = self.starts.pop(node)
            self.table[node] = (start, max(start, end))

    return LineState
