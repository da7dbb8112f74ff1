"""PY105: 'nccl' backend of init_process_group / new_group / deepspeed.init_distributed -> 'hccl' (docs/sources.md#class-a-safe)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import SAFE
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, replace_in_simple_string, string_role, string_value


@register
class DistBackend(PyRule):
    code = "PY105"
    name = "dist-backend"
    description = (
        "init_process_group('nccl') / backend='nccl' / deepspeed.init_distributed(dist_backend='nccl') -> 'hccl'"
    )
    safety = SAFE
    source = "docs/sources.md#class-a-safe, docs/sources.md#transfer-to-npu"

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        if string_value(node) == "nccl" and "nccl" in node.value and string_role(self.ctx, node) == "backend":
            self.change(
                node, lambda n: replace_in_simple_string(n, "nccl", "hccl"), "backend 'nccl' -> 'hccl'", op="nccl"
            )
