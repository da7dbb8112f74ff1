"""One rank of Megatron-Core (worker side; the adapter and its declarations are in
adapters/megatron.py, whose docstring describes the model, optimizer, loss and metrics).

``MegatronEngine`` steps and accounts (the ``Engine`` roles) here and composes the rest from the
modules beside it: its construction (``megatron_build.MegatronBuild``), the MoE load-balancing loss
and routed-token counts (``megatron_moe.MegatronMoE``), native checkpoints
(``megatron_checkpointing.MegatronCheckpointing``: the ``Checkpointing`` role) and ``bench convert``'s
canonical export and import (``megatron_canonical_io.MegatronCanonicalIO``: the ``CanonicalIO`` role).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from parabench.adapters.base import Engine, ModelStateBytes, WorkerContext
from parabench.adapters.megatron_build import Counters, MegatronBuild
from parabench.adapters.megatron_canonical_io import MegatronCanonicalIO
from parabench.adapters.megatron_checkpointing import MegatronCheckpointing
from parabench.adapters.megatron_compat import import_core_uncompiled
from parabench.adapters.megatron_moe import MegatronMoE
from parabench.devices import package_version
from parabench.metrics import held_bytes, optimizer_state_tensors
from parabench.redirect import install

if TYPE_CHECKING:  # pragma: no cover
    from parabench.adapters.megatron import MegatronOptions


# the mixins come before Engine: their methods (tokens_per_expert, finish_checkpoint) replace the
# roles' defaults
class MegatronEngine(MegatronMoE, MegatronCheckpointing, MegatronCanonicalIO, MegatronBuild, Engine):
    def __init__(self, ctx: WorkerContext, redirect_cuda: bool = True):
        """``redirect_cuda=False`` when something else already maps CUDA onto the device (MindSpeed's
        adaptor applies torch_npu's transfer_to_npu)."""
        import torch

        self.ctx = ctx
        job = ctx.job
        self.opts: MegatronOptions = job.backend.options
        self.device_type = job.device.type
        self._redirection = None
        self._async_queue = None  # dist_checkpointing's background saves (run.checkpoint.async)
        self.counters = Counters()
        try:
            if self.device_type == "cpu":  # fusions off on a CPU: no compile wrappers (megatron_compat)
                import_core_uncompiled(torch)
            if redirect_cuda and self.device_type in ("cpu", "npu"):
                # CUDA -> host (or NPU): torch.cuda.*, device="cuda" literals, CUDA RNG, .cuda(), nccl.
                self._redirection = install("cuda", self.device_type)
                self._redirect_inside_backward(torch)
            self._build(torch)
        except BaseException:
            self.close()
            raise

    def _megatron_optimizers(self) -> list:
        """Megatron's optimizers that wrap a torch optimizer (a ChainedOptimizer holds several)."""
        return [o for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer]) if o.optimizer is not None]

    def param_groups(self) -> list[dict]:
        return [g for o in self._megatron_optimizers() for g in o.optimizer.param_groups]

    def data_parallel(self) -> tuple[int, int]:
        return self.ps.get_data_parallel_rank(), self.ps.get_data_parallel_world_size()

    def train_step(self, micro_batches):
        import torch
        import torch.distributed as dist

        o, job = self.opts, self.ctx.job
        seq = job.data.seq_len
        for m in self.chunks:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()

        def forward_step(data_iterator, model):
            tokens, labels = next(data_iterator)
            positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
            if o.cp > 1:  # this CP rank's 2 of 2*cp sequence chunks (load-balanced causal split)
                from megatron.core.utils import get_batch_on_this_cp_rank

                b = get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels, "position_ids": positions})
                tokens, labels, positions = b["tokens"], b["labels"], b["position_ids"]
            self._router_logits.clear()
            per_token = model(tokens, positions, None, labels=labels)  # loss on the last stage, hidden states elsewhere
            if not job.model.is_moe:
                return per_token, _loss
            if not self.ps.is_pipeline_last_stage(ignore_virtual=True):
                return self._stage_aux(per_token, len(micro_batches)), _loss
            return per_token, lambda per_token: _loss(per_token, self._aux_loss())

        data = [iter(micro_batches) for _ in self.chunks] if len(self.chunks) > 1 else iter(micro_batches)
        self.counters.active = True
        t0 = time.perf_counter()
        losses = self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=data,
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=seq,
            micro_batch_size=job.data.micro_batch_size,
            forward_only=False,
        )
        self.schedule_s += time.perf_counter() - t0
        ok, _grad_norm, _ = self.optimizer.step()
        self.counters.active = False
        while self._aux_sends:  # the stages' router statistics sent to the last stage (pp > 1)
            self._aux_sends.pop()[0].wait()
        if not ok:
            raise RuntimeError("megatron optimizer step was skipped (non-finite gradients)")
        self.steps += 1

        loss = torch.zeros((), dtype=torch.float32)
        if self.ps.is_pipeline_last_stage(ignore_virtual=True):
            loss = torch.stack([d["loss"] for d in losses]).float().mean()
        if o.pp > 1:
            dist.broadcast(
                loss,
                src=self.ps.get_pipeline_model_parallel_last_rank(),
                group=self.ps.get_pipeline_model_parallel_group(),
            )
        return loss

    def full_state_dict(self):
        return self._gather_canonical(lambda name, p: p)

    def model_state_bytes(self) -> ModelStateBytes:
        params = [p for m in self.chunks for p in m.parameters()]
        optimizers = self._megatron_optimizers()
        moments, other = optimizer_state_tensors(o.optimizer for o in optimizers)
        main = []
        for opt in optimizers:
            # fp32 master copies of low-precision params (bf16): Float16Optimizer / DistributedOptimizer
            for groups in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
                for group in getattr(opt, groups, []) or []:
                    main.extend(group)
        grads = [getattr(p, "main_grad", None) for p in params]
        param_bytes = held_bytes(params)
        main_bytes = held_bytes(main)
        return ModelStateBytes(
            params=param_bytes,
            grads=held_bytes(grads),
            optimizer=held_bytes(moments) + main_bytes,
            optimizer_other=held_bytes(other),
            detail={"fp32_main_params": main_bytes, "param_count": sum(p.numel() for p in params)},
        )

    def extra_metrics(self) -> dict[str, float]:
        o, m = self.opts, self.ctx.job.grad_accum
        out: dict[str, float] = {}
        if o.pp > 1:
            out["pipeline_bubble_predicted"] = (o.pp - 1) / (o.vpp * m)  # Narayanan et al. 2021, 2104.04473
        if self.steps and self.schedule_s > 0:
            rank = self.ctx.rank
            if o.pp > 1:
                out[f"rank{rank}.pipeline_bubble_measured"] = max(0.0, 1.0 - self.counters.compute_s / self.schedule_s)
            if o.tp > 1:
                layers = self.ctx.job.model.num_hidden_layers // o.pp
                out[f"rank{rank}.tp_collectives_per_step"] = self.counters.tp_calls / self.steps
                out[f"rank{rank}.tp_comm_bytes_per_step"] = self.counters.tp_bytes / self.steps
                out["tp_decoder_allreduces_predicted_per_step"] = 4 * layers * m  # 2 fwd + 2 bwd per layer
        return out

    def artifacts(self) -> dict[str, Any]:
        return {
            "megatron": {
                "version": package_version("megatron-core"),
                "layout": dataclasses.asdict(self.layout),
                "transformer_config": {
                    k: str(v) for k, v in sorted(vars(self.config).items()) if not k.startswith("_") and not callable(v)
                },
            }
        }

    def close(self) -> None:
        if self._async_queue is not None:
            self._async_queue.close()  # waits for a save still running
            self._async_queue = None
        ps = getattr(self, "ps", None)
        if ps is not None and ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        self.counters.restore()
        if self._redirection is not None:
            self._redirection.remove()
            self._redirection = None


def _loss(per_token, aux_loss=0.0):
    # token mean of this micro-batch (+ a MoE model's load-balancing term, MegatronEngine._aux_loss)
    loss = per_token.float().mean() + aux_loss
    # The schedule divides the returned tensor by m in place: report a copy.
    return loss, {"loss": loss.detach().clone()}
