"""Which statements of a Python file LibCST has to parse: the cheap pre-filter of
:func:`parabench.migrate.apply_rules.migrate_python`.

Stage 1 tests the raw text for words any rule can react to; stage 2 parses it with the C ``ast``
parser and looks only at identifiers, attribute names, imports and non-docstring strings; stage 3
(``_select``) keeps the top-level statements (and members of top-level classes, statements of
function bodies) that can matter and blanks the others - their lines emptied, so every line number
stays the same. The result is a :class:`Plan`. Nothing here imports LibCST.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import itertools
import operator
import re

from parabench.migrate import api_map
from parabench.migrate.core import Options
from parabench.migrate.rules._base import statement_first_line

_PARTIAL_MAX = 0.8  # parse the whole file when the statements that matter hold more of its text


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


def _words(words: tuple[str, ...], whole: tuple[str, ...] = ()):
    """``search(s)``: does ``s`` contain one of ``words`` (lower case), ignoring case, or one of
    ``whole`` as a word of its own (not inside a longer identifier)? Substring tests on the
    lower-cased text: ~20x faster than one case-insensitive alternation regex, which dominated the
    cost of the files that need no change."""

    memo: dict[str, bool] = {}  # short strings (identifiers, names) repeat: answered once each
    alone = re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, whole)) + r")(?!\w)").search if whole else None

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
        else:
            if alone is not None and alone(low):
                hit = True
        if len(s) <= 64:
            if len(memo) >= 100_000:
                memo.clear()
            memo[s] = hit
        return hit

    return search


_STATIC_SEARCH = _words(_STATIC_WORDS)
_MINDSPEED_SEARCH = _words((*_STATIC_WORDS, "megatron"))

# The names that stages 2 and 3 test (identifiers, attribute names, imports, keywords; a span's
# text passes the text gate first, as before) match fewer than the words above where a word would
# match far more than any rule needs (Megatron-Core's get_data_parallel_group, DeepSpeed's
# get_accelerator, re.compile: the corpus of benchmarks/migrate_corpus.py had 1,287 files parsed by
# LibCST, 6.05 M characters; with these 1,018 and 4.33 M, every output byte the same):
# - PY905 resolves a call to torch.nn[.parallel].DataParallel or torch.nn.parallel.data_parallel,
#   so its names count only as a whole name or dotted part (``nn.DataParallel``, an import of
#   ``data_parallel``), not inside ``get_data_parallel_group`` or ``DistributedDataParallel``;
# - PY909 resolves ``compile`` to torch.compile, so it too counts only as a whole name (not
#   ``compiled``, ``torch.compiler``), and ``X.compile`` only where X may be torch (``re.compile``
#   is in most files): ``_mentions_trigger``, ``_torch_names``;
# - "accelerator" is a stage-1 word only: PY912 reports ``accelerator='gpu'``, whose 'gpu' is no
#   word of its own but passes the string gate in stage 2; no rule reads an identifier for it.
_WHOLE_WORDS = ("data_parallel", "dataparallel", "compile")
_CODE_WORDS = tuple(w for w in _STATIC_WORDS if w not in _WHOLE_WORDS and w != "accelerator")
_STATIC_CODE_SEARCH = _words(_CODE_WORDS, _WHOLE_WORDS)
_MINDSPEED_CODE_SEARCH = _words((*_CODE_WORDS, "megatron"), _WHOLE_WORDS)


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


def _code_search(options: Options, gate):
    """The search of stages 2 and 3 (see _CODE_WORDS); the text gate's own in --mode runtime."""
    if options.mode == "runtime":
        return gate
    return _MINDSPEED_CODE_SEARCH if options.target == "mindspeed" else _STATIC_CODE_SEARCH


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


def prefilter(text: str, options: Options) -> Plan:
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
    return _select(text, tree, options, gate, _code_search(options, gate))


_Expr, _Constant, _Import, _ImportFrom, _If = ast.Expr, ast.Constant, ast.Import, ast.ImportFrom, ast.If


def _torch_names(body: list) -> frozenset[str]:
    """Names that may resolve to ``torch`` in the module (``PyContext.qnames``): ``torch`` itself
    (also when no import binds it) and every name an import anywhere in it binds to ``torch``."""
    return frozenset({"torch", *(local for local, qual in _bindings(body) if qual == "torch")})


def _docstring(body: list) -> ast.AST | None:
    first = body[0] if body else None
    if type(first) is _Expr and type(first.value) is _Constant and type(first.value.value) is str:
        return first.value
    return None


def _mentions_trigger(nodes: list, search, docstrings: set[int], torch_names: frozenset[str]) -> bool:
    """Does any identifier, attribute name, import or role-bearing string under ``nodes`` match?
    One pass; a container is always reached before its body, so its docstring is known in time.
    ``X.compile`` matches only where X is one of ``torch_names`` (``_torch_names``)."""
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
            attr = node.attr
            if attr == "compile":  # torch.compile is the only one a rule resolves (PY909)
                value = node.value
                if type(value) is Name and value.id in torch_names:
                    return True
            elif search(attr):
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


def _select(text: str, tree: ast.Module, options: Options, gate, search) -> Plan:
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

    torch_names = frozenset() if runtime else _torch_names(body)

    def whole_file() -> Plan:  # no blanking: LibCST parses the file as it is
        return Plan(runtime or _mentions_trigger([tree], search, docstrings, torch_names), "", text, tree)

    if len(body) < 2 or "\r" in text or not text.endswith("\n"):
        return whole_file()
    lines = text.split("\n")
    units = _group(body, lines)
    first = [u[0] for u in units]
    if any(b <= a for a, b in zip(first, first[1:])):
        return whole_file()
    spans, members = _spans(body, units, lines, runtime, docstrings)
    starts = line_starts(text)
    offs = [starts[g.start - 1] for g in spans] + [len(text)]
    if any(b <= a for a, b in zip(offs, offs[1:])):
        return whole_file()
    for k, g in enumerate(spans):
        g.text = text[offs[k] : offs[k + 1]]
    keep, triggered = _spans_that_matter(spans, doc is not None, runtime, (gate, search), docstrings, torch_names)
    if not runtime and not triggered:
        return Plan(False)
    trims: dict[int, _Trim] = {}
    if not runtime:
        special, imported = _keep_linked_spans(spans, keep, triggered, search, torch_names)
        trims = _trim_functions(spans, keep, lines, (gate, search), docstrings, special, imported, torch_names)
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
    spans: list[_Span], module_doc: bool, runtime: bool, searches, docstrings: set[int], torch_names: frozenset[str]
) -> tuple[list[bool], list[int]]:
    """(keep, triggered): the structural spans and those holding a trigger are kept; ``triggered``
    lists the latter (the start of ``_keep_linked_spans``)."""
    gate, search = searches  # the text gate tests the span's text, then ``search`` its names
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
        if not runtime and gate(g.text) and _mentions_trigger(g.nodes, search, docstrings, torch_names):
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
    searches,
    docstrings: set[int],
    special: set[str],
    imported: set[str],
    torch_names: frozenset[str],
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
    gate, search = searches  # as in _spans_that_matter
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
                gate(chunk)
                and _mentions_trigger(stmts, search, docstrings, torch_names)
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


def _keep_linked_spans(
    spans: list[_Span], keep: list[bool], triggered: list[int], search, torch_names: frozenset[str]
) -> tuple[set[str], set[str]]:
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
            if (
                type(x) in _FUNCS
                and x.decorator_list
                and _mentions_trigger(x.decorator_list, search, set(), torch_names)
            ):
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


def line_starts(text: str) -> list[int]:
    """starts[k] = offset of line k+1 (the lines as split at "\n"; a loop of str.find in Python
    took 3x as long)."""
    lines = text.split("\n")
    del lines[-1]
    return list(itertools.accumulate(map(operator.add, map(len, lines), itertools.repeat(1)), initial=0))
