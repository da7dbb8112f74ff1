"""PY116: torch.distributed.is_nccl_available -> is_hccl_available (docs/sources.md#transfer-to-npu: transfer_to_npu does the same)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule

QNS = frozenset({"torch.distributed.is_nccl_available", "torch.distributed.distributed_c10d.is_nccl_available"})


@register
class IsNcclAvailable(PyRule):
    code = "PY116"
    name = "is-nccl-available"
    description = "torch.distributed.is_nccl_available() -> is_hccl_available() (added by torch_npu)"
    safety = REVIEW
    source = "docs/sources.md#transfer-to-npu"

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value == "is_nccl_available" and self.ctx.qnames(node) & QNS:
            self.change(
                node,
                lambda n: n.with_changes(attr=cst.Name("is_hccl_available")),
                "is_nccl_available -> is_hccl_available",
                op="torch.distributed.is_nccl_available",
            )

    def visit_ImportAlias(self, node: cst.ImportAlias) -> None:
        stmt = self.ctx.parent(node)
        if (
            isinstance(stmt, cst.ImportFrom)
            and isinstance(node.name, cst.Name)
            and node.name.value == "is_nccl_available"
        ):
            from parabench.migrate.rules._py import dotted

            if dotted(stmt.module) in ("torch.distributed", "torch.distributed.distributed_c10d"):
                self.change(
                    node,
                    lambda n: n.with_changes(
                        name=cst.Name("is_hccl_available"),
                        asname=n.asname or cst.AsName(name=cst.Name("is_nccl_available")),
                    ),
                    "import is_nccl_available -> is_hccl_available as is_nccl_available",
                    op="torch.distributed.is_nccl_available",
                )
