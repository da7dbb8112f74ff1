"""PY102: `.cuda()` on tensors and modules -> `.npu()` (docs/sources.md#class-a-safe)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import SAFE
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule


@register
class TensorCudaMethod(PyRule):
    code = "PY102"
    name = "cuda-method"
    description = "x.cuda(...) -> x.npu(...) for tensors and modules (not for imported modules such as numba.cuda)"
    safety = SAFE
    source = "docs/sources.md#class-a-safe, docs/sources.md#transfer-to-npu"

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if not isinstance(func, cst.Attribute) or func.attr.value != "cuda":
            return
        if isinstance(func.value, (cst.Name, cst.Attribute)) and self.ctx.is_import(func.value):
            return  # torch.cuda / numba.cuda / cupy.cuda: a module, not a tensor
        if isinstance(func.value, cst.Name) and func.value.value in ("self", "cls") and self._own_cuda(node):
            return  # the class defines cuda() itself: self.cuda() is that method (issue #13, class 5)
        self.change(func, lambda n: n.with_changes(attr=cst.Name("npu")), ".cuda() -> .npu()", op="Tensor.cuda")

    def _own_cuda(self, node: cst.CSTNode) -> bool:
        """Does the class around ``node`` define a method named cuda?"""
        p = self.ctx.parent(node)
        while p is not None and not isinstance(p, cst.ClassDef):
            p = self.ctx.parent(p)
        body = p.body.body if p is not None and isinstance(p.body, cst.IndentedBlock) else ()
        return any(isinstance(s, cst.FunctionDef) and s.name.value == "cuda" for s in body)
