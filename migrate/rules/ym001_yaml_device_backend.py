"""YM001: device/backend values in YAML configs: cuda -> npu, nccl -> hccl (docs/sources.md#class-s-review)."""

from __future__ import annotations

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._py import BACKEND_COMPOUND_RE, DEVICE_RE
from parabench.migrate.rules._text import yaml_pairs, yaml_replace, yaml_scalar
from parabench.migrate.rules._values import KEPT_TIP, kept_for_parser, kept_message


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
                fixed = kept_for_parser(doc.options, [str(key)], value, value.replace(old, new))
                if fixed is not None:  # the config's consumer would reject it (rules/_values.py)
                    message = kept_message(fixed, value, value.replace(old, new))
                    doc.manual(type(self), v.start_mark.index, message, op=str(key), tip=KEPT_TIP)
                    break
                edit = yaml_replace(doc, v, old, new)
                if edit:
                    doc.change(type(self), *edit, f"{key}: {value} -> {value.replace(old, new)}", op=str(key))
                break
