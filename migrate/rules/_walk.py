"""Read-only traversal of a LibCST tree, in exactly the order ``node.visit(visitor)`` uses.

``CSTNode.visit`` rebuilds every node it passes (``_visit_and_replace_children`` constructs and
validates a new dataclass per node), so a plain visitor pass costs more than the parse itself.
The rules only read the tree, so the index walks the fields directly. The field order of each
node class is taken once from LibCST itself: the field names ``_visit_and_replace_children``
passes to its ``visit_*`` helpers, in source order (some fields are visited conditionally, e.g.
an f-string's format_spec, so one instance's ``on_visit_attribute`` calls are not enough).
Order and parents were checked equal to ``visit``'s on 267 DeepSpeed, Megatron-LM and torch
modules (whitespace and comment nodes aside, which it leaves out); the golden and fixture tests
cover the rules' use of it.
"""

from __future__ import annotations

import inspect
import re

import libcst as cst

_FIELDS: dict[type, tuple[str, ...]] = {}
# Whitespace and comments are not walked: no rule visits them or asks for their parent, and they are
# ~70% of a parsed module's nodes (Megatron-Core: SimpleWhitespace 38%, Newline 15%, EmptyLine 11%).
# Walking them was most of the index's cost and made the rule dispatch loop over them.
_UNWALKED = (
    cst.SimpleWhitespace,
    cst.ParenthesizedWhitespace,
    cst.TrailingWhitespace,
    cst.EmptyLine,
    cst.Newline,
    cst.Comment,
)
_IS_NODE: dict[type, bool] = dict.fromkeys(_UNWALKED, False)  # type -> walked node type


def _node_type(t: type) -> bool:
    _IS_NODE[t] = result = issubclass(t, cst.CSTNode)
    return result


class _FieldRecorder(cst.CSTVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.fields: list[str] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        return False  # do not descend: only the order of this node's own fields is wanted

    def on_leave(self, original_node: cst.CSTNode) -> None:
        return None

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        if attribute not in self.fields:
            self.fields.append(attribute)

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        return None


_VISIT_FIELD = re.compile(r'visit_\w+\(\s*self,\s*"(\w+)"')


def child_fields(node: cst.CSTNode) -> tuple[str, ...]:
    cls = type(node)
    fields = _FIELDS.get(cls)
    if fields is None:
        try:
            names = _VISIT_FIELD.findall(inspect.getsource(cls._visit_and_replace_children))
        except (OSError, TypeError):  # no source: what this instance announces
            rec = _FieldRecorder()
            node._visit_and_replace_children(rec)
            names = rec.fields
        fields = _FIELDS[cls] = tuple(dict.fromkeys(names))
    return fields


def walk(root: cst.CSTNode) -> tuple[list[cst.CSTNode], dict[cst.CSTNode, cst.CSTNode]]:
    """-> (every node in pre-order, child -> parent), whitespace and comments (``_UNWALKED``) left
    out. Iterative: deep trees do not recurse."""
    order: list[cst.CSTNode] = []
    parents: dict[cst.CSTNode, cst.CSTNode] = {}
    stack = [root]
    pop, push, append = stack.pop, stack.extend, order.append
    fields_of = _FIELDS
    is_node = _IS_NODE  # type -> bool: isinstance against the CSTNode ABC is slow
    while stack:
        node = pop()
        append(node)
        fields = fields_of.get(type(node))
        if fields is None:
            fields = child_fields(node)
        if not fields:
            continue
        kids: list[cst.CSTNode] = []
        for name in fields:
            value = getattr(node, name)
            t = type(value)
            if t is tuple or t is list:
                for v in value:
                    tv = type(v)
                    if is_node.get(tv) or (tv not in is_node and _node_type(tv)):
                        kids.append(v)
            elif is_node.get(t) or (t not in is_node and _node_type(t)):
                kids.append(value)
        for k in kids:
            parents[k] = node
        kids.reverse()
        push(kids)
    return order, parents
