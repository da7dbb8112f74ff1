"""Migrate one Python source text: the rules run on what :mod:`parabench.migrate.parse_plan` chose
for LibCST to parse, and the result is spliced back into the source text.

LibCST - the expensive part - parses only the statements the plan keeps (the others' lines left
empty, so every line number stays the same); the rules' edits are applied to that tree, and every
top-level statement that did not change is copied from the source text, the changed ones patched
line by line. Where splicing is not exact the whole file is parsed instead. The input is parsed,
never imported or executed (``compile`` only builds a code object).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from parabench.migrate.core import Finding, Options
from parabench.migrate.entries import may_train_at_top_level, top_level_training
from parabench.migrate.libcst_private import code_at, parse_module_unvalidated
from parabench.migrate.parse_plan import Plan, line_starts, prefilter
from parabench.migrate.rules._base import rules_for


def migrate_python(
    text: str, path: str, options: Options, *, partial: bool = True
) -> tuple[str, list[Finding], bool, str]:
    """Returns (new_text, findings, full_parse, skip_reason). ``partial=False`` gives LibCST the
    whole file even where the pre-filter found statements that cannot matter (tests compare both)."""
    if options.mode == "runtime" and not options.entry and "__main__" not in text:
        options = _top_level_entry(text, options)
    plan = prefilter(text, options)
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
        module = parse_module_unvalidated(plan.parse_text)  # the only LibCST parse of the file
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
        new_text = _render(new, module, layout, text, plan, ctx)
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


@dataclasses.dataclass(frozen=True)
class _Parsed:
    """What every patch of one file reads: the text LibCST parsed and its line starts, the parsed
    module, the map from rebuilt nodes to the parsed ones they replace, and ``known_lines`` (the
    (first, last) lines code generation already found for a parsed node, else None)."""

    text: str
    starts: list[int]
    module: Any
    origin: dict
    known_lines: Callable[[Any], tuple[int, int] | None]


def _render(new, parsed, layout, text: str, plan: Plan, ctx) -> str | None:
    """Source of ``new`` spliced into ``text``: top-level statements that are still the parsed
    objects are copied from ``text`` (with the statements blanked for a partial parse around them),
    rebuilt ones replace only the lines that changed, inserted ones are generated.
    None when that cannot be done exactly. ``ctx``: the rules' PyContext (its inserts, the rebuilt
    nodes' origins, known lines)."""
    if (
        layout is None
        or not parsed.has_trailing_newline
        or not _same_objects(new.header, parsed.header)
        or not _same_objects(new.footer, parsed.footer)
    ):
        return None
    starts = line_starts(text)
    ptext = plan.parse_text
    pstarts = starts if ptext is text else line_starts(ptext)
    if len(pstarts) != len(starts):
        return None
    # line index (0-based) where each parsed statement's text begins; the footer's lines are the last ones
    rows = [r - 1 for r in layout.region] + [len(starts) - 1 - len(parsed.footer)]
    if any(b < a for a, b in zip(rows, rows[1:])):
        return None
    bounds = [starts[r] for r in rows]
    origin, inserted = ctx.origin, ctx.inserted
    patching = _Parsed(ptext, pstarts, parsed, origin, ctx.known_lines)
    out = [text[: bounds[0]]]
    seen: list[int] = []
    for stmt in new.body:
        i = layout.index.get(stmt)
        if i is None and stmt in origin:
            i = layout.index[origin[stmt]]
            region = text[bounds[i] : bounds[i + 1]]
            old = ptext[pstarts[rows[i]] : pstarts[rows[i + 1]]]
            piece = _patch_statement(region, rows[i] + 1, patching, origin[stmt], stmt, layout.block(i, origin[stmt]))
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
    lines: list[str], base: int, parsed: _Parsed, old, new, sub, indents: tuple[str, ...], edits: list
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
    indents = (*indents, parsed.module.default_indent if old_block.indent is None else old_block.indent)
    mine: list = []
    for at, (old_s, new_s) in enumerate(zip(old_block.body, new_block.body)):
        if old_s is new_s:
            continue
        if parsed.origin.get(new_s) is not old_s:
            return False
        nested = (
            sub.block(at, old_s)
            if isinstance(old_s, (cst.ClassDef, cst.FunctionDef)) or type(old_s) in _COMPOUND
            else None
        )
        if nested is not None and (
            _patch_block(lines, base, parsed, old_s, new_s, nested, indents, mine)
            or _patch_header_and_body(lines, base, parsed, old_s, new_s, nested, sub.region[at] - 1, indents, mine)
        ):
            continue
        patch = _patch_whole(lines, base, parsed, sub, at, old_s, new_s, indents)
        if patch is None:
            return False
        mine.append(patch)
    edits.extend(mine)
    return True


def _patch_whole(lines: list[str], base: int, parsed: _Parsed, sub, at: int, old_s, new_s, indents: tuple[str, ...]):
    """The line patch (first, end, new lines) of body statement ``at`` of ``sub``'s block, rebuilt
    as a whole: the lines where its old and new code differ; None when one of them was blanked."""
    ptext, pstarts, module = parsed.text, parsed.starts, parsed.module
    row = sub.region[at] - 1  # 0-based line of the statement's text in the file
    if at + 1 < len(sub.region):  # statements tile the block: the parsed text up to the next one
        count = sub.region[at + 1] - 1 - row
        old_code = ptext[pstarts[row] : pstarts[row + count]]
    elif (known := parsed.known_lines(old_s)) is not None and row < known[1] < len(pstarts):
        # the block's last statement ends on the last line the rules' code generation found for it
        # (PyContext.lines): its text is the parsed text of its lines (LibCST reproduces its input)
        count = known[1] - row
        old_code = ptext[pstarts[row] : pstarts[row + count]]
    else:
        old_code = code_at(module, indents, old_s)
        count = old_code.count("\n")
        if row + count >= len(pstarts) or ptext[pstarts[row] : pstarts[row + count]] != old_code:
            return None
    return _line_patch(lines, base, row, count, old_code, code_at(module, indents, new_s))


def _line_patch(lines: list[str], base: int, row: int, count: int, old: str, new: str):
    """(first, end, new lines): the ``count`` source lines from file line ``row`` (0-based; ``lines[0]``
    is line ``base``) with those where ``old`` (their parsed text) and ``new`` differ replaced; None
    when a differing line was blanked for the parse."""
    lo = row - (base - 1)
    piece = _replace_changed_lines("\n".join(lines[lo : lo + count]) + "\n", old, new)
    if piece is None or not piece.endswith("\n"):
        return None
    return lo, lo + count, piece[:-1].split("\n")


def _patch_header_and_body(
    lines: list[str], base: int, parsed: _Parsed, old_s, new_s, nested, row: int, indents: tuple[str, ...], edits: list
) -> bool:
    """A rebuilt def or class whose header changed (a parameter's annotation, a decorator), its
    body perhaps too: the header's lines are patched on their own and the body's statements as
    ``_patch_block`` patches them, so the body's blanked statements (parse_plan._trim_functions)
    are never regenerated. ``row``: the statement's first line (0-based, leading lines included)."""
    import libcst as cst

    old_body, new_body = old_s.body, getattr(new_s, "body", None)
    if type(old_s) not in (cst.FunctionDef, cst.ClassDef) or type(new_s) is not type(old_s) or not nested.region:
        return False
    if not isinstance(old_body, cst.IndentedBlock) or not isinstance(new_body, cst.IndentedBlock):
        return False
    mine: list = []
    if new_body is not old_body and not _patch_block(
        lines, base, parsed, old_s, old_s.with_changes(body=new_body), nested, indents, mine
    ):
        return False
    # the headers: each statement generated with a one-line body in place of its own, that line cut off
    stub = old_body.with_changes(body=[cst.SimpleStatementLine(body=[cst.Pass()])], footer=())
    old_head, new_head = (
        _without_last_line(code_at(parsed.module, indents, s.with_changes(body=stub))) for s in (old_s, new_s)
    )
    count = old_head.count("\n")
    if row + count > nested.region[0] - 1 or parsed.text[parsed.starts[row] : parsed.starts[row + count]] != old_head:
        return False
    head = _line_patch(lines, base, row, count, old_head, new_head)
    if head is None:
        return False
    edits.extend([*mine, head])
    return True


def _without_last_line(code: str) -> str:
    return code[: code.rindex("\n", 0, len(code) - 1) + 1]


def _patch_statement(region: str, first_line: int, parsed: _Parsed, old, new, sub) -> str | None:
    """``region`` (the source text of a top-level statement starting at ``first_line``) with the
    rebuilt statements inside ``new`` patched line by line; None when that does not apply."""
    lines = region.split("\n")
    edits: list = []
    if sub is None or not (
        _patch_block(lines, first_line, parsed, old, new, sub, (), edits)
        or _patch_header_and_body(lines, first_line, parsed, old, new, sub, first_line - 1, (), edits)
    ):
        return None
    for lo, hi, new_lines in sorted(edits, reverse=True):
        lines[lo:hi] = new_lines
    return "\n".join(lines)


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
