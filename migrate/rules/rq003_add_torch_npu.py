"""RQ003: requirements that pin torch get a matching torch-npu line (docs/sources.md#mindspeed-versions: torch and torch_npu versions are coupled)."""

from __future__ import annotations

import re

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._text import iter_requirements
from parabench.migrate.rules.rq001_cuda_only_packages import req_name

PIN = re.compile(r"==\s*(\d+\.\d+(?:\.\d+)?)")


@register
class AddTorchNpu(TextRule):
    code = "RQ003"
    name = "add-torch-npu"
    description = "add `torch-npu==<torch version>.*` after the torch requirement when no torch-npu line exists"
    safety = REVIEW
    kind = "requirements"
    source = "docs/sources.md#mindspeed-versions"

    def apply(self, doc: TextDoc) -> None:
        lines = list(iter_requirements(doc))
        if any(req_name(code) == "torch-npu" for _, _, _, code in lines):
            return
        for _lineno, offset, line, code in lines:
            if req_name(code) == "torch" and not code.lstrip().startswith("-"):
                pin = PIN.search(code)
                new = f"torch-npu=={pin.group(1)}.*" if pin else "torch-npu"
                at = offset + len(line)
                doc.change(
                    type(self),
                    at,
                    at,
                    "\n" + new,
                    f"added {new}",
                    op="torch-npu",
                    tip="torch_npu must match the torch version exactly (post releases: 2.7.1.post4 for torch 2.7.1) and the CANN toolkit",
                )
                return
