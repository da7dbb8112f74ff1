"""SH003: NCCL tuning variables without HCCL equivalent are dropped with a warning (docs/sources.md#ascend-env-vars: NCCL_IB_*, NCCL_ALGO, NCCL_PROTO)."""

from __future__ import annotations

import re

from parabench.migrate import api_map
from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._text import shell_code_lines

ASSIGN = re.compile(r"(?<![A-Za-z0-9_$])((?:TORCH_)?NCCL_[A-Z0-9_]+)=(\"[^\"]*\"|'[^']*'|\S*)\s*")
MARK = "# [bench migrate] dropped, no HCCL equivalent:"
# an option whose argument is the assignment (`mpirun -x NAME=V`, `docker run -e NAME=V`): removing
# the assignment removes its flag too, or the flag would take the next word as its argument
FLAG_BEFORE = re.compile(r"(?:(?<=\s)|^)(?:-x|-e|--env|-env)\s+$")


@register
class ShellNcclEnvDrop(TextRule):
    code = "SH003"
    name = "shell-nccl-env-drop"
    description = "NCCL_IB_*, NCCL_ALGO, NCCL_PROTO, NCCL_DEBUG ... assignments removed (whole `export` lines become a warning comment)"
    safety = REVIEW
    kind = "shell"
    source = "docs/sources.md#ascend-env-vars, docs/sources.md#class-m-manual"

    def apply(self, doc: TextDoc) -> None:
        rule = type(self)
        for _lineno, offset, code in shell_code_lines(doc):
            matches = [m for m in ASSIGN.finditer(code) if api_map.is_droppable_env(m.group(1))]
            if not matches:
                continue
            stripped = code.strip()
            rest = ASSIGN.sub(lambda m: "" if api_map.is_droppable_env(m.group(1)) else m.group(0), stripped).strip()
            names = ", ".join(m.group(1) for m in matches)
            tip = "; ".join(sorted({api_map.env_drop_tip(m.group(1)) for m in matches}))
            if rest in ("", "export"):
                indent = code[: len(code) - len(code.lstrip())]
                start = offset + len(indent)
                end = offset + len(code.rstrip())
                doc.change(rule, start, end, f"{MARK} {stripped}", f"dropped {names}", op=names, tip=tip)
            else:
                for m in matches:
                    flag = FLAG_BEFORE.search(code, 0, m.start())
                    doc.change(
                        rule,
                        offset + (flag.start() if flag else m.start()),
                        offset + m.end(),
                        "",
                        f"dropped {m.group(1)} from the command",
                        op=m.group(1),
                        tip=tip,
                    )
