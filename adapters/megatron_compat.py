"""What differs between the megatron-core releases the Megatron adapter supports, in one place.

Supported: 0.12.x (MindSpeed's pin: MindSpeed ``core_r0.12.1``, MindSpeed-LLM's known-good set with
torch 2.7.1) and 0.16.x. Every difference the adapter hits is chosen here by a feature check on the
installed megatron-core (a keyword in a signature, a field of a config dataclass), never by
comparing version strings, so the engine code reads the same on every release:

* **Which virtual pipeline stage a model chunk is.** 0.16 takes ``vp_stage`` in ``GPTModel`` and
  ``get_num_layers_to_build``; 0.12 has no such argument and reads ``parallel_state``'s virtual
  pipeline rank while building (``get_transformer_layer_offset`` in
  ``megatron/core/transformer/transformer_layer.py`` numbers the chunk's layers from it), so it is
  set around the construction. :func:`build_chunk` and :func:`num_layers_to_build` do either.
* **AdamW.** 0.16's ``OptimizerConfig`` has ``decoupled_weight_decay`` (False would be L2-coupled
  Adam); 0.12 has no such field and its adam is always decoupled (``torch.optim.AdamW`` without TE
  or Apex; their FusedAdam defaults to ``adam_w_mode=True``). :func:`adamw_options` sets the field
  only where it exists.

The rest of what the adapter calls (``initialize_model_parallel``, DDP and its config, the
distributed optimizer, the schedules and ``finalize_model_grads``, the tensor-parallel mappings)
has the same signature on both for the arguments used: 0.16's process-group collection
(``pg_collection``) is optional there and left to ``parallel_state``'s global groups, which both
releases build in ``initialize_model_parallel``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any


def _accepts(fn: Any, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def build_chunk(gpt_model: type, ps: Any, vp_stage: int | None, **kwargs: Any) -> Any:
    """``GPTModel(**kwargs)`` for virtual stage ``vp_stage`` (None without interleaving)."""
    if _accepts(gpt_model.__init__, "vp_stage"):
        return gpt_model(**kwargs, vp_stage=vp_stage)
    with _virtual_rank(ps, vp_stage):
        return gpt_model(**kwargs)


def num_layers_to_build(config: Any, vp_stage: int | None) -> int:
    """Decoder layers of this pipeline rank's virtual stage ``vp_stage``."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    if _accepts(get_num_layers_to_build, "vp_stage"):
        return get_num_layers_to_build(config, vp_stage=vp_stage)
    from megatron.core import parallel_state as ps

    with _virtual_rank(ps, vp_stage):
        return get_num_layers_to_build(config)


@contextlib.contextmanager
def _virtual_rank(ps: Any, vp_stage: int | None):
    """parallel_state's virtual pipeline rank set to ``vp_stage`` while building, then restored
    (the schedules set it themselves while they run)."""
    if vp_stage is None:
        yield
        return
    before = ps.get_virtual_pipeline_model_parallel_rank()
    ps.set_virtual_pipeline_model_parallel_rank(vp_stage)
    try:
        yield
    finally:
        ps.set_virtual_pipeline_model_parallel_rank(before)


def adamw_options(optimizer_config: type) -> dict[str, Any]:
    """OptimizerConfig keywords that make ``optimizer='adam'`` decoupled AdamW on this release."""
    fields = {f.name for f in dataclasses.fields(optimizer_config)}
    return {"decoupled_weight_decay": True} if "decoupled_weight_decay" in fields else {}


def patch_fp8_fallback(patch: Any) -> None:
    """Let the distributed optimizer step without Transformer Engine (host, NPU) on 0.12.

    Its step always calls ``fp8_utils.quantize_param_shard`` with this rank's fp8 params; 0.12's
    fallback for a missing TE raises "Invalid Transformer Engine version for FP8 distributed
    optimizer" even when there are none, 0.16's returns (every TE implementation returns early on an
    empty list too). Where the empty call raises, the optimizer's binding gets that early return
    through ``patch(obj, name, make)`` (scoped: the engine undoes it in close()).
    """
    from megatron.core import fp8_utils
    from megatron.core.optimizer import distrib_optimizer

    try:
        fp8_utils.quantize_param_shard([], [], [], None)
        return
    except RuntimeError:
        pass

    def make(original):
        def quantize_param_shard(model_params, *args, **kwargs):
            if len(model_params):
                original(model_params, *args, **kwargs)

        return quantize_param_shard

    patch(distrib_optimizer, "quantize_param_shard", make)
