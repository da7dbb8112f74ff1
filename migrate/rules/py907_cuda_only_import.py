"""PY907: imports of CUDA-only packages (transformer_engine, triton, flash_attn, xformers, bitsandbytes, amp_C, *_cuda, apex, pynvml, symmetric memory) (docs/sources.md#cuda-only-packages)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate import api_map
from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, dotted
from parabench.migrate.rules.py111_apex_norm import import_fits

# apex imports migrated by other rules when those rules are active
MIGRATED = (
    (api_map.APEX_NORM_MODULES, api_map.APEX_NORM, "PY111"),
    (api_map.APEX_OPTIM_MODULES, api_map.APEX_OPTIM, "PY112"),
)


@register
class CudaOnlyImport(PyRule):
    code = "PY907"
    name = "cuda-only-import"
    description = "import of a CUDA-only package or compiled *_cuda extension: reported with the NPU alternative"
    safety = MANUAL
    source = "docs/sources.md#cuda-only-packages, docs/sources.md#class-m-manual, docs/sources.md#pattern-7, docs/sources.md#pattern-9"

    def visit_Import(self, node: cst.Import) -> None:
        for alias in node.names:
            mod = dotted(alias.name) or ""
            tip = api_map.cuda_only_module_tip(mod, self.ctx.options.local_packages)
            if tip:
                self.manual(node, f"import {mod}: CUDA-only", op=mod, tip=tip)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.relative or node.module is None:
            return
        mod = dotted(node.module) or ""
        names = (
            []
            if isinstance(node.names, cst.ImportStar)
            else [a.name.value for a in node.names if isinstance(a.name, cst.Name)]
        )
        for modules, mapping, code in MIGRATED:
            if mod in modules and names and all(n in mapping for n in names) and code in self.ctx.active:
                if import_fits(self.ctx, node, mapping):
                    return
        tip = api_map.cuda_only_module_tip(mod, self.ctx.options.local_packages)
        if tip is None:
            for n in names:  # `from torch.distributed import _symmetric_memory`, `from apex import amp`
                tip = (
                    api_map.cuda_only_module_tip(f"{mod}.{n}", self.ctx.options.local_packages)
                    if mod != "apex"
                    else api_map.cuda_only_module_tip(mod, self.ctx.options.local_packages)
                )
                if tip:
                    mod = f"{mod}.{n}"
                    break
        if tip:
            self.manual(node, f"from {mod} import ...: CUDA-only", op=mod, tip=tip)
