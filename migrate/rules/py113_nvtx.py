"""PY113: NVTX markers -> torch.npu.mstx (docs/sources.md#mstx-markers: NVTX -> torch_npu.npu.mstx)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, cuda_refs


@register
class Nvtx(PyRule):
    code = "PY113"
    name = "nvtx-to-mstx"
    description = "torch.cuda.nvtx.mark/range_start/range_end -> torch.npu.mstx.* (also `from torch.cuda import nvtx`)"
    safety = REVIEW
    source = "docs/sources.md#mstx-markers, docs/sources.md#class-s-review"
    tip = "mstx.range_start needs an NPU stream argument in some torch_npu versions; push/pop stacks are not migrated"

    def visit_Module(self, node: cst.Module) -> None:
        refs = cuda_refs(self.ctx)
        for use in refs.direct:
            if use.category != "nvtx":
                continue
            nvtx_attr = self.ctx.parent(use.node)  # <torch>.cuda.nvtx
            self.change(
                nvtx_attr,
                lambda n: n.with_changes(value=n.value.with_changes(attr=cst.Name("npu")), attr=cst.Name("mstx")),
                f"torch.cuda.{use.path} -> torch.npu.mstx.{use.data}",
                op=f"torch.cuda.{use.path}",
                tip=self.tip,
            )
        for b in refs.bindings:
            if b.decision != "nvtx":
                continue
            if isinstance(b.stmt, cst.ImportFrom) and len(b.stmt.names) == 1:
                local = b.alias.asname.name.value if b.alias.asname else "nvtx"

                def fn(stmt: cst.ImportFrom, local=local) -> cst.ImportFrom:
                    alias = cst.ImportAlias(name=cst.Name("mstx"), asname=cst.AsName(name=cst.Name(local)))
                    return stmt.with_changes(module=cst.parse_expression("torch.npu"), names=[alias])

                self.change(
                    b.stmt,
                    fn,
                    f"from torch.cuda import nvtx -> from torch.npu import mstx as {local}",
                    op="torch.cuda.nvtx",
                    tip=self.tip,
                )
            elif isinstance(b.stmt, cst.Import):
                self.change(
                    b.alias.name,
                    lambda n: cst.parse_expression("torch_npu.npu.mstx"),
                    "import torch.cuda.nvtx -> torch_npu.npu.mstx",
                    op="torch.cuda.nvtx",
                    tip=self.tip,
                )
