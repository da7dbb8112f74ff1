"""PY918: what torch_npu's profiler does not offer, in files PY121 moves to it (docs/sources.md#npu-profiler).

Reported, never rewritten: ``key_averages()`` / ``events()`` tables (torch_npu parses the trace
directory offline), ``*cuda_time*`` sort keys, torch's ``experimental_config`` and ``use_gzip``,
``ProfilerActivity`` members without an NPU twin, and the legacy autograd profiler's CUDA timing
(``torch.autograd.profiler.profile(use_cuda=...)``, ``emit_nvtx``) in any file.
"""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, string_value
from parabench.migrate.rules.py121_profiler import (
    ACTIVITY_MAP,
    LEGACY,
    LEGACY_TIP,
    NO_TABLES,
    activity_of,
    device_profiling,
    mapped_name,
)


@register
class ProfilerGaps(PyRule):
    code = "PY918"
    name = "profiler-gaps"
    description = (
        "profiling torch_npu cannot do as written: key_averages()/events(), cuda_time sort keys, "
        "experimental_config/use_gzip, autograd profiler use_cuda/emit_nvtx (reported)"
    )
    safety = MANUAL
    source = "docs/sources.md#npu-profiler, docs/sources.md#class-m-manual"

    def visit_Module(self, node: cst.Module) -> None:
        if any(k in self.ctx.names for k in ("use_cuda", "use_device", "emit_nvtx")):
            self._report_legacy()
        refs = device_profiling(self.ctx)
        if refs:
            for r in refs:
                activity = activity_of(self.ctx, r)
                if activity is not None and activity not in ACTIVITY_MAP:
                    self.manual(self.ctx.parent(r), f"ProfilerActivity.{activity}: no torch_npu twin", op=activity)
            self._report_gaps()

    def _report_gaps(self) -> None:
        ctx = self.ctx
        for n in ctx.order:
            if isinstance(n, cst.Attribute) and n.attr.value in NO_TABLES and isinstance(ctx.parent(n), cst.Call):
                self.manual(
                    n,
                    f".{n.attr.value}() of a profile: torch_npu's profile has no such table",
                    op=n.attr.value,
                    tip="read the results with torch_npu.profiler.analyse / MindStudio Insight from the trace directory",
                )
            elif isinstance(n, cst.SimpleString) and "cuda_time" in (string_value(n) or ""):
                self.manual(
                    n,
                    f"{n.value}: no CUDA times in an NPU profile",
                    op=string_value(n) or "",
                    tip="use the npu_time keys",
                )
            elif (
                isinstance(n, cst.Arg)
                and n.keyword is not None
                and n.keyword.value in ("experimental_config", "use_gzip")
            ):
                call = ctx.parent(n)
                if isinstance(call, cst.Call) and mapped_name(ctx, call.func) in (
                    "profile",
                    "tensorboard_trace_handler",
                ):
                    self.manual(
                        n,
                        f"{n.keyword.value}= of torch's profiler: not accepted by torch_npu's",
                        op=n.keyword.value,
                        tip="experimental_config: torch_npu.profiler._ExperimentalConfig(profiler_level=..., "
                        "aic_metrics=...); use_gzip: no option (transfer_to_npu drops experimental_config)",
                    )

    def _report_legacy(self) -> None:
        for n in self.ctx.order:
            if isinstance(n, cst.Call) and self.ctx.qnames(n.func) & LEGACY:
                if any(
                    a.keyword and a.keyword.value in ("use_cuda", "use_device") for a in n.args
                ) or "emit_nvtx" in self.ctx.code(n.func):
                    self.manual(
                        n,
                        f"{self.ctx.code(n.func)}: CUDA timing of the autograd profiler",
                        op="torch.autograd.profiler",
                        tip=LEGACY_TIP,
                    )
