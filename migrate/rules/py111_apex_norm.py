"""PY111: apex FusedLayerNorm / FusedRMSNorm -> torch.nn.LayerNorm / RMSNorm (docs/sources.md#class-s-review)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate import api_map
from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, dotted, parse_expr, torch_bound


def call_fits(call: cst.CSTNode | None, func: cst.CSTNode, replacement: str) -> bool:
    """Does this use of an apex class still work with ``replacement`` (api_map.APEX_ACCEPTS)?
    Uses other than a call (``isinstance(o, FusedAdam)``) do."""
    if not isinstance(call, cst.Call) or call.func is not func:
        return True
    positional, keywords = api_map.APEX_ACCEPTS[replacement]
    if any(a.star for a in call.args):
        return False  # *args / **kwargs: cannot be checked
    if sum(1 for a in call.args if a.keyword is None) > positional:
        return False
    return all(a.keyword is None or a.keyword.value in keywords for a in call.args)


def import_fits(ctx, node: cst.ImportFrom, mapping: dict[str, str]) -> bool:
    """Do all calls of the names ``node`` imports still work with their replacements? (issue #29 class 5)"""
    for a in node.names:
        local = a.asname.name.value if a.asname else a.name.value
        replacement = mapping.get(a.name.value) if isinstance(a.name, cst.Name) else None
        if replacement is None:
            continue
        for use in ctx.names.get(local, ()):
            if not call_fits(ctx.parent(use), use, replacement):
                return False
    return True


def rewrite_from_import(rule: PyRule, node: cst.ImportFrom, modules, mapping: dict[str, str], tip: str) -> None:
    if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
        return
    mod = dotted(node.module)
    if mod not in modules:
        return
    names = [a.name.value for a in node.names if isinstance(a.name, cst.Name)]
    if not names or any(n not in mapping for n in names):
        return  # partly unmappable: left whole, reported by PY907
    if not import_fits(rule.ctx, node, mapping):
        return  # a call passes apex-only arguments: left whole, reported by PY907
    targets = {mapping[n].rsplit(".", 1)[0] for n in names}
    if len(targets) != 1:
        return
    new_mod = targets.pop()

    def fn(stmt: cst.ImportFrom) -> cst.ImportFrom:
        aliases = []
        for a in stmt.names:
            local = a.asname.name.value if a.asname else a.name.value
            new_name = mapping[a.name.value].rsplit(".", 1)[1]
            asname = None if local == new_name else cst.AsName(name=cst.Name(local))
            aliases.append(a.with_changes(name=cst.Name(new_name), asname=asname))
        return stmt.with_changes(module=parse_expr(new_mod), names=aliases)

    rule.change(
        node, fn, f"from {mod} import {', '.join(names)} -> {', '.join(mapping[n] for n in names)}", op=mod, tip=tip
    )


def rewrite_attribute(rule: PyRule, node: cst.Attribute, modules, mapping: dict[str, str], tip: str) -> None:
    for q in sorted(rule.ctx.qnames(node)):  # sorted: set order varies per process
        mod, _, name = q.rpartition(".")
        if mod in modules and name in mapping and torch_bound(rule.ctx.module):
            if not call_fits(rule.ctx.parent(node), node, mapping[name]):
                return  # apex-only arguments: left, reported by PY907
            new = parse_expr(mapping[name])
            rule.change(node, lambda n, new=new: new, f"{q} -> {mapping[name]}", op=q, tip=tip)
            return


@register
class ApexNorm(PyRule):
    code = "PY111"
    name = "apex-fused-norm"
    description = "apex.normalization FusedLayerNorm/MixedFusedLayerNorm/FusedRMSNorm -> torch.nn.LayerNorm/RMSNorm (same constructor arguments)"
    safety = REVIEW
    source = "docs/sources.md#class-s-review"
    needs_torch_npu = False
    tip = "apex-only kwargs (memory_efficient, sequence_parallel) must be removed; MindSpeed patches Megatron's norms itself"

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        rewrite_from_import(self, node, api_map.APEX_NORM_MODULES, api_map.APEX_NORM, self.tip)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        rewrite_attribute(self, node, api_map.APEX_NORM_MODULES, api_map.APEX_NORM, self.tip)
