"""SH006: `--device cuda` on command lines -> npu (docs/sources.md#class-s-review: bare device literals)."""

from __future__ import annotations

import re

from parabench.migrate import api_map
from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._text import shell_code_lines
from parabench.migrate.rules._values import KEPT_TIP, kept_for_parser, kept_message

PAT = re.compile(
    r"(?<![\w-])(" + "|".join(re.escape(f) for f in api_map.DEVICE_FLAGS) + r")(\s+|=)([\"']?)cuda(:\d+)?\3(?![\w-])"
)


@register
class ShellDeviceFlag(TextRule):
    code = "SH006"
    name = "shell-device-flag"
    description = "--device cuda[:N] arguments in launch scripts -> npu[:N]"
    safety = REVIEW
    kind = "shell"
    source = "docs/sources.md#class-s-review"

    def apply(self, doc: TextDoc) -> None:
        for _lineno, offset, code in shell_code_lines(doc):
            for m in PAT.finditer(code):
                start = offset + m.start() + len(m.group(1)) + len(m.group(2)) + len(m.group(3))
                old = "cuda" + (m.group(4) or "")
                fixed = kept_for_parser(doc.options, [m.group(1)], old, old.replace("cuda", "npu"))
                if fixed is not None:  # the script's parser would reject npu (rules/_values.py)
                    doc.manual(
                        type(self),
                        start,
                        kept_message(fixed, old, old.replace("cuda", "npu")),
                        op=m.group(1),
                        tip=KEPT_TIP,
                    )
                    continue
                doc.change(type(self), start, start + 4, "npu", f"{m.group(1)} cuda -> npu", op=m.group(1))
