"""Step checkpoints on Megatron-Core (the ``Checkpointing`` role of ``MegatronEngine``, worker side):
``megatron.core.dist_checkpointing`` in Megatron-LM's layout (torch_dist), the distributed optimizer
in the format this release saves (megatron_compat), asynchronous saves through its
``AsyncCallsQueue``. Reading checkpoints Megatron-LM itself wrote is ``bench convert``'s
(parabench.convert.megatron_checkpoint), not this module's.

``MegatronCheckpointing`` is a mixin of ``MegatronEngine`` (adapters/megatron_engine.py): it reads
``opts``, ``ps``, ``chunks``, ``optimizer``, ``_async_queue`` and the engine's ``_megatron_optimizers()``.
"""

from __future__ import annotations

from pathlib import Path

from parabench.adapters.base import Checkpointing
from parabench.adapters.megatron_build import unwrap
from parabench.adapters.megatron_compat import (
    content_metadata_kwargs,
    distopt_format,
    loading_torch_adam,
    optimizer_state_kwargs,
    saved_distopt_format,
)


class MegatronCheckpointing(Checkpointing):
    """Native checkpoints of a ``MegatronEngine``."""

    def _sharded_state_dict(self, is_loading: bool, distopt_format: str | None) -> dict:
        """Megatron-LM's layout (training/checkpointing.py generate_state_dict): ``model`` (or
        ``model0``, ``model1``.. per virtual stage) and ``optimizer``, whose states point at the
        model's ShardedTensors; the distributed optimizer's in ``distopt_format``
        (megatron_compat.distopt_format: one tensor of the parameter's shape per state, reshardable)."""
        models = [unwrap(chunk) for chunk in self.chunks]  # GPTModel: Megatron-LM unwraps DDP/Float16Module too
        if len(models) == 1:
            state = {"model": models[0].sharded_state_dict()}
        else:
            state = {f"model{i}": model.sharded_state_dict() for i, model in enumerate(models)}
        kwargs = optimizer_state_kwargs(self._distributed_optimizer(), distopt_format) if distopt_format else {}
        state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=is_loading, **kwargs)
        return state

    def _distributed_optimizer(self) -> type:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        return DistributedOptimizer

    def _distopt_format(self) -> str | None:
        """The format this release saves the distributed optimizer in (None without one)."""
        return distopt_format(self._distributed_optimizer()) if self.opts.distributed_optimizer else None

    def _strategies(self, directory, saving: bool):
        """torch_dist (PyTorch DCP files) with the work spread over the data-parallel replicas."""
        from megatron.core.dist_checkpointing.serialization import (
            get_default_load_sharded_strategy,
            get_default_save_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelLoadStrategyWrapper,
            FullyParallelSaveStrategyWrapper,
        )

        group = self.ps.get_data_parallel_group(with_context_parallel=True)
        if saving:
            return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), group)
        return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(directory)), group)

    def _gather_updated_params(self) -> None:
        """With overlap_param_gather, the weights other data-parallel ranks updated reach this rank's
        model only in the next forward's all-gather: gather them now, or the model's part of the
        checkpoint is one step behind its optimizer's (Megatron-LM's save_checkpoint_and_time does
        the same: force_param_sync, megatron/training/training.py). Megatron then marks the gather
        done, so the next forward would skip it; it is marked pending again, so the step after a save
        communicates what every other step does (the measured volume stays the formula's)."""
        if not self.opts.overlap_param_gather:
            return
        for chunk in self.chunks:
            chunk.start_param_sync(force_sync=True)
            for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                group.param_gather_dispatched = False

    def save_checkpoint(self, directory, *, async_save: bool = False) -> None:
        from megatron.core import dist_checkpointing

        Path(directory).mkdir(parents=True, exist_ok=True)  # every rank: dist_checkpointing needs it to exist
        self._gather_updated_params()
        fmt = self._distopt_format()
        state = self._sharded_state_dict(is_loading=False, distopt_format=fmt)
        strategy = self._strategies(directory, saving=True)
        recorded = content_metadata_kwargs(dist_checkpointing.save, fmt) if fmt else {}
        request = dist_checkpointing.save(state, str(directory), strategy, async_sharded_save=async_save, **recorded)
        if request is not None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._async_queue = self._async_queue or AsyncCallsQueue()
            self._async_queue.schedule_async_request(request)

    def finish_checkpoint(self) -> None:
        if self._async_queue is not None:
            self._async_queue.maybe_finalize_async_calls(blocking=True, no_dist=False)

    def load_checkpoint(self, directory) -> None:
        from megatron.core import dist_checkpointing

        fmt = self._distopt_format()
        fmt = fmt and saved_distopt_format(str(directory), fmt)
        with loading_torch_adam(self._megatron_optimizers()):
            state = self._sharded_state_dict(is_loading=True, distopt_format=fmt)
            loaded = dist_checkpointing.load(state, str(directory), self._strategies(directory, saving=False))
            models = [unwrap(chunk) for chunk in self.chunks]
            for i, model in enumerate(models):
                model.load_state_dict(loaded["model" if len(models) == 1 else f"model{i}"])
            self.optimizer.load_state_dict(loaded["optimizer"])
