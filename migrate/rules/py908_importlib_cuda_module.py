"""PY908: CUDA extension modules loaded by name (importlib.import_module('fused_layer_norm_cuda')) (docs/sources.md#class-m-manual)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate import api_map
from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, string_role, string_value


@register
class ImportlibCudaModule(PyRule):
    code = "PY908"
    name = "importlib-cuda-module"
    description = "importlib.import_module / __import__ of a CUDA-only module given as a string (reported)"
    safety = MANUAL
    source = "docs/sources.md#class-m-manual, docs/sources.md#pattern-8"

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        value = string_value(node)
        if not value or string_role(self.ctx, node) != "import":
            return
        tip = api_map.cuda_only_module_tip(value, self.ctx.options.local_packages)
        if tip:
            self.manual(node, f"dynamic import of {value}: CUDA-only", op=value, tip=tip)
