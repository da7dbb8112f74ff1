"""PY905: nn.DataParallel is unsupported on NPU: use DDP (docs/sources.md#transfer-to-npu-limits)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule

QNS = frozenset(
    {
        "torch.nn.DataParallel",
        "torch.nn.parallel.DataParallel",
        "torch.nn.parallel.data_parallel.DataParallel",
        "torch.nn.parallel.data_parallel",
    }
)


@register
class DataParallel(PyRule):
    code = "PY905"
    name = "data-parallel"
    description = "torch.nn.DataParallel(...) calls: unsupported on NPU, use DistributedDataParallel (reported)"
    safety = MANUAL
    source = "docs/sources.md#transfer-to-npu-limits, docs/sources.md#class-m-manual, docs/sources.md#pattern-2"

    def visit_Call(self, node: cst.Call) -> None:
        if self.ctx.qnames(node.func) & QNS:
            self.manual(
                node,
                "nn.DataParallel is unsupported on NPU",
                op="torch.nn.DataParallel",
                tip="launch with torchrun and wrap in DistributedDataParallel (one process per NPU)",
            )
