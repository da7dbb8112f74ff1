"""PY912: accelerator='cuda'/'gpu' (Lightning allow-list) must not become 'npu' blindly (docs/sources.md#pattern-13)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, string_role, string_value


@register
class LightningAccelerator(PyRule):
    code = "PY912"
    name = "accelerator-allow-list"
    description = (
        "accelerator='cuda'/'gpu' keyword (Lightning allow-list): reported, an NPU accelerator plugin is needed"
    )
    safety = MANUAL
    source = "docs/sources.md#pattern-13"

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        value = string_value(node)
        if value in ("cuda", "gpu") and string_role(self.ctx, node) == "accelerator":
            self.manual(
                node,
                f"accelerator='{value}'",
                op="accelerator",
                tip="Lightning accepts only registered accelerators: install an NPU accelerator plugin, then use its name",
            )
