"""PY914: a CUDA check guarding code that stays CUDA-only is left as is and reported (docs/sources.md#guard-safety).

The analysis runs after every rule, whichever rules are selected (rules/_guard.py): it withdraws
the rewrite of `torch.cuda.is_available()`, `device_count()`, `x.is_cuda`, `device.type == 'cuda'`
... when the branch the check kept unreachable on a machine without CUDA still holds CUDA-only code.
"""

from __future__ import annotations

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule


@register
class CudaGuard(PyRule):
    code = "PY914"
    name = "cuda-guard-kept"
    description = (
        "CUDA checks (is_available, device_count, is_cuda, device == 'cuda' ...) whose if-body, and-operands, "
        "other arm or following code stay CUDA-only: left as is and reported, so the fallback still runs"
    )
    safety = MANUAL
    source = "docs/sources.md#guard-safety"
