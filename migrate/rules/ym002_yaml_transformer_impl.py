"""YM002: transformer_impl: transformer_engine -> local in YAML configs (docs/sources.md#mindspeed-flags: --transformer-impl local)."""

from __future__ import annotations

from parabench.migrate.core import REVIEW
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._text import yaml_pairs, yaml_replace, yaml_scalar


@register
class YamlTransformerImpl(TextRule):
    code = "YM002"
    name = "yaml-transformer-impl"
    description = (
        "transformer_impl / transformer-impl: transformer_engine -> local (Transformer Engine does not exist on NPU)"
    )
    safety = REVIEW
    kind = "yaml"
    source = "docs/sources.md#mindspeed-flags"

    def apply(self, doc: TextDoc) -> None:
        for k, v, _ in yaml_pairs(doc):
            key = str(yaml_scalar(k) or "").replace("-", "_")
            if key == "transformer_impl" and yaml_scalar(v) == "transformer_engine":
                edit = yaml_replace(doc, v, "transformer_engine", "local")
                if edit:
                    doc.change(
                        type(self),
                        *edit,
                        "transformer_impl: transformer_engine -> local",
                        op="transformer_impl",
                        tip="MindSpeed/Megatron local layers; fused kernels via MindSpeed flags",
                    )
