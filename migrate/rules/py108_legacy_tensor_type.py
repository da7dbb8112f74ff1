"""PY108: legacy torch.cuda.FloatTensor-style types -> torch.npu twins (docs/sources.md#class-s-review)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, cuda_refs


@register
class LegacyTensorType(PyRule):
    code = "PY108"
    name = "legacy-tensor-type"
    description = "torch.cuda.FloatTensor and other legacy tensor/storage types -> torch.npu.* (deprecated types: prefer torch.tensor(..., device=))"
    safety = REVIEW
    source = "docs/sources.md#class-s-review, docs/sources.md#npu-api-twins, docs/sources.md#transfer-to-npu"

    def visit_Module(self, node: cst.Module) -> None:
        for use in cuda_refs(self.ctx).direct:
            if use.category == "legacy":
                tip = "NPU has no float64 matmul kernels for many ops" if "Double" in use.path else ""
                self.change(
                    use.node,
                    lambda n: n.with_changes(attr=cst.Name("npu")),
                    f"legacy type torch.cuda.{use.path} -> torch.npu.{use.path}",
                    op=f"torch.cuda.{use.path}",
                    tip=tip,
                )
