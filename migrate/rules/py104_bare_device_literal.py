"""PY104: other 'cuda' literals that provably reach a device position -> 'npu', flagged (docs/sources.md#class-s-review).

A string is rewritten by its role, not its spelling (issue #13, class 5; rules/_reach.py): an
argparse option naming a device, a variable whose use is a device argument, the return of a
device-named function without an NPU branch, a dict key looked up with a device (with its literal
lookups). Never touched: docstrings, log/print/exception messages, metric keys and other call
arguments, values stored in dicts (checkpoints), plain comparisons, getattr names, Lightning
`accelerator=` (PY912).
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
from parabench.migrate.rules._reach import key_group, reaches_device
from parabench.migrate.rules.py130_accepted_values import kept_in_python

ROLES = frozenset({"other", "arg"})
TIP = "check this string names a device (user-facing choices change too)"


@register
class BareDeviceLiteral(PyRule):
    code = "PY104"
    name = "bare-device-literal"
    description = "'cuda' literal that reaches a device position (argparse --device defaults/choices, variables used as devices, device-named functions' returns, dict keys looked up with a device) -> 'npu', for review"
    safety = REVIEW
    source = "docs/sources.md#class-s-review, docs/sources.md#pattern-2, docs/sources.md#pattern-4, docs/sources.md#pattern-11, docs/sources.md#pattern-13"

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        value = string_value(node)
        if value is None or not DEVICE_RE.match(value) or "cuda" not in node.value:
            return
        role = string_role(self.ctx, node)
        if role == "key":
            for s in key_group(self.ctx, node) or ():
                self.change(
                    s,
                    lambda n: replace_in_simple_string(n, "cuda", "npu"),
                    f"'{value}' key looked up with a device (key and literal lookups together) -> 'npu'",
                    op=value,
                    tip=TIP,
                )
            return
        why = reaches_device(self.ctx, node, role) if role in ROLES else None
        if why and not kept_in_python(self, node, value, value.replace("cuda", "npu")):
            self.change(
                node,
                lambda n: replace_in_simple_string(n, "cuda", "npu"),
                f"'{value}' ({why}) -> '{value.replace('cuda', 'npu')}'",
                op=value,
                tip=TIP,
            )

    def visit_FormattedString(self, node: cst.FormattedString) -> None:
        if not fstring_device(node):
            return
        role = string_role(self.ctx, node)
        why = reaches_device(self.ctx, node, role) if role in ROLES else None
        if why:
            self.change(node, fstring_to_npu, f"f'cuda:{{...}}' ({why}) -> f'npu:{{...}}'", op="f'cuda:{...}'")
