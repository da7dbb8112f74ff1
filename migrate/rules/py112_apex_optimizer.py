"""PY112: apex FusedAdam / FusedSGD -> torch.optim.AdamW / SGD (docs/sources.md#class-s-review).

apex FusedAdam defaults to adam_w_mode=True (decoupled weight decay), so AdamW keeps the update rule.
"""

from __future__ import annotations

import libcst as cst

from parabench.migrate import api_map
from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule
from parabench.migrate.rules.py111_apex_norm import rewrite_attribute, rewrite_from_import


@register
class ApexOptimizer(PyRule):
    code = "PY112"
    name = "apex-fused-optimizer"
    description = (
        "apex.optimizers FusedAdam -> torch.optim.AdamW (apex default adam_w_mode=True), FusedSGD -> torch.optim.SGD"
    )
    safety = REVIEW
    source = "docs/sources.md#class-s-review"
    needs_torch_npu = False
    tip = "remove apex-only kwargs (adam_w_mode, set_grad_none, bias_correction); adam_w_mode=False means torch.optim.Adam; torch_npu.optim.NpuFusedAdamW is the fused NPU variant"

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        rewrite_from_import(self, node, api_map.APEX_OPTIM_MODULES, api_map.APEX_OPTIM, self.tip)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        rewrite_attribute(self, node, api_map.APEX_OPTIM_MODULES, api_map.APEX_OPTIM, self.tip)
