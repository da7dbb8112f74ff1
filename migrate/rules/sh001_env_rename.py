"""SH001: CUDA_VISIBLE_DEVICES / PYTORCH_CUDA_ALLOC_CONF in launch scripts -> Ascend names (docs/sources.md#ascend-env-vars)."""

from __future__ import annotations

import math
import re

from parabench.migrate import api_map
from parabench.migrate.core import SAFE
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._text import shell_code_lines, word_re

_BUFF = re.compile(r"^(\d+)")


def rename_env(rule: type[TextRule], doc: TextDoc, safety: str) -> None:
    for name, (new, level, note) in api_map.ENV_MAP.items():
        if level != safety:
            continue
        pat = word_re(name)
        for _lineno, offset, code in shell_code_lines(doc):
            for m in pat.finditer(code):
                start, end = offset + m.start(), offset + m.end()
                replacement, msg = new, f"{name} -> {new}"
                if name == "NCCL_BUFFSIZE" and code[m.end() : m.end() + 1] == "=":
                    value = _BUFF.match(code[m.end() + 1 :])
                    if value:  # bytes -> MB (docs/sources.md#ascend-env-vars)
                        mb = max(1, math.ceil(int(value.group(1)) / 2**20))
                        end = offset + m.end() + 1 + value.end()
                        replacement = f"{new}={mb}"
                        msg = f"{name}={value.group(1)} (bytes) -> {new}={mb} (MB)"
                doc.change(rule, start, end, replacement, msg, op=name, tip=note)


@register
class ShellEnvRename(TextRule):
    code = "SH001"
    name = "shell-env-rename"
    description = "CUDA_VISIBLE_DEVICES -> ASCEND_RT_VISIBLE_DEVICES, PYTORCH_CUDA_ALLOC_CONF -> PYTORCH_NPU_ALLOC_CONF (assignments and $references)"
    safety = SAFE
    kind = "shell"
    source = "docs/sources.md#ascend-env-vars, docs/sources.md#class-a-safe"

    def apply(self, doc: TextDoc) -> None:
        rename_env(type(self), doc, "safe")
