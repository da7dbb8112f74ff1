"""RT001: --mode runtime: entry points import torch_npu's transfer_to_npu shim instead of static rewrites (docs/sources.md#transfer-to-npu).

Entry points: a top-level ``if __name__ == "__main__":``, or what ``migrate.entries`` found
(``Options.entry``: started by a launch script or the package's console scripts, or training code
at module level); the finding says which."""

from __future__ import annotations

import sys

import libcst as cst

from parabench.migrate.core import SAFE, Finding
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import ModuleRule, PyContext, dotted, imports_module, insert_statements, top_imports
from parabench.migrate.rules.ms001_megatron_adaptor import is_entry

SHIM = "import torch_npu\nfrom torch_npu.contrib import transfer_to_npu  # noqa: F401 - maps torch.cuda/'cuda'/nccl to NPU at run time\n"


@register
class TransferToNpu(ModuleRule):
    code = "RT001"
    name = "transfer-to-npu"
    description = (
        "entry points get `from torch_npu.contrib import transfer_to_npu` after their first torch import: "
        "`if __name__ == '__main__'` scripts, files launch scripts or console_scripts start, top-level training code"
    )
    safety = SAFE
    modes = frozenset({"runtime"})
    source = "docs/sources.md#transfer-to-npu"

    def post(self, original: cst.Module, new: cst.Module, ctx: PyContext) -> cst.Module:
        why = "`if __name__ == '__main__'`" if is_entry(original) else ctx.options.entry
        if not why or imports_module(original, "torch_npu"):
            return new
        imports = top_imports(original)
        at = None
        for index, stmt, mods in imports:
            if any(m == "torch" or m.startswith("torch.") for m in mods):
                small = stmt.body[0]
                plain = (
                    len(stmt.body) == 1
                    and isinstance(small, cst.Import)
                    and all(dotted(a.name) == "torch" for a in small.names)
                )
                at, after = (index + 1, True) if plain else (index, False)
                break
        if at is None:  # no torch import: before the first third-party import, else after the imports
            for index, _stmt, mods in imports:
                root = mods[0].split(".")[0]
                if root != "__future__" and root not in sys.stdlib_module_names:
                    at, after = index, False
                    break
            else:
                at = imports[-1][0] + 1 if imports else after_docstring(original)
                after = at > 0
        line = ctx.body_line(at)
        ctx.findings.append(
            Finding(
                self.code,
                self.safety,
                line,
                line,
                f"import transfer_to_npu at the entry point (found: {why})",
                op="torch_npu.contrib.transfer_to_npu",
                after=SHIM.splitlines()[1],
            )
        )
        return insert_statements(ctx, new, at, SHIM, after=after)


def after_docstring(module: cst.Module) -> int:
    i = 0
    body = module.body
    if (
        body
        and isinstance(body[0], cst.SimpleStatementLine)
        and isinstance(body[0].body[0], cst.Expr)
        and isinstance(body[0].body[0].value, cst.SimpleString)
    ):
        i = 1
    return i
