"""PY107: `x.is_cuda` -> `x.is_npu` (docs/sources.md#class-s-review)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule


@register
class IsCuda(PyRule):
    code = "PY107"
    name = "is-cuda"
    description = "tensor.is_cuda -> tensor.is_npu (check the branch it guards still makes sense)"
    safety = REVIEW
    source = "docs/sources.md#class-s-review, docs/sources.md#transfer-to-npu"

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value != "is_cuda":
            return
        if isinstance(node.value, (cst.Name, cst.Attribute)) and self.ctx.is_import(node.value):
            return
        self.change(node, lambda n: n.with_changes(attr=cst.Name("is_npu")), ".is_cuda -> .is_npu", op="Tensor.is_cuda")
