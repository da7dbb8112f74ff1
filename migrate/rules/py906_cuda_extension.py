"""PY906: CUDA C++ extensions (CUDAExtension, load/load_inline with CUDA sources) (docs/sources.md#class-m-manual)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule

EXT = "torch.utils.cpp_extension."
TIP = "CUDA kernels do not build for NPU: port to AscendC (torch_npu custom ops) or replace with torch ops"


@register
class CudaExtension(PyRule):
    code = "PY906"
    name = "cuda-extension"
    description = (
        "torch.utils.cpp_extension.CUDAExtension and load/load_inline with .cu sources or cuda_sources= (reported)"
    )
    safety = MANUAL
    source = "docs/sources.md#class-m-manual"

    def visit_Call(self, node: cst.Call) -> None:
        names = self.ctx.qnames(node.func)
        q = next((n for n in sorted(names) if n.startswith(EXT)), None)  # sorted: set order varies per process
        if q is None:
            return
        name = q[len(EXT) :]
        if name == "CUDAExtension":
            self.manual(node, "CUDAExtension build", op=q, tip=TIP)
        elif name in ("load", "load_inline"):
            code = self.ctx.module.code_for_node(node)
            if ".cu" in code or "cuda_sources" in code or "with_cuda=True" in code:
                self.manual(node, f"{name} of CUDA sources", op=q, tip=TIP)
