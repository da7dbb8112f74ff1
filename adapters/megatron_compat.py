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
* **The distributed optimizer's checkpoint format** (docs/sources.md#megatron-distributed-optimizer-checkpoints,
  docs/megatron.md#checkpoints-with-the-distributed-optimizer). 0.16's ``dist_checkpointing`` refuses
  ``ShardedTensor.flattened_range`` (``mapping.py``, ``validate_metadata_integrity``), from which its
  ``sharded_state_dict`` default ``fully_sharded_model_space`` is built; it offers
  ``fully_reshardable`` (added in 0.15), chosen by ``metadata['distrib_optim_sharding_type']`` and
  recorded in the checkpoint with ``save(..., content_metadata=...)``, as Megatron-LM's
  ``megatron/training/checkpointing.py`` does. 0.12 has neither: its ``sharding_type`` argument
  defaults to ``fully_sharded_model_space``, flattened ranges and all. :func:`distopt_format`,
  :func:`optimizer_state_kwargs`, :func:`content_metadata_kwargs` and :func:`saved_distopt_format`
  choose by what the installed classes and functions have. On both, loading it without Transformer
  Engine or Apex (torch's AdamW) needs :func:`loading_torch_adam` around it.

* **Importing megatron-core on a CPU.** Both releases decorate their fusion helpers with
  ``megatron.core.jit.jit_fuser``, which is ``torch.compile`` on torch >= 2.2
  (``megatron/core/jit.py``): each decoration at import builds a compile wrapper, and the first one
  imports TorchDynamo and Inductor - 3 of the 5 CPU-seconds ``import megatron.core`` took in every CPU
  rank here. A CPU run turns the fusions off (``bias_activation_fusion`` and the rest, in the
  adapter's TransformerConfig) and never calls a compiled kernel, so :func:`import_core_uncompiled`
  imports megatron-core with ``jit_fuser`` the plain function, what 0.16's own ``disable_jit_fuser()``
  sets after the fact (too late: the decorators have run by then).

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
import sys
from typing import Any

from parabench.adapters.base import torch_compile_as_identity


def import_core_uncompiled(torch: Any) -> None:
    """Import megatron-core with ``jit_fuser`` an identity decorator, in a CPU worker before anything
    else imports it (module docstring); ``jit_fuser`` stays the identity for the modules megatron-core
    imports later."""
    if "megatron.core" in sys.modules:
        return
    with torch_compile_as_identity(torch) as identity:
        import megatron.core.jit as jit
    jit.jit_fuser = identity


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


def define_router_gemm_without_te(define: Any) -> None:
    """Let megatron-core's MoE router run without Transformer Engine (host, NPU) on 0.16.

    ``transformer/moe/moe_utils.py`` imports ``te_general_gemm`` only inside its ``try: import
    transformer_engine``, yet ``RouterGatingLinearFunction.forward`` and ``backward`` test
    ``if te_general_gemm is not None`` unconditionally: without TE every router call raised
    ``NameError: name 'te_general_gemm' is not defined`` (megatron-core 0.16.1; its torch.mm branch
    is the one meant for this case). Where the name is missing it is defined as None through
    ``define(obj, name, value)`` (scoped: the engine removes it in close())."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        define(moe_utils, "te_general_gemm", None)


# The distributed optimizer's checkpoint formats that keep every layout reshardable: each optimizer
# state is a tensor of its parameter's (global) shape, saved under the parameter's sharding
# (megatron/core/optimizer/distrib_optimizer.py, ``sharded_state_dict``).
FULLY_RESHARDABLE = "fully_reshardable"  # 0.15+: gathered over the data-parallel group at save
MODEL_SPACE = "fully_sharded_model_space"  # 0.12: each rank's flat slice of each parameter


# Releases whose distributed optimizer has no fully_reshardable format (see distopt_format): named by
# series only for the check before launch, which does not import megatron-core (seconds, torch with it).
MODEL_SPACE_SERIES = ("0.12",)


def distopt_format(distributed_optimizer: type) -> str:
    """The format parabench saves the distributed optimizer in on this release."""
    formats = getattr(distributed_optimizer, "checkpoint_fully_reshardable_formats", ())
    return FULLY_RESHARDABLE if FULLY_RESHARDABLE in formats else MODEL_SPACE


def optimizer_state_kwargs(distributed_optimizer: type, sharding_type: str) -> dict[str, Any]:
    """Keywords of ``optimizer.sharded_state_dict`` that select ``sharding_type``: Megatron-LM's
    ``metadata`` dict where the method takes one (0.13+; ``chained_optim_avoid_prefix`` as
    Megatron-LM sets it), else 0.12's ``sharding_type`` argument."""
    if _accepts(distributed_optimizer.sharded_state_dict, "metadata"):
        return {"metadata": {"distrib_optim_sharding_type": sharding_type, "chained_optim_avoid_prefix": True}}
    return {"sharding_type": sharding_type}


def content_metadata_kwargs(save: Any, sharding_type: str) -> dict[str, Any]:
    """``dist_checkpointing.save`` keywords recording the format in the checkpoint, where ``save``
    takes ``content_metadata`` (not 0.12): read back by :func:`saved_distopt_format`."""
    if not _accepts(save, "content_metadata"):
        return {}
    return {"content_metadata": {"distrib_optim_sharding_type": sharding_type, "chained_optim_avoid_prefix": True}}


def saved_distopt_format(directory: str, default: str) -> str:
    """The distributed optimizer format a checkpoint records (``default`` where the release cannot
    read content metadata or the checkpoint has none)."""
    from megatron.core import dist_checkpointing

    read = getattr(dist_checkpointing, "load_content_metadata", None)
    metadata = (read(directory) if read else None) or {}
    return metadata.get("distrib_optim_sharding_type", default)


@contextlib.contextmanager
def loading_torch_adam(optimizers: list):
    """Around a load of distributed optimizers that wrap torch's AdamW (no Transformer Engine or
    Apex; 0.12 and 0.16 alike), three gaps of megatron-core's loading path bridged:

    * ``DistributedOptimizer.state_dict()``, which ``sharded_state_dict`` calls when loading too,
      reads the step from the inner optimizer's per-parameter states and asserts there is exactly
      one; a fresh optimizer has none. Primed here with the state torch's AdamW allocates at its
      first step (step 0, zero moments); the load overwrites every value.
    * ``load_state_dict`` puts the checkpoint's step into every state, then
      ``_set_main_param_and_optimizer_states`` copies every state the optimizer holds, ``step``
      included, from the loaded parameter state, which has no ``step`` (KeyError 'step'). Patched on
      the instance while loading: a state the checkpoint lacks keeps the value just loaded.
    * That step is one tensor shared by every parameter's state (torch's ``Optimizer.load_state_dict``
      keeps ``step`` tensors as given), which AdamW would advance once per parameter. Each state gets
      its own copy after the load.
    """
    import torch
    from megatron.core.optimizer import distrib_optimizer

    targets = [o for o in optimizers if isinstance(o, distrib_optimizer.DistributedOptimizer)]
    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True) or not targets:
        yield
        return
    for optimizer in targets:
        _prime_adam_state(torch, optimizer.optimizer)
        optimizer._set_main_param_and_optimizer_states = _keeping_unsaved(optimizer)
    try:
        yield
    finally:
        for optimizer in targets:
            del optimizer._set_main_param_and_optimizer_states  # the class's method again
            for state in optimizer.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].clone()


def _prime_adam_state(torch: Any, inner: Any) -> None:
    if inner.state:
        return
    for group in inner.param_groups:
        for p in group["params"]:
            inner.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }


def _keeping_unsaved(optimizer: Any):
    original = optimizer._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        current = optimizer._get_main_param_and_optimizer_states(model_param)
        original(model_param, {**current, **tensors})

    return set_states


def distopt_checkpoint_blocker(version: str | None) -> str | None:
    """Why this installation cannot checkpoint the distributed optimizer (None: it can). 0.12's
    flattened-range code (``dist_checkpointing`` ``validation.py``, ``mapping.py``,
    ``exchange_utils.py``) calls ``numpy.product``, an alias numpy 2.0 removed, so every save of
    ``fully_sharded_model_space`` raises AttributeError under numpy 2."""
    if version is None or ".".join(version.split(".")[:2]) not in MODEL_SPACE_SERIES:
        return None
    import numpy

    if hasattr(numpy, "product"):
        return None
    return (
        f"megatron-core {version} checkpoints the distributed optimizer as {MODEL_SPACE}, whose code calls "
        f"numpy.product, removed in numpy 2.0 (numpy {numpy.__version__} here): install 'numpy<2', "
        "or checkpoint without the distributed optimizer"
    )
