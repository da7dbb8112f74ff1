"""Migrate one Python source text: cheap pre-filter, then LibCST rules, then a compile check.

The input is parsed, never imported or executed (``compile`` only builds a code object).
"""

from __future__ import annotations

import ast
import re

from parabench.migrate.core import Finding, Options

# Words that any static Python rule can react to (case-insensitive, in identifiers or strings).
_STATIC_WORDS = (
    "cuda", "nccl", "nvtx", "apex", "flash_attn", "transformer_engine", "triton", "xformers", "bitsandbytes",
    "amp_c", "pynvml", "nvidia", "dataparallel", "compile", "symmetric_memory", "nvshmem", "float8", "torchao",
    "cudnn", "tf32", "cpp_extension", "mamba_ssm", "causal_conv1d", "cupy", "deep_gemm", "accelerator",
)
_STATIC_RE = re.compile("|".join(_STATIC_WORDS), re.IGNORECASE)
# String constants only matter when the whole string is a device/backend/env/module/command name;
# prose ("moving batch to cuda") never triggers a rule (roles are decided on the syntax tree later).
_STRING_GATE = re.compile(
    r"^(?:cuda(?::\d*)?|nccl|gpu|(?:\w+:\w+,)*cuda:nccl(?:,\w+:\w+)*"
    r"|[A-Z0-9_]*(?:CUDA|NCCL)[A-Z0-9_]*|nvidia-smi(?:\s.*)?"
    r"|[\w.]*(?:cuda|amp_C|flash_attn|transformer_engine|triton|xformers|bitsandbytes|pynvml|apex|mamba_ssm|causal_conv1d)[\w.]*)$",
    re.DOTALL,
)
_MEGATRON_RE = re.compile("megatron")
_MAIN_RE = re.compile("__main__")


def _text_gate(options: Options) -> re.Pattern[str]:
    if options.mode == "runtime":
        return _MAIN_RE
    if options.target == "mindspeed":
        return re.compile(_STATIC_RE.pattern + "|megatron", re.IGNORECASE)
    return _STATIC_RE


def needs_full_parse(text: str, options: Options) -> tuple[bool, str]:
    """Decide cheaply whether any rule could fire. Returns (need, reason-if-unparseable)."""
    need, reason, _tree = _prefilter(text, options)
    return need, reason


def _prefilter(text: str, options: Options) -> tuple[bool, str, ast.Module | None]:
    """-> (need, reason-if-unparseable, the ``ast`` tree when one was built).

    Stage 1: a regex over the raw text (most files never mention a trigger word).
    Stage 2: the C ``ast`` parser; only identifiers, attribute names, imports and non-docstring
    string constants count, so comments, docstrings and prose-only mentions are skipped.
    The tree is kept: it gives the line of every top-level statement (see ``Layout``).
    """
    gate = _text_gate(options)
    if not gate.search(text):
        return False, "", None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError) as exc:
        return False, f"unparseable: {type(exc).__name__}: {getattr(exc, 'msg', exc)} (line {getattr(exc, 'lineno', '?')})", None
    if options.mode == "runtime":
        return True, "", tree
    # one pass; a container is always reached before its body, so its docstring is known in time
    docstrings: set[int] = set()
    search, string_gate = gate.search, _STRING_GATE.match
    containers = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    Name, Attribute, Constant, alias, ImportFrom, keyword = ast.Name, ast.Attribute, ast.Constant, ast.alias, ast.ImportFrom, ast.keyword
    AST = ast.AST
    stack: list[ast.AST] = [tree]
    pop, push = stack.pop, stack.append
    while stack:
        node = pop()
        t = type(node)
        if t is Name:
            if search(node.id):
                return True, "", tree
            continue
        if t is Attribute:
            if search(node.attr):
                return True, "", tree
        elif t is Constant:
            if type(node.value) is str and id(node) not in docstrings and string_gate(node.value):
                return True, "", tree
            continue
        elif t is alias:
            if search(node.name):
                return True, "", tree
            continue
        elif t is ImportFrom:
            if node.module and search(node.module):
                return True, "", tree
        elif t is keyword:
            if node.arg and search(node.arg):
                return True, "", tree
        elif t in containers and node.body:
            first = node.body[0]
            if type(first) is ast.Expr and type(first.value) is Constant:
                docstrings.add(id(first.value))
        for field in node._fields:
            value = getattr(node, field, None)
            if type(value) is list:
                for v in value:
                    if isinstance(v, AST):
                        push(v)
            elif isinstance(value, AST):
                push(value)
    return False, "", None


def migrate_python(text: str, path: str, options: Options) -> tuple[str, list[Finding], bool, str]:
    """Returns (new_text, findings, full_parse, skip_reason)."""
    need, reason, tree = _prefilter(text, options)
    if reason:
        return text, [], False, reason
    if not need:
        return text, [], False, ""

    import libcst as cst

    from parabench.migrate.rules._base import rules_for
    from parabench.migrate.rules._py import Layout, ModuleRule, PyContext, PyRule

    try:
        module = cst.parse_module(text)  # the only LibCST parse of the file
    except Exception as exc:  # libcst.ParserSyntaxError and friends
        return text, [], True, f"unparseable: {str(exc).splitlines()[0]}"
    rules = rules_for("python", options)
    active = frozenset(r.code for r in rules)
    # "\r" line ends: ast and LibCST could count lines differently; use whole-module passes
    layout = Layout.build(module, tree) if tree is not None and "\r" not in text else None
    ctx = PyContext(module, options, active, layout)
    visitors = [r(ctx) for r in rules if issubclass(r, PyRule)]
    if visitors:
        _dispatch(ctx.order, visitors)
    new = module.visit(_Apply(ctx.edits, _ancestors(ctx))) if ctx.edits else module
    for rule in rules:
        if issubclass(rule, ModuleRule):
            new = rule().post(module, new, ctx)
    new_text = text if new is module else _render(new, module, layout, text)
    findings = sorted(ctx.findings, key=lambda f: (f.line, f.rule, f.end_line, f.message))
    if new_text != text:
        try:
            compile(new_text, path, "exec", dont_inherit=True)
        except SyntaxError as exc:
            try:
                compile(text, path, "exec", dont_inherit=True)
            except SyntaxError:
                return text, [], True, f"unparseable: {exc.msg} (line {exc.lineno})"
            return text, [], True, f"internal: migrated code did not compile ({exc.msg}, line {exc.lineno}); left unchanged"
    return new_text, findings, True, ""


_VISIT_CACHE: dict[type, list[str]] = {}


def _visit_methods(cls: type) -> list[str]:
    """Names of the visit_* methods a rule class really defines (not libcst's no-op defaults)."""
    names = _VISIT_CACHE.get(cls)
    if names is None:
        import libcst as cst

        base = cst.BatchableCSTVisitor
        names = [n for n in dir(cls) if n.startswith("visit_") and getattr(cls, n) is not getattr(base, n, None)]
        _VISIT_CACHE[cls] = names
    return names


def _dispatch(order, visitors) -> None:
    """Call every rule's visit_<Node> on the nodes in pre-order, as one LibCST visit pass would
    (libcst's visit_batched introspects each visitor with inspect.getmembers per file, ~8 ms per
    rule, and ``visit`` itself rebuilds every node it passes)."""
    table: dict[str, list] = {}
    for v in visitors:
        for name in _visit_methods(type(v)):
            table.setdefault(name[len("visit_"):], []).append(getattr(v, name))
    get = table.get
    for node in order:
        fns = get(type(node).__name__)
        if fns:
            for fn in fns:
                fn(node)


def _render(new, original, layout, text: str) -> str:
    """Source of ``new``: top-level statements that are still the original objects are copied
    from ``text``, only the rebuilt or inserted ones go through code generation."""
    if layout is None or not original.has_trailing_newline or new.header is not original.header or new.footer is not original.footer:
        return new.code
    starts = [0]
    find = text.find
    while (i := find("\n", starts[-1])) >= 0:
        starts.append(i + 1)
    # starts[k] = offset of line k+1; the footer's blank/comment lines are the last lines
    bounds = [starts[r - 1] for r in layout.region] + [starts[len(starts) - 1 - len(original.footer)]]
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        return new.code
    out = [text[: bounds[0]]]
    for stmt in new.body:
        i = layout.index.get(stmt)
        out.append(text[bounds[i]: bounds[i + 1]] if i is not None else new.code_for_node(stmt))
    out.append(text[bounds[-1]:])
    return "".join(out)


def _apply_class():
    import libcst as cst

    class Apply(cst.CSTTransformer):
        """Applies edits recorded against original nodes; edits compose bottom-up."""

        def __init__(self, edits, needed):
            super().__init__()
            self.edits = edits
            self.needed = needed

        def on_visit(self, node) -> bool:
            # only descend where an edit lies below: untouched subtrees are reused, not rebuilt
            return node in self.needed

        def on_leave(self, original_node, updated_node):
            fns = self.edits.get(original_node)
            if fns:
                for fn in fns:
                    updated_node = fn(updated_node)
            return updated_node

        def on_visit_attribute(self, node, attribute) -> None:
            return None

        def on_leave_attribute(self, original_node, attribute) -> None:
            return None

    return Apply


def _ancestors(ctx) -> set:
    needed: set = set()
    for node in ctx.edits:
        cur = node
        while cur is not None and cur not in needed:
            needed.add(cur)
            cur = ctx.parent(cur)
    return needed


def _Apply(edits, needed):  # noqa: N802 - factory keeps libcst out of this module's import time
    global _APPLY
    try:
        cls = _APPLY
    except NameError:
        cls = _APPLY = _apply_class()
    return cls(edits, needed)
