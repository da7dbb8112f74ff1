"""RQ002: CUDA wheel pins (torch==2.1.0+cu121, --extra-index-url .../whl/cu121) in requirements files (docs/sources.md#mindspeed-versions: torch + torch_npu pairs)."""

from __future__ import annotations

import re

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._text import iter_requirements
from parabench.migrate.rules.rq001_cuda_only_packages import req_name

LOCAL = re.compile(r"\+cu\d+")
INDEX = re.compile(r"^\s*(--extra-index-url|--index-url|-f|--find-links|-i)\b.*(/whl/cu\d+|/cu\d+/?)")
MARK = "# [bench migrate] CUDA wheel index, removed:"


@register
class CudaWheels(TextRule):
    code = "RQ002"
    name = "cuda-wheel-pins"
    description = "+cuXXX local versions on torch/torchvision/torchaudio stripped; CUDA wheel index URLs commented out"
    safety = REVIEW
    kind = "requirements"
    source = "docs/sources.md#mindspeed-versions"

    def apply(self, doc: TextDoc) -> None:
        for _lineno, offset, line, code in iter_requirements(doc):
            if INDEX.match(code):
                start = offset + len(line) - len(line.lstrip())
                doc.change(
                    type(self),
                    start,
                    offset + len(line),
                    f"{MARK} {line.strip()}",
                    "CUDA wheel index removed",
                    op="index-url",
                    tip="install torch from PyPI (CPU/aarch64 wheel) and torch_npu from PyPI",
                )
                continue
            if req_name(code) in ("torch", "torchvision", "torchaudio"):
                for m in LOCAL.finditer(code):
                    doc.change(
                        type(self),
                        offset + m.start(),
                        offset + m.end(),
                        "",
                        f"local version {m.group(0)} removed",
                        op=req_name(code),
                    )
