"""PY115: `torch.backends.cudnn.deterministic = X` -> `torch.use_deterministic_algorithms(X)` (docs/sources.md#class-s-review: cudnn flags).

cudnn.benchmark / cudnn.enabled are left alone: they are plain attributes without effect on NPU.
A file that calls `torch.use_deterministic_algorithms` itself keeps its cudnn flag as it is: the
user chose the setting (`warn_only=True`, say), and a second call would reset it (issue #13,
class 4: a rewrite never changes a setting the user made).
"""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, torch_bound

QN = "torch.backends.cudnn.deterministic"
CALL = "torch.use_deterministic_algorithms"


@register
class CudnnDeterministic(PyRule):
    code = "PY115"
    name = "cudnn-deterministic"
    description = "torch.backends.cudnn.deterministic = X -> torch.use_deterministic_algorithms(X) (raises on ops without deterministic kernels)"
    safety = REVIEW
    source = "docs/sources.md#class-s-review"
    needs_torch_npu = False
    tip = "use_deterministic_algorithms(True) raises on nondeterministic ops; HCCL_DETERMINISTIC=true makes collectives deterministic"

    def visit_Assign(self, node: cst.Assign) -> None:
        if (
            len(node.targets) != 1
            or QN not in self.ctx.qnames(node.targets[0].target)
            or not torch_bound(self.ctx.module)
            or self._sets_determinism()
        ):
            return

        def fn(n: cst.Assign) -> cst.Expr:
            call = cst.Call(func=cst.parse_expression("torch.use_deterministic_algorithms"), args=[cst.Arg(n.value)])
            return cst.Expr(value=call, semicolon=n.semicolon)

        self.change(node, fn, f"{QN} = ... -> torch.use_deterministic_algorithms(...)", op=QN, tip=self.tip)

    def _sets_determinism(self) -> bool:
        """Does the file call torch.use_deterministic_algorithms anywhere (any alias)?"""
        found = self.ctx.cache.get("py115_sets")
        if found is None:
            nodes = [n for n in self.ctx.order if type(n) is cst.Attribute and n.attr.value == CALL.split(".")[1]]
            nodes += self.ctx.names.get(CALL.split(".")[1], [])
            found = any(CALL in self.ctx.qnames(n) for n in nodes)
            self.ctx.cache["py115_sets"] = found
        return bool(found)
