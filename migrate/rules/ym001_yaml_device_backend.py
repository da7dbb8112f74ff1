"""YM001: device/backend values in YAML configs: cuda -> npu, nccl -> hccl (docs/sources.md#class-s-review)."""

from __future__ import annotations

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._py import BACKEND_COMPOUND_RE, DEVICE_RE
from parabench.migrate.rules._text import yaml_pairs, yaml_replace, yaml_scalar


@register
class YamlDeviceBackend(TextRule):
    code = "YM001"
    name = "yaml-device-backend"
    description = "YAML scalar values cuda[:N] -> npu[:N], nccl -> hccl, cuda:nccl,cpu:gloo -> npu:hccl,cpu:gloo (not under accelerator:)"
    safety = REVIEW
    kind = "yaml"
    source = "docs/sources.md#class-s-review, docs/sources.md#pattern-9"

    def apply(self, doc: TextDoc) -> None:
        for k, v, _ in yaml_pairs(doc):
            key = yaml_scalar(k)
            if str(key).lower() == "accelerator":
                continue
            for item in getattr(v, "value", []) if yaml_scalar(v) is None else [v]:
                self._value(doc, key, item)

    def _value(self, doc: TextDoc, key, v) -> None:
        value = yaml_scalar(v)
        if value is None:
            return
        for old, new, ok in (
            ("cuda", "npu", DEVICE_RE.match(value)),
            ("nccl", "hccl", value == "nccl"),
            ("cuda:nccl", "npu:hccl", BACKEND_COMPOUND_RE.match(value)),
        ):
            if ok:
                edit = yaml_replace(doc, v, old, new)
                if edit:
                    doc.change(type(self), *edit, f"{key}: {value} -> {value.replace(old, new)}", op=str(key))
                break
