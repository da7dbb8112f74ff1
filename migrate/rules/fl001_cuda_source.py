"""FL001: CUDA source files (.cu/.cuh) in the tree (docs/sources.md#class-m-manual: CUDA extensions)."""

from __future__ import annotations

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import TextDoc, TextRule, register


@register
class CudaSource(TextRule):
    code = "FL001"
    name = "cuda-source-file"
    description = ".cu/.cuh kernel sources: copied unchanged and reported (port to AscendC or torch ops)"
    safety = MANUAL
    kind = "cuda"
    source = "docs/sources.md#class-m-manual"

    def apply(self, doc: TextDoc) -> None:
        doc.manual(
            type(self),
            0,
            "CUDA kernel source",
            op="CUDA kernel",
            tip="port to AscendC (torch_npu custom op) or replace with torch/torch_npu ops",
        )
