"""PY911: NCCL tuning env vars without an HCCL equivalent, used from Python (docs/sources.md#ascend-env-vars)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate import api_map
from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, string_role, string_value


@register
class NcclEnvManual(PyRule):
    code = "PY911"
    name = "nccl-env-no-equivalent"
    description = (
        "NCCL_IB_*, NCCL_ALGO, NCCL_PROTO, NCCL_DEBUG ... set or read from Python: no HCCL equivalent (reported)"
    )
    safety = MANUAL
    source = "docs/sources.md#ascend-env-vars, docs/sources.md#class-m-manual"

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        value = string_value(node)
        if (
            value
            and api_map.is_droppable_env(value)
            and value.isupper()
            and string_role(self.ctx, node) not in ("prose", "concat")
        ):
            self.manual(
                node,
                f"{value}: no HCCL equivalent; left in place (HCCL does not read it): remove or replace it by hand",
                op=value,
                tip=api_map.env_drop_tip(value),
            )
