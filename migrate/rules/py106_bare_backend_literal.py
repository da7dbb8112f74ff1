"""PY106: other 'nccl' literals naming a backend (argparse defaults, variables) and 'cuda:nccl,cpu:gloo' -> hccl, flagged (docs/sources.md#class-s-review)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import BACKEND_COMPOUND_RE, PyRule, replace_in_simple_string, string_role, string_value
from parabench.migrate.rules.py130_accepted_values import kept_in_python

ROLES = frozenset({"backend-other", "other", "arg"})


@register
class BareBackendLiteral(PyRule):
    code = "PY106"
    name = "bare-backend-literal"
    description = "'nccl' literal outside init calls (argparse --dist-backend default, variables) and 'cuda:nccl,cpu:gloo' -> hccl, for review"
    safety = REVIEW
    source = "docs/sources.md#class-s-review, docs/sources.md#pattern-2"

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        value = string_value(node)
        if value is None:
            return
        role = string_role(self.ctx, node)
        if value == "nccl" and _names_nccl_itself(self.ctx, node):
            return
        if value == "nccl" and "nccl" in node.value and role in ROLES:
            if kept_in_python(self, node, value, "hccl"):
                return
            self.change(
                node, lambda n: replace_in_simple_string(n, "nccl", "hccl"), f"'nccl' ({role}) -> 'hccl'", op="nccl"
            )
        elif BACKEND_COMPOUND_RE.match(value) and "cuda:nccl" in node.value and role in ROLES | {"backend"}:
            if kept_in_python(self, node, value, value.replace("cuda:nccl", "npu:hccl")):
                return
            self.change(
                node,
                lambda n: replace_in_simple_string(n, "cuda:nccl", "npu:hccl"),
                f"'{value}' -> '{value.replace('cuda:nccl', 'npu:hccl')}'",
                op=value,
            )


def _names_nccl_itself(ctx, node: cst.SimpleString) -> bool:
    """``NCCL_BACKEND = 'nccl'``: a constant whose own name says it is NCCL's name, against which
    the code tells NCCL from HCCL (DeepSpeed's comm/constants.py): rewritten, HCCL would match it
    and take NCCL's branch (issue #29)."""
    parent = ctx.parent(node)
    if isinstance(parent, cst.Assign) and parent.value is node:
        names = [t.target.value for t in parent.targets if isinstance(t.target, cst.Name)]
    elif isinstance(parent, cst.AnnAssign) and parent.value is node and isinstance(parent.target, cst.Name):
        names = [parent.target.value]
    else:
        return False
    line = ctx.parent(parent)
    at_module_level = isinstance(line, cst.SimpleStatementLine) and isinstance(ctx.parent(line), cst.Module)
    return at_module_level and any("NCCL" in n.upper() for n in names)
