"""Python rule base: a LibCST context with resolved metadata, and the shared analyses.

The analyses answer *role* questions from the syntax tree and resolved qualified names, never from
text: "is this string a device argument, a log message or a dict key?", "which torch.cuda member
does this expression reach, through which alias?".
"""

from __future__ import annotations

import builtins
import dataclasses
import re
from collections.abc import Callable
from typing import ClassVar

import libcst as cst

from parabench.migrate import api_map
from parabench.migrate.core import MANUAL, REVIEW, Finding, Options
from parabench.migrate.libcst_private import line_table
from parabench.migrate.rules import _scope
from parabench.migrate.rules._base import Rule, statement_first_line
from parabench.migrate.rules._values import BACKEND_COMPOUND_RE, DEVICE_RE  # noqa: F401 - the rules import them from here
from parabench.migrate.rules._walk import walk

# Keyword arguments that name a device (docs/sources.md#transfer-to-npu: device rewriting of transfer_to_npu).
DEVICE_KWARGS = frozenset(
    {"device", "device_type", "map_location", "device_id", "default_device", "init_device", "output_device", "devices"}
)
BACKEND_KWARGS = frozenset({"backend", "dist_backend"})
# Calls whose first positional argument is a device type / device.
DEVICE_POS0_CALLS = frozenset(
    {
        "torch.device",
        "torch.autocast",
        "torch.amp.autocast",
        "torch.amp.GradScaler",
        "torch.get_device_module",
        "torch.distributed.device_mesh.init_device_mesh",
        "torch.distributed.init_device_mesh",
        "torch.set_default_device",
        "torch.Generator",
        "torch.cuda.amp.GradScaler",
        # torch.cuda queries that take a device (issue #29 class 4): renamed to torch.npu by PY101,
        # whose torch_npu versions reject a "cuda" device string
        *(
            f"torch.cuda.{name}"
            for name in (
                "get_device_properties",
                "get_device_name",
                "set_device",
                "synchronize",
                "device",
                "memory_allocated",
                "max_memory_allocated",
                "memory_reserved",
                "max_memory_reserved",
                "reset_peak_memory_stats",
                "memory_stats",
                "mem_get_info",
            )
        ),
    }
)
# Calls whose first positional argument / backend keyword is the process-group backend.
BACKEND_CALLS = frozenset(
    {
        "torch.distributed.init_process_group",
        "torch.distributed.new_group",
        "deepspeed.init_distributed",
        "torch.distributed.distributed_c10d.init_process_group",
        "torch.distributed.new_subgroups",
    }
)
LOG_METHODS = frozenset(
    {"debug", "info", "warning", "warn", "error", "exception", "critical", "log", "write", "format"}
)
KEY_METHODS = frozenset({"get", "pop", "setdefault", "__getitem__", "__contains__"})
ATTR_CALLS = frozenset({"builtins.getattr", "builtins.hasattr", "builtins.setattr", "builtins.delattr"})
IMPORT_CALLS = frozenset({"importlib.import_module", "builtins.__import__", "importlib.util.find_spec"})


def dotted(node: cst.CSTNode) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        left = dotted(node.value)
        return f"{left}.{node.attr.value}" if left else None
    return None


def string_value(node: cst.CSTNode) -> str | None:
    if not isinstance(node, cst.SimpleString):
        return None
    raw = node.value
    prefix = raw[: len(raw) - len(raw.lstrip("rRbBuUfF"))].lower()
    if "b" in prefix:
        return None
    body = raw[len(prefix) :]
    q = 3 if body[:3] in ('"""', "'''") else 1
    inner = body[q:-q]
    if "\\" not in inner:
        return inner  # the common case, without literal_eval (an ast.parse per string)
    try:
        value = node.evaluated_value
    except Exception:  # malformed escapes
        return None
    return value if isinstance(value, str) else None


def replace_in_simple_string(node: cst.SimpleString, old: str, new: str) -> cst.SimpleString:
    """Rewrite the literal's content, keeping prefix and quote style. Only used when the raw
    token spells ``old`` verbatim (checked by the caller)."""
    return node.with_changes(value=node.value.replace(old, new, 1))


def fstring_device(node: cst.FormattedString) -> bool:
    """f'cuda:{i}': the whole string is a device spec."""
    parts = node.parts
    return (
        len(parts) == 2
        and isinstance(parts[0], cst.FormattedStringText)
        and parts[0].value == "cuda:"
        and isinstance(parts[1], cst.FormattedStringExpression)
    )


def fstring_to_npu(node: cst.FormattedString) -> cst.FormattedString:
    first = node.parts[0]
    return node.with_changes(parts=[first.with_changes(value="npu:"), *node.parts[1:]])


class PyContext:
    """One parsed module plus resolved metadata, shared by every Python rule of a run."""

    def __init__(self, module: cst.Module, options: Options, active: frozenset[str], layout: Layout | None = None):
        self.module = module
        self.options = options
        self.active = active
        self.layout = layout  # first line of each top-level statement (from the pre-filter's ast), if known
        self._pos: dict = {}  # node -> (first, last) line, filled per top-level statement on demand
        self._pos_full = False
        # one read-only traversal: parents, import bindings, name occurrences, pre-order for the
        # rules. No scope analysis: LibCST's ScopeProvider + QualifiedNameProvider cost about
        # four parses per file.
        self.order, self._parent, self._imports, self.names, self.in_import, self.import_nodes = _index(module)
        self._qcache: dict[cst.CSTNode, set[str]] = {}
        self.edits: dict[cst.CSTNode, list[Callable]] = {}
        self.findings: list[Finding] = []
        # (node, finding) of every change and manual item: the guard analysis (rules/_guard.py)
        # finds what stays CUDA-only inside a guarded branch and withdraws unsafe guard edits
        self.finding_nodes: list[tuple[cst.CSTNode, Finding]] = []
        self.applied_codes: set[str] = set()
        self.needs_npu = False
        self.inserted: dict[
            cst.CSTNode, bool
        ] = {}  # statement added by a module rule -> attached after (True) / before
        self.origin: dict[cst.CSTNode, cst.CSTNode] = {}  # rebuilt node -> parsed node (set once edits are applied)
        self.cache: dict[str, object] = {}

    def qnames(self, node: cst.CSTNode) -> set[str]:
        """Qualified names an expression resolves to through imports: {'torch.cuda.synchronize'}.

        Like LibCST's QualifiedNameProvider for import-bound names: an import binds its name in
        its function (or the module); a parameter, assignment or loop variable of the same name
        in an enclosing function shadows it (rules._scope).
        """
        cached = self._qcache.get(node)
        if cached is not None:
            return cached
        out: set[str] = set()
        t = type(node)  # exact types (no subclasses): isinstance through LibCST's ABC metaclass is slow
        if node in self.in_import:
            pass
        elif t is cst.Name:
            if not _is_reference(self, node):
                pass
            elif node.value in self._imports:
                out = _scope.resolve(self, node, _bind) or set()  # None: a local shadows the import
            elif node.value in _BUILTINS:
                out = {f"builtins.{node.value}"}
            else:
                out = {node.value}
        elif t is cst.Attribute:
            out = {f"{q}.{node.attr.value}" for q in self.qnames(node.value)}
        self._qcache[node] = out
        return out

    def is_import(self, node: cst.CSTNode) -> bool:
        """True when the expression's root name is bound by an import (a module or its member)."""
        root = node
        while isinstance(root, cst.Attribute):
            root = root.value
        return (
            isinstance(root, cst.Name)
            and root.value in self._imports
            and root not in self.in_import
            and _scope.resolve(self, root, _bind) is not None
        )

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self._parent.get(node)

    def lines(self, node: cst.CSTNode) -> tuple[int, int]:
        pos = self._pos.get(node)
        if pos is not None or self._pos_full:
            return pos or (0, 0)
        path = [node]
        while (up := self._parent.get(path[-1])) is not None and up is not self.module:
            path.append(up)
        index = self.layout.index.get(path[-1]) if self.layout is not None and up is self.module else None
        if index is None:  # no layout, or not inside a statement: one code-generation pass over the module
            self._pos = line_table(self.module)
            self._pos_full = True
            return self._pos.get(node, (0, 0))
        # descend through the indented blocks of class, function and compound statement bodies to
        # the innermost statement that holds the node: code generation of that statement only
        layout, at, j = self.layout, index, len(path) - 1
        while j >= 2:
            step = layout.inner(at, path[j], path[j - 1], path[j - 2])
            if step is None:
                break
            sub, depth = step
            inner = sub.index.get(path[j - depth]) if j >= depth else None
            if inner is None:
                break
            layout, at, j = sub, inner, j - depth
        self._pos.update(line_table(path[j], layout.region[at], self.module))
        return self._pos.get(node, (0, 0))

    def known_lines(self, node: cst.CSTNode) -> tuple[int, int] | None:
        """The lines of ``node`` if a code-generation pass of ``lines`` has already found them."""
        return self._pos.get(node)

    def body_line(self, index: int) -> int:
        """First line of the top-level statement that a statement inserted at ``index`` of the
        parsed body would precede (the last statement when inserted at the end), in the whole file
        also when only some statements were parsed; 1 for an empty module."""
        body = self.module.body
        if not body:
            return 1
        layout = self.layout
        if layout is not None and layout.parsed is not None and layout.starts is not None:
            at = layout.parsed[index - 1] + 1 if index > 0 else 0
            return layout.starts[min(at, len(layout.starts) - 1)]
        return self.lines(body[min(index, len(body) - 1)])[0]

    def code(self, node: cst.CSTNode) -> str:
        text = self.module.code_for_node(node)
        return text if len(text) <= 200 else text[:197] + "..."

    # recording
    def change(
        self, rule: type[Rule], node: cst.CSTNode, fn: Callable, message: str, op: str = "", tip: str = ""
    ) -> bool:
        applied = not (rule.safety == REVIEW and self.options.safe_only)
        start, end = self.lines(node)
        before = self.code(node)
        try:
            new = fn(node)
            after = self.module.code_for_node(new) if isinstance(new, cst.CSTNode) else ""
        except Exception as exc:  # a rule bug: the rest of the file migrates, this edit becomes a manual item
            self.findings.append(
                Finding(
                    rule.code,
                    MANUAL,
                    start,
                    end,
                    f"rule {rule.code} failed here ({type(exc).__name__}: {exc}); migrate this code by hand and report the rule bug",
                    op,
                    tip,
                    before,
                    applied=False,
                )
            )
            return False
        if applied:
            self.edits.setdefault(node, []).append(fn)
            self.applied_codes.add(rule.code)
            self.needs_npu = self.needs_npu or bool(getattr(rule, "needs_torch_npu", False))
        msg = message if applied else f"not applied (--safe-only): {message}"
        self.findings.append(Finding(rule.code, rule.safety, start, end, msg, op, tip, before, after[:200], applied))
        self.finding_nodes.append((node, self.findings[-1]))
        return applied

    def manual(self, rule: type[Rule], node: cst.CSTNode, message: str, op: str = "", tip: str = "") -> None:
        start, end = self.lines(node)
        self.findings.append(Finding(rule.code, MANUAL, start, end, message, op, tip, applied=False))
        self.finding_nodes.append((node, self.findings[-1]))


_BUILTINS = frozenset(dir(builtins))
_DEFINING = frozenset({cst.FunctionDef, cst.ClassDef, cst.AsName, cst.ImportAlias})


def _is_reference(ctx: PyContext, node: cst.Name) -> bool:
    """A Name used as a value (not an attribute name, keyword, parameter or definition name)."""
    p = ctx._parent.get(node)
    t = type(p)  # exact types: none of these node classes has subclasses
    if t is cst.Attribute or t is cst.Arg:
        return p.value is node
    if t is cst.Param:
        return p.default is node
    return t not in _DEFINING


def _index(module: cst.Module):
    """Pre-order nodes, parents, import bindings (local name -> qualified names), Name nodes by
    value (outside imports), nodes inside import statements, import statements."""
    order, parents = walk(module)
    imports: dict[str, set[str]] = {}
    names: dict[str, list[cst.Name]] = {}
    in_import: set[cst.CSTNode] = set()
    import_nodes: list[cst.CSTNode] = []
    Name, Import, ImportFrom = cst.Name, cst.Import, cst.ImportFrom
    for node in order:
        t = type(node)  # exact types: isinstance through LibCST's ABC metaclass is slow
        if t is Name:
            if node not in in_import:
                names.setdefault(node.value, []).append(node)
        elif t is Import or t is ImportFrom:
            import_nodes.append(node)
            _bind(node, imports)
            in_import.update(walk(node)[0])
    return order, parents, imports, names, in_import, import_nodes


@dataclasses.dataclass
class Layout:
    """Where each top-level statement of the module lies in the source text, without a LibCST
    code-generation pass: the first line of its first token comes from the pre-filter's ``ast``
    tree, its leading blank/comment lines from the LibCST node. ``region[i]`` is the first line of
    statement i's text (its leading lines included); regions tile the file between header and footer."""

    region: list[int]
    index: dict[cst.CSTNode, int]
    # partial parse (see parse_plan._select): first line of every top-level statement of the whole file,
    # and which of those the parsed statements are; None when the whole file was parsed
    starts: list[int] | None = None
    parsed: list[int] | None = None
    nodes: list = dataclasses.field(default_factory=list)  # the ast statement of each statement (first of a line)
    lines: list[str] | None = None
    _blocks: dict = dataclasses.field(default_factory=dict)

    @staticmethod
    def build(
        module, tree, starts: list[int] | None = None, parsed: list[int] | None = None, lines: list[str] | None = None
    ) -> Layout | None:
        """``module``/``tree``: anything with a ``body`` (a Module, or a class's block and its ast);
        ``lines``: the source lines (decorator lines are read from them)."""
        body = tree.body
        region: list[int] = []
        nodes: list = []
        k = 0
        for stmt in module.body:
            if k >= len(body):
                return None
            first = body[k]
            nodes.append(first)
            before = len(stmt.leading_lines)
            if isinstance(stmt, cst.SimpleStatementLine):
                k += len(stmt.body)
            else:
                k += 1
                decorators = getattr(stmt, "decorators", ())
                if decorators:
                    if not first.decorator_list:
                        return None
                    first_line = statement_first_line(first, lines)
                    before += len(decorators[0].leading_lines)
                    region.append(first_line - before)
                    continue
            region.append(first.lineno - before)
        if k != len(body) or any(b <= a for a, b in zip(region, region[1:])) or (region and region[0] < 1):
            return None
        if parsed is not None and len(parsed) != len(region):
            return None
        return Layout(region, {stmt: i for i, stmt in enumerate(module.body)}, starts, parsed, nodes, lines)

    def block(self, i: int, stmt: cst.CSTNode) -> Layout | None:
        """Layout of the body of statement ``i`` when it is a class, a function or an
        if/for/while/with/try with an indented body (cached); regions are lines of the whole file,
        as for the module."""
        if i in self._blocks:
            return self._blocks[i]
        node = self.nodes[i] if i < len(self.nodes) else None
        kind = type(node).__name__
        sub = None
        if type(stmt) in _COMPOUND:
            kinds: tuple[str, ...] = _COMPOUND[type(stmt)]
        elif isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            kinds = ("ClassDef",) if isinstance(stmt, cst.ClassDef) else ("FunctionDef", "AsyncFunctionDef")
        else:
            kinds = ()
        if kind in kinds and isinstance(stmt.body, cst.IndentedBlock):
            sub = Layout.build(stmt.body, node, lines=self.lines)
            if sub is not None and sub.region and sub.region[0] <= self.region[i]:
                sub = None
        self._blocks[i] = sub
        return sub

    def inner(self, i: int, stmt: cst.CSTNode, below: cst.CSTNode, below2: cst.CSTNode) -> tuple[Layout, int] | None:
        """For line numbers: the layout of the indented block of statement ``i`` that holds the
        path ``stmt`` > ``below`` > ``below2`` > ... (the body of a class or function; the body,
        ``else``, ``finally`` or an ``except`` of an if/for/while/with/try), and how many path steps
        lead from ``stmt`` to the block's statement (2, or 3 through else/finally/except); None when
        there is none or the ``ast`` statement does not match."""
        if type(stmt) is cst.ClassDef or type(stmt) is cst.FunctionDef or below is getattr(stmt, "body", None):
            return None if below is not stmt.body or (sub := self.block(i, stmt)) is None else (sub, 2)
        kinds = _COMPOUND.get(type(stmt))
        node = self.nodes[i] if i < len(self.nodes) else None
        if kinds is None or type(node).__name__ not in kinds:
            return None
        t = type(below)
        if t is cst.Else and below is stmt.orelse:
            key, block, stmts, depth = -2, below.body, node.orelse, 3
        elif t is cst.Finally and below is stmt.finalbody:
            key, block, stmts, depth = -3, below.body, node.finalbody, 3
        elif t is cst.ExceptHandler and type(stmt) is cst.Try and len(stmt.handlers) == len(node.handlers):
            key = next(k for k, h in enumerate(stmt.handlers) if h is below)
            block, stmts, depth = below.body, node.handlers[key].body, 3
        else:
            return None
        if below2 is not block or type(block) is not cst.IndentedBlock:
            return None
        cache = (i, key)
        if cache not in self._blocks:
            sub = Layout.build(block, _Body(stmts), lines=self.lines)
            self._blocks[cache] = sub if sub is not None and sub.region and sub.region[0] > self.region[i] else None
        sub = self._blocks[cache]
        return None if sub is None else (sub, depth)


@dataclasses.dataclass
class _Body:
    body: list  # ast statements of one block (what Layout.build reads)


# compound statements whose blocks line numbers and the rendering descend into -> their ast types
_COMPOUND = {
    cst.If: ("If",),
    cst.For: ("For", "AsyncFor"),
    cst.While: ("While",),
    cst.With: ("With", "AsyncWith"),
    cst.Try: ("Try",),
}


def _bind(node: cst.CSTNode, imports: dict[str, set[str]]) -> None:
    if isinstance(node, cst.Import):
        for a in node.names:
            full = dotted(a.name) or ""
            if a.asname is not None and isinstance(a.asname.name, cst.Name):
                imports.setdefault(a.asname.name.value, set()).add(full)
            else:
                root = full.split(".")[0]
                imports.setdefault(root, set()).add(root)
    elif isinstance(node, cst.ImportFrom) and not isinstance(node.names, cst.ImportStar):
        mod = "." * len(node.relative) + ((dotted(node.module) or "") if node.module is not None else "")
        for a in node.names:
            if not isinstance(a.name, cst.Name):
                continue
            asname = a.asname.name if a.asname is not None else None
            local = asname.value if isinstance(asname, cst.Name) else a.name.value
            imports.setdefault(local, set()).add(
                f"{mod}{a.name.value}" if mod.endswith(".") else f"{mod}.{a.name.value}"
            )


class PyRule(Rule, cst.BatchableCSTVisitor):
    kind: ClassVar[str] = "python"
    needs_torch_npu: ClassVar[bool] = True  # applied changes make the file need `import torch_npu`

    def __init__(self, ctx: PyContext):
        super().__init__()
        self.ctx = ctx

    def change(self, node, fn, message, op="", tip=""):
        return self.ctx.change(type(self), node, fn, message, op, tip)

    def manual(self, node, message, op="", tip=""):
        self.ctx.manual(type(self), node, message, op, tip)


class ModuleRule(Rule):
    """A rule that inserts statements into the finished module (runs after all edits)."""

    kind: ClassVar[str] = "python"
    needs_torch_npu: ClassVar[bool] = False

    def post(self, original: cst.Module, new: cst.Module, ctx: PyContext) -> cst.Module:  # pragma: no cover
        raise NotImplementedError


# --- role of a string literal -------------------------------------------------------------------


def _call_name(ctx: PyContext, call: cst.Call) -> tuple[set[str], str]:
    func = call.func
    last = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""
    return ctx.qnames(func), last


def _is_prose_call(qn: set[str], last: str) -> bool:
    low = last.lower()
    return (
        "builtins.print" in qn
        or "warnings.warn" in qn
        or low in LOG_METHODS
        or "print" in low
        or "log" in low
        or low.endswith(("error", "exception", "warning"))
    )


def _target_names(node: cst.CSTNode) -> list[str]:
    if isinstance(node, cst.Assign):
        return [dotted(t.target) or "" for t in node.targets]
    if isinstance(node, (cst.AnnAssign, cst.AugAssign)):
        return [dotted(node.target) or ""]
    return []


def string_role(ctx: PyContext, node: cst.CSTNode) -> str:
    """Syntactic role of a string literal node (cached).

    device / backend: argument or default that names a device / process-group backend;
    compare-device / compare-backend / compare: an operand of a comparison;
    prose: docstring, log/print/exception message; key: subscript index or dict key;
    attrname / import / command / accelerator / concat: special arguments; other: anything else.
    """
    cache = ctx.cache.setdefault("roles", {})
    if node in cache:
        return cache[node]
    role = _string_role(ctx, node)
    cache[node] = role
    return role


def _string_role(ctx: PyContext, node: cst.CSTNode) -> str:
    child, p = _role_holder(ctx, node)
    if isinstance(p, cst.ConcatenatedString):
        return "concat"
    if isinstance(p, cst.Expr):
        return "prose"
    if isinstance(p, cst.Arg):
        return _argument_role(ctx, p)
    if isinstance(p, cst.Param) and p.default is child:
        return _named_value_role(p.name.value)
    if isinstance(p, (cst.Comparison, cst.ComparisonTarget)):
        return _comparison_role(ctx, p, child)
    if isinstance(p, (cst.SubscriptElement, cst.Index)):
        return "key"
    if isinstance(p, cst.DictElement):
        d = ctx.parent(p)
        if _dict_in_device_arg(ctx, d):
            return "device"
        return "key" if p.key is child else "other"
    if isinstance(p, (cst.Assign, cst.AnnAssign)) and getattr(p, "value", None) is child:
        return _named_value_role(" ".join(_target_names(p)))
    return "other"


def _role_holder(ctx: PyContext, node: cst.CSTNode) -> tuple[cst.CSTNode, cst.CSTNode | None]:
    """(child, parent): the node whose parent gives the string its role - climbing through
    conditional and boolean expressions and list/tuple/set elements (a container's role is its
    elements'); the parent is a ConcatenatedString when the string is part of one."""
    child, p = node, ctx.parent(node)
    while True:
        if isinstance(p, cst.ConcatenatedString):
            return child, p
        if isinstance(p, cst.IfExp) and p.test is not child:
            child, p = p, ctx.parent(p)
            continue
        if isinstance(p, cst.BooleanOperation):
            child, p = p, ctx.parent(p)
            continue
        if isinstance(p, cst.Element):  # list/tuple/set element -> role of the container
            container = ctx.parent(p)
            child, p = container, ctx.parent(container)
            continue
        spec = _formatted_spec(ctx, child, p)
        if spec is not None:  # "cuda:{}".format(i), "cuda:%d" % i: the result is the device spec
            child, p = spec, ctx.parent(spec)
            continue
        return child, p


FORMAT_SPEC_RE = re.compile(r"^cuda:(?:\{\w*\}|%[ds])$")


def _formatted_spec(ctx: PyContext, child: cst.CSTNode, p: cst.CSTNode | None) -> cst.CSTNode | None:
    """The ``.format(...)`` call or ``%`` expression that fills in the string ``child``, or None."""
    if not isinstance(child, cst.SimpleString) or not FORMAT_SPEC_RE.match(string_value(child) or ""):
        return None
    if isinstance(p, cst.BinaryOperation) and isinstance(p.operator, cst.Modulo) and p.left is child:
        return p
    if isinstance(p, cst.Attribute) and p.value is child and p.attr.value == "format":
        call = ctx.parent(p)
        return call if isinstance(call, cst.Call) and call.func is p else None
    return None


def _named_value_role(names: str) -> str:
    """Role of a parameter default or an assigned value, by the name(s) it is bound to."""
    names = names.lower()
    if "device" in names:
        return "device"
    if "backend" in names:
        return "backend-other"
    return "other"


def _argument_role(ctx: PyContext, p: cst.Arg) -> str:
    call = ctx.parent(p)
    if not isinstance(call, cst.Call):
        return "other"
    qn, last = _call_name(ctx, call)
    if p.keyword is not None:
        k = p.keyword.value
        if k in DEVICE_KWARGS:
            return "device"
        if k in BACKEND_KWARGS:
            return "backend" if qn & BACKEND_CALLS else "backend-other"
        if k == "accelerator":
            return "accelerator"
        if k == "choices":  # accepted values: extended by PY130, never rewritten (rules/_values.py)
            return "choices"
        if k in ("msg", "message", "help", "desc", "description"):
            return "prose"
        return "arg"
    positional = [a for a in call.args if a.keyword is None and not a.star]
    index = next((i for i, a in enumerate(positional) if a is p), -1)
    if index == 0 and isinstance(call.func, cst.Attribute) and call.func.attr.value == "to" and not qn & ATTR_CALLS:
        return "device"
    if index == 0 and qn & DEVICE_POS0_CALLS:
        return "device"
    if index == 0 and qn & BACKEND_CALLS:
        return "backend"
    if index == 0 and isinstance(call.func, cst.Attribute) and call.func.attr.value in KEY_METHODS:
        return "key"  # mapping.get("cuda"): a lookup key (pattern 4)
    if qn & ATTR_CALLS and index == 1:
        return "attrname"
    if qn & IMPORT_CALLS:
        return "import"
    if any(q.startswith(("subprocess.", "os.system", "os.popen")) for q in qn):
        return "command"
    if _is_prose_call(qn, last):
        return "prose"
    return "arg"


def _comparison_role(ctx: PyContext, p: cst.CSTNode, child: cst.CSTNode) -> str:
    comp = p if isinstance(p, cst.Comparison) else ctx.parent(p)
    others = [comp.left] + [t.comparator for t in comp.comparisons]
    text = " ".join(ctx.module.code_for_node(o) for o in others if o is not child).lower()
    if "backend" in text:
        return "compare-backend"
    if "device" in text or ".type" in text:
        return "compare-device"
    return "compare"


def _dict_in_device_arg(ctx: PyContext, d: cst.CSTNode | None) -> bool:
    arg = ctx.parent(d) if d is not None else None
    return isinstance(arg, cst.Arg) and arg.keyword is not None and arg.keyword.value == "map_location"


# --- torch.cuda references ----------------------------------------------------------------------


@dataclasses.dataclass
class CudaUse:
    node: cst.CSTNode  # the expression that denotes torch.cuda (or a submodule/member for aliases)
    outer: cst.CSTNode  # the full attribute chain
    path: str  # member path after torch.cuda
    category: str
    data: str


@dataclasses.dataclass
class CudaBinding:
    """A name bound to torch.cuda (or part of it) by an import or an assignment."""

    stmt: cst.CSTNode  # Import / ImportFrom / Assign
    alias: cst.CSTNode | None  # ImportAlias, or the torch.cuda expression of an Assign
    base: str  # member path the bound name denotes ("" = torch.cuda itself)
    uses: list[CudaUse]
    decision: str = "npu"  # npu | nvtx | blocked


def binding_problems(b: CudaBinding) -> list[str]:
    """Member paths that keep a binding from being migrated."""
    if not b.uses:
        cat = api_map.classify_cuda_member(b.base)[0] if b.base else "module"
        return [] if cat in _OK or cat == "module" or (cat == "nvtx") else [b.base]
    ok = ("nvtx",) if b.base.startswith("nvtx") else (*_OK, "module")
    return sorted({u.path for u in b.uses if u.category not in ok})


@dataclasses.dataclass
class CudaRefs:
    direct: list[CudaUse]
    bindings: list[CudaBinding]


_OK = ("supported", "legacy")


def _climb(ctx: PyContext, node: cst.CSTNode) -> tuple[cst.CSTNode, str]:
    parts, cur = [], node
    while True:
        p = ctx.parent(cur)
        if isinstance(p, cst.Attribute) and p.value is cur:
            parts.append(p.attr.value)
            cur = p
        else:
            return cur, ".".join(parts)


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a and b else a or b


def cuda_refs(ctx: PyContext) -> CudaRefs:
    cached = ctx.cache.get("cuda_refs")
    if cached is not None:
        return cached  # type: ignore[return-value]
    direct: list[CudaUse] = []
    alias_uses: dict[str, list[tuple[cst.CSTNode, cst.CSTNode, str]]] = {}
    assign_aliases: list[tuple[cst.Assign, cst.CSTNode]] = []
    # exact type: isinstance through LibCST's ABC metaclass costs ~1 us per node of the file
    attribute = cst.Attribute
    candidates: list[cst.CSTNode] = [n for n in ctx._parent if type(n) is attribute and n.attr.value == "cuda"]
    for local, quals in ctx._imports.items():
        if any(q == "torch.cuda" or q.startswith("torch.cuda.") for q in quals):
            candidates += ctx.names.get(local, [])
    for node in candidates:
        names = ctx.qnames(node)
        hit = next(
            (q for q in sorted(names) if q == "torch.cuda" or q.startswith("torch.cuda.")), None
        )  # sorted: set order varies per process
        if hit is None:
            continue
        if isinstance(node, cst.Attribute):
            if hit != "torch.cuda":
                continue  # an outer link of a chain: handled from its torch.cuda part
            outer, path = _climb(ctx, node)
            p = ctx.parent(node)
            if (
                not path
                and isinstance(p, cst.Assign)
                and len(p.targets) == 1
                and isinstance(p.targets[0].target, cst.Name)
            ):
                assign_aliases.append((p, node))
                continue
            cat, data = api_map.classify_cuda_member(path)
            direct.append(CudaUse(node, outer, path, cat, data))
        else:  # a Name bound by an import
            p = ctx.parent(node)
            if isinstance(p, cst.Attribute) and p.attr is node:
                continue
            outer, suffix = _climb(ctx, node)
            alias_uses.setdefault(hit, []).append((node, outer, suffix))
    bindings = _import_bindings(ctx, alias_uses)
    for assign, expr in assign_aliases:
        uses = []
        target = assign.targets[0].target
        # every other load of the same name in the file (no scope analysis: see PyContext.qnames)
        for use in ctx.names.get(target.value, []):
            if use is target or not _is_reference(ctx, use) or isinstance(ctx.parent(use), cst.AssignTarget):
                continue
            if not _scope.same_binding(ctx, use, target, _bind):
                continue  # a parameter or local of the same name in another function
            outer, suffix = _climb(ctx, use)
            cat, data = api_map.classify_cuda_member(suffix)
            uses.append(CudaUse(use, outer, suffix, cat, data))
        bindings.append(CudaBinding(assign, expr, "", uses))
    for b in bindings:
        b.decision = _decide(b)
    # `from torch.cuda import a, b` is rewritten as one statement: all names migrate or none
    groups: dict[int, list[CudaBinding]] = {}
    for b in bindings:
        if isinstance(b.stmt, cst.ImportFrom):
            groups.setdefault(id(b.stmt), []).append(b)
    for group in groups.values():
        if len({b.decision for b in group}) > 1:
            for b in group:
                b.decision = "blocked"
    refs = CudaRefs(direct, bindings)
    ctx.cache["cuda_refs"] = refs
    return refs


def _decide(b: CudaBinding) -> str:
    cats = [u.category for u in b.uses]
    if not b.uses:
        cats = [api_map.classify_cuda_member(b.base)[0]] if b.base else ["module"]
    if b.base.startswith("nvtx"):
        if isinstance(b.stmt, cst.ImportFrom) and b.base != "nvtx":
            return "blocked"  # `from torch.cuda.nvtx import mark`: mstx is a class, not a module
        return "nvtx" if all(c == "nvtx" for c in cats) and b.uses else "blocked"
    return "npu" if all(c in _OK or c == "module" for c in cats) else "blocked"


def _import_bindings(ctx: PyContext, alias_uses: dict) -> list[CudaBinding]:
    found: list[CudaBinding] = []

    def _binding(stmt, alias, full) -> CudaBinding:
        base = full[len("torch.cuda.") :] if full != "torch.cuda" else ""
        local = alias.asname.name.value if alias.asname else dotted(alias.name).split(".")[-1]  # type: ignore[union-attr]
        uses = []
        for node, outer, suffix in alias_uses.get(full, []):
            if not isinstance(node, cst.Name) or node.value != local:
                continue
            path = _join(base, suffix)
            cat, data = api_map.classify_cuda_member(path)
            uses.append(CudaUse(node, outer, path, cat, data))
        return CudaBinding(stmt, alias, base, uses)

    for node in ctx.import_nodes:
        if isinstance(node, cst.Import):
            for alias in node.names:
                full = dotted(alias.name) or ""
                if alias.asname is not None and (full == "torch.cuda" or full.startswith("torch.cuda.")):
                    found.append(_binding(node, alias, full))
        elif isinstance(node, cst.ImportFrom):
            if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
                continue
            mod = dotted(node.module) or ""
            for alias in node.names:
                full = f"{mod}.{alias.name.value}" if isinstance(alias.name, cst.Name) else ""
                if full == "torch.cuda" or full.startswith("torch.cuda."):
                    found.append(_binding(node, alias, full))
    return found


def new_import_module(full: str) -> str:
    """torch.cuda[.sub] -> the module to import instead (submodules live under torch_npu.npu)."""
    rest = full[len("torch.cuda") :]
    if not rest:
        return "torch.npu"
    return "torch_npu.npu" + rest


def parse_expr(text: str) -> cst.BaseExpression:
    return cst.parse_expression(text)


# --- module-level helpers -----------------------------------------------------------------------


def top_imports(module: cst.Module) -> list[tuple[int, cst.SimpleStatementLine, list[str]]]:
    """Top-level import statements -> [(index in body, statement, imported module names)]."""
    out = []
    for i, stmt in enumerate(module.body):
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        mods = []
        for small in stmt.body:
            if isinstance(small, cst.Import):
                mods += [dotted(a.name) or "" for a in small.names]
            elif isinstance(small, cst.ImportFrom) and not small.relative and small.module is not None:
                mods.append(dotted(small.module) or "")
        if mods:
            out.append((i, stmt, mods))
    return out


def imports_module(module: cst.Module, name: str) -> bool:
    return any(m == name or m.startswith(name + ".") for _, _, mods in top_imports(module) for m in mods)


def torch_bound(module: cst.Module) -> bool:
    """`import torch` (unaliased) at module level: `torch.` expressions can be emitted."""
    for _, stmt, _ in top_imports(module):
        for small in stmt.body:
            if isinstance(small, cst.Import) and any(
                dotted(a.name) == "torch"
                and a.asname is None
                or (dotted(a.name) or "").startswith("torch.")
                and a.asname is None
                for a in small.names
            ):
                return True
    return False


def insert_statements(
    ctx: PyContext,
    new: cst.Module,
    index: int,
    code: str,
    *,
    after: bool,
    blank_lines: int = 0,
    behind_inserts: bool = False,
) -> cst.Module:
    """Insert ``code`` at ``index`` of the parsed body, attached to the statement before it
    (``after=True``: directly after its text; ``behind_inserts`` too: after the statements other
    rules inserted there before) or to the one at ``index`` (directly before its leading lines),
    ``blank_lines`` empty lines before it. Where statements were left out of the parse
    (parse_plan._select) the two differ: only an insert after a statement's text is placed exactly
    without a whole-file parse."""
    stmts = list(cst.parse_module(code).body)
    if blank_lines and stmts:
        stmts[0] = stmts[0].with_changes(leading_lines=[cst.EmptyLine()] * blank_lines)
    for stmt in stmts:
        ctx.inserted[stmt] = after
    body = list(new.body)
    # ``index`` counts the parsed statements; ``new`` may hold other rules' inserts already:
    # place it next to its anchor statement (or what the edits rebuilt from it)
    original = ctx.module.body
    anchor = (
        original[index - 1] if after and index > 0 else original[index] if not after and index < len(original) else None
    )
    at = (
        index
        if anchor is None
        else next((p + after for p, s in enumerate(body) if s is anchor or ctx.origin.get(s) is anchor), index)
    )
    while behind_inserts and after and at < len(body) and body[at] in ctx.inserted:
        at += 1
    return new.with_changes(body=body[:at] + stmts + body[at:])
