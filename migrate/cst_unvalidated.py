"""``libcst.parse_module`` without LibCST's per-node validation: the one patch of LibCST's internals
in parabench, kept here so that a LibCST upgrade has one place to re-check.

Every node's ``__post_init__`` runs ``_validate`` (the checks that keep hand-built trees printable);
for a tree the parser made from source they cannot fail, and they cost a fifth of the parse
(libcst/_nodes/base.py, ``CSTNode.__post_init__``: "PERF: ... avoid validating the tree when parsing
a file"). LibCST has no public switch for it (``parse_module`` takes only a ``PartialParserConfig``,
none of whose fields touches validation), so the hook is replaced for the one call and put back after
it; nodes the rules build later are validated as usual. The process pool of ``bench migrate`` runs
one file at a time per process, so no other thread builds nodes meanwhile.

CHECKED_LIBCST_VERSIONS are the LibCST releases this was checked on;
tests/migrate/test_cst_unvalidated.py fails on any other, saying what to re-check (RECHECK).
"""

from __future__ import annotations

from typing import Any

CHECKED_LIBCST_VERSIONS = frozenset({"1.9.0"})
RECHECK = (
    "in libcst/_nodes/base.py, CSTNode.__post_init__ still does nothing but call self._validate(), "
    "and the parser still builds nodes through their dataclass __init__ (so __post_init__ runs); "
    "then run tests/migrate/test_cst_unvalidated.py and add the version to "
    "parabench.migrate.cst_unvalidated.CHECKED_LIBCST_VERSIONS"
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
