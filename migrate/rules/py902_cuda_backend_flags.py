"""PY902: torch.backends.cuda / cudnn switches without NPU meaning (SDPA kernel choice, cudnn.version) (docs/sources.md#class-m-manual)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, _climb

HANDLED = {
    "torch.backends.cuda.matmul.allow_tf32": "PY114",
    "torch.backends.cudnn.allow_tf32": "PY114",
    "torch.backends.cudnn.deterministic": "PY115",
}
IGNORED = frozenset(
    {"torch.backends.cudnn.benchmark", "torch.backends.cudnn.enabled", "torch.backends.cudnn.is_available"}
)
TIPS = {
    "sdp": "SDPA on NPU dispatches to npu_fusion_attention; CUDA kernel switches have no effect: remove",
    "version": "cuDNN does not exist on NPU: gate on torch.npu.is_available() or a feature check",
}


@register
class CudaBackendFlags(PyRule):
    code = "PY902"
    name = "cuda-backend-flags"
    description = "torch.backends.cuda.* (SDPA kernel switches, linalg library, cufft) and torch.backends.cudnn.version(): no NPU meaning, reported"
    safety = MANUAL
    source = "docs/sources.md#class-m-manual"

    def visit_Attribute(self, node: cst.Attribute) -> None:
        names = self.ctx.qnames(node)
        base = next((q for q in sorted(names) if q in ("torch.backends.cuda", "torch.backends.cudnn")), None)
        if base is None:
            return
        outer, path = _climb(self.ctx, node)
        if not path:
            return
        full = f"{base}.{path}"
        if full in IGNORED or any(full.startswith(k) and v in self.ctx.active for k, v in HANDLED.items()):
            return
        tip = (
            TIPS["sdp"]
            if "sdp" in path
            else TIPS["version"]
            if path.startswith("version")
            else "CUDA backend switch: no NPU equivalent, remove or guard"
        )
        self.manual(outer, f"{full}: CUDA backend switch", op=full, tip=tip)
