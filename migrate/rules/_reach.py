"""Does a plain 'cuda' literal reach a device position? (issue #13, class 5: strings by role).

PY103 rewrites 'cuda' where the syntax says it is a device (device=, torch.device(...), .to(...),
a variable named *device*, a device comparison). Anywhere else a 'cuda' is a log prefix, a metric
key, a value written to a checkpoint, a lookup key, a label - unless it provably flows into one of
those positions. PY104 asks here, and rewrites only then:

- an argparse option that names a device (``--device``, ``--accelerator``): its default/choices
  are what ``args.device`` hands to the code;
- ``name = 'cuda'`` (also through ``x if c else y``) where a use of that binding of ``name`` is
  in a device position;
- ``return 'cuda'`` from a function named for a device (``get_device``) that has no NPU branch of
  its own (one that has one returns 'cuda' as its CUDA fallback: left alone);
- a dict key 'cuda' of ``table = {...}`` that the code looks up with a device
  (``table[device]``, ``table.get(device.type)``): the key and every literal lookup
  ``table['cuda']`` move together, so no lookup raises KeyError.
"""

from __future__ import annotations

import libcst as cst

from parabench.migrate.rules import _scope
from parabench.migrate.rules._py import (
    DEVICE_RE,
    PyContext,
    _bind,
    _is_reference,
    _role_holder,
    dotted,
    string_role,
    string_value,
)
from parabench.migrate.rules._walk import walk

DEVICE_POSITIONS = frozenset({"device", "compare-device"})
_DEVICE_WORDS = ("device", "accel")


def reaches_device(ctx: PyContext, node: cst.CSTNode, role: str) -> str | None:
    """Why the 'cuda' literal ``node`` (of ``role``) names a device, or None when it may not."""
    child, p = _role_holder(ctx, node)
    if role == "arg" and isinstance(p, cst.Arg):
        return _argparse_device(ctx, p)
    if role != "other":
        return None
    if isinstance(p, (cst.Assign, cst.AnnAssign)) and getattr(p, "value", None) is child:
        targets = [t.target for t in p.targets] if isinstance(p, cst.Assign) else [p.target]
        if len(targets) == 1 and isinstance(targets[0], cst.Name):
            return _name_reaches_device(ctx, targets[0])
        return None
    if isinstance(p, cst.Return):
        return _device_function_return(ctx, p)
    return None


def _argparse_device(ctx: PyContext, arg: cst.Arg) -> str | None:
    call = ctx.parent(arg)
    func = call.func if isinstance(call, cst.Call) else None
    if not isinstance(func, cst.Attribute) or func.attr.value != "add_argument":
        return None
    if arg.keyword is None or arg.keyword.value not in ("default", "choices", "const"):
        return None
    flags = [string_value(a.value) or "" for a in call.args if a.keyword is None]
    dest = next((string_value(a.value) for a in call.args if a.keyword and a.keyword.value == "dest"), None)
    names = " ".join([*flags, dest or ""]).lower()
    if any(w in names for w in _DEVICE_WORDS):
        return f"argparse option {flags[0] if flags else dest} names a device"
    return None


def _name_reaches_device(ctx: PyContext, target: cst.Name) -> str | None:
    for use in ctx.names.get(target.value, ()):
        if use is target or not _is_reference(ctx, use) or isinstance(ctx.parent(use), cst.AssignTarget):
            continue
        if not _scope.same_binding(ctx, use, target, _bind):
            continue
        if string_role(ctx, use) in DEVICE_POSITIONS:
            return f"{target.value} is used as a device (line {ctx.lines(use)[0]})"
    return None


def _device_function_return(ctx: PyContext, ret: cst.Return) -> str | None:
    fn = ctx.parent(ret)
    while fn is not None and not isinstance(fn, (cst.FunctionDef, cst.Lambda)):
        fn = ctx.parent(fn)
    if not isinstance(fn, cst.FunctionDef) or not any(w in fn.name.value.lower() for w in _DEVICE_WORDS):
        return None
    if _has_npu_branch(ctx, fn):
        return None
    return f"returned by {fn.name.value}()"


def _has_npu_branch(ctx: PyContext, fn: cst.FunctionDef) -> bool:
    for n in walk(fn)[0]:
        if (
            isinstance(n, cst.SimpleString)
            and (v := string_value(n))
            and v.startswith("npu")
            and DEVICE_RE.match(v.replace("npu", "cuda", 1))
        ):
            return True
        if isinstance(n, cst.Attribute) and any(q.startswith(("torch.npu", "torch_npu")) for q in ctx.qnames(n)):
            return True
    return False


# --- dict keys and their lookups ---------------------------------------------------------------


def key_group(ctx: PyContext, key: cst.SimpleString) -> list[cst.SimpleString] | None:
    """For a 'cuda' key of ``table = {...}`` looked up with a device somewhere: the key and every
    literal 'cuda' lookup of ``table`` (rewritten together); None otherwise."""
    element = ctx.parent(key)
    if not isinstance(element, cst.DictElement) or element.key is not key:
        return None
    d = ctx.parent(element)
    assign = ctx.parent(d)
    if not isinstance(assign, cst.Assign) or assign.value is not d or len(assign.targets) != 1:
        return None
    target = assign.targets[0].target
    if not isinstance(target, cst.Name):
        return None
    literal: list[cst.SimpleString] = []
    by_device = False
    for use in ctx.names.get(target.value, ()):
        if use is target or not _scope.same_binding(ctx, use, target, _bind):
            continue
        index = _lookup_index(ctx, use)
        if index is None:
            continue
        if isinstance(index, cst.SimpleString):
            if string_value(index) == string_value(key):
                literal.append(index)
        elif _device_expression(ctx, index):
            by_device = True
    return [key, *literal] if by_device else None


def _lookup_index(ctx: PyContext, use: cst.Name) -> cst.CSTNode | None:
    """``table[x]`` / ``table.get(x, ...)`` / ``table.pop(x)``: the x, else None."""
    p = ctx.parent(use)
    if isinstance(p, cst.Subscript) and p.value is use and len(p.slice) == 1:
        index = p.slice[0].slice
        return index.value if isinstance(index, cst.Index) else None
    if isinstance(p, cst.Attribute) and p.value is use and p.attr.value in ("get", "pop", "setdefault"):
        call = ctx.parent(p)
        if isinstance(call, cst.Call) and call.func is p and call.args and call.args[0].keyword is None:
            return call.args[0].value
    return None


def _device_expression(ctx: PyContext, expr: cst.CSTNode) -> bool:
    """An expression that holds a device name: ``device``, ``args.device``, ``x.device.type``..."""
    text = (dotted(expr) or "").lower()
    return "device" in text or text.endswith(".type")
