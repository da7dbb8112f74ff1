"""PY109: CUDA env var names read or written from Python -> Ascend names (docs/sources.md#ascend-env-vars: move both sides)."""

from __future__ import annotations

import libcst as cst

from parabench.migrate import api_map
from parabench.migrate.core import SAFE
from parabench.migrate.rules._base import register
from parabench.migrate.rules._py import PyRule, replace_in_simple_string, string_role, string_value

SKIP_ROLES = frozenset({"prose", "concat", "attrname", "import", "command"})


def env_literal(rule: PyRule, node: cst.SimpleString, safety: str) -> None:
    value = string_value(node)
    entry = api_map.ENV_MAP.get(value or "")
    if entry is None or entry[1] != safety or value not in node.value:
        return
    if string_role(rule.ctx, node) in SKIP_ROLES:
        return
    new, _, note = entry
    rule.change(node, lambda n: replace_in_simple_string(n, value, new), f"env {value} -> {new}", op=value, tip=note)


@register
class EnvVar(PyRule):
    code = "PY109"
    name = "env-var"
    description = "'CUDA_VISIBLE_DEVICES' -> 'ASCEND_RT_VISIBLE_DEVICES', 'PYTORCH_CUDA_ALLOC_CONF' -> 'PYTORCH_NPU_ALLOC_CONF' wherever the name is used as a string"
    safety = SAFE
    source = "docs/sources.md#ascend-env-vars, docs/sources.md#class-a-safe, docs/sources.md#pattern-14"
    needs_torch_npu = False

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        env_literal(self, node, "safe")
