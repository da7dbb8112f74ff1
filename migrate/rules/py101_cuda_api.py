"""PY101: torch.cuda runtime API with a torch.npu twin -> torch.npu (docs/sources.md#npu-api-twins)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import SAFE
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, _join, cuda_refs, dotted, new_import_module, parse_expr, torch_bound


@register
class CudaApi(PyRule):
    code = "PY101"
    name = "cuda-api"
    description = (
        "torch.cuda.* call/attribute with a torch.npu twin -> torch.npu.* (also through import and variable aliases)"
    )
    safety = SAFE
    source = "docs/sources.md#npu-api-twins, docs/sources.md#class-a-safe, docs/sources.md#transfer-to-npu"

    def visit_Module(self, node: cst.Module) -> None:
        refs = cuda_refs(self.ctx)
        for use in refs.direct:
            if use.category in ("supported", "module"):
                old = _join("torch.cuda", use.path)
                self.change(use.node, _to_npu, f"{old} -> {_join('torch.npu', use.path)}", op=old)
            elif use.category == "replace":
                new = parse_expr(use.data)
                self.change(
                    use.outer,
                    lambda n, new=new: new,
                    f"torch.cuda.{use.path} -> {use.data}",
                    op=f"torch.cuda.{use.path}",
                )
        for b in refs.bindings:
            if b.decision == "blocked" and not b.base and torch_bound(self.ctx.module):
                # pattern 15: the alias stays for its unsupported uses; supported calls migrate one by one
                for u in b.uses:
                    if u.category == "supported" and isinstance(u.node, cst.Name):
                        self.change(
                            u.node,
                            lambda n: parse_expr("torch.npu"),
                            f"{u.node.value}.{u.path} -> torch.npu.{u.path}",
                            op=f"torch.cuda.{u.path}",
                        )
                continue
            if b.decision != "npu":
                continue
            if isinstance(b.stmt, cst.Assign):
                self.change(b.alias, _to_npu, "module alias torch.cuda -> torch.npu", op="torch.cuda")
            else:
                self._rewrite_import(b)

    def _rewrite_import(self, b) -> None:
        stmt, alias = b.stmt, b.alias
        full = "torch.cuda" + (f".{b.base}" if b.base else "")
        if isinstance(stmt, cst.Import):
            new_mod = new_import_module(full)
            self.change(alias.name, lambda n, m=new_mod: parse_expr(m), f"import {full} -> import {new_mod}", op=full)
            return
        # ImportFrom: `from torch import cuda` or `from torch.cuda[.sub] import X`
        mod = dotted(stmt.module) or ""
        if mod == "torch":

            def fn(n: cst.ImportAlias) -> cst.ImportAlias:
                asname = n.asname or cst.AsName(name=cst.Name("cuda"))
                return n.with_changes(name=cst.Name("npu"), asname=asname)

            self.change(alias, fn, "from torch import cuda -> from torch import npu as cuda", op="torch.cuda")
        else:
            done = self.ctx.cache.setdefault("py101_from", set())
            if id(stmt) in done:
                return
            done.add(id(stmt))
            new_mod = new_import_module(mod)
            self.change(
                stmt.module,
                lambda n, m=new_mod: parse_expr(m),
                f"from {mod} import ... -> from {new_mod} import ...",
                op=mod,
            )


def _to_npu(node: cst.CSTNode) -> cst.CSTNode:
    if isinstance(node, cst.Attribute):
        return node.with_changes(attr=cst.Name("npu"))
    return node
