"""RQ001: CUDA-only packages in requirements files are commented out with the reason (docs/sources.md#cuda-only-packages)."""

from __future__ import annotations

import re

from parabench.migrate import api_map
from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._text import iter_requirements

NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
MARK = "# [bench migrate] CUDA-only, removed:"


def req_name(code: str) -> str | None:
    m = NAME.match(code)
    return m.group(1).lower().replace("_", "-").replace(".", "-") if m else None


@register
class CudaOnlyPackages(TextRule):
    code = "RQ001"
    name = "cuda-only-packages"
    description = "flash-attn, transformer-engine, apex, xformers, bitsandbytes, triton, nvidia-*, cupy-cuda*, pynvml ... requirement lines commented out"
    safety = REVIEW
    kind = "requirements"
    source = "docs/sources.md#cuda-only-packages, docs/sources.md#class-m-manual"

    def apply(self, doc: TextDoc) -> None:
        for _lineno, offset, line, code in iter_requirements(doc):
            name = req_name(code)
            if not name or code.lstrip().startswith("-"):
                continue
            tip = api_map.CUDA_ONLY_PACKAGES.get(name)
            if tip is None and name.startswith(api_map.CUDA_ONLY_PACKAGE_PREFIXES):
                tip = "CUDA runtime wheel"
            if tip:
                start = offset + len(line) - len(line.lstrip())
                doc.change(
                    type(self), start, offset + len(line), f"{MARK} {line.strip()}", f"removed {name}", op=name, tip=tip
                )
