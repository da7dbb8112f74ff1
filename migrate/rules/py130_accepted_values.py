"""PY130: accepted-value sets (Literal[...], choices=[...]) gain the migrated value next to the original (docs/sources.md#accepted-values).

`distributed_backend: Literal["nccl", "gloo"] = "nccl"` -> `Literal["nccl", "hccl", "gloo"] = "hccl"`
(PY106 moves the default): the Literal, the argparse choices derived from it (typing.get_args, a
dataclass-to-argparse helper) and the launch scripts' `--distributed-backend hccl` (SH005) agree
again, in every file of the project, and every value accepted before still is.
"""

from __future__ import annotations

import libcst as cst

from parabench.migrate.core import SAFE
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, dotted, string_value
from parabench.migrate.rules._values import KEPT_TIP, kept_for_parser, kept_message, mapped_value

LITERAL_QNS = frozenset({"typing.Literal", "typing_extensions.Literal", "Literal"})


def _extended(elements, make):
    """``elements`` with a new element after each mapped one whose value is missing; None if none."""
    nodes = [e.value if isinstance(e, cst.Element) else getattr(e.slice, "value", None) for e in elements]
    values = {string_value(n) for n in nodes if n is not None}
    out: list = []
    added: list[str] = []
    for k, (e, node) in enumerate(zip(elements, nodes)):
        value = string_value(node) if node is not None else None
        new = mapped_value(value) if value is not None else None
        if new is None or new in values or new in added:
            out.append(e)
            continue
        string = cst.SimpleString(f"{node.prefix}{node.quote}{new}{node.quote}")
        comma = e.comma if isinstance(e.comma, cst.Comma) else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        last = k == len(elements) - 1
        out += [e.with_changes(comma=comma), make(e, string).with_changes(comma=e.comma if last else comma)]
        added.append(new)
    return (out, added) if added else None


@register
class AcceptedValues(PyRule):
    code = "PY130"
    name = "accepted-values"
    description = "Literal['nccl', ...] / choices=['cuda', ...]: add the migrated value ('hccl', 'npu') beside the original, so parsers accept what the migration writes"
    safety = SAFE
    source = "docs/sources.md#accepted-values"

    def visit_Subscript(self, node: cst.Subscript) -> None:
        if not self.ctx.qnames(node.value) & LITERAL_QNS:
            return
        done = _extended(node.slice, lambda e, s: e.with_changes(slice=cst.Index(value=s)))
        if done:
            self._change(node, "slice", done, "Literal")

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is None or node.keyword.value != "choices":
            return
        seq = node.value
        if isinstance(seq, (cst.List, cst.Tuple, cst.Set)):
            done = _extended(seq.elements, lambda e, s: e.with_changes(value=s))
            if done:
                self._change(seq, "elements", done, "choices")

    def _change(self, node, field: str, done, what: str) -> None:
        elements, added = done
        self.change(
            node,
            lambda n: n.with_changes(**{field: elements}),
            f"{what}: accepts {', '.join(repr(a) for a in added)} too (the migrated value)",
            op=what,
            tip="the original values stay accepted; drop them once nothing passes them",
        )


# --- value rewrites into a parser's fixed set (rules/_values.py): kept and reported ------------------


def position_names(ctx, node: cst.CSTNode) -> list[str]:
    """Names of the flag, field, parameter or key a string literal is the value of."""
    p = ctx.parent(node)
    if isinstance(p, cst.Arg) and p.keyword is not None:
        call = ctx.parent(p)
        if p.keyword.value == "default" and isinstance(call, cst.Call) and dotted(call.func) is not None:
            if dotted(call.func).endswith("add_argument"):
                names = [string_value(a.value) for a in call.args if a.keyword is None or a.keyword.value == "dest"]
                return [n for n in names if n]
        return [p.keyword.value]
    if isinstance(p, cst.Param) and p.default is node:
        return [p.name.value]
    if isinstance(p, cst.Element):  # an element of NAME = (...): the constant itself
        holder = ctx.parent(ctx.parent(p))
        if isinstance(holder, cst.Assign) and all(isinstance(t.target, cst.Name) for t in holder.targets):
            return [f"const:{t.target.value}" for t in holder.targets]
        return []
    if isinstance(p, (cst.Assign, cst.AnnAssign)) and p.value is node:
        targets = [t.target for t in p.targets] if isinstance(p, cst.Assign) else [p.target]
        names = [(dotted(t) or "").rsplit(".", 1)[-1] for t in targets]
        owner = ctx.parent(ctx.parent(ctx.parent(p)))  # statement line -> class body -> class
        if isinstance(owner, cst.ClassDef):  # an enum member's value: the enum's accepted set
            names.append(f"enum:{owner.name.value}")
        return names
    if isinstance(p, cst.DictElement) and p.value is node:
        return [string_value(p.key) or ""]
    return []


def kept_in_python(rule: PyRule, node: cst.CSTNode, old: str, new: str) -> bool:
    """True (and a manual finding) when ``node``'s value must stay for a parser's fixed set."""
    if not rule.ctx.options.fixed_values:
        return False
    fixed = kept_for_parser(rule.ctx.options, position_names(rule.ctx, node), old, new)
    if fixed is None:
        return False
    rule.manual(node, kept_message(fixed, old, new), op=old, tip=KEPT_TIP)
    return True
