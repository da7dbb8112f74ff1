"""PY904: code comparing the backend with 'nccl' (staging devices, timeouts) must be edited by hand (docs/sources.md#transfer-to-npu-limits)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, string_role, string_value

QNS = frozenset({"torch.distributed.Backend.NCCL", "torch.distributed.distributed_c10d.Backend.NCCL"})
TIP = "decide what the branch means on NPU: usually `backend in ('nccl', 'hccl')`; transfer_to_npu does not rewrite comparisons"


@register
class NcclBackendCheck(PyRule):
    code = "PY904"
    name = "nccl-backend-check"
    description = "`backend == 'nccl'` / Backend.NCCL checks: reported, the branch is wrong on hccl"
    safety = MANUAL
    source = "docs/sources.md#transfer-to-npu-limits, docs/sources.md#class-m-manual, docs/sources.md#pattern-3"

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        if string_value(node) == "nccl" and string_role(self.ctx, node).startswith("compare"):
            self.manual(node, "comparison with 'nccl'", op="backend == 'nccl'", tip=TIP)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value == "NCCL" and self.ctx.qnames(node) & QNS:
            self.manual(node, "Backend.NCCL used", op="torch.distributed.Backend.NCCL", tip=TIP)
