"""SH007: Transformer-Engine flags in Megatron launch scripts -> MindSpeed equivalents (docs/sources.md#mindspeed-flags: --transformer-impl local)."""

from __future__ import annotations

import re

from parabench.migrate import api_map
from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._text import shell_code_lines, word_re

IMPL = re.compile(r"(?<![\w-])--transformer-impl(\s+|=)([\"']?)transformer_engine\2(?![\w-])")


@register
class ShellTeFlags(TextRule):
    code = "SH007"
    name = "shell-te-flags"
    description = (
        "--transformer-impl transformer_engine -> local; --apply-rope-fusion -> --use-fused-rotary-pos-emb (MindSpeed)"
    )
    safety = REVIEW
    kind = "shell"
    targets = frozenset({"mindspeed"})
    source = "docs/sources.md#mindspeed-flags"

    def apply(self, doc: TextDoc) -> None:
        rule = type(self)
        for _lineno, offset, code in shell_code_lines(doc):
            for m in IMPL.finditer(code):
                start = offset + m.end() - len(m.group(2)) - len("transformer_engine")
                doc.change(
                    rule,
                    start,
                    start + len("transformer_engine"),
                    "local",
                    "--transformer-impl transformer_engine -> local",
                    op="--transformer-impl",
                    tip="MindSpeed replaces TE layers with its local fused implementations",
                )
            for old, new in api_map.TE_FLAG_MAP.items():
                if new in doc.text:
                    continue
                for m in word_re(old).finditer(code):
                    doc.change(rule, offset + m.start(), offset + m.end(), new, f"{old} -> {new}", op=old)
