"""SH002: NCCL/CUDA env vars with an HCCL/Ascend twin of different semantics (docs/sources.md#ascend-env-vars)."""

from __future__ import annotations

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules.sh001_env_rename import rename_env


@register
class ShellEnvRenameReview(TextRule):
    code = "SH002"
    name = "shell-env-rename-review"
    description = "NCCL_SOCKET_IFNAME -> HCCL_SOCKET_IFNAME, NCCL_BUFFSIZE bytes -> HCCL_BUFFSIZE MB, (TORCH_)NCCL_ASYNC_ERROR_HANDLING -> HCCL_ASYNC_ERROR_HANDLING, CUDA_LAUNCH_BLOCKING -> ASCEND_LAUNCH_BLOCKING"
    safety = REVIEW
    kind = "shell"
    source = "docs/sources.md#ascend-env-vars, docs/sources.md#class-s-review"

    def apply(self, doc: TextDoc) -> None:
        rename_env(type(self), doc, "review")
