"""MS001: Megatron entry scripts import mindspeed.megatron_adaptor before Megatron (docs/sources.md#mindspeed-adaptor)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import SAFE, Finding
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import ModuleRule, PyContext, imports_module, insert_statements, top_imports


def is_entry(module: cst.Module) -> bool:
    """A script: has a top-level `if __name__ == '__main__':`."""
    for stmt in module.body:
        if isinstance(stmt, cst.If):
            code = cst.Module(body=[]).code_for_node(stmt.test).replace('"', "'").replace(" ", "")
            if code in ("__name__=='__main__'", "'__main__'==__name__"):
                return True
    return False


@register
class MegatronAdaptor(ModuleRule):
    code = "MS001"
    name = "megatron-adaptor"
    description = (
        "entry scripts that import megatron get `import mindspeed.megatron_adaptor` before the first megatron import"
    )
    safety = SAFE
    targets = frozenset({"mindspeed"})
    source = "docs/sources.md#mindspeed-adaptor"

    def post(self, original: cst.Module, new: cst.Module, ctx: PyContext) -> cst.Module:
        if not is_entry(original) or imports_module(original, "mindspeed"):
            return new
        for index, stmt, mods in top_imports(original):
            if any(m == "megatron" or m.startswith("megatron.") for m in mods):
                line = ctx.lines(stmt)[0]
                ctx.findings.append(
                    Finding(
                        self.code,
                        self.safety,
                        line,
                        line,
                        "import mindspeed.megatron_adaptor before Megatron",
                        op="mindspeed.megatron_adaptor",
                        after="import mindspeed.megatron_adaptor",
                    )
                )
                return insert_statements(
                    ctx,
                    new,
                    index,
                    "import mindspeed.megatron_adaptor  # noqa: F401 - patches Megatron for NPU\n",
                    after=False,
                )
        return new
