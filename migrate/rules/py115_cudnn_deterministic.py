"""PY115: `torch.backends.cudnn.deterministic = X` -> `torch.use_deterministic_algorithms(X)` (docs/sources.md#class-s-review: cudnn flags).

cudnn.benchmark / cudnn.enabled are left alone: they are plain attributes without effect on NPU.
"""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, torch_bound

QN = "torch.backends.cudnn.deterministic"


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
        ):
            return

        def fn(n: cst.Assign) -> cst.Expr:
            call = cst.Call(func=cst.parse_expression("torch.use_deterministic_algorithms"), args=[cst.Arg(n.value)])
            return cst.Expr(value=call, semicolon=n.semicolon)

        self.change(node, fn, f"{QN} = ... -> torch.use_deterministic_algorithms(...)", op=QN, tip=self.tip)
