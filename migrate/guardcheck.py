"""Guard safety as a property of a migrated file, checked on the texts alone (issue #13).

``violations(before, after)`` finds every branch that was unreachable in ``before`` on a machine
without CUDA and is reachable in ``after`` on an NPU machine, while it still holds CUDA-only code.
Such a branch is a fallback turned into a crash: the input ran there, the output would not.

Both texts are parsed with ``ast`` (never imported or executed). The checks of each text are
evaluated in an emulated environment, in Kleene's three-valued logic (anything else is unknown;
docs/sources.md#guard-safety): *before*, no CUDA and no NPU (``torch.cuda.is_available()`` and
``torch.npu.is_available()`` False, ``device_count()`` 0, ``x.is_cuda`` False, ``x == 'cuda'``
False); *after*, an NPU and still no CUDA (static migration: ``torch.cuda`` is PyTorch's own), so
``torch.npu.is_available()`` is True, ``torch.npu.device_count()`` at least 1, ``x.is_npu`` and
``x == 'npu'`` unknown. Branches are if/while bodies, else sides, conditional-expression arms,
and/or operands and the code after an early exit or an assert; those of the two texts are paired
in order (difflib over their shapes: migration inserts statements but keeps the control flow).

This is independent of the migrator's own guard analysis (rules/_guard.py, on the syntax tree
before the edits); the tests run it over every fixture, and benchmarks/migrate_corpus.py per file.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import operator
import re

from parabench.migrate import api_map

UNKNOWN = object()


class _AtLeastOne:
    """An int known to be >= 1 (``torch.npu.device_count()`` on an NPU machine)."""

    def __bool__(self) -> bool:
        return True


AT_LEAST_ONE = _AtLeastOne()
_QUERIES = ("is_available", "is_initialized", "is_bf16_supported", "device_count")
_DEVICE = re.compile(r"^(cuda|npu)(:\d+)?$")
# value of each query call: (before, after)
_CALLS: dict[str, tuple[object, object]] = {
    **{f"torch.cuda.{q}": (False, False) for q in _QUERIES[:3]},
    "torch.cuda.device_count": (0, 0),
    "torch.npu.is_available": (False, True),
    "torch.npu.is_initialized": (False, UNKNOWN),
    "torch.npu.is_bf16_supported": (False, UNKNOWN),
    "torch.npu.device_count": (0, AT_LEAST_ONE),
    "torch.distributed.is_nccl_available": (False, False),
    "torch.distributed.is_hccl_available": (False, True),
    "torch.backends.cudnn.is_available": (False, False),
}
_ATTRS: dict[str, tuple[object, object]] = {"is_cuda": (False, False), "is_npu": (False, UNKNOWN)}
_OPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le}
_OPS.update({ast.Gt: operator.gt, ast.GtE: operator.ge})
# torch.backends.cudnn members that are harmless without cuDNN (plain flags, the query itself)
_CUDNN_OK = frozenset({"benchmark", "deterministic", "enabled", "allow_tf32", "is_available"})
_HOST_DEVICES = frozenset({"cpu", "meta"})  # a gate naming these also lets the fallback machine in


@dataclasses.dataclass(frozen=True)
class Violation:
    line: int  # in the migrated text
    construct: str  # the CUDA-only code found in the branch
    guard: str  # source of the test that now lets it run
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def violations(before: str, after: str) -> list[Violation]:
    """Branches that a migration made reachable on an NPU while they still hold CUDA-only code."""
    try:
        tb, ta = ast.parse(before), ast.parse(after)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    old, new = _File(tb, 0), _File(ta, 1)
    bs, as_ = old.branches(), new.branches()
    out: list[Violation] = []
    matcher = difflib.SequenceMatcher(None, [b.shape for b in bs], [a.shape for a in as_], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            continue
        for b, a in zip(bs[i1:i2], as_[j1:j2]):
            for k, (region, was_dead) in enumerate(zip(a.regions, b.dead)):
                if was_dead and not a.dead[k]:
                    found = new.cuda_only(region)
                    if found is not None:
                        line, what = found
                        guard = ast.get_source_segment(after, a.test) or ast.dump(a.test)
                        out.append(
                            Violation(
                                line, what, guard, f"{what} is reachable on NPU through `{guard}` (was unreachable)"
                            )
                        )
    return out


@dataclasses.dataclass
class _Branch:
    shape: tuple
    test: ast.AST
    regions: list[list[ast.AST]]
    dead: list[bool]  # region unreachable in this file's environment


class _File:
    """One parsed text in one environment (0: before, no CUDA; 1: after, NPU)."""

    def __init__(self, tree: ast.Module, env: int):
        self.tree, self.env = tree, env
        self.parents: dict[ast.AST, ast.AST] = {}
        self.imports: dict[str, str] = {}
        assigned: dict[str, list[ast.AST]] = {}
        stores: dict[str, int] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.imports[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.imports[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                assigned.setdefault(node.targets[0].id, []).append(node.value)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                stores[node.id] = stores.get(node.id, 0) + 1
        # names stored once, by `name = value`: the value reaches the tests that read them
        self.values = {k: v[0] for k, v in assigned.items() if len(v) == 1 and stores.get(k) == 1}
        self.kernels = self._cuda_kernels()

    def _cuda_kernels(self) -> dict[str, str]:
        """Functions of the module decorated by a CUDA-only package (``@triton.jit``,
        ``@helion.kernel()``) -> that package: calling one needs CUDA."""
        out: dict[str, str] = {}
        for stmt in self.tree.body:
            if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for deco in stmt.decorator_list:
                q = self.qname(deco.func if isinstance(deco, ast.Call) else deco)
                if q and api_map.cuda_only_module_tip(q):
                    out[stmt.name] = q.split(".")[0]
                    break
        return out

    # --- names --------------------------------------------------------------------------------------

    def qname(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.imports.get(node.id)
        if isinstance(node, ast.Attribute):
            left = self.qname(node.value)
            return f"{left}.{node.attr}" if left else None
        return None

    # --- evaluation ---------------------------------------------------------------------------------

    def value(self, node: ast.AST, depth: int = 0):
        if depth > 20:
            return UNKNOWN
        t = type(node)
        if t is ast.Constant:
            return node.value
        if t is ast.Name:
            expr = self.values.get(node.id)
            return UNKNOWN if expr is None else self.value(expr, depth + 1)
        if t is ast.UnaryOp and isinstance(node.op, ast.Not):
            v = self.value(node.operand, depth + 1)
            return UNKNOWN if v is UNKNOWN else not v
        if t is ast.BoolOp:
            return self._bool(node, depth)
        if t is ast.IfExp:
            test = self.value(node.test, depth + 1)
            return UNKNOWN if test is UNKNOWN else self.value(node.body if test else node.orelse, depth + 1)
        if t is ast.Call:
            q = self.qname(node.func)
            if q in _CALLS:
                return _CALLS[q][self.env]
            if _is_device_prefix_test(node):  # str(x.device).startswith("cuda")
                return self._device_string(node.args[0].value, False)
            if isinstance(node.func, ast.Name) and node.func.id == "bool" and len(node.args) == 1:
                return self.value(node.args[0], depth + 1)
            return UNKNOWN
        if t is ast.Attribute and node.attr in _ATTRS and self.qname(node.value) is None:
            return _ATTRS[node.attr][self.env]
        if t is ast.Compare and len(node.ops) == 1:
            return self._compare(node, depth)
        return UNKNOWN

    def _bool(self, node: ast.BoolOp, depth: int):
        """Kleene: an operand that decides (False for `and`, True for `or`) decides, unknown or not."""
        is_and = isinstance(node.op, ast.And)
        unknown, v = False, None
        for operand in node.values:
            v = self.value(operand, depth + 1)
            if v is UNKNOWN:
                unknown = True
            elif bool(v) != is_and:
                return v
        return UNKNOWN if unknown else v

    def _device_string(self, value: str, negated: bool):
        """A test that a device (type) equals ``value``: no CUDA in either environment; an NPU
        after migration, where it is unknown which device the code was given."""
        if value.startswith("npu") and self.env == 1:
            return UNKNOWN
        return negated

    def _compare(self, node: ast.Compare, depth: int):
        op, left, right = node.ops[0], node.left, node.comparators[0]
        if isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
            # `device.type in ("cuda", "xpu")`: a device gate unless the literal names the host too
            names = [e.value for e in right.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            devices = [n for n in names if _DEVICE.match(n)]
            if devices and not _HOST_DEVICES.intersection(names):
                found = {self._device_string(d, False) for d in devices}
                if UNKNOWN in found:
                    return UNKNOWN
                return isinstance(op, ast.NotIn)
        for side in (left, right):
            if isinstance(side, ast.Constant) and isinstance(side.value, str) and _DEVICE.match(side.value):
                if isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn)):
                    return self._device_string(side.value, isinstance(op, (ast.NotEq, ast.IsNot, ast.NotIn)))
        fn = _OPS.get(type(op))
        lv, rv = self.value(left, depth + 1), self.value(right, depth + 1)
        if fn is None or lv is UNKNOWN or rv is UNKNOWN:
            return UNKNOWN
        if lv is AT_LEAST_ONE or rv is AT_LEAST_ONE:
            return _at_least_one(fn, lv, rv)
        try:
            return fn(lv, rv)
        except TypeError:
            return UNKNOWN

    # --- branches -----------------------------------------------------------------------------------

    def branches(self) -> list[_Branch]:
        out: list[_Branch] = []
        for node in _preorder(self.tree):
            b = self._branch(node)
            if b is not None:
                out.append(b)
        return out

    def _branch(self, node: ast.AST) -> _Branch | None:
        t = type(node)
        if t is ast.BoolOp:
            dead, decided = [False], False
            is_and = isinstance(node.op, ast.And)
            for operand in node.values[:-1]:
                v = self.value(operand)
                decided = decided or v is not UNKNOWN and bool(v) != is_and
                dead.append(decided)
            return _Branch(("BoolOp", type(node.op).__name__, len(node.values)), node, [[v] for v in node.values], dead)
        if t is ast.For and _is_range_call(node.iter):
            # `for i in range(torch.cuda.device_count()):` - no iteration without a device
            v = self.value(node.iter.args[0])
            return _Branch(("ForRange", len(node.body)), node.iter, [node.body], [v is not UNKNOWN and v == 0])
        if t not in (ast.If, ast.While, ast.IfExp, ast.Assert):
            return None
        v = self.value(node.test)
        falsy, truthy = v is not UNKNOWN and not v, v is not UNKNOWN and bool(v)
        if t is ast.IfExp:
            return _Branch(("IfExp",), node.test, [[node.body], [node.orelse]], [falsy, truthy])
        if t is ast.Assert:
            return _Branch(("Assert",), node.test, [self._rest(node)], [falsy])
        rest = self._rest(node) if t is ast.If else []
        rest_dead = truthy and _exits(node.body) or falsy and _exits(node.orelse)
        shape = (t.__name__, len(node.body), len(node.orelse))
        return _Branch(shape, node.test, [node.body, node.orelse, rest], [falsy, truthy, rest_dead])

    def _rest(self, stmt: ast.AST) -> list[ast.AST]:
        out: list[ast.AST] = []
        cur = stmt
        while True:
            parent = self.parents.get(cur)
            if parent is None:
                return out
            for field in ("body", "orelse", "finalbody", "handlers"):
                seq = getattr(parent, field, None)
                if isinstance(seq, list) and any(s is cur for s in seq):
                    out += seq[next(i for i, s in enumerate(seq) if s is cur) + 1 :]
            if isinstance(parent, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                return out
            cur = parent

    # --- CUDA-only code -----------------------------------------------------------------------------

    def cuda_only(self, region: list[ast.AST]) -> tuple[int, str] | None:
        """(line, what) of the first CUDA-only construct in ``region``, or None."""
        for top in region:
            for node in _preorder(top):
                what = self._cuda_only(node)
                if what:
                    return getattr(node, "lineno", 0), what
        return None

    def _cuda_only(self, node: ast.AST) -> str | None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            return next((m for m in mods if api_map.cuda_only_module_tip(m)), None)
        if isinstance(node, ast.Name):
            if node.id in self.kernels:
                return f"{node.id} (a {self.kernels[node.id]} kernel)"
            q = self.imports.get(node.id)
            return q if q and api_map.cuda_only_module_tip(q) else None
        if isinstance(node, ast.Attribute):
            return self._cuda_attr(node)
        if isinstance(node, ast.Call):
            return self._cuda_call(node)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("nvidia-smi"):
            return "nvidia-smi"
        return None

    def _cuda_attr(self, node: ast.Attribute) -> str | None:
        q = self.qname(node)
        if q is None or isinstance(self.parents.get(node), ast.Attribute):
            return None  # judged at the outermost link of the chain
        if q.startswith("torch.cuda."):
            member = q[len("torch.cuda.") :]
            return None if member in _QUERIES else q
        if q == "torch.version.cuda" or q == "torch.nn.DataParallel":
            return q
        if q.startswith("torch.backends.cuda."):
            return q
        if q.startswith("torch.backends.cudnn.") and q.split(".")[3] not in _CUDNN_OK:
            return q
        return None

    def _cuda_call(self, node: ast.Call) -> str | None:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "cuda" and self.qname(func.value) is None:
            return ".cuda()"
        device_args = [
            kw.value for kw in node.keywords if kw.arg in ("device", "device_type", "map_location", "output_device")
        ]
        q = self.qname(func)
        if q in ("torch.device", "torch.autocast") or isinstance(func, ast.Attribute) and func.attr == "to":
            device_args += node.args[:1]
        for arg in device_args:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.split(":")[0] == "cuda":
                return f"device '{arg.value}'"
        return None


def _is_range_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "range"
        and len(node.args) == 1
        and not node.keywords
    )


def _is_device_prefix_test(node: ast.Call) -> bool:
    """``<expr>.startswith("cuda")`` / ``("npu")``: a string test of a device."""
    func = node.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "startswith"
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and node.args[0].value in ("cuda", "npu", "cuda:", "npu:")
    )


def _at_least_one(fn, lv, rv):
    """Compare an unknown int n >= 1 with a known int: the answer when every such n agrees."""
    other = rv if lv is AT_LEAST_ONE else lv
    if not isinstance(other, int) or other is AT_LEAST_ONE:
        return UNKNOWN
    samples = {1, max(1, other - 1), max(1, other), other + 1, 10**9}
    results = {fn(n, rv) if lv is AT_LEAST_ONE else fn(lv, n) for n in samples}
    return results.pop() if len(results) == 1 else UNKNOWN


def _exits(body: list[ast.AST]) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))


def _preorder(node: ast.AST):
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(list(ast.iter_child_nodes(n))))
