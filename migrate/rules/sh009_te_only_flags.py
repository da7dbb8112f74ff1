"""SH009: FP8 / Transformer-Engine-only flags without an NPU equivalent (docs/sources.md#mindspeed-flags)."""

from __future__ import annotations

import re

from parabench.migrate import api_map
from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import TextDoc, TextRule, register, rules_for
from parabench.migrate.rules._text import shell_code_lines

FLAGS = re.compile(
    r"(?<![\w-])("
    + "|".join(re.escape(f) for f in sorted(api_map.TE_ONLY_FLAGS, key=len, reverse=True))
    + r")(?![\w-])"
)
IMPL = re.compile(r"(?<![\w-])--transformer-impl(\s+|=)([\"']?)transformer_engine\2(?![\w-])")


@register
class ShellTeOnlyFlags(TextRule):
    code = "SH009"
    name = "shell-te-only-flags"
    description = "--fp8-*, --tp-comm-overlap, TE RNG tracker flags (and --transformer-impl transformer_engine for --to npu): reported"
    safety = MANUAL
    kind = "shell"
    source = "docs/sources.md#mindspeed-flags, docs/sources.md#class-m-manual, docs/sources.md#pattern-9"

    def apply(self, doc: TextDoc) -> None:
        for _lineno, offset, code in shell_code_lines(doc):
            for m in FLAGS.finditer(code):
                doc.manual(
                    type(self),
                    offset + m.start(),
                    f"{m.group(1)}: Transformer-Engine/FP8 only",
                    op=m.group(1),
                    tip=api_map.TE_ONLY_FLAGS[m.group(1)],
                )
            if doc.options.target != "mindspeed" or "SH007" not in _active(doc):
                for m in IMPL.finditer(code):
                    doc.manual(
                        type(self),
                        offset + m.start(),
                        "--transformer-impl transformer_engine",
                        op="--transformer-impl",
                        tip="Transformer Engine does not exist on NPU: migrate with --to mindspeed (local impl)",
                    )


def _active(doc: TextDoc) -> set[str]:
    return {r.code for r in rules_for("shell", doc.options)}
