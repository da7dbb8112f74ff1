"""PY901: torch.cuda APIs that torch.npu lacks or changes: reported, never rewritten (docs/sources.md#transfer-to-npu-limits)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, binding_problems, cuda_refs


@register
class UnsupportedCudaApi(PyRule):
    code = "PY901"
    name = "unsupported-cuda-api"
    description = "torch.cuda.* without a torch.npu twin (get_device_capability, CUDA graphs, nccl, nvtx push/pop, unknown names): reported with a tip"
    safety = MANUAL
    source = "docs/sources.md#transfer-to-npu-limits, docs/sources.md#npu-api-twins, docs/sources.md#class-m-manual, docs/sources.md#pattern-5, docs/sources.md#pattern-7"

    def visit_Module(self, node: cst.Module) -> None:
        refs = cuda_refs(self.ctx)
        active = self.ctx.active
        owned = {"supported": "PY101", "module": "PY101", "replace": "PY101", "legacy": "PY108", "nvtx": "PY113"}
        for use in refs.direct:
            owner = owned.get(use.category)
            if owner is not None and owner in active:
                continue
            self._report(use)
        stmts: dict[int, list] = {}
        for b in refs.bindings:
            if b.decision == "npu" and "PY101" in active or b.decision == "nvtx" and "PY113" in active:
                continue
            stmts.setdefault(id(b.stmt), []).append(b)
            for use in b.uses:
                if use.path in binding_problems(b):
                    self._report(use)
        for group in stmts.values():
            stmt = group[0].stmt
            bad = sorted({p for b in group for p in binding_problems(b)})
            what = self.ctx.code(stmt).strip().splitlines()[0]
            reason = ("uses " + ", ".join(bad)) if bad else "its rewrite rule is disabled"
            self.manual(
                stmt,
                f"torch.cuda alias not migrated ({what}): {reason}",
                op="torch.cuda",
                tip="migrate or remove the unsupported uses, then rerun",
            )

    def _report(self, use) -> None:
        op = f"torch.cuda.{use.path}".rstrip(".")
        tip = use.data if use.category in ("unsupported", "unknown") else "its rewrite rule is disabled"
        label = "unsupported on NPU" if use.category == "unsupported" else "not migrated"
        self.manual(use.outer, f"{op}: {label}", op=op, tip=tip)
