"""PY120: tensor type strings ('torch.cuda.FloatTensor') where they are compared with a tensor's type
-> 'torch.npu.*' (docs/sources.md#tensor-type-strings).

On an NPU, ``tensor.type()`` and ``torch.typename(tensor)`` name the type ``torch.npu.FloatTensor``:
code that compares them with ``'torch.cuda.*'`` takes its else branch (Megatron's mixed-precision
optimizers raise there). Rewritten only where the string is an operand of such a comparison, an
element of a collection that is one (also through a name bound to the collection), or the
argument of ``tensor.type(...)``; never in docstrings, messages or other strings.
"""

from __future__ import annotations

import re

import libcst as cst

from parabench.migrate import api_map
from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyContext, PyRule, dotted, replace_in_simple_string, string_value

TYPE_STRING = re.compile(r"^torch\.cuda\.(\w+)$")
TYPENAME_CALLS = frozenset({"torch.typename"})


@register
class TensorTypeString(PyRule):
    code = "PY120"
    name = "tensor-type-string"
    description = (
        "'torch.cuda.FloatTensor'-style strings compared with tensor.type() / torch.typename() "
        "(also in lists/sets used for that, and tensor.type('...') arguments) -> 'torch.npu.*'"
    )
    safety = REVIEW
    source = "docs/sources.md#tensor-type-strings, docs/sources.md#npu-api-twins"

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        value = string_value(node)
        m = TYPE_STRING.match(value or "")
        if m is None or m.group(1) not in api_map.LEGACY_TYPES or value not in node.value:
            return
        how = _type_role(self.ctx, node)
        if how:
            new = value.replace("torch.cuda.", "torch.npu.", 1)
            self.change(
                node,
                lambda n: replace_in_simple_string(n, "torch.cuda.", "torch.npu."),
                f"'{value}' ({how}) -> '{new}'",
                op=value,
                tip="an NPU tensor's type() is torch.npu.*; keep both names if the code also runs on CUDA",
            )


def _type_role(ctx: PyContext, node: cst.CSTNode) -> str:
    """How the string takes part in a tensor-type test: 'comparison', 'collection', 'type() argument'; '' if not."""
    p = ctx.parent(node)
    if isinstance(p, cst.Arg) and p.keyword is None and _is_type_call(ctx, ctx.parent(p), with_args=True):
        return "type() argument"
    child = node
    if isinstance(p, cst.Element):  # an element: the role is the collection's
        child = ctx.parent(p)
        if not isinstance(child, (cst.List, cst.Tuple, cst.Set)):
            return ""
        p = ctx.parent(child)
        if _wrapped_in_set_call(ctx, p):  # frozenset([...]) / set([...])
            child = ctx.parent(p)
            p = ctx.parent(child)
        if isinstance(p, (cst.Assign, cst.AnnAssign)) and p.value is child:
            return "collection" if _name_compared_with_type(ctx, p) else ""
    if isinstance(p, (cst.Comparison, cst.ComparisonTarget)):
        comp = p if isinstance(p, cst.Comparison) else ctx.parent(p)
        operands = [comp.left] + [t.comparator for t in comp.comparisons]
        if any(o is not child and _is_type_query(ctx, o) for o in operands):
            return "comparison" if child is node else "collection"
    return ""


def _wrapped_in_set_call(ctx: PyContext, arg: cst.CSTNode | None) -> bool:
    call = ctx.parent(arg) if isinstance(arg, cst.Arg) else None
    return isinstance(call, cst.Call) and bool(ctx.qnames(call.func) & {"builtins.set", "builtins.frozenset"})


def _is_type_call(ctx: PyContext, call: cst.CSTNode | None, *, with_args: bool = False) -> bool:
    """``x.type()`` (``x.type('...')`` with ``with_args``); ``torch.typename(x)``."""
    if not isinstance(call, cst.Call):
        return False
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value == "type" and not ctx.is_import(func):
        return bool(call.args) if with_args else not call.args
    return not with_args and bool(ctx.qnames(func) & TYPENAME_CALLS)


def _is_type_query(ctx: PyContext, node: cst.CSTNode) -> bool:
    """A tensor's type name: ``x.type()``, ``torch.typename(x)``, or a name holding one."""
    if _is_type_call(ctx, node):
        return True
    name = node.value if isinstance(node, cst.Name) else node.attr.value if isinstance(node, cst.Attribute) else ""
    return bool(name) and _bound_to_type_call(ctx, name)


def _bound_to_type_call(ctx: PyContext, name: str) -> bool:
    """Is ``name`` assigned ``x.type()`` / ``torch.typename(x)`` somewhere in the file?"""
    cache = ctx.cache.setdefault("PY120.type_names", {})
    if name not in cache:
        cache[name] = any(
            isinstance(a := ctx.parent(ctx.parent(n)), cst.Assign) and _is_type_call(ctx, a.value)
            for n in ctx.names.get(name, [])
            if isinstance(ctx.parent(n), cst.AssignTarget)
        )
    return cache[name]


def _name_compared_with_type(ctx: PyContext, assign: cst.Assign | cst.AnnAssign) -> bool:
    """Is the name the collection is bound to (``TYPES = [...]``, ``self.TYPES = [...]``) the
    right side of ``<type query> in NAME`` anywhere in the file?"""
    targets = [t.target for t in assign.targets] if isinstance(assign, cst.Assign) else [assign.target]
    for target in targets:
        name = dotted(target)
        if name is None:
            continue
        last = name.split(".")[-1]
        for use in ctx.names.get(last, []):
            holder = ctx.parent(use) if isinstance(ctx.parent(use), cst.Attribute) else use
            if isinstance(ctx.parent(use), cst.Attribute) and ctx.parent(use).attr is not use:
                continue
            target_node = ctx.parent(holder)
            if isinstance(target_node, cst.ComparisonTarget) and isinstance(target_node.operator, (cst.In, cst.NotIn)):
                comp = ctx.parent(target_node)
                if _is_type_query(ctx, comp.left):
                    return True
    return False
