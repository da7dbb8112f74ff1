"""PY110: NCCL/CUDA env names with an HCCL/Ascend twin of different semantics -> renamed, flagged (docs/sources.md#ascend-env-vars)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule
from parabench.migrate.rules.py109_env_var import env_literal


@register
class EnvVarReview(PyRule):
    code = "PY110"
    name = "env-var-review"
    description = "NCCL_SOCKET_IFNAME, NCCL_BUFFSIZE (bytes -> MB!), TORCH_NCCL_ASYNC_ERROR_HANDLING, CUDA_LAUNCH_BLOCKING -> HCCL_*/ASCEND_* names"
    safety = REVIEW
    source = "docs/sources.md#ascend-env-vars, docs/sources.md#class-s-review"
    needs_torch_npu = False

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        env_literal(self, node, "review")
