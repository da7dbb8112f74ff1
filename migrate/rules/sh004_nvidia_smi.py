"""SH004: nvidia-smi in launch scripts (docs/sources.md#cuda-only-packages: -> npu-smi, different options and output)."""

from __future__ import annotations

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._text import shell_code_lines, word_re

PAT = word_re("nvidia-smi")


@register
class ShellNvidiaSmi(TextRule):
    code = "SH004"
    name = "shell-nvidia-smi"
    description = "nvidia-smi calls (device counting, monitoring): reported; use `npu-smi info`"
    safety = MANUAL
    kind = "shell"
    source = "docs/sources.md#cuda-only-packages, docs/sources.md#class-m-manual"

    def apply(self, doc: TextDoc) -> None:
        for _lineno, offset, code in shell_code_lines(doc):
            for m in PAT.finditer(code):
                doc.manual(
                    type(self),
                    offset + m.start(),
                    "nvidia-smi call",
                    op="nvidia-smi",
                    tip="use `npu-smi info` (other flags/output); count devices with python -c 'import torch_npu, torch; print(torch.npu.device_count())'",
                )
