"""PY113: NVTX markers -> torch_npu's mstx (docs/sources.md#mstx-markers).

``mark``/``range_start``/``range_end`` have mstx twins of the same meaning. NVTX's stack API
(``range_push``/``range_pop``, the ``range`` context manager and decorator) has none: mstx ranges
are ids that ``range_start`` returns and ``range_end`` takes. Those calls go to small helpers the
rule adds after the file's imports, a stack of mstx range ids, so a migrated script keeps its
annotations and runs to its end (annotations never change numerics).
"""

from __future__ import annotations

import libcst as cst

from parabench.migrate import api_map
from parabench.migrate.core import REVIEW, Finding
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import ModuleRule, PyContext, PyRule, cuda_refs, insert_statements, top_imports
from parabench.migrate.rules.rt001_transfer_to_npu import after_docstring

HELPERS_KEY = "PY113.helpers"
STACK = frozenset(api_map.NVTX_STACK.values())

_PUSH_POP = '''_mstx_range_ids = []  # [bench migrate] torch.cuda.nvtx push/pop on torch_npu's mstx: open range ids


def _mstx_range_push(msg):
    """[bench migrate] torch.cuda.nvtx.range_push on mstx, which has no stack of its own:
    range_start returns an id that range_end takes."""
    from torch_npu.npu import mstx

    _mstx_range_ids.append(mstx.range_start(msg))
    return len(_mstx_range_ids) - 1


def _mstx_range_pop():
    """[bench migrate] torch.cuda.nvtx.range_pop on mstx: ends the innermost open range."""
    from torch_npu.npu import mstx

    if not _mstx_range_ids:
        return -1
    mstx.range_end(_mstx_range_ids.pop())
    return len(_mstx_range_ids)
'''

_RANGE = '''

class _mstx_range:
    """torch.cuda.nvtx.range(msg, *args, **kwargs) on mstx: a context manager and a decorator."""

    def __init__(self, msg, *args, **kwargs):
        self.msg = msg.format(*args, **kwargs)

    def __enter__(self):
        _mstx_range_push(self.msg)

    def __exit__(self, *exc):
        _mstx_range_pop()

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return wrapper
'''


@register
class Nvtx(PyRule, ModuleRule):
    code = "PY113"
    name = "nvtx-to-mstx"
    description = (
        "torch.cuda.nvtx.mark/range_start/range_end -> torch.npu.mstx.* (also `from torch.cuda import nvtx`); "
        "range_push/range_pop/range -> a stack of mstx range ids added to the file"
    )
    safety = REVIEW
    needs_torch_npu = True
    source = "docs/sources.md#mstx-markers, docs/sources.md#class-s-review"
    tip = "mstx.range_start needs an NPU stream argument in some torch_npu versions"
    stack_tip = "NVTX's per-thread stack becomes one stack per file: ranges pushed in one thread and popped in another pair up differently"

    def __init__(self, ctx: PyContext | None = None):  # PyRule: a visitor over ctx; ModuleRule: post() only
        super().__init__(ctx)

    def visit_Module(self, node: cst.Module) -> None:
        refs = cuda_refs(self.ctx)
        for use in refs.direct:
            if use.category != "nvtx":
                continue
            if use.data in STACK:
                self._to_helper(use)
                continue
            nvtx_attr = self.ctx.parent(use.node)  # <torch>.cuda.nvtx
            self.change(
                nvtx_attr,
                lambda n: n.with_changes(value=n.value.with_changes(attr=cst.Name("npu")), attr=cst.Name("mstx")),
                f"torch.cuda.{use.path} -> torch.npu.mstx.{use.data}",
                op=f"torch.cuda.{use.path}",
                tip=self.tip,
            )
        for b in refs.bindings:
            if b.decision != "nvtx":
                continue
            self._binding(b)
            for use in b.uses:
                if use.data in STACK:
                    self._to_helper(use)

    def _to_helper(self, use) -> None:
        if self.change(
            use.outer,
            lambda n, name=use.data: cst.Name(name),
            f"torch.cuda.{use.path} -> {use.data} (mstx range ids on a stack, added to this file)",
            op=f"torch.cuda.{use.path}",
            tip=self.stack_tip,
        ):
            self.ctx.cache.setdefault(HELPERS_KEY, set()).add(use.data)

    def _binding(self, b) -> None:
        if isinstance(b.stmt, cst.ImportFrom) and len(b.stmt.names) == 1:
            local = b.alias.asname.name.value if b.alias.asname else "nvtx"

            def fn(stmt: cst.ImportFrom, local=local) -> cst.ImportFrom:
                alias = cst.ImportAlias(name=cst.Name("mstx"), asname=cst.AsName(name=cst.Name(local)))
                return stmt.with_changes(module=cst.parse_expression("torch.npu"), names=[alias])

            self.change(
                b.stmt,
                fn,
                f"from torch.cuda import nvtx -> from torch.npu import mstx as {local}",
                op="torch.cuda.nvtx",
                tip=self.tip,
            )
        elif isinstance(b.stmt, cst.Import):
            self.change(
                b.alias.name,
                lambda n: cst.parse_expression("torch_npu.npu.mstx"),
                "import torch.cuda.nvtx -> torch_npu.npu.mstx",
                op="torch.cuda.nvtx",
                tip=self.tip,
            )

    def post(self, original: cst.Module, new: cst.Module, ctx: PyContext) -> cst.Module:
        """Add the stack helpers the rewritten calls use, after the file's top-level imports."""
        helpers = ctx.cache.get(HELPERS_KEY)
        if not helpers:
            return new
        code = _PUSH_POP + (_RANGE if "_mstx_range" in helpers else "")
        imports = top_imports(original)
        at = imports[-1][0] + 1 if imports else after_docstring(original)
        line = ctx.body_line(at)
        ctx.findings.append(
            Finding(
                self.code,
                self.safety,
                line,
                line,
                f"added the mstx range stack ({', '.join(sorted(helpers))})",
                op="torch.cuda.nvtx",
                after="_mstx_range_ids = []",
            )
        )
        # right after the imports' text and after any import other rules add there: the place before the
        # next statement's leading lines, which a partial parse (parse_plan._select) can also splice exactly
        return insert_statements(ctx, new, at, code, after=at > 0, blank_lines=2, behind_inserts=True)
