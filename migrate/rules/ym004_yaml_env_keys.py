"""YM004: env var names used as YAML keys (launcher env: sections) -> Ascend/HCCL names (docs/sources.md#ascend-env-vars)."""

from __future__ import annotations

from parabench.migrate import api_map
from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._text import yaml_pairs, yaml_replace, yaml_scalar


@register
class YamlEnvKeys(TextRule):
    code = "YM004"
    name = "yaml-env-keys"
    description = (
        "CUDA_VISIBLE_DEVICES, PYTORCH_CUDA_ALLOC_CONF, NCCL_SOCKET_IFNAME ... as YAML keys -> Ascend/HCCL names"
    )
    safety = REVIEW
    kind = "yaml"
    source = "docs/sources.md#ascend-env-vars, docs/sources.md#class-a-safe, docs/sources.md#class-s-review"

    def apply(self, doc: TextDoc) -> None:
        for k, _v, _ in yaml_pairs(doc):
            key = yaml_scalar(k)
            entry = api_map.ENV_MAP.get(key or "")
            if entry and key != "NCCL_BUFFSIZE":
                edit = yaml_replace(doc, k, key, entry[0])
                if edit:
                    doc.change(type(self), *edit, f"{key} -> {entry[0]}", op=key, tip=entry[2])
