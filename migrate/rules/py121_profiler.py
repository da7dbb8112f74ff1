"""PY121: torch.profiler profiling CUDA -> torch_npu's profiler (docs/sources.md#npu-profiler).

On an NPU, ``torch.profiler.profile(activities=[..., ProfilerActivity.CUDA])`` records no device
activity. ``transfer_to_npu`` swaps ``torch.profiler.profile``, ``schedule``,
``tensorboard_trace_handler``, ``ProfilerAction`` and ``ProfilerActivity.CUDA/CPU`` for torch_npu's
at run time; this rule writes the same swap into the file, for every reference at once (torch_npu's
profile calls its own schedule and compares its own enums), when the file profiles the device: it
names ``ProfilerActivity.CUDA`` or calls ``profile(...)`` without ``activities`` (torch's default
includes the device). What torch_npu's profiler does not offer is reported by PY918.
"""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyContext, PyRule

MAPPED = ("profile", "schedule", "tensorboard_trace_handler", "ProfilerActivity", "ProfilerAction")
MODULES = ("torch.profiler", "torch.profiler.profiler")
ACTIVITY_HOMES = ("torch.autograd.ProfilerActivity", "torch._C._profiler.ProfilerActivity")
ACTIVITY_MAP = {"CUDA": "NPU", "CPU": "CPU"}
LEGACY = frozenset({"torch.autograd.profiler.profile", "torch.autograd.profile", "torch.autograd.profiler.emit_nvtx"})
NO_TABLES = frozenset({"key_averages", "events", "total_average"})
LEGACY_TIP = (
    "torch_npu has no use_cuda/NVTX mode of the autograd profiler: use "
    "torch_npu.profiler.profile(activities=[torch_npu.profiler.ProfilerActivity.CPU, "
    "torch_npu.profiler.ProfilerActivity.NPU]), and torch_npu.npu.mstx for annotations"
)


def mapped_name(ctx: PyContext, node: cst.CSTNode) -> str | None:
    """The torch.profiler member (of MAPPED) an expression denotes, else None."""
    for q in sorted(ctx.qnames(node)):
        mod, _, name = q.rpartition(".")
        if name in MAPPED and mod in MODULES or q in ACTIVITY_HOMES:
            return name
    return None


def device_profiling(ctx: PyContext) -> list[cst.CSTNode]:
    """The references PY121 rewrites: every mapped member the file uses, when the file profiles
    the device (names ``ProfilerActivity.CUDA`` or calls ``profile(...)`` without ``activities``);
    else none. Cached per file (PY918 asks too)."""
    cached = ctx.cache.get("PY121.refs")
    if cached is None:
        refs = _references(ctx)
        device = any(activity_of(ctx, r) == "CUDA" for r in refs) or any(
            _is_call(ctx, r) and not any(a.keyword and a.keyword.value == "activities" for a in ctx.parent(r).args)
            for r in refs
            if mapped_name(ctx, r) == "profile"
        )
        cached = ctx.cache["PY121.refs"] = refs if device else []
    return cached  # type: ignore[return-value]


def _references(ctx: PyContext) -> list[cst.CSTNode]:
    """Outermost expressions that denote a mapped member (``torch.profiler.profile``, an
    imported ``schedule``, ``ProfilerActivity``)."""
    out: list[cst.CSTNode] = []
    local = [
        k
        for k, quals in ctx._imports.items()
        if any(q.startswith(("torch.profiler.", "torch.autograd.", "torch._C.")) for q in quals)
    ]
    for key in (*MAPPED, *local):
        for n in ctx.names.get(key, ()):
            p = ctx.parent(n)
            node = p if isinstance(p, cst.Attribute) and p.attr is n else n
            up = ctx.parent(node)
            if node in out or isinstance(up, cst.Attribute) and up.value is node and mapped_name(ctx, up):
                continue  # seen, or part of a longer chain that is itself mapped
            if mapped_name(ctx, node):
                out.append(node)
    return out


def activity_of(ctx: PyContext, node: cst.CSTNode) -> str | None:
    p = ctx.parent(node)
    if mapped_name(ctx, node) == "ProfilerActivity" and isinstance(p, cst.Attribute) and p.value is node:
        return p.attr.value
    return None


def _is_call(ctx: PyContext, node: cst.CSTNode) -> bool:
    p = ctx.parent(node)
    return isinstance(p, cst.Call) and p.func is node


@register
class Profiler(PyRule):
    code = "PY121"
    name = "profiler-to-npu"
    description = (
        "torch.profiler profile/schedule/tensorboard_trace_handler/ProfilerActivity.CUDA -> torch_npu.profiler.* "
        "(ProfilerActivity.NPU), all references of a file that profiles the device (what does not map: PY918)"
    )
    safety = REVIEW
    source = "docs/sources.md#npu-profiler, docs/sources.md#transfer-to-npu"
    tip = "torch_npu writes its trace for offline analysis (tensorboard_trace_handler dir / torch_npu.profiler.analyse)"

    def visit_Module(self, node: cst.Module) -> None:
        for r in device_profiling(self.ctx):
            self._rewrite(r)

    def _rewrite(self, node: cst.CSTNode) -> None:
        name = mapped_name(self.ctx, node)
        target, new = node, f"torch_npu.profiler.{name}"
        activity = activity_of(self.ctx, node)
        if activity is not None:
            if activity not in ACTIVITY_MAP:
                return  # PY918 reports it
            target, new = self.ctx.parent(node), f"torch_npu.profiler.ProfilerActivity.{ACTIVITY_MAP[activity]}"
        before = self.ctx.code(target)
        self.change(
            target,
            lambda n, new=new: cst.parse_expression(new),
            f"{before} -> {new}",
            op=f"torch.profiler.{name}" + (f".{activity}" if activity else ""),
            tip=self.tip,
        )
