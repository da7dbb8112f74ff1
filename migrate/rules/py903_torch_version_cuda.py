"""PY903: torch.version.cuda gates (bf16 support, kernels) are None on NPU (docs/sources.md#class-m-manual)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule


@register
class TorchVersionCuda(PyRule):
    code = "PY903"
    name = "torch-version-cuda"
    description = "torch.version.cuda is None on NPU: code deciding bf16/kernels from it silently falls back (reported)"
    safety = MANUAL
    source = "docs/sources.md#class-m-manual, docs/sources.md#pattern-6"

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if "torch.version.cuda" in self.ctx.qnames(node):
            self.manual(
                node,
                "torch.version.cuda is None on NPU",
                op="torch.version.cuda",
                tip="decide bf16 with torch.npu.is_bf16_supported(); record torch_npu.__version__ instead",
            )
