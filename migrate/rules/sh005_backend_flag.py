"""SH005: `--distributed-backend nccl` and friends -> hccl (docs/sources.md#mindspeed-flags)."""

from __future__ import annotations

import re

from parabench.migrate import api_map
from parabench.migrate.core import SAFE
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._text import shell_code_lines
from parabench.migrate.rules._values import KEPT_TIP, kept_for_parser, kept_message

PAT = re.compile(
    r"(?<![\w-])(" + "|".join(re.escape(f) for f in api_map.BACKEND_FLAGS) + r")(\s+|=)([\"']?)nccl\3(?![\w-])"
)


@register
class ShellBackendFlag(TextRule):
    code = "SH005"
    name = "shell-backend-flag"
    description = "--distributed-backend/--dist-backend/--backend nccl on command lines -> hccl"
    safety = SAFE
    kind = "shell"
    source = "docs/sources.md#mindspeed-flags, docs/sources.md#class-a-safe"

    def apply(self, doc: TextDoc) -> None:
        for _lineno, offset, code in shell_code_lines(doc):
            for m in PAT.finditer(code):
                start = offset + m.end() - len(m.group(3)) - len("nccl")
                fixed = kept_for_parser(doc.options, [m.group(1)], "nccl", "hccl")
                if fixed is not None:  # the script's parser would reject hccl (rules/_values.py)
                    doc.manual(type(self), start, kept_message(fixed, "nccl", "hccl"), op=m.group(1), tip=KEPT_TIP)
                    continue
                doc.change(type(self), start, start + 4, "hccl", f"{m.group(1)} nccl -> hccl", op=m.group(1))
