"""PY114: TF32 switches -> NPU HF32 switches (docs/sources.md#hf32-switches: allow_tf32 -> allow_hf32, not identical)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, parse_expr, torch_bound

MAP = {
    "torch.backends.cuda.matmul.allow_tf32": "torch.npu.matmul.allow_hf32",
    "torch.backends.cudnn.allow_tf32": "torch.npu.conv.allow_hf32",
}


@register
class Tf32(PyRule):
    code = "PY114"
    name = "tf32-to-hf32"
    description = "torch.backends.cuda.matmul.allow_tf32 / cudnn.allow_tf32 -> torch.npu.matmul / conv.allow_hf32 (HF32 is not TF32)"
    safety = REVIEW
    source = "docs/sources.md#hf32-switches, docs/sources.md#class-s-review"
    tip = "HF32 rounds differently from TF32: compare losses"

    def visit_Attribute(self, node: cst.Attribute) -> None:
        for q in sorted(self.ctx.qnames(node)):  # sorted: set order varies per process
            if q in MAP and torch_bound(self.ctx.module):
                new = parse_expr(MAP[q])
                self.change(node, lambda n, new=new: new, f"{q} -> {MAP[q]}", op=q, tip=self.tip)
                return
