"""The DDP engine (the backend's declarations: parabench.adapters.ddp): torch's
DistributedDataParallel. Imported by the worker processes only, so that the ``bench`` parent, which
checks a job against the adapter's declarations, never imports torch."""

from __future__ import annotations

import contextlib

import torch

from parabench.adapters.base import WorkerContext
from parabench.adapters.torch_common import TorchEngine
from parabench.model import build_llama, set_activation_checkpointing


class DDPEngine(TorchEngine):
    def full_state_dict(self):
        return {n: p.detach().float().cpu() for n, p in self.model.module.named_parameters()}


def create_engine(ctx: WorkerContext) -> DDPEngine:
    from torch.nn.parallel import DistributedDataParallel

    job, opts = ctx.job, ctx.job.backend.options
    model = build_llama(job.model, seed=job.run.seed).to(ctx.device.torch_device)
    set_activation_checkpointing(model, opts.activation_checkpointing)
    ddp = DistributedDataParallel(
        model,
        bucket_cap_mb=opts.bucket_cap_mb,
        gradient_as_bucket_view=opts.gradient_as_bucket_view,
        static_graph=opts.static_graph,
    )
    if ctx.comm_log is not None:  # its C++ reducer's all-reduce made visible (parabench.commlog)
        ctx.comm_log.hook_ddp(ddp)

    def sync(last: bool):
        return ddp.no_sync() if not last else contextlib.nullcontext()

    autocast = torch.bfloat16 if job.run.precision == "bf16" else None
    return DDPEngine(ctx, ddp, list(model.named_parameters()), sync, autocast)
