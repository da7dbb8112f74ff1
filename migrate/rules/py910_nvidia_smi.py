"""PY910: nvidia-smi called from Python (docs/sources.md#cuda-only-packages: pynvml/nvidia-smi -> npu-smi)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, string_role, string_value


@register
class NvidiaSmi(PyRule):
    code = "PY910"
    name = "nvidia-smi"
    description = "commands starting with nvidia-smi in strings passed to subprocess/os.system (reported; npu-smi has other options)"
    safety = MANUAL
    source = "docs/sources.md#cuda-only-packages, docs/sources.md#class-m-manual"

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        value = string_value(node)
        if value and value.split()[:1] == ["nvidia-smi"] and string_role(self.ctx, node) in ("command", "arg", "other"):
            self.manual(node, "nvidia-smi invoked", op="nvidia-smi", tip="use `npu-smi info` (different output format)")
