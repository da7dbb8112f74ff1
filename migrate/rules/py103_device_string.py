"""PY103: 'cuda' device strings in device roles -> 'npu' (docs/sources.md#class-a-safe).

Device roles: device=/device_type=/map_location= keywords, torch.device(...), .to(...), autocast /
GradScaler / init_device_mesh first argument, parameters and variables named *device*, and
comparisons whose other side is a device (`device.type == 'cuda'`, `'cuda' in device`): the test
must move together with the value or NPU silently takes the CPU branch (pattern 1).
"""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import SAFE
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import (
    DEVICE_RE,
    FORMAT_SPEC_RE,
    PyRule,
    fstring_device,
    fstring_to_npu,
    replace_in_simple_string,
    string_role,
    string_value,
)
from parabench.migrate.rules.py130_accepted_values import kept_in_python

ROLES = frozenset({"device", "compare-device"})


@register
class DeviceString(PyRule):
    code = "PY103"
    name = "device-string"
    description = "'cuda' / 'cuda:N' / f'cuda:{i}' naming a device (device arguments, torch.device, .to, device variables and device comparisons) -> 'npu'"
    safety = SAFE
    source = "docs/sources.md#class-a-safe, docs/sources.md#transfer-to-npu, docs/sources.md#pattern-1, docs/sources.md#pattern-2, docs/sources.md#pattern-12"

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        value = string_value(node)
        if value is None or "cuda" not in node.value:
            return
        if not DEVICE_RE.match(value) and not FORMAT_SPEC_RE.match(value):  # "cuda:{}".format(i): _role_holder
            return
        if _dispatch_with_generic_else(self.ctx, node) or _expectation_of_kept_input(self.ctx, node):
            return
        if string_role(self.ctx, node) in ROLES and not kept_in_python(self, node, value, value.replace("cuda", "npu")):
            self.change(
                node,
                lambda n: replace_in_simple_string(n, "cuda", "npu"),
                f"device '{value}' -> '{value.replace('cuda', 'npu')}'",
                op=value,
            )

    def visit_FormattedString(self, node: cst.FormattedString) -> None:
        if fstring_device(node) and string_role(self.ctx, node) in ROLES:
            self.change(node, fstring_to_npu, "device f'cuda:{...}' -> f'npu:{...}'", op="f'cuda:{...}'")


def _dispatch_with_generic_else(ctx, node: cst.SimpleString) -> bool:
    """``if device_type == "cuda": <CUDA's own API> else: <API built from device_type>``: the else
    side already serves any other device (``getattr(torch, f"is_autocast_{device_type}_enabled")``),
    the NPU included; rewritten, the NPU would take CUDA's branch (issue #29)."""
    target = ctx.parent(node)
    comparison = ctx.parent(target) if isinstance(target, cst.ComparisonTarget) else None
    if not isinstance(comparison, cst.Comparison) or not isinstance(comparison.comparisons[0].operator, cst.Equal):
        return False
    if not isinstance(comparison.left, cst.Name) or len(comparison.comparisons) != 1:
        return False
    stmt = ctx.parent(comparison)
    if not isinstance(stmt, cst.If) or stmt.test is not comparison or not isinstance(stmt.orelse, cst.Else):
        return False
    name = comparison.left.value
    return any(ctx.parent(use) is not None and _inside(ctx, use, stmt.orelse) for use in ctx.names.get(name, ()))


def _inside(ctx, node: cst.CSTNode, root: cst.CSTNode) -> bool:
    while node is not None and node is not root:
        node = ctx.parent(node)
    return node is root


def _expectation_of_kept_input(ctx, node: cst.SimpleString) -> bool:
    """``assert model.device.type == "cuda"`` in a test that sets the device itself with a "cuda"
    that stays (``monkeypatch.setattr(mod, "DEVICE", "cuda")``): the expectation follows the input,
    or the test fails on any machine (issue #29)."""
    stmt = ctx.parent(ctx.parent(node))
    while stmt is not None and not isinstance(stmt, (cst.Assert, cst.SimpleStatementLine)):
        stmt = ctx.parent(stmt)
    if not isinstance(stmt, cst.Assert):
        return False
    fn = stmt
    while fn is not None and not isinstance(fn, cst.FunctionDef):
        fn = ctx.parent(fn)
    if fn is None or not fn.name.value.startswith("test"):
        return False
    for other in ctx.order:
        if isinstance(other, cst.SimpleString) and other is not node and _inside(ctx, other, fn):
            value = string_value(other) or ""
            if DEVICE_RE.match(value) and "cuda" in value and string_role(ctx, other) not in ROLES:
                return True
    return False
