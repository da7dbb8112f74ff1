"""Migrate one Python source text: cheap pre-filter, then LibCST rules, then a compile check.

The pre-filter (regex, then the C ``ast`` parser) decides whether any rule could fire and which
top-level statements can matter; LibCST - the expensive part - parses only those, with the other
statements' lines left empty so every line number stays the same, and the result is spliced back
into the source text. Where splicing is not exact the whole file is parsed instead.
The input is parsed, never imported or executed (``compile`` only builds a code object).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import itertools
import operator
import re

from parabench.migrate import api_map
from parabench.migrate.core import Finding, Options
from parabench.migrate.entries import may_train_at_top_level, top_level_training
from parabench.migrate.rules._base import rules_for, statement_first_line

# Words that any static Python rule can react to (case-insensitive, in identifiers or strings).
_STATIC_WORDS = (
    "cuda",
    "nccl",
    "nvtx",
    "apex",
    "flash_attn",
    "transformer_engine",
    "triton",
    "xformers",
    "bitsandbytes",
    "amp_c",
    "pynvml",
    "nvidia",
    "dataparallel",
    "data_parallel",
    "compile",
    "symmetric_memory",
    "nvshmem",
    "float8",
    "torchao",
    "cudnn",
    "tf32",
    "cpp_extension",
    "mamba_ssm",
    "causal_conv1d",
    "cupy",
    "deep_gemm",
    "helion",
    "deep_ep",
    "megablocks",
    "grouped_gemm",
    "mx_formats",
    "float8nocompile",
    "sparse_attention",
    "accelerator",
    "profiler",  # PY121: torch.profiler.profile() profiles the device by default
    "use_deterministic_algorithms",  # PY115 must see the user's own setting (issue #13 class 4)
)
# String constants only matter when the whole string is a device/backend/env/module/command name;
# prose ("moving batch to cuda") never triggers a rule (roles are decided on the syntax tree later).
# Each alternative covers what a rule tests: device/backend names (PY103-PY106, PY904, PY912),
# env names, also NAME=value (PY109-PY111: no lower-case letters), commands (PY910 splits on
# whitespace), module names (PY908: api_map.CUDA_ONLY_MODULES and *_cuda*).
_MODULE_WORDS = sorted({"cuda", *api_map.CUDA_ONLY_MODULES}, key=len, reverse=True)
_STRING_GATE = re.compile(
    r"^(?:cuda(?::\d*|:\{\w*\}|:%[ds])?|nccl|gpu|(?:\w+:\w+,)*cuda:nccl(?:,\w+:\w+)*"
    r"|[A-Z0-9_]*(?:CUDA|NCCL)[^a-z]*|\s*nvidia-smi(?:\s.*)?"
    r"|[\w.]*(?:" + "|".join(map(re.escape, _MODULE_WORDS)) + r")[\w.]*)$",
    re.DOTALL,
)


def _words(words: tuple[str, ...]):
    """``search(s)``: does ``s`` contain one of ``words`` (lower case), ignoring case? Substring
    tests on the lower-cased text: ~20x faster than one case-insensitive alternation regex, which
    dominated the cost of the files that need no change."""

    memo: dict[str, bool] = {}  # short strings (identifiers, names) repeat: answered once each

    def search(s: str) -> bool:
        hit = memo.get(s)
        if hit is not None:
            return hit
        low = s.lower()
        hit = False
        for w in words:
            if w in low:
                hit = True
                break
        if len(s) <= 64:
            if len(memo) >= 100_000:
                memo.clear()
            memo[s] = hit
        return hit

    return search


_STATIC_SEARCH = _words(_STATIC_WORDS)
_MINDSPEED_SEARCH = _words((*_STATIC_WORDS, "megatron"))


def may_hold_cuda(text: str) -> bool:
    """Could ``text`` (any file, any kind) hold CUDA code? The pre-filter's trigger words: a superset."""
    return _STATIC_SEARCH(text)


def _main_search(s: str) -> bool:
    return "__main__" in s


def _any(s: str) -> bool:
    return True


def _text_gate(options: Options):
    if options.mode == "runtime":
        return _any if options.entry else _main_search
    if options.target == "mindspeed":
        return _MINDSPEED_SEARCH
    return _STATIC_SEARCH


@dataclasses.dataclass
class Plan:
    """What the pre-filter decided for one file.

    ``need``: some rule could fire (else the file is copied unparsed). ``parse_text``: the text to
    give LibCST - the source itself, or the source with the top-level statements (and members of
    top-level classes) that cannot matter blanked (their lines emptied, so every line number stays
    the same). ``first``: the first
    line of every top-level statement of the file; ``parsed``: which of them ``parse_text`` keeps;
    ``partial_classes``: which of those are classes with members blanked; ``tree``: the ``ast``
    statements of ``parse_text`` (for ``Layout``; such classes hold their parsed members only)."""

    need: bool
    reason: str = ""
    parse_text: str = ""
    tree: object = None
    first: list[int] | None = None
    parsed: list[int] | None = None
    partial_classes: frozenset[int] = frozenset()  # parsed classes with some members blanked

    @property
    def partial(self) -> bool:
        return self.parsed is not None


def _prefilter(text: str, options: Options) -> Plan:
    """Stage 1: substring tests over the raw text (most files never mention a trigger word).
    Stage 2: the C ``ast`` parser; only identifiers, attribute names, imports and non-docstring
    string constants count, so comments, docstrings and prose-only mentions are skipped.
    Stage 3 (``_select``): which statements LibCST has to see at all."""
    gate = _text_gate(options)
    if not gate(text):
        return Plan(False)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError) as exc:
        return Plan(
            False, f"unparseable: {type(exc).__name__}: {getattr(exc, 'msg', exc)} (line {getattr(exc, 'lineno', '?')})"
        )
    except (RecursionError, MemoryError):
        return Plan(False, "unparseable: nesting too deep for the parser")
    return _select(text, tree, options, gate)


_Expr, _Constant, _Import, _ImportFrom, _If = ast.Expr, ast.Constant, ast.Import, ast.ImportFrom, ast.If


def _docstring(body: list) -> ast.AST | None:
    first = body[0] if body else None
    if type(first) is _Expr and type(first.value) is _Constant and type(first.value.value) is str:
        return first.value
    return None


def _mentions_trigger(nodes: list, search, docstrings: set[int]) -> bool:
    """Does any identifier, attribute name, import or role-bearing string under ``nodes`` match?
    One pass; a container is always reached before its body, so its docstring is known in time."""
    string_gate = _STRING_GATE.match
    containers = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    Name, Attribute, Constant, alias, ImportFrom, keyword = (
        ast.Name,
        ast.Attribute,
        ast.Constant,
        ast.alias,
        ast.ImportFrom,
        ast.keyword,
    )
    AST = ast.AST
    stack = list(nodes)
    pop, push = stack.pop, stack.append
    while stack:
        node = pop()
        t = type(node)
        if t is Name:
            if search(node.id):
                return True
            continue
        if t is Attribute:
            if search(node.attr):
                return True
        elif t is Constant:
            if type(node.value) is str and id(node) not in docstrings and string_gate(node.value):
                return True
            continue
        elif t is alias:
            if search(node.name):
                return True
            continue
        elif t is ImportFrom:
            if node.module and search(node.module):
                return True
        elif t is keyword:
            if node.arg and search(node.arg):
                return True
        elif t in containers and node.body:
            if search(node.name):  # `def cuda(self)`: PY102 must see a class's own cuda()
                return True
            doc = _docstring(node.body)
            if doc is not None:
                docstrings.add(id(doc))
        for field in node._fields:
            value = getattr(node, field, None)
            if type(value) is list:
                for v in value:
                    if isinstance(v, AST):
                        push(v)
            elif isinstance(value, AST):
                push(value)
    return False


_IDENT_RE = re.compile(r"[^\W\d]\w*")  # identifiers, non-ASCII ones too
# a line that could end an assignment `name = <expr>.cuda` (cuda_refs follows such aliases file-wide)
_ALIAS_RE = re.compile(r"cuda[^\w\n]*(?:[;#].*)?$", re.MULTILINE)


_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")


def _statements(nodes):
    """Every statement under the statements ``nodes``, at any depth (imports and assignments are
    statements: no need to walk expressions to find them)."""
    stack = list(nodes)
    while stack:
        x = stack.pop()
        yield x
        for field in _BLOCKS:
            sub = getattr(x, field, None)
            if type(sub) is list:
                stack.extend(sub)


def _bindings(nodes) -> list[tuple[str, str]]:
    """(local name, qualified name) bound by every import under ``nodes`` (as rules._py._bind)."""
    out = []
    for node in nodes:
        for n in _statements((node,)):
            if type(n) is _Import:
                for a in n.names:
                    out.append((a.asname, a.name) if a.asname else ((root := a.name.split(".")[0]), root))
            elif type(n) is _ImportFrom:
                mod = "." * n.level + (n.module or "")
                for a in n.names:
                    if a.name != "*":
                        out.append((a.asname or a.name, f"{mod}{a.name}" if mod.endswith(".") else f"{mod}.{a.name}"))
    return out


def _joined(prev, nxt, lines: list[str]) -> bool:
    """Are two consecutive statements one line for LibCST (``a; b``, also across a ``\\``)?"""
    if nxt.lineno == prev.end_lineno:
        return True
    between = [lines[prev.end_lineno - 1].encode()[prev.end_col_offset :].decode("utf-8", "ignore")]
    between += lines[prev.end_lineno : nxt.lineno - 1]
    between.append(lines[nxt.lineno - 1].encode()[: nxt.col_offset].decode("utf-8", "ignore"))
    return any(";" in b.split("#", 1)[0] for b in between)


def _group(stmts: list, lines: list[str]) -> list[tuple[int, int, int]]:
    """Statements as LibCST sees them (`a = 1; b = 2` is one line) -> [(first line, i, j)]: the
    first line counts decorators, ``stmts[i:j]`` is the group."""
    out = []
    i, n = 0, len(stmts)
    while i < n:
        j = i + 1
        while j < n and _joined(stmts[j - 1], stmts[j], lines):
            j += 1
        out.append((statement_first_line(stmts[i], lines), i, j))
        i = j
    return out


@dataclasses.dataclass
class _Span:
    """A span of whole lines that is parsed or blanked as one: a top-level statement, or the
    header (decorators, ``class`` line) or one member of a top-level class."""

    start: int  # first line
    unit: int  # index of the top-level statement
    nodes: list  # ast nodes whose subtrees lie in the span
    member: int = -1  # -1: whole statement, -2: class header, >= 0: member group index
    text: str = ""


def _class_members(cls: ast.ClassDef, lines: list[str]) -> list[tuple[int, int, int]] | None:
    """Member groups of a class whose members each start their own line (else None)."""
    return _own_line_groups(cls, lines, 2)


def _own_line_groups(node, lines: list[str], least: int) -> list[tuple[int, int, int]] | None:
    """Statement groups of the body of a class or function when there are at least ``least`` and
    each starts its own line below the header (else None)."""
    groups = _group(node.body, lines)
    if len(groups) < least:
        return None
    for first, i, _j in groups:
        s = node.body[i]
        if first <= node.lineno:
            return None
        if getattr(s, "decorator_list", None):
            if not lines[first - 1].lstrip().startswith("@"):
                return None
        elif lines[first - 1].encode()[: s.col_offset].strip():
            return None
    return groups


def _select(text: str, tree: ast.Module, options: Options, search) -> Plan:
    """Which top-level statements (and members of top-level classes) can matter to a rule; the
    rest are blanked for LibCST.

    A span is parsed when it holds a trigger (as in stage 2), or is structural for the
    module-level rules (module docstring, top-level imports, ``if __name__ ...``), or references a
    name bound by an import of a trigger module (``from torch.cuda import amp`` ... ``amp.X``) or
    by ``x = <...>.cuda`` (the aliases ``cuda_refs`` follows), or holds an import (at any depth)
    binding a name that a parsed span mentions (qualified names resolve file-wide). Names are
    matched as words in the span's text: a superset, never fewer spans than needed. A class is
    parsed with its header when any member is (with its first member when only the header is)."""
    body = tree.body
    runtime = options.mode == "runtime"
    docstrings: set[int] = set()
    doc = _docstring(body)
    if doc is not None:
        docstrings.add(id(doc))

    def whole_file() -> Plan:  # no blanking: LibCST parses the file as it is
        return Plan(runtime or _mentions_trigger([tree], search, docstrings), "", text, tree)

    if len(body) < 2 or "\r" in text or not text.endswith("\n"):
        return whole_file()
    lines = text.split("\n")
    units = _group(body, lines)
    first = [u[0] for u in units]
    if any(b <= a for a, b in zip(first, first[1:])):
        return whole_file()
    spans, members = _spans(body, units, lines, runtime, docstrings)
    starts = _line_starts(text)
    offs = [starts[g.start - 1] for g in spans] + [len(text)]
    if any(b <= a for a, b in zip(offs, offs[1:])):
        return whole_file()
    for k, g in enumerate(spans):
        g.text = text[offs[k] : offs[k + 1]]
    keep, triggered = _spans_that_matter(spans, doc is not None, runtime, search, docstrings)
    if not runtime and not triggered:
        return Plan(False)
    trims: dict[int, _Trim] = {}
    if not runtime:
        special, imported = _keep_linked_spans(spans, keep, triggered, search)
        trims = _trim_functions(spans, keep, lines, search, docstrings, special, imported)
    _keep_class_headers(spans, keep, members)
    kept = sum(len(g.text) for k, g in enumerate(spans) if keep[k])
    kept -= sum(starts[b - 1] - starts[a - 1] for t in trims.values() for a, b in t.cuts)
    if kept > _PARTIAL_MAX * len(text):
        return Plan(True, "", text, tree)  # blanking would save little
    parts = [text[: offs[0]]]
    for k, g in enumerate(spans):
        if not keep[k]:
            parts.append("\n" * g.text.count("\n"))
            continue
        at = offs[k]
        for a, b in trims[k].cuts if k in trims else ():  # blanked lines [a, b) of a function body
            parts.append(text[at : starts[a - 1]])
            parts.append("\n" * (b - a))
            at = starts[b - 1]
        parts.append(text[at : offs[k + 1]])
    return _partial_plan("".join(parts), body, units, spans, keep, members, first, trims)


def _spans(
    body: list, units: list[tuple[int, int, int]], lines: list[str], runtime: bool, docstrings: set[int]
) -> tuple[list[_Span], dict[int, list[tuple[int, int, int]]]]:
    """The spans of the module in order - a whole top-level statement, or a class header and each of
    its member groups - and, per class split into members, its member groups."""
    spans: list[_Span] = []
    members: dict[int, list[tuple[int, int, int]]] = {}
    for u, (start, i, j) in enumerate(units):
        s = body[i]
        groups = _class_members(s, lines) if j == i + 1 and type(s) is ast.ClassDef and not runtime else None
        if groups is None:
            spans.append(_Span(start, u, body[i:j]))
            continue
        members[u] = groups
        cdoc = _docstring(s.body)
        if cdoc is not None:
            docstrings.add(id(cdoc))
        spans.append(_Span(start, u, [*s.decorator_list, *s.bases, *s.keywords, *getattr(s, "type_params", ())], -2))
        spans.extend(_Span(f, u, s.body[a:b], g) for g, (f, a, b) in enumerate(groups))
    return spans, members


def _spans_that_matter(
    spans: list[_Span], module_doc: bool, runtime: bool, search, docstrings: set[int]
) -> tuple[list[bool], list[int]]:
    """(keep, triggered): the structural spans and those holding a trigger are kept; ``triggered``
    lists the latter (the start of ``_keep_linked_spans``)."""
    keep = [False] * len(spans)
    keep[0] = module_doc
    triggered: list[int] = []
    for k, g in enumerate(spans):
        if g.member == -1:
            t0 = type(g.nodes[0])
            if t0 is _Import or t0 is _ImportFrom or any(type(s) in (_Import, _ImportFrom) for s in g.nodes[1:]):
                keep[k] = True
            elif t0 is _If and any(type(x) is ast.Name and x.id == "__name__" for x in ast.walk(g.nodes[0].test)):
                keep[k] = True
        if not runtime and search(g.text) and _mentions_trigger(g.nodes, search, docstrings):
            keep[k] = True
            triggered.append(k)
    return keep, triggered


def _keep_class_headers(spans: list[_Span], keep: list[bool], members: dict[int, list]) -> None:
    """A class is parsed with its header when a member is; its body cannot be empty (a kept header
    alone keeps its first member)."""
    header = -1
    for k, g in enumerate(spans):
        if g.member == -2:
            header = k
        elif g.member >= 0 and keep[k]:
            keep[header] = True
    for k, g in enumerate(spans):
        if g.member == -2 and keep[k] and not any(keep[k + 1 : k + 1 + len(members[g.unit])]):
            keep[k + 1] = True


def _partial_plan(
    parse_text: str,
    body: list,
    units: list[tuple[int, int, int]],
    spans: list[_Span],
    keep: list[bool],
    members: dict[int, list[tuple[int, int, int]]],
    first: list[int],
    trims: dict[int, _Trim],
) -> Plan:
    """The plan for a partial parse: the ``ast`` statements LibCST will see (classes with blanked
    members hold their kept members only, functions with blanked statements their kept ones)."""
    kept_units: dict[int, list[int]] = {}  # unit -> kept member groups (all spans of a whole statement)
    for k, g in enumerate(spans):
        if keep[k]:
            kept_units.setdefault(g.unit, [])
            if g.member >= 0:
                kept_units[g.unit].append(g.member)
    bodies = {id(t.fn): t.body for t in trims.values()}
    trimmed_units = {spans[k].unit for k in trims}

    def seen(node):  # the function as LibCST sees it
        kept = bodies.get(id(node))
        if kept is None:
            return node
        fn = copy.copy(node)
        fn.body = kept
        return fn

    stmts: list = []
    partial_classes: set[int] = set()
    for u, groups_kept in kept_units.items():
        _start, i, j = units[u]
        if u in members and (len(groups_kept) < len(members[u]) or u in trimmed_units):
            cls = copy.copy(body[i])
            cls.body = [seen(s) for g in groups_kept for s in body[i].body[members[u][g][1] : members[u][g][2]]]
            stmts.append(cls)
            partial_classes.add(u)
        else:
            stmts.extend(seen(s) for s in body[i:j])
            if u in trimmed_units:
                partial_classes.add(u)
    sub = ast.Module(body=stmts, type_ignores=[])
    return Plan(True, "", parse_text, sub, first, sorted(kept_units), frozenset(partial_classes))


@dataclasses.dataclass
class _Trim:
    """A function whose body LibCST sees in part: ``body`` its kept statements, ``cuts`` the
    blanked line ranges [first, end)."""

    fn: ast.AST
    body: list
    cuts: list[tuple[int, int]]


_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_DEVICE_NAME = re.compile("device|accel", re.IGNORECASE).search  # rules/_reach.py _DEVICE_WORDS


def _trim_functions(
    spans: list[_Span],
    keep: list[bool],
    lines: list[str],
    search,
    docstrings: set[int],
    special: set[str],
    imported: set[str],
) -> dict[int, _Trim]:
    """The statements of the bodies of kept top-level functions and methods of top-level classes
    that no rule can need, to blank as ``_select`` blanks top-level ones (a span index -> _Trim).

    A body statement is kept when it holds a trigger; holds an import; binds a name some import
    binds (it would shadow the module there: rules._scope); or mentions a linking name (see
    ``_keep_linked_spans``; among them the names assigned a CUDA check or a device string, which
    the guard, device-reach and dict-key analyses follow: ``use_cuda = torch.cuda.is_available()``
    ... ``if not use_cuda: return``). A function named for a device (``get_device``) is kept whole
    (PY104 looks for an NPU branch anywhere in it, rules/_reach.py); one with nothing kept keeps
    its first statement."""
    out: dict[int, _Trim] = {}
    for k, g in enumerate(spans):
        fn = g.nodes[0] if keep[k] and len(g.nodes) == 1 and g.member != -2 else None
        groups = _own_line_groups(fn, lines, 1) if type(fn) in _FUNCS and not _DEVICE_NAME(fn.name) else None
        if groups is None:
            continue
        doc = _docstring(fn.body)
        if doc is not None:
            docstrings.add(id(doc))
        kept: list = []
        cuts: list[tuple[int, int]] = []
        for n, (start, i, j) in enumerate(groups):
            end = groups[n + 1][0] if n + 1 < len(groups) else fn.body[j - 1].end_lineno + 1
            chunk, stmts = "\n".join(lines[start - 1 : end - 1]), fn.body[i:j]
            words = set(_IDENT_RE.findall(chunk))
            if (
                search(chunk)
                and _mentions_trigger(stmts, search, docstrings)
                or not words.isdisjoint(special)
                or "import" in words
                and any(type(x) in (_Import, _ImportFrom) for x in _statements(stmts))
                or not words.isdisjoint(imported)
                and _binds_any(stmts, imported)
            ):
                kept += stmts
            elif cuts and cuts[-1][1] == start:
                cuts[-1] = (cuts[-1][0], end)
            else:
                cuts.append((start, end))
        if not cuts:
            continue
        if not kept:  # a body cannot be empty: keep its first statement
            kept = fn.body[groups[0][1] : groups[0][2]]
            first_end = groups[1][0] if len(groups) > 1 else fn.body[-1].end_lineno + 1
            cuts = [(a, b) for a, b in ((first_end if a == groups[0][0] else a, b) for a, b in cuts) if a < b]
        out[k] = _Trim(fn, kept, cuts)
    return out


# what makes an assigned name one the analyses follow into other statements: a CUDA check
# (rules/_guard.py GUARD_CALLS, ``x.is_cuda``) or a string that may be a device, backend or dict key
_CHECK_NAMES = frozenset(
    {"is_available", "is_initialized", "is_bf16_supported", "device_count", "is_nccl_available", "is_cuda"}
)


# PY918 reports these anywhere in a file that profiles the device (rules/py918_profiler_gaps.py)
_PROFILE_READS = frozenset({"key_averages", "events", "total_average", "experimental_config", "use_gzip"})


def _assigned_names(nodes, out: set[str]) -> None:
    """Names that ``name = <value>`` / ``name: T = <value>`` assign anywhere under ``nodes`` where
    the value holds a CUDA check or a string the pre-filter's string gate passes: the guard
    analysis follows such names to the tests that read them (rules/_guard.py ``_guard_names``),
    PY104 to the device positions and dict lookups that use them (rules/_reach.py). Walks
    statements only (an assignment is one), then the values (``_linking_value``)."""
    gate = _STRING_GATE.match
    for x in _statements(nodes):
        t = type(x)
        if t is ast.Assign:
            targets = [e.id for e in x.targets if type(e) is ast.Name]
        elif t is ast.AnnAssign and type(x.target) is ast.Name and x.value is not None:
            targets = [x.target.id]
        else:
            continue
        if targets and _linking_value(x.value, gate):
            out.update(targets)


def _linking_value(v, gate) -> bool:
    """Does an assigned value hold a CUDA check or a gated string where the analyses look: through
    calls, boolean, conditional, unary and comparison operators, containers and dict keys (how
    rules/_guard.py climbs from a check and rules/_py.py ``_role_holder`` from a string)?"""
    t = type(v)
    if t is ast.Constant:
        return type(v.value) is str and gate(v.value) is not None
    if t is ast.Attribute:
        return v.attr in _CHECK_NAMES
    if t is ast.Name:
        return v.id in _CHECK_NAMES
    if t is ast.Call:
        parts = [v.func, *v.args, *(k.value for k in v.keywords)]
    elif t is ast.IfExp:
        parts = [v.test, v.body, v.orelse]
    elif t is ast.BoolOp:
        parts = v.values
    elif t is ast.UnaryOp:
        parts = [v.operand]
    elif t is ast.Compare:
        parts = [v.left, *v.comparators]
    elif t in (ast.List, ast.Tuple, ast.Set):
        parts = v.elts
    elif t is ast.Dict:
        parts = [k for k in v.keys if k is not None]
    else:
        return False
    return any(_linking_value(p, gate) for p in parts)


def _binds_any(nodes, names: set[str]) -> bool:
    """Does anything under ``nodes`` bind one of ``names`` (assignment, loop or ``with``/``except``
    target, ``def``/``class``)?"""
    for node in nodes:
        for x in ast.walk(node):
            t = type(x)
            if t is ast.Name:
                if type(x.ctx) is ast.Store and x.id in names:
                    return True
            elif t in _FUNCS or t is ast.ClassDef or t is ast.ExceptHandler:
                if x.name in names:
                    return True
    return False


def _keep_linked_spans(spans: list[_Span], keep: list[bool], triggered: list[int], search) -> tuple[set[str], set[str]]:
    """Mark the spans linked to parsed ones by names (see ``_select``) -> (the linking names,
    every name an import binds). Linking names: special bindings (imports of trigger modules,
    ``x = <...>.cuda``, type-string collections), names assigned a CUDA check or a device string
    (``_assigned_names``), and where a profiler is used, what PY918 reports file-wide."""
    binds: dict[int, list[tuple[str, str]]] = {}
    for k, g in enumerate(spans):
        if "import" in g.text:
            binds[k] = _bindings(g.nodes)
    special = {local for pairs in binds.values() for local, qual in pairs if search(qual)}
    for k in triggered:
        if _ALIAS_RE.search(spans[k].text):
            for x in _statements(spans[k].nodes):
                if (
                    type(x) is ast.Assign
                    and len(x.targets) == 1
                    and type(x.targets[0]) is ast.Name
                    and type(x.value) is ast.Attribute
                    and x.value.attr == "cuda"
                ):
                    special.add(x.targets[0].id)
        if "torch.cuda." in spans[k].text:
            special.update(_type_string_collections(spans[k].nodes))
        for x in spans[k].nodes:  # `@triton.jit def kernel`: its calls are CUDA-only code (rules/_guard.py)
            if type(x) in _FUNCS and x.decorator_list and _mentions_trigger(x.decorator_list, search, set()):
                special.add(x.name)
        _assigned_names(spans[k].nodes, special)
    if any("profiler" in spans[k].text.lower() for k in triggered):
        special.update(_PROFILE_READS)
    if special:
        uses = re.compile(r"\b(?:" + "|".join(sorted(map(re.escape, special))) + r")\b").search
        for k, g in enumerate(spans):
            if not keep[k] and uses(g.text):
                keep[k] = True
    pending = {k: {local for local, _ in pairs} for k, pairs in binds.items() if not keep[k]}
    if pending:
        mentioned: set[str] = set()
        for k, g in enumerate(spans):
            if keep[k]:
                mentioned.update(_IDENT_RE.findall(g.text))
        changed = True
        while changed:
            changed = False
            for k, names in list(pending.items()):
                if names & mentioned:
                    keep[k] = True
                    mentioned.update(_IDENT_RE.findall(spans[k].text))
                    del pending[k]
                    changed = True
    return special, {local for pairs in binds.values() for local, _ in pairs}


def _type_string_collections(nodes) -> set[str]:
    """Names bound to a list/tuple/set holding a 'torch.cuda.*Tensor' string: PY120 rewrites them
    where the name is tested with ``x.type() in NAME``, which may lie in another statement."""
    found = set()
    for x in _statements(nodes):
        if type(x) in (ast.Assign, ast.AnnAssign) and x.value is not None:
            value = x.value.args[0] if type(x.value) is ast.Call and len(x.value.args) == 1 else x.value
            if type(value) in (ast.List, ast.Tuple, ast.Set) and any(
                type(e) is ast.Constant and type(e.value) is str and e.value.startswith("torch.cuda.")
                for e in value.elts
            ):
                for t in x.targets if type(x) is ast.Assign else [x.target]:
                    name = t.id if type(t) is ast.Name else t.attr if type(t) is ast.Attribute else None
                    if name:
                        found.add(name)
    return found


_PARTIAL_MAX = 0.8  # parse the whole file when the statements that matter hold more of its text


def migrate_python(
    text: str, path: str, options: Options, *, partial: bool = True
) -> tuple[str, list[Finding], bool, str]:
    """Returns (new_text, findings, full_parse, skip_reason). ``partial=False`` gives LibCST the
    whole file even where the pre-filter found statements that cannot matter (tests compare both)."""
    if options.mode == "runtime" and not options.entry and "__main__" not in text:
        options = _top_level_entry(text, options)
    plan = _prefilter(text, options)
    if plan.reason:
        return text, [], False, plan.reason
    if not plan.need:
        return text, [], False, ""
    if plan.partial and not partial:
        plan = Plan(True, "", text, ast.parse(text))
    if plan.partial:
        done = _migrate(text, path, options, plan)
        if done is not None:
            return done
        # the partial result could not be spliced back exactly: parse the whole file
        plan = Plan(True, "", text, ast.parse(text))
    done = _migrate(text, path, options, plan)
    assert done is not None
    return done


def _top_level_entry(text: str, options: Options) -> Options:
    """--mode runtime: a module without a ``__main__`` guard that trains at top level is an entry
    point (nanoGPT style); ``options.entry`` says why (``migrate.entries.top_level_training``)."""
    if not may_train_at_top_level(text):
        return options
    try:
        why = top_level_training(ast.parse(text))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return options  # the pre-filter reports it
    return dataclasses.replace(options, entry=why) if why else options


def _migrate(text: str, path: str, options: Options, plan: Plan) -> tuple[str, list[Finding], bool, str] | None:
    """Run the rules on ``plan.parse_text``; None when a partial parse cannot be spliced back."""

    from parabench.migrate.rules._py import Layout, ModuleRule, PyContext, PyRule

    try:
        module = _parse_module(plan.parse_text)  # the only LibCST parse of the file
    except Exception as exc:  # libcst.ParserSyntaxError and friends
        if plan.partial:
            return None
        return text, [], True, f"unparseable: {str(exc).splitlines()[0]}"
    rules = rules_for("python", options)
    active = frozenset(r.code for r in rules)
    # "\r" line ends: ast and LibCST could count lines differently; use whole-module passes
    layout = (
        Layout.build(module, plan.tree, plan.first, plan.parsed, text.split("\n"))
        if plan.tree is not None and "\r" not in text
        else None
    )
    if plan.partial and layout is None:
        return None
    ctx = PyContext(module, options, active, layout)
    visitors = [r(ctx) for r in rules if issubclass(r, PyRule)]
    if visitors:
        _dispatch(ctx.order, visitors)
    if ctx.edits:  # a CUDA check is migrated only with everything it guards (rules/_guard.py)
        from parabench.migrate.rules._guard import keep_unsafe_guards

        keep_unsafe_guards(ctx)
    origin: dict = {}
    new = module.visit(_edit_applier(ctx.edits, _ancestors(ctx), origin)) if ctx.edits else module
    ctx.origin = origin
    for rule in rules:
        if issubclass(rule, ModuleRule):
            new = rule().post(module, new, ctx)
    if new is module:
        new_text = text
    else:
        new_text = _render(new, module, layout, text, plan, origin, ctx.inserted)
        if new_text is None:
            if plan.partial:
                return None
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
            if plan.partial:
                return None
            return (
                text,
                [],
                True,
                f"internal: migrated code did not compile ({exc.msg}, line {exc.lineno}); left unchanged",
            )
    return new_text, findings, True, ""


def _parse_module(text: str):
    """``libcst.parse_module`` without the per-node validation of the nodes the parser builds.

    Every node's ``__post_init__`` runs ``_validate`` (the checks that keep hand-built trees
    printable); for a tree the parser made from source they cannot fail, and they cost a fifth of
    the parse (libcst/_nodes/base.py, ``CSTNode.__post_init__``: "PERF: ... avoid validating the
    tree when parsing a file"). Switched off for this call only; nodes the rules build later are
    validated as usual."""
    import libcst as cst
    from libcst._nodes.base import CSTNode

    validate = CSTNode.__dict__["__post_init__"]
    CSTNode.__post_init__ = _unvalidated  # type: ignore[method-assign]
    try:
        return cst.parse_module(text)
    finally:
        CSTNode.__post_init__ = validate  # type: ignore[method-assign]


def _unvalidated(self) -> None:
    return None


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
            table.setdefault(name[len("visit_") :], []).append(getattr(v, name))
    by_type: dict[type, list] = {}  # node type -> its visitors (the name looked up once per type)
    get = by_type.get
    for node in order:
        t = type(node)
        fns = get(t)
        if fns is None:
            fns = by_type[t] = table.get(t.__name__, [])
        for fn in fns:
            fn(node)


def _line_starts(text: str) -> list[int]:
    """starts[k] = offset of line k+1 (the lines as split at "\n"; a loop of str.find in Python
    took 3x as long)."""
    lines = text.split("\n")
    del lines[-1]
    return list(itertools.accumulate(map(operator.add, map(len, lines), itertools.repeat(1)), initial=0))


def _render(new, parsed, layout, text: str, plan: Plan, origin: dict, inserted: dict) -> str | None:
    """Source of ``new`` spliced into ``text``: top-level statements that are still the parsed
    objects are copied from ``text`` (with the statements blanked for a partial parse around them),
    rebuilt ones replace only the lines that changed, inserted ones are generated.
    None when that cannot be done exactly."""
    if (
        layout is None
        or not parsed.has_trailing_newline
        or not _same_objects(new.header, parsed.header)
        or not _same_objects(new.footer, parsed.footer)
    ):
        return None
    starts = _line_starts(text)
    ptext = plan.parse_text
    pstarts = starts if ptext is text else _line_starts(ptext)
    if len(pstarts) != len(starts):
        return None
    # line index (0-based) where each parsed statement's text begins; the footer's lines are the last ones
    rows = [r - 1 for r in layout.region] + [len(starts) - 1 - len(parsed.footer)]
    if any(b < a for a, b in zip(rows, rows[1:])):
        return None
    bounds = [starts[r] for r in rows]
    out = [text[: bounds[0]]]
    seen: list[int] = []
    for stmt in new.body:
        i = layout.index.get(stmt)
        if i is None and stmt in origin:
            i = layout.index[origin[stmt]]
            region = text[bounds[i] : bounds[i + 1]]
            old = ptext[pstarts[rows[i]] : pstarts[rows[i + 1]]]
            piece = _patch_statement(
                region, rows[i] + 1, ptext, pstarts, origin[stmt], stmt, layout.block(i, origin[stmt]), origin, parsed
            )
            if piece is None:
                piece = _replace_changed_lines(region, old, new.code_for_node(stmt))
            if piece is None:
                return None
            out.append(piece)
            seen.append(i)
        elif i is not None:
            out.append(text[bounds[i] : bounds[i + 1]])
            seen.append(i)
        else:  # inserted by a module rule
            # attached to the statement after it, with blanked statements in between: their
            # leading lines (known only to a whole-file parse) decide where it goes
            if plan.partial and (
                _after_partial_class(plan, seen[-1] if seen else -1)
                or not inserted.get(stmt, False)
                and _blanked_between(plan, seen[-1] if seen else -1)
            ):
                return None
            out.append(new.code_for_node(stmt))
    if plan.partial and seen != list(range(len(rows) - 1)):
        return None  # a parsed statement was dropped or replaced: its region holds blanked ones too
    out.append(text[bounds[-1] :])
    return "".join(out)


def _after_partial_class(plan: Plan, a: int) -> bool:
    """Is parsed statement ``a`` (the one an insert follows) a class with blanked members? Its
    blanked last members can sit on either side of where LibCST ends it."""
    return 0 <= a < len(plan.parsed) and plan.parsed[a] in plan.partial_classes


def _patch_block(
    lines: list[str],
    base: int,
    ptext: str,
    pstarts: list[int],
    old,
    new,
    sub,
    origin,
    module,
    indents: tuple[str, ...],
    edits: list,
) -> bool:
    """A rebuilt class or function whose header is untouched: add to ``edits`` the line patches
    of its rebuilt body statements (descending into rebuilt classes and functions in turn).
    ``lines``: source lines, ``lines[0]`` being line ``base`` of the file; ``sub``: the layout of
    the body. False (and ``edits`` unchanged) when that does not apply."""
    import libcst as cst

    from parabench.migrate.rules._py import _COMPOUND

    if sub is None or type(new) is not type(old) or not isinstance(new.body, cst.IndentedBlock):
        return False
    for f in dataclasses.fields(old):
        if f.name != "body" and not _same_field(getattr(old, f.name), getattr(new, f.name)):
            return False
    old_block, new_block = old.body, new.body
    for f in dataclasses.fields(old_block):
        if f.name != "body" and not _same_field(getattr(old_block, f.name), getattr(new_block, f.name)):
            return False
    if len(old_block.body) != len(new_block.body):
        return False
    indents = (*indents, module.default_indent if old_block.indent is None else old_block.indent)
    mine: list = []
    for at, (old_s, new_s) in enumerate(zip(old_block.body, new_block.body)):
        if old_s is new_s:
            continue
        if origin.get(new_s) is not old_s:
            return False
        if (isinstance(old_s, (cst.ClassDef, cst.FunctionDef)) or type(old_s) in _COMPOUND) and _patch_block(
            lines, base, ptext, pstarts, old_s, new_s, sub.block(at, old_s), origin, module, indents, mine
        ):
            continue
        row = sub.region[at] - 1  # 0-based line of the statement's text in the file
        if at + 1 < len(sub.region):  # statements tile the block: the parsed text up to the next one
            count = sub.region[at + 1] - 1 - row
            old_code = ptext[pstarts[row] : pstarts[row + count]]
        else:
            old_code = _code_at(module, indents, old_s)
            count = old_code.count("\n")
            if row + count >= len(pstarts) or ptext[pstarts[row] : pstarts[row + count]] != old_code:
                return False
        lo = row - (base - 1)
        piece = _replace_changed_lines(
            "\n".join(lines[lo : lo + count]) + "\n", old_code, _code_at(module, indents, new_s)
        )
        if piece is None or not piece.endswith("\n"):
            return False
        mine.append((lo, lo + count, piece[:-1].split("\n")))
    edits.extend(mine)
    return True


def _patch_statement(
    region: str, first_line: int, ptext: str, pstarts: list[int], old, new, sub, origin, module
) -> str | None:
    """``region`` (the source text of a top-level statement starting at ``first_line``) with the
    rebuilt statements inside ``new`` patched line by line; None when that does not apply."""
    lines = region.split("\n")
    edits: list = []
    if not _patch_block(lines, first_line, ptext, pstarts, old, new, sub, origin, module, (), edits):
        return None
    for lo, hi, new_lines in sorted(edits, reverse=True):
        lines[lo:hi] = new_lines
    return "\n".join(lines)


def _code_at(module, indents: tuple[str, ...], node) -> str:
    """Source of a statement nested in indented blocks (``code_for_node`` would generate it at
    column 0)."""
    from libcst._nodes.internal import CodegenState

    state = CodegenState(default_indent=module.default_indent, default_newline=module.default_newline)
    for indent in indents:
        state.increase_indent(indent)
    node._codegen(state)
    return "".join(state.tokens)


def _same_field(a, b) -> bool:
    if a is b:
        return True
    return isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and _same_objects(a, b)


def _same_objects(a, b) -> bool:
    """The same line objects (a transform that does not descend rebuilds the tuple, not the lines)."""
    return a is b or (len(a) == len(b) and all(x is y for x, y in zip(a, b)))


def _blanked_between(plan: Plan, a: int) -> bool:
    """Are there blanked statements between parsed statements ``a`` and ``a + 1``?"""
    parsed, units = plan.parsed, len(plan.first)
    before = parsed[a] if a >= 0 else -1
    after = parsed[a + 1] if a + 1 < len(parsed) else units
    return after != before + 1


def _replace_changed_lines(region: str, old: str, new: str) -> str | None:
    """``region`` (source text) with the lines where ``old`` (the parsed text of the same lines)
    and ``new`` differ replaced by ``new``'s. None when a differing line is not in ``region``
    as parsed (a blanked line)."""
    r, o, n = region.split("\n"), old.split("\n"), new.split("\n")
    if len(r) != len(o):
        return None
    p = 0
    top = min(len(o), len(n))
    while p < top and o[p] == n[p]:
        p += 1
    s = 0
    while s < top - p and o[-1 - s] == n[-1 - s]:
        s += 1
    if o[p : len(o) - s] != r[p : len(r) - s]:
        return None
    return "\n".join(r[:p] + n[p : len(n) - s] + r[len(r) - s :])


@functools.cache
def _apply_class():
    """The transformer class (built on first use: keeps libcst out of this module's import time)."""
    import libcst as cst

    class Apply(cst.CSTTransformer):
        """Applies edits recorded against original nodes; edits compose bottom-up."""

        def __init__(self, edits, needed, origin):
            super().__init__()
            self.edits = edits
            self.needed = needed
            self.origin = origin  # rebuilt node -> the parsed one it replaces

        def on_visit(self, node) -> bool:
            # only descend where an edit lies below: untouched subtrees are reused, not rebuilt
            return node in self.needed

        def on_leave(self, original_node, updated_node):
            fns = self.edits.get(original_node)
            if fns:
                for fn in fns:
                    updated_node = fn(updated_node)
            if updated_node is not original_node:
                self.origin[updated_node] = original_node
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


def _edit_applier(edits, needed, origin):
    """A LibCST transformer that applies ``edits`` to the nodes in ``needed`` (see ``_apply_class``)."""
    return _apply_class()(edits, needed, origin)
