"""PY913: FP8 dtypes in training code (docs/sources.md#class-m-manual: FP8/torchao)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule


@register
class Fp8(PyRule):
    code = "PY913"
    name = "fp8-dtype"
    description = "torch.float8_* dtypes: FP8 matmul is not available on this NPU generation (reported)"
    safety = MANUAL
    source = "docs/sources.md#class-m-manual"

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value.startswith("float8_") and any(q.startswith("torch.float8_") for q in self.ctx.qnames(node)):
            self.manual(node, f"torch.{node.attr.value}", op=f"torch.{node.attr.value}", tip="train in bf16 on NPU")
