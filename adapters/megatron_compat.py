"""What differs between the megatron-core releases the Megatron adapter supports, in one place.

Supported: 0.12.x (MindSpeed's pin: MindSpeed ``core_r0.12.1``, MindSpeed-LLM's known-good set with
torch 2.7.1) and 0.16.x. Every difference the adapter hits is chosen here by a feature check on the
installed megatron-core (a keyword in a signature, a field of a config dataclass), never by
comparing version strings, so the engine code reads the same on every release:

* **Which virtual pipeline stage a model chunk is.** 0.13 added ``vp_stage`` to ``GPTModel`` and
  ``get_num_layers_to_build``; 0.12 reads the virtual rank from ``parallel_state`` instead
  (Megatron-LM 0.12 ``training.get_model`` calls ``set_virtual_pipeline_model_parallel_rank(i)``
  before building chunk ``i``). :func:`build_chunk` and :func:`num_layers_to_build` do either.
* **AdamW.** 0.16's ``OptimizerConfig`` has ``decoupled_weight_decay`` (False would be L2-coupled
  Adam); 0.12 has no such field and its adam is always decoupled (``torch.optim.AdamW`` without TE
  or Apex; their FusedAdam defaults to ``adam_w_mode=True``). :func:`adamw_options` sets the field
  only where it exists.

The rest of what the adapter calls (``initialize_model_parallel``, DDP and its config, the
distributed optimizer, the schedules and ``finalize_model_grads``, the tensor-parallel mappings)
has the same signature on both for the arguments used: the process-group collection
(``pg_collection``, 0.14+) is optional there and left to ``parallel_state``'s global groups.
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
