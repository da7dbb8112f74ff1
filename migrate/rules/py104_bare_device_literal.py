"""PY104: other 'cuda' literals that name a device (defaults, choices, return values) -> 'npu', flagged (docs/sources.md#class-s-review).

Never touched: docstrings, log/print/exception messages, subscript and dict keys (checkpoint keys,
PyTorch's device->backend map: pattern 4), getattr names, Lightning `accelerator=` (PY912).
"""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import (
    DEVICE_RE,
    PyRule,
    fstring_device,
    fstring_to_npu,
    replace_in_simple_string,
    string_role,
    string_value,
)

ROLES = frozenset({"other", "arg", "compare", "backend-other"})


@register
class BareDeviceLiteral(PyRule):
    code = "PY104"
    name = "bare-device-literal"
    description = "'cuda' literal outside a known device role (argparse defaults/choices, returns, plain comparisons) -> 'npu', for review"
    safety = REVIEW
    source = "docs/sources.md#class-s-review, docs/sources.md#pattern-2, docs/sources.md#pattern-4, docs/sources.md#pattern-11, docs/sources.md#pattern-13"

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        value = string_value(node)
        if value is None or not DEVICE_RE.match(value) or "cuda" not in node.value:
            return
        role = string_role(self.ctx, node)
        if role in ROLES:
            self.change(
                node,
                lambda n: replace_in_simple_string(n, "cuda", "npu"),
                f"'{value}' ({role}) -> '{value.replace('cuda', 'npu')}'",
                op=value,
                tip="check this string names a device (user-facing choices change too)",
            )

    def visit_FormattedString(self, node: cst.FormattedString) -> None:
        if fstring_device(node) and string_role(self.ctx, node) in ROLES:
            self.change(node, fstring_to_npu, "f'cuda:{...}' -> f'npu:{...}'", op="f'cuda:{...}'")
