"""SH008: enable MindSpeed fused kernels matching the model flags (docs/sources.md#mindspeed-flags: --use-fused-rmsnorm/-swiglu/-rotary-pos-emb)."""

from __future__ import annotations

import re

from parabench.migrate import api_map
from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._text import shell_code_lines


@register
class MindSpeedFusedFlags(TextRule):
    code = "SH008"
    name = "mindspeed-fused-flags"
    description = "--normalization RMSNorm / --swiglu / --position-embedding-type rope get MindSpeed's --use-fused-* flag next to them"
    safety = REVIEW
    kind = "shell"
    targets = frozenset({"mindspeed"})
    source = "docs/sources.md#mindspeed-flags"

    def apply(self, doc: TextDoc) -> None:
        for flag, value, fused in api_map.MINDSPEED_FUSED:
            if re.search(r"(?<![\w-])" + re.escape(fused) + r"(?![\w-])", doc.text):
                continue
            if value is None:
                pat = re.compile(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])")
            else:
                pat = re.compile(
                    r"(?<![\w-])" + re.escape(flag) + r"(?:\s+|=)([\"']?)" + re.escape(value) + r"\1(?![\w-])"
                )
            for _lineno, offset, code in shell_code_lines(doc):
                m = pat.search(code)
                if m:
                    at = offset + m.end()
                    doc.change(
                        type(self), at, at, f" {fused}", f"add {fused} (MindSpeed fused kernel for {flag})", op=fused
                    )
                    break
