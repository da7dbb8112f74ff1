"""Guard analysis: a CUDA check is migrated only together with everything it guards.

On a machine without CUDA, ``torch.cuda.is_available()`` is False, ``device_count()`` is 0,
``x.is_cuda`` is False and ``device.type == 'cuda'`` is False. Migrated, the same checks ask for the
NPU and are True on one, so the code they kept out of reach runs: the if-body, the ``and``
operands after the check, the other arm of a conditional expression, the code after
``if not torch.cuda.is_available(): return ...`` or after ``assert torch.cuda.is_available()``.
Where that code still holds something CUDA-only after migration - a manual item of any rule, a
torch.cuda member without an NPU twin, a CUDA-only package (flash_attn, pynvml, apex, triton ...)
- the check's rewrite is withdrawn and reported (PY914): the input ran on a machine without CUDA
by taking the fallback, the output must too (docs/sources.md#guard-safety).

Each check is evaluated with the values it had before migration on a machine without CUDA, in
Kleene's three-valued logic (anything else is unknown); a branch whose test is then certainly
false (or, for the else side, certainly true) was unreachable there. Names assigned a check once in
the file (``use_cuda = torch.cuda.is_available()``) carry its value to the tests that read them.
``parabench.migrate.guardcheck`` checks the same property on the output text, independently.
"""

from __future__ import annotations

import dataclasses
import operator
import re

import libcst as cst

from parabench.migrate import api_map
from parabench.migrate.core import MANUAL, Finding
from parabench.migrate.rules._base import all_rules
from parabench.migrate.rules._py import PyContext, _climb, cuda_refs, dotted, string_value

CODE = "PY914"
# calls that answer "is there CUDA here?" -> their value on a machine without CUDA
GUARD_CALLS: dict[str, object] = {
    "torch.cuda.is_available": False,
    "torch.cuda.is_initialized": False,
    "torch.cuda.is_bf16_supported": False,
    "torch.cuda.device_count": 0,
    "torch.distributed.is_nccl_available": False,
    "torch.distributed.distributed_c10d.is_nccl_available": False,
}
UNKNOWN = object()  # Kleene's third value
_COMPARE = {
    cst.Equal: operator.eq,
    cst.NotEqual: operator.ne,
    cst.LessThan: operator.lt,
    cst.LessThanEqual: operator.le,
    cst.GreaterThan: operator.gt,
    cst.GreaterThanEqual: operator.ge,
}
# a string operand equal to 'cuda' before migration: `x == 'cuda'` is False without CUDA
_STRING_COMPARE = {cst.Equal: False, cst.In: False, cst.Is: False, cst.NotEqual: True, cst.NotIn: True, cst.IsNot: True}
_HOST_DEVICES = frozenset({"cpu", "meta"})
# test skips -> whether the test runs when the condition is true (issue #29 class 2)
SKIP_CALLS: dict[str, bool] = {
    "unittest.skipIf": False,
    "unittest.case.skipIf": False,
    "pytest.mark.skipif": False,
    "unittest.skipUnless": True,
    "unittest.case.skipUnless": True,
}
_CUDA_SETTING = re.compile(r"^[A-Z0-9_]*_CUDA(?:_[A-Z0-9_]*)?$|^CUDA_[A-Z0-9_]+$")
_CUDA_ONLY_REASON = re.compile(
    r"cuda[- ]only|only (?:supported )?(?:on |for |with |supports? )?(?:nvidia |an? )?(?:cuda|nvidia)|cuda kernel|triton"
    r"|requires? (?:the |an? )?(?:nvidia|cuda)",
    re.IGNORECASE,
)
_OWNER = {"supported": "PY101", "module": "PY101", "replace": "PY101", "legacy": "PY108", "nvtx": "PY113"}


@dataclasses.dataclass
class _Atom:
    node: cst.CSTNode  # the expression whose value the migration flips
    value: object  # its value before migration on a machine without CUDA
    edits: list[cst.CSTNode]  # the edited nodes that flip it


def keep_unsafe_guards(ctx: PyContext) -> None:
    """Withdraw the edits that flip a check guarding code that stays CUDA-only; report each (PY914)."""
    atoms = _atoms(ctx)
    if not atoms:
        return
    names = _guard_names(ctx, atoms)
    cuda_only: dict[cst.CSTNode, str] | None = None
    unsafe: dict[cst.CSTNode, tuple[cst.CSTNode, str]] = {}
    for cond in _conditions(ctx, atoms, names):
        regions, used = _regions(ctx, cond, atoms, names)
        if not used or all(a in unsafe for a in used):
            continue
        if cuda_only is None:
            cuda_only = _cuda_only(ctx)
        hit = _first_inside(ctx, cuda_only, regions) if regions else None
        skip = isinstance(cond, cst.Call) and not isinstance(ctx.parent(cond), cst.For)
        if hit is None and (skip and regions or _fails_without_cuda(cond, atoms, names)):
            hit = _cuda_only_reason(ctx, cond)
        if hit is not None:
            # the whole test stays: `x.is_cuda and y.is_cuda` with one half migrated asks for both devices
            test = _test_of(cond)
            for a in [*used, *_atoms_inside(ctx, atoms, test)]:
                unsafe.setdefault(a, hit)
    if unsafe:
        _withdraw(ctx, [atoms[a] for a in unsafe], unsafe)


def _raises(block: cst.CSTNode) -> list[cst.CSTNode]:
    """The ``raise X(...)`` or ``return "<why not>"`` that a block consists of (``if not x.is_cuda:
    raise ...``), if it does."""
    body = block.body if isinstance(block, (cst.IndentedBlock, cst.SimpleStatementSuite)) else ()
    if len(body) != 1:
        return []
    line = body[0]
    small = line.body if isinstance(line, cst.SimpleStatementLine) else [line]
    return [
        s
        for s in small
        if isinstance(s, cst.Raise)
        and s.exc is not None
        or isinstance(s, cst.Return)
        and isinstance(s.value, (cst.SimpleString, cst.FormattedString))
    ]


def _fails_without_cuda(cond: cst.CSTNode, atoms: dict, names: dict) -> bool:
    """An assert that fails, or an ``if ...: raise`` that raises, on a machine without CUDA: the
    check keeps what follows from CUDA-less machines, and its message may say why."""
    if isinstance(cond, cst.Assert):
        value = _eval(cond.test, atoms, names, [], [], 0)
        return value is not UNKNOWN and not value
    if isinstance(cond, cst.If) and _raises(cond.body):
        value = _eval(cond.test, atoms, names, [], [], 0)
        return value is not UNKNOWN and bool(value)
    return False


def _test_of(cond: cst.CSTNode) -> cst.CSTNode:
    if isinstance(cond, (cst.BooleanOperation, cst.IfExp)):
        return cond
    return cond.args[0].value if isinstance(cond, cst.Call) else cond.test


def _atoms_inside(ctx: PyContext, atoms: dict, root: cst.CSTNode) -> list[cst.CSTNode]:
    out = []
    for node in atoms:
        cur = node
        while cur is not None and cur is not root:
            cur = ctx.parent(cur)
        if cur is root:
            out.append(node)
    return out


# --- the checks whose value the migration flips --------------------------------------------------


def _atoms(ctx: PyContext) -> dict[cst.CSTNode, _Atom]:
    atoms: dict[cst.CSTNode, _Atom] = {}

    def add(found, edit) -> None:
        if found is not None:
            node, value = found
            atom = atoms.setdefault(node, _Atom(node, value, []))
            if edit not in atom.edits:
                atom.edits.append(edit)

    for edit in ctx.edits:
        if isinstance(edit, (cst.SimpleString, cst.FormattedString)):
            add(_string_atom(ctx, edit), edit)
        elif isinstance(edit, cst.Attribute):
            add((edit, False) if edit.attr.value == "is_cuda" else _call_atom(ctx, _climb(ctx, edit)[0]), edit)
    # an import rewritten as a whole (`from torch import cuda` -> `... npu as cuda`) flips its uses
    by_stmt: dict[cst.CSTNode, list[cst.CSTNode]] = {}
    for edit in ctx.edits:
        if edit in ctx.in_import:
            stmt = edit
            while not isinstance(stmt, (cst.Import, cst.ImportFrom)):
                stmt = ctx.parent(stmt)
            by_stmt.setdefault(stmt, []).append(edit)
    for stmt, edited in by_stmt.items():
        for local in _bound_names(stmt):
            for use in ctx.names.get(local, ()):
                for edit in edited:
                    add(_call_atom(ctx, _climb(ctx, use)[0]), edit)
    return atoms


def _bound_names(stmt: cst.CSTNode) -> list[str]:
    if isinstance(stmt.names, cst.ImportStar):
        return []
    out = []
    for alias in stmt.names:
        name = alias.asname.name if alias.asname is not None else alias.name
        while isinstance(name, cst.Attribute):
            name = name.value
        if isinstance(name, cst.Name):
            out.append(name.value)
    return out


def _call_atom(ctx: PyContext, outer: cst.CSTNode) -> tuple[cst.CSTNode, object] | None:
    parent = ctx.parent(outer)
    if not isinstance(parent, cst.Call) or parent.func is not outer:
        return None
    hit = sorted(q for q in ctx.qnames(outer) if q in GUARD_CALLS)
    return (parent, GUARD_CALLS[hit[0]]) if hit else None


def _string_atom(ctx: PyContext, node: cst.CSTNode) -> tuple[cst.CSTNode, object] | None:
    parent = ctx.parent(node)
    if isinstance(parent, cst.Element) and isinstance(ctx.parent(parent), (cst.Tuple, cst.List, cst.Set)):
        # `device.type in ("cuda", "xpu")`: False without CUDA on the machine migrated to, unless
        # the literal also names the CPU (then the fallback takes the same branch)
        container = ctx.parent(parent)
        target = ctx.parent(container)
        if not isinstance(target, cst.ComparisonTarget) or target.comparator is not container:
            return None
        if any(string_value(e.value) in _HOST_DEVICES for e in container.elements):
            return None
        node, parent = container, target
    if isinstance(parent, cst.ComparisonTarget):
        comparison, op = ctx.parent(parent), parent.operator
    elif isinstance(parent, cst.Comparison) and parent.left is node:
        comparison, op = parent, parent.comparisons[0].operator
    else:
        return None
    value = _STRING_COMPARE.get(type(op))
    if value is None or len(comparison.comparisons) != 1:
        return None
    return comparison, value


def _guard_names(ctx: PyContext, atoms: dict[cst.CSTNode, _Atom]) -> dict[str, cst.CSTNode]:
    """``name = <expression holding a check>``, the only assignment of that name in the file."""
    out: dict[str, cst.CSTNode] = {}
    for atom in atoms.values():
        child, p = atom.node, ctx.parent(atom.node)
        while isinstance(p, (cst.BooleanOperation, cst.UnaryOperation, cst.Comparison, cst.ComparisonTarget)):
            child, p = p, ctx.parent(p)
        if isinstance(p, cst.Assign) and p.value is child and len(p.targets) == 1:
            target = p.targets[0].target
            if isinstance(target, cst.Name):
                stores = [n for n in ctx.names.get(target.value, ()) if isinstance(ctx.parent(n), cst.AssignTarget)]
                if len(stores) == 1:
                    out[target.value] = child
    return out


# --- the constructs a flipped check decides ------------------------------------------------------


def _conditions(ctx: PyContext, atoms: dict, names: dict[str, cst.CSTNode]) -> list[cst.CSTNode]:
    """If/While/Assert statements, conditional and boolean expressions whose test holds a check."""
    starts = list(atoms)
    for name in names:
        starts += [n for n in ctx.names.get(name, ()) if not isinstance(ctx.parent(n), cst.AssignTarget)]
    out: list[cst.CSTNode] = []
    seen: set[cst.CSTNode] = set()
    for start in starts:
        child, p = start, ctx.parent(start)
        while p is not None and not isinstance(p, (cst.SimpleStatementLine, cst.IndentedBlock, cst.Module)):
            decides = (
                isinstance(p, cst.BooleanOperation)
                or isinstance(p, (cst.IfExp, cst.If, cst.While, cst.Assert))
                and p.test is child
            )
            skip = _skip_call(ctx, p, child) or _range_loop(ctx, p, child)
            if (decides or skip) and p not in seen:
                seen.add(p)
                out.append(p)
            if isinstance(p, (cst.If, cst.While)) or skip:
                break
            child, p = p, ctx.parent(p)
    return out


def _skip_call(ctx: PyContext, p: cst.CSTNode, child: cst.CSTNode) -> bool:
    """Is ``p`` a test skip (``@unittest.skipIf(cond, ...)``, ``pytest.mark.skipif``, ``pytestmark =``)
    whose condition is ``child``? It guards the test it decorates (or the rest of the module)."""
    if not isinstance(p, cst.Call) or not p.args or p.args[0] is not child:
        return False
    if not ctx.qnames(p.func) & SKIP_CALLS.keys():
        return False
    holder = ctx.parent(p)
    return isinstance(holder, cst.Decorator) or isinstance(holder, cst.Assign) and holder.value is p


def _range_loop(ctx: PyContext, p: cst.CSTNode, child: cst.CSTNode) -> bool:
    """``for i in range(torch.cuda.device_count()):`` - the loop body runs only with a device."""
    if not isinstance(p, cst.Call) or len(p.args) != 1 or p.args[0] is not child:
        return False
    loop = ctx.parent(p)
    return isinstance(p.func, cst.Name) and p.func.value == "range" and isinstance(loop, cst.For) and loop.iter is p


def _skip_regions(ctx, cond: cst.Call, atoms, names, regions, used) -> None:
    """The test that a skip keeps from running on a machine without CUDA."""
    value = _eval(cond.args[0].value, atoms, names, regions, used, 0)
    runs_when = SKIP_CALLS[sorted(ctx.qnames(cond.func) & SKIP_CALLS.keys())[0]]
    if value is UNKNOWN or bool(value) == runs_when:
        return
    holder = ctx.parent(cond)
    regions += [ctx.parent(holder)] if isinstance(holder, cst.Decorator) else _rest(ctx, holder)


def _cuda_only_reason(ctx: PyContext, cond: cst.Call) -> tuple[cst.CSTNode, str] | None:
    """A skip whose reason, or an assert whose message, says what it guards is CUDA-only
    ("... CUDA-only", "only supports NVIDIA CUDA GPUs", "CUDA kernels")."""
    if isinstance(cond, cst.Call):
        reasons = [a.value for a in cond.args[1:]]
    elif isinstance(cond, cst.If):
        reasons = [r.exc if isinstance(r, cst.Raise) else r.value for r in _raises(cond.body)]
    else:
        reasons = [cond.msg] if cond.msg else []
    for node in reasons:
        text = " ".join(ctx.code(node).split())
        if _CUDA_ONLY_REASON.search(text):
            short = text if len(text) <= 80 else text[:77] + "..."
            return node, f"code its {'reason' if isinstance(cond, cst.Call) else 'message'} calls CUDA-only: {short}"
    return None


def _regions(ctx: PyContext, cond: cst.CSTNode, atoms: dict, names: dict) -> tuple[list[cst.CSTNode], list]:
    """(code unreachable before migration on a machine without CUDA, the checks that decided it)."""
    regions: list[cst.CSTNode] = []
    used: list[cst.CSTNode] = []
    if isinstance(cond, cst.Call) and isinstance(ctx.parent(cond), cst.For):
        if _eval(cond.args[0].value, atoms, names, regions, used, 0) == 0:
            regions.append(ctx.parent(cond).body)
        return regions, used
    if isinstance(cond, cst.Call):
        _skip_regions(ctx, cond, atoms, names, regions, used)
        return regions, used
    if isinstance(cond, (cst.BooleanOperation, cst.IfExp)):
        _eval(cond, atoms, names, regions, used, 0)
        return regions, used
    value = _eval(cond.test, atoms, names, regions, used, 0)
    orelse = getattr(cond, "orelse", None)
    if value is UNKNOWN:
        # `if triton_too_old and not torch.cuda.is_available(): HAVE_TRITON = False else: <Triton>`:
        # the check still decides between the branches; one that holds CUDA-only code keeps it
        if isinstance(cond, cst.If):
            regions += [cond.body, *([orelse] if orelse is not None else [])]
        return regions, used
    if isinstance(cond, cst.Assert):
        if not value:
            regions += _rest(ctx, cond)
    elif not value:
        regions.append(cond.body)
        if isinstance(cond, cst.If) and orelse is not None and _exits(_else_body(orelse)):
            regions += _rest(ctx, cond)
    elif isinstance(cond, cst.If):
        if orelse is not None:
            regions.append(orelse)
        if _exits(cond.body):
            regions += _rest(ctx, cond)
    return regions, used


def _eval(node, atoms, names, regions, used, depth):
    """Value of ``node`` before migration on a machine without CUDA (UNKNOWN when not known);
    operands that short-circuiting skips go to ``regions``, the checks consulted to ``used``."""
    atom = atoms.get(node)
    if atom is not None:
        used.append(node)
        return atom.value
    if depth > 20:
        return UNKNOWN
    t = type(node)
    if t is cst.Name:
        if node.value in ("True", "False"):
            return node.value == "True"
        expr = names.get(node.value)
        return UNKNOWN if expr is None else _eval(expr, atoms, names, regions, used, depth + 1)
    if t is cst.Integer:
        return int(node.value.replace("_", ""), 0)
    if t is cst.UnaryOperation and isinstance(node.operator, cst.Not):
        v = _eval(node.expression, atoms, names, regions, used, depth + 1)
        return UNKNOWN if v is UNKNOWN else not v
    if t is cst.BooleanOperation:
        return _eval_bool(node, atoms, names, regions, used, depth)
    if t is cst.IfExp:
        test = _eval(node.test, atoms, names, regions, used, depth + 1)
        if test is UNKNOWN:
            return UNKNOWN
        regions.append(node.orelse if test else node.body)
        return _eval(node.body if test else node.orelse, atoms, names, regions, used, depth + 1)
    if t is cst.Comparison and len(node.comparisons) == 1:
        fn = _COMPARE.get(type(node.comparisons[0].operator))
        left = _eval(node.left, atoms, names, regions, used, depth + 1)
        right = _eval(node.comparisons[0].comparator, atoms, names, regions, used, depth + 1)
        if fn is None or left is UNKNOWN or right is UNKNOWN:
            return UNKNOWN
        try:
            return fn(left, right)
        except TypeError:
            return UNKNOWN
    if t is cst.Call and isinstance(node.func, cst.Name) and node.func.value == "bool" and len(node.args) == 1:
        return _eval(node.args[0].value, atoms, names, regions, used, depth + 1)
    return UNKNOWN


def _eval_bool(node, atoms, names, regions, used, depth):
    is_and = isinstance(node.operator, cst.And)
    left = _eval(node.left, atoms, names, regions, used, depth + 1)
    if left is not UNKNOWN and bool(left) != is_and:  # `False and x`, `True or x`: x never runs
        regions.append(node.right)
        return left
    right = _eval(node.right, atoms, names, regions, used, depth + 1)
    if left is UNKNOWN:
        return right if right is not UNKNOWN and bool(right) != is_and else UNKNOWN
    return right


def _else_body(orelse: cst.CSTNode) -> cst.CSTNode | None:
    return orelse.body if isinstance(orelse, cst.Else) else None


def _exits(block: cst.CSTNode | None) -> bool:
    """Does the block end in return/raise/continue/break?"""
    if block is None:
        return False
    body = block.body if isinstance(block, (cst.IndentedBlock, cst.SimpleStatementSuite)) else ()
    last = body[-1] if body else None
    if isinstance(last, cst.SimpleStatementLine):
        last = last.body[-1] if last.body else None
    return isinstance(last, (cst.Return, cst.Raise, cst.Continue, cst.Break))


def _rest(ctx: PyContext, stmt: cst.CSTNode) -> list[cst.CSTNode]:
    """The statements after ``stmt`` up to the end of its function (or module)."""
    out: list[cst.CSTNode] = []
    cur = stmt
    if isinstance(ctx.parent(cur), cst.SimpleStatementLine):  # an assert: its line is the statement
        cur = ctx.parent(cur)
    while True:
        while isinstance(ctx.parent(cur), cst.If) and ctx.parent(cur).orelse is cur:  # an elif
            cur = ctx.parent(cur)
        block = ctx.parent(cur)
        if not isinstance(block, (cst.IndentedBlock, cst.Module)):
            return out
        at = next(i for i, s in enumerate(block.body) if s is cur)
        out += block.body[at + 1 :]
        owner = ctx.parent(block)
        if isinstance(owner, (cst.Else, cst.ExceptHandler, cst.Finally)):
            owner = ctx.parent(owner)
        if owner is None or isinstance(block, cst.Module) or isinstance(owner, (cst.FunctionDef, cst.ClassDef)):
            return out
        cur = owner


# --- what stays CUDA-only ------------------------------------------------------------------------


def _cuda_only(ctx: PyContext) -> dict[cst.CSTNode, str]:
    """Nodes that stay CUDA-only after migration -> what they are: every manual item and every
    change not applied, and (whichever rules are selected) torch.cuda members without an NPU
    twin and names of CUDA-only packages."""
    out: dict[cst.CSTNode, str] = {}
    for node, finding in ctx.finding_nodes:
        if not finding.applied:
            out.setdefault(node, finding.op or finding.message)
    refs = cuda_refs(ctx)
    for use in refs.direct:
        owner = _OWNER.get(use.category)
        if owner is None or owner not in ctx.active:
            out.setdefault(use.outer, f"torch.cuda.{use.path}".rstrip("."))
    for b in refs.bindings:
        if b.decision == "blocked" or b.decision == "npu" and "PY101" not in ctx.active:
            for use in b.uses:
                out.setdefault(use.outer, f"torch.cuda.{use.path}".rstrip("."))
    for local, quals in ctx._imports.items():
        module = next((q for q in sorted(quals) if api_map.cuda_only_module_tip(q, ctx.options.local_packages)), None)
        if module is not None:
            for use in ctx.names.get(local, ()):
                out.setdefault(use, module)
    for name, module in _cuda_kernels(ctx):
        for use in ctx.names.get(name, ()):
            if not isinstance(ctx.parent(use), cst.FunctionDef):
                out.setdefault(use, f"{name} (a {module} kernel)")
    for node, name in _cuda_setting_names(ctx):
        out.setdefault(node, name)
    for node in ctx.order:  # `self._create_cuda_graph()`: the author says it is CUDA's
        if isinstance(node, cst.Call) and node.func not in ctx.edits:
            name = node.func.attr.value if isinstance(node.func, cst.Attribute) else getattr(node.func, "value", "")
            torch_api = any(q.startswith("torch.") for q in ctx.qnames(node.func))  # judged by cuda_refs above
            if isinstance(name, str) and "cuda" in name.lower() and name != "cuda" and not torch_api:
                out.setdefault(node, f"{name}()")
    for stmt in ctx.import_nodes:
        for q in _imported_modules(stmt):
            if api_map.cuda_only_module_tip(q, ctx.options.local_packages):
                out.setdefault(stmt, q)
    return out


def _cuda_setting_names(ctx: PyContext) -> list[tuple[cst.CSTNode, str]]:
    """String literals that name a CUDA setting no rule migrated (``'MV2_USE_CUDA'`` exported to
    MVAPICH): code that sets them asks for CUDA behaviour."""
    out = []
    for node in ctx.order:
        if isinstance(node, cst.SimpleString) and node not in ctx.edits:
            value = string_value(node) or ""
            if _CUDA_SETTING.match(value) and value not in api_map.ENV_KEEP and value not in api_map.ENV_MAP:
                out.append((node, value))
    return out


def _cuda_kernels(ctx: PyContext) -> list[tuple[str, str]]:
    """(name, package) of the module's functions decorated by a CUDA-only package:
    ``@triton.jit``, ``@triton.autotune(...)``, ``@helion.kernel()``: calling one needs CUDA."""
    out = []
    for stmt in ctx.module.body:
        for deco in getattr(stmt, "decorators", ()) if isinstance(stmt, cst.FunctionDef) else ():
            expr = deco.decorator.func if isinstance(deco.decorator, cst.Call) else deco.decorator
            hit = [q for q in sorted(ctx.qnames(expr)) if api_map.cuda_only_module_tip(q, ctx.options.local_packages)]
            if hit:
                out.append((stmt.name.value, hit[0].split(".")[0]))
                break
    return out


def _imported_modules(stmt: cst.CSTNode) -> list[str]:
    if isinstance(stmt, cst.Import):
        return [dotted(a.name) or "" for a in stmt.names]
    if stmt.relative or stmt.module is None:
        return []
    return [dotted(stmt.module) or ""]


def _first_inside(ctx: PyContext, cuda_only: dict, regions: list) -> tuple[cst.CSTNode, str] | None:
    roots = set(regions)
    for node, label in cuda_only.items():
        cur = node
        while cur is not None:
            if cur in roots:
                return node, label
            cur = ctx.parent(cur)
    return None


def _withdraw(ctx: PyContext, atoms: list[_Atom], why: dict) -> None:
    """Drop the atoms' edits and their change findings; report each kept check."""
    dropped: set[cst.CSTNode] = set()
    for atom in atoms:
        dropped.update(atom.edits)
    for node in dropped:
        ctx.edits.pop(node, None)
    gone = {id(f) for node, f in ctx.finding_nodes if node in dropped and f.applied}
    ctx.findings[:] = [f for f in ctx.findings if id(f) not in gone]
    ctx.finding_nodes[:] = [(n, f) for n, f in ctx.finding_nodes if id(f) not in gone]
    _recount(ctx)
    for atom in atoms:
        node, label = why[atom.node]
        check = ctx.code(atom.node)
        start, end = ctx.lines(atom.node)
        ctx.findings.append(
            Finding(
                CODE,
                MANUAL,
                start,
                end,
                f"`{check}` left as is: it guards {label} (line {ctx.lines(node)[0]}), which stays CUDA-only; "
                "migrated, the check would run that code on NPU",
                op=check,
                tip="port or remove the CUDA-only code it guards, then rerun (or decide the check by hand)",
                before=check,
                applied=False,
            )
        )


def _recount(ctx: PyContext) -> None:
    """applied_codes / needs_npu from the changes still applied."""
    rules = all_rules()
    live = [f for node, f in ctx.finding_nodes if f.applied and node in ctx.edits]
    ctx.applied_codes = {f.rule for f in live}
    ctx.needs_npu = any(getattr(rules.get(f.rule), "needs_torch_npu", False) for f in live)
