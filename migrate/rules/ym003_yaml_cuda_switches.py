"""YM003: flash-attention / Transformer-Engine / fp8 / triton switches turned on in YAML configs (docs/sources.md#class-m-manual)."""

from __future__ import annotations

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._text import truthy, yaml_pairs, yaml_scalar

SWITCHES = {
    "use_flash_attn": "flash-attn is CUDA-only: torch_npu.npu_fusion_attention (MindSpeed supports use_flash_attn natively)",
    "flash_attn": "flash-attn is CUDA-only: use torch_npu.npu_fusion_attention",
    "flash_attention": "flash-attn is CUDA-only: use torch_npu.npu_fusion_attention",
    "use_flash_attention": "flash-attn is CUDA-only: use torch_npu.npu_fusion_attention",
    "fp8": "FP8 is unavailable on this NPU generation: use bf16",
    "transformer_engine": "Transformer Engine is CUDA-only: use MindSpeed",
    "use_te": "Transformer Engine is CUDA-only: use MindSpeed",
    "use_transformer_engine": "Transformer Engine is CUDA-only: use MindSpeed",
    "use_triton": "Triton kernels are CUDA-only",
    "xformers": "xformers is CUDA-only",
    "use_xformers": "xformers is CUDA-only",
}
MINDSPEED_OK = frozenset({"use_flash_attn"})


@register
class YamlCudaSwitches(TextRule):
    code = "YM003"
    name = "yaml-cuda-switches"
    description = "enabled use_flash_attn / fp8* / transformer_engine / use_triton / xformers keys, attn_implementation: flash_attention_*, accelerator: cuda|gpu: reported"
    safety = MANUAL
    kind = "yaml"
    source = "docs/sources.md#class-m-manual, docs/sources.md#pattern-9, docs/sources.md#pattern-13"

    def apply(self, doc: TextDoc) -> None:
        for k, v, _ in yaml_pairs(doc):
            key = str(yaml_scalar(k) or "").lower().replace("-", "_")
            value = yaml_scalar(v)
            offset = k.start_mark.index
            if key == "attn_implementation" and value and value.startswith("flash_attention"):
                doc.manual(
                    type(self), offset, f"attn_implementation: {value}", op=key, tip="use sdpa (or eager) on NPU"
                )
                continue
            if key == "accelerator" and value in ("cuda", "gpu"):
                doc.manual(
                    type(self),
                    offset,
                    f"accelerator: {value}",
                    op=key,
                    tip="allow-list: use the NPU accelerator name your framework registers",
                )
                continue
            if doc.options.target == "mindspeed" and key in MINDSPEED_OK:
                continue
            tip = SWITCHES.get(key) or (SWITCHES["fp8"] if key.startswith("fp8") else None)
            if tip and value is not None and truthy(value):
                doc.manual(type(self), offset, f"{key}: {value}", op=key, tip=tip)
