"""Values the migrator writes and the parsers that must accept them (issue 13, class 2).

The value rewrites (``'cuda'`` -> ``'npu'``, ``'nccl'`` -> ``'hccl'``, in Python defaults, launch
flags, YAML and JSON) write into positions that a parser checks: argparse ``choices``, ``Literal``
annotations (also as choices through ``typing.get_args`` or a dataclass-to-argparse helper, which
derive ``--name`` / ``--na-me`` from the field ``na_me``), enum members. Chosen design:

- A literal set in the code (``Literal[...]``, ``choices=[...]``) is extended: PY130 adds the
  migrated value next to the original (``Literal["nccl", "hccl", "gloo"]``), keeping the original,
  so every value accepted before still is and the migrated one is too, in every file at once.
- A set the migrator cannot extend (enum members, ``choices=`` a name or a call, a Literal when
  PY130 does not run) is fixed: the engine collects these from every Python file of the run
  before migrating (``collect_fixed``), and a rewrite into a flag, field or key of that name is not
  made but reported as manual, naming the parser (``kept_for_parser``).

Names match as argparse derives them: dashes stripped, ``-`` read as ``_``, case folded.
"""

from __future__ import annotations

import ast
import re

from parabench.migrate.core import FixedValues, Options

DEVICE_RE = re.compile(r"^cuda(:\d+)?$")
BACKEND_COMPOUND_RE = re.compile(r"^(?:[a-z]+:[a-z]+,)*cuda:nccl(?:,[a-z]+:[a-z]+)*$")
EXTENDER = "PY130"  # the rule that extends literal sets


def mapped_value(value: str) -> str | None:
    """The value the migrator writes instead of ``value`` (None: it writes none)."""
    if value == "nccl":
        return "hccl"
    if DEVICE_RE.match(value):
        return value.replace("cuda", "npu", 1)
    if BACKEND_COMPOUND_RE.match(value):
        return value.replace("cuda:nccl", "npu:hccl", 1)
    return None


def flag_name(text: str) -> str:
    """``--distributed-backend`` / ``distributed_backend`` / ``-b`` -> ``distributed_backend`` / ``b``."""
    return text.lstrip("-").replace("-", "_").lower()


def kept_for_parser(options: Options, names, old: str, new: str) -> FixedValues | None:
    """The fixed set that accepts ``old`` but not ``new`` for one of ``names`` (flag/field/key)."""
    wanted = {flag_name(n) for n in names if n}
    for fixed in options.fixed_values:
        if fixed.names & wanted and old in fixed.values and new not in fixed.values:
            return fixed
    return None


def kept_message(fixed: FixedValues, old: str, new: str) -> str:
    accepted = ", ".join(sorted(fixed.values))
    return f"'{old}' kept: its parser accepts only {accepted} ({fixed.why}, {fixed.where}), not '{new}'"


KEPT_TIP = "add the NPU value to the parser (enum member, choices), then migrate the value"


# --- collection: the fixed sets of one Python file ----------------------------------------------


def collect_fixed(text: str, rel: str, extend_literals: bool) -> list[FixedValues]:
    """The accepted-value sets of ``text`` that hold a value the migrator rewrites and that will not
    be extended (enums, non-literal choices; literals too when ``extend_literals`` is False)."""
    if "nccl" not in text and "cuda" not in text:
        return []
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    nodes = list(ast.walk(tree))  # one walk for the enums and the sets (each walk was half the cost)
    enums = _enums(nodes)
    consts = {  # module-level NAME = [literal strings]: fixed, PY130 extends literals in place only
        t.id: v
        for st in tree.body
        if isinstance(st, ast.Assign) and (v := _literal_strings(st.value)) is not None
        for t in st.targets
        if isinstance(t, ast.Name)
    }
    out: list[FixedValues] = []
    for node in nodes:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            out += _argparse_sets(node, enums, consts, rel, extend_literals)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out += _annotation_sets(node.target.id, node.annotation, enums, rel, extend_literals)
        elif isinstance(node, ast.arg) and node.annotation is not None:
            out += _annotation_sets(node.arg, node.annotation, enums, rel, extend_literals)
    return [f for f in out if any(mapped_value(v) for v in f.values)]


def _enums(nodes: list[ast.AST]) -> dict[str, tuple[frozenset[str], int]]:
    """Enum classes with string members among ``nodes`` (all of a module's): name -> (values, line)."""
    out = {}
    for node in nodes:
        if isinstance(node, ast.ClassDef) and any(_last_name(b).endswith("Enum") for b in node.bases):
            values = [
                s.value.value
                for s in node.body
                if isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str)
            ]
            if values:
                out[node.name] = (frozenset(values), node.lineno)
    return out


def _last_name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _literal_strings(node: ast.AST) -> frozenset[str] | None:
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return frozenset(e.value for e in node.elts)  # type: ignore[attr-defined]
    return None


def _argparse_sets(call: ast.Call, enums: dict, consts: dict, rel: str, extend_literals: bool) -> list[FixedValues]:
    names = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    names += [k.value.value for k in call.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)]
    keys = frozenset(flag_name(n) for n in names if isinstance(n, str))
    out = []
    for k in call.keywords:
        where = f"{rel}:{call.lineno}"
        if k.arg == "choices":
            literal = _literal_strings(k.value)
            if literal is not None:
                if not extend_literals:
                    out.append(FixedValues(keys, literal, where, "choices, not extended: PY130 off"))
                continue
            enum = _enum_in(k.value, enums)
            if enum:  # the members' values are kept too (``enum:`` names)
                keys_enum = keys | {flag_name(f"enum:{enum}")}
                out.append(FixedValues(keys_enum, enums[enum][0], where, f"choices from enum {enum}"))
            elif isinstance(k.value, ast.Name) and k.value.id in consts:
                const = k.value.id  # its own elements are kept too (``const:`` names)
                out.append(FixedValues(keys | {flag_name(f"const:{const}")}, consts[const], where, f"choices={const}"))
        elif k.arg == "type" and _last_name(k.value) in enums:
            name = _last_name(k.value)
            out.append(FixedValues(keys | {flag_name(f"enum:{name}")}, enums[name][0], where, f"type=enum {name}"))
    return out


def _enum_in(node: ast.AST, enums: dict) -> str:
    return next((n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in enums), "")


def _annotation_sets(name: str, ann: ast.AST, enums: dict, rel: str, extend_literals: bool) -> list[FixedValues]:
    where = f"{rel}:{ann.lineno}"
    keys = frozenset({flag_name(name)})
    enum = _last_name(ann) if _last_name(ann) in enums else ""
    if enum:
        return [FixedValues(keys | {flag_name(f"enum:{enum}")}, enums[enum][0], where, f"annotated with enum {enum}")]
    if isinstance(ann, ast.Subscript) and _last_name(ann.value) == "Literal" and not extend_literals:
        values = [e.value for e in ast.walk(ann.slice) if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return [FixedValues(keys, frozenset(values), where, "Literal, not extended: PY130 off")]
    return []
