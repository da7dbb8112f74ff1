"""JS002: CUDA-only features switched on in JSON configs: fp8, Transformer Engine, flash-attn, triton sparse attention, NVMe offload (docs/sources.md#class-m-manual)."""

from __future__ import annotations

from parabench.migrate.core import MANUAL
from parabench.migrate.rules._base import TextDoc, TextRule, register
from parabench.migrate.rules._text import json_get, json_strings, truthy

KEYS = {
    "fp8": "FP8 is unavailable on this NPU generation: use bf16",
    "transformer_engine": "Transformer Engine is CUDA-only: use MindSpeed",
    "flash_attn": "flash-attn is CUDA-only: use torch_npu.npu_fusion_attention",
    "flash_attention": "flash-attn is CUDA-only: use torch_npu.npu_fusion_attention",
    "use_flash_attn": "flash-attn is CUDA-only: use torch_npu.npu_fusion_attention (MindSpeed: --use-flash-attn)",
    "sparse_attention": "DeepSpeed sparse attention needs Triton (CUDA-only)",
    "use_triton": "Triton kernels are CUDA-only",
    "xformers": "xformers is CUDA-only",
}


@register
class JsonCudaFeatures(TextRule):
    code = "JS002"
    name = "json-cuda-features"
    description = "enabled fp8 / transformer_engine / flash_attn / sparse_attention / use_triton keys, NVMe offload and accelerator: cuda in JSON: reported"
    safety = MANUAL
    kind = "json"
    source = "docs/sources.md#class-m-manual, docs/sources.md#pattern-9"

    def apply(self, doc: TextDoc) -> None:
        strings = json_strings(doc)
        data = doc.cache["json_data"]
        for start, _end, value, is_key, path in strings:
            if is_key:
                low = value.lower()
                tip = KEYS.get(low) or next((t for k, t in KEYS.items() if low.startswith(k + "_")), None)
                if tip and truthy(json_get(data, path + (value,))):
                    doc.manual(type(self), start, f'"{value}" enabled', op=value, tip=tip)
            else:
                key = str(path[-1]).lower() if path else ""
                if key == "device" and value == "nvme":
                    doc.manual(
                        type(self),
                        start,
                        "NVMe offload",
                        op="offload.device=nvme",
                        tip="needs DeepSpeed's async_io op built for the NPU host: check `ds_report`, else offload to cpu",
                    )
                elif key == "accelerator" and value in ("cuda", "gpu"):
                    doc.manual(
                        type(self),
                        start,
                        f'accelerator "{value}"',
                        op="accelerator",
                        tip="allow-list: use the NPU accelerator name your framework registers",
                    )
