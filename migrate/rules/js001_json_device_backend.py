"""JS001: "cuda" / "nccl" values in JSON configs (DeepSpeed, launch configs) -> "npu" / "hccl" (docs/sources.md#class-s-review)."""

from __future__ import annotations

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._py import BACKEND_COMPOUND_RE, DEVICE_RE
from parabench.migrate.rules._text import json_strings
from parabench.migrate.rules._values import KEPT_TIP, kept_for_parser, kept_message


@register
class JsonDeviceBackend(TextRule):
    code = "JS001"
    name = "json-device-backend"
    description = 'JSON string values "cuda[:N]" -> "npu[:N]", "nccl" -> "hccl", "cuda:nccl,cpu:gloo" -> "npu:hccl,cpu:gloo" (keys untouched)'
    safety = REVIEW
    kind = "json"
    source = "docs/sources.md#class-s-review, docs/sources.md#pattern-9"

    def apply(self, doc: TextDoc) -> None:
        for start, end, value, is_key, path in json_strings(doc):
            if is_key:
                continue
            raw = doc.text[start:end]
            key = path[-1] if path else ""
            if str(key).lower() == "accelerator":
                continue  # allow-lists (pattern 13): JS002 reports it
            for old, new, ok in (
                ("cuda", "npu", DEVICE_RE.match(value)),
                ("nccl", "hccl", value == "nccl"),
                ("cuda:nccl", "npu:hccl", BACKEND_COMPOUND_RE.match(value)),
            ):
                if ok and old in raw:
                    fixed = kept_for_parser(doc.options, [str(key)], value, value.replace(old, new))
                    if fixed is not None:  # the config's consumer would reject it (rules/_values.py)
                        message = kept_message(fixed, value, value.replace(old, new))
                        doc.manual(type(self), start, message, op=str(key), tip=KEPT_TIP)
                        break
                    pos = start + raw.index(old)
                    doc.change(
                        type(self),
                        pos,
                        pos + len(old),
                        new,
                        f'"{key}": "{value}" -> "{value.replace(old, new)}"',
                        op=str(key),
                    )
                    break
