"""PY100: files that now use torch.npu / 'npu' devices get `import torch_npu` (docs/sources.md#ascend-migration-tool: Ascend's tool does the same)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import SAFE, Finding
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import ModuleRule, PyContext, dotted, imports_module, insert_statements, top_imports


@register
class TorchNpuImport(ModuleRule):
    code = "PY100"
    name = "torch-npu-import"
    description = (
        "insert `import torch_npu` next to the first top-level torch import of a file that was migrated to NPU APIs"
    )
    safety = SAFE
    source = "docs/sources.md#ascend-migration-tool"

    def post(self, original: cst.Module, new: cst.Module, ctx: PyContext) -> cst.Module:
        if not ctx.needs_npu or imports_module(original, "torch_npu"):
            return new
        for index, stmt, mods in top_imports(original):
            if not any(m == "torch" or m.startswith("torch.") for m in mods):
                continue
            small = stmt.body[0]
            plain = (
                len(stmt.body) == 1
                and isinstance(small, cst.Import)
                and all(dotted(a.name) == "torch" for a in small.names)
            )
            at = index + 1 if plain else index
            line = ctx.lines(stmt)[0]
            ctx.findings.append(
                Finding(
                    self.code,
                    self.safety,
                    line,
                    line,
                    "import torch_npu (registers the npu device, torch.npu and hccl)",
                    op="import torch_npu",
                    after="import torch_npu",
                )
            )
            return insert_statements(ctx, new, at, "import torch_npu\n", after=plain)
        return new
