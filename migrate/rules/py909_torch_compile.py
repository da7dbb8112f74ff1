"""PY909: torch.compile has no CUDA inductor on NPU (docs/sources.md#class-m-manual)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule


@register
class TorchCompile(PyRule):
    code = "PY909"
    name = "torch-compile"
    description = "torch.compile(...) / @torch.compile: Inductor's CUDA/Triton backend does not exist on NPU (reported)"
    safety = MANUAL
    source = "docs/sources.md#class-m-manual"

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value == "compile" and "torch.compile" in self.ctx.qnames(node):
            self.manual(
                node,
                "torch.compile",
                op="torch.compile",
                tip="run eager, or compile with torchair's NPU backend (backend=torchair.get_npu_backend())",
            )

    def visit_Name(self, node: cst.Name) -> None:
        # a bare name resolves to torch.compile only through an import of it (PyContext.qnames):
        # test that first, not every name of the file
        if (
            "torch.compile" in self.ctx._imports.get(node.value, ())
            and "torch.compile" in self.ctx.qnames(node)
            and not isinstance(self.ctx.parent(node), cst.ImportAlias)
        ):
            self.manual(
                node,
                "torch.compile",
                op="torch.compile",
                tip="run eager, or compile with torchair's NPU backend (backend=torchair.get_npu_backend())",
            )
