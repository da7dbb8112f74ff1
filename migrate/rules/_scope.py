"""Which binding a name refers to: function scopes, for names an import binds (issue #13, scope).

``import torch`` at the top of a file and ``def f(torch): torch.cuda...`` inside it: the parameter
is not the module. Python resolves a name in the innermost function (or lambda) that binds it -
a parameter, an assignment or loop target, a ``with``/``except`` name, a ``def``, an import in that
function - else in the module (The Python Language Reference, 4.2.2 "Resolution of names";
class bodies do not enclose their methods). Only names that some import binds are looked up
here, and only when the file also binds them otherwise (``shadowed``), so the common file costs
one scan of those names' occurrences.
"""

from __future__ import annotations

from collections.abc import Callable

import libcst as cst

_SCOPES = (cst.FunctionDef, cst.Lambda)
_THROUGH = (cst.Tuple, cst.List, cst.Element, cst.StarredElement)  # `a, (b, *c) = ...`


def resolve(ctx, node: cst.Name, bind: Callable) -> set[str] | None:
    """Qualified names of the imports ``node`` refers to; None when a local binding that is not an
    import shadows them (a parameter, ``torch = ...``, ``for cuda in ...``). ``bind(stmt, dict)``
    records the names an import statement binds (rules._py._bind)."""
    table = _table(ctx, bind)
    entry = table.get(node.value)
    if entry is None:
        return set(ctx._imports[node.value])
    for scope in _enclosing(ctx, node):
        found = entry.get(scope)
        if found is not None:
            return set(found) if found else None
    return set(ctx._imports[node.value])


def same_binding(ctx, use: cst.Name, target: cst.Name, bind: Callable) -> bool:
    """Does ``use`` refer to the binding that ``target`` (an assignment target) makes?"""
    if use.value not in _table(ctx, bind):
        return True
    owner = _scope_of(ctx, target)
    table = _table(ctx, bind)[use.value]
    return next((s for s in _enclosing(ctx, use) if s in table), None) is owner


def _table(ctx, bind: Callable) -> dict[str, dict[cst.CSTNode | None, set[str]]]:
    """name -> scope (a FunctionDef/Lambda, None for the module) -> import qnames bound there
    (empty: bound only otherwise), for import-bound names that are bound otherwise too."""
    cached = ctx.cache.get("scope_table")
    if cached is not None:
        return cached
    table: dict[str, dict] = {}
    for name in ctx._imports:
        binders = [n for n in ctx.names.get(name, ()) if _binds(ctx, n)]
        if binders:
            scopes = table.setdefault(name, {})
            for n in binders:
                scopes.setdefault(_scope_of(ctx, n), set())
    for stmt in ctx.import_nodes:
        scope = _scope_of(ctx, stmt)
        if scope is not None:  # an import inside a function binds there only
            bound: dict[str, set[str]] = {}
            bind(stmt, bound)
            for name, quals in bound.items():
                table.setdefault(name, {}).setdefault(scope, set()).update(quals)
    if table:
        module: dict[str, set[str]] = {}  # what the module's own imports bind
        for stmt in ctx.import_nodes:
            if _scope_of(ctx, stmt) is None:
                bind(stmt, module)
        for name, scopes in table.items():  # module level: its imports win (`except ImportError: x = None`)
            scopes[None] = scopes.get(None, set()) | module.get(name, set())
    ctx.cache["scope_table"] = table
    return table


def _binds(ctx, n: cst.Name) -> bool:
    """Is this occurrence of a name a binding (not a use)?"""
    child, p = n, ctx.parent(n)
    while isinstance(p, _THROUGH):
        child, p = p, ctx.parent(p)
    if isinstance(p, cst.Param):
        return p.name is n
    if isinstance(p, (cst.AssignTarget, cst.AsName)):
        return True
    if isinstance(p, (cst.AnnAssign, cst.AugAssign, cst.For, cst.NamedExpr)):
        return p.target is child
    if isinstance(p, (cst.FunctionDef, cst.ClassDef)):
        return p.name is n
    return False


def _scope_of(ctx, node: cst.CSTNode) -> cst.CSTNode | None:
    """The function or lambda whose local ``node`` (a binding or an import statement) is."""
    p = ctx.parent(node)
    if isinstance(p, (cst.FunctionDef, cst.ClassDef)) and p.name is node:
        p = ctx.parent(p)  # `def torch():` binds in the enclosing scope
    while p is not None:
        if isinstance(p, _SCOPES):
            return p
        p = ctx.parent(p)
    return None


def _enclosing(ctx, node: cst.CSTNode):
    """Scopes a reference looks in, innermost first, the module (None) last."""
    p = ctx.parent(node)
    while p is not None:
        if isinstance(p, _SCOPES):
            yield p
        p = ctx.parent(p)
    yield None
