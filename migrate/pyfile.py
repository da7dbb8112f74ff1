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
    """Decide cheaply whether any rule could fire. Returns (need, reason-if-unparseable).

    Stage 1: a regex over the raw text (most files never mention a trigger word).
    Stage 2: the C ``ast`` parser; only identifiers, attribute names, imports and non-docstring
    string constants count, so comments, docstrings and prose-only mentions are skipped.
    """
    gate = _text_gate(options)
    if not gate.search(text):
        return False, ""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError) as exc:
        return False, f"unparseable: {type(exc).__name__}: {getattr(exc, 'msg', exc)} (line {getattr(exc, 'lineno', '?')})"
    if options.mode == "runtime":
        return True, ""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    search = gate.search
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if search(node.id):
                return True, ""
        elif isinstance(node, ast.Attribute):
            if search(node.attr):
                return True, ""
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, str) and id(node) not in docstrings and _STRING_GATE.match(node.value):
                return True, ""
        elif isinstance(node, ast.alias):
            if search(node.name):
                return True, ""
        elif isinstance(node, ast.ImportFrom):
            if node.module and search(node.module):
                return True, ""
        elif isinstance(node, ast.keyword):
            if node.arg and search(node.arg):
                return True, ""
    return False, ""


def migrate_python(text: str, path: str, options: Options) -> tuple[str, list[Finding], bool, str]:
    """Returns (new_text, findings, full_parse, skip_reason)."""
    need, reason = needs_full_parse(text, options)
    if reason:
        return text, [], False, reason
    if not need:
        return text, [], False, ""

    import libcst as cst

    from parabench.migrate.rules._base import rules_for
    from parabench.migrate.rules._py import ModuleRule, PyContext, PyRule

    try:
        module = cst.parse_module(text)
    except Exception as exc:  # libcst.ParserSyntaxError and friends
        return text, [], True, f"unparseable: {str(exc).splitlines()[0]}"
    rules = rules_for("python", options)
    active = frozenset(r.code for r in rules)
    ctx = PyContext(module, options, active)
    visitors = [r(ctx) for r in rules if issubclass(r, PyRule)]
    if visitors:
        module.visit(_dispatcher(visitors))
    new = module.visit(_Apply(ctx.edits, _ancestors(ctx))) if ctx.edits else module
    for rule in rules:
        if issubclass(rule, ModuleRule):
            new = rule().post(module, new, ctx)
    new_text = new.code
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


def _dispatcher(visitors):
    """One traversal calling every rule's visit_<Node> (libcst's visit_batched introspects each
    visitor with inspect.getmembers per file, which cost ~8 ms per rule)."""
    import libcst as cst

    table: dict[str, list] = {}
    for v in visitors:
        for name in _visit_methods(type(v)):
            table.setdefault(name[len("visit_"):], []).append(getattr(v, name))

    class Dispatch(cst.CSTVisitor):
        def on_visit(self, node) -> bool:
            fns = table.get(type(node).__name__)
            if fns:
                for fn in fns:
                    fn(node)
            return True

        def on_leave(self, original_node) -> None:
            return None

        def on_visit_attribute(self, node, attribute) -> None:
            return None

        def on_leave_attribute(self, original_node, attribute) -> None:
            return None

    return Dispatch()


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
