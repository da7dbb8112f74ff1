"""The FSDP engine (docs of the backend: parabench.adapters.fsdp): torch's FSDP2 ``fully_shard`` and,
with ``backend.tp`` > 1, DTensor tensor parallelism. Imported by the worker processes only, so that
the ``bench`` parent, which checks a job against the adapter's declarations, never imports torch."""

from __future__ import annotations

import contextlib

import torch

from parabench.adapters.base import WorkerContext
from parabench.adapters.torch_common import TorchEngine
from parabench.model import build_llama, set_activation_checkpointing


def tensor_parallel_plan() -> dict:
    """The per-layer plan of torchtitan's ``apply_tp`` (torchtitan/models/llama3/infra/parallelize.py)
    without sequence parallelism: the attention's and the MLP's input enters as one replicated DTensor,
    so the backward all-reduces its gradient once per block (Megatron's f operator), not once per
    column-parallel projection; the row-parallel outputs are all-reduced (g)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    replicated = Replicate()
    return {
        # the rotary tables (cos, sin) stay plain tensors, identical on every rank
        "self_attn": PrepareModuleInput(
            input_layouts=(replicated, None, None), desired_input_layouts=(replicated, None, None)
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp": PrepareModuleInput(input_layouts=(replicated,), desired_input_layouts=(replicated,)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh) -> None:
    """Split every decoder layer over ``tp_mesh``. The attention then computes its rank's heads only:
    it reshapes by its head counts, which become the local ones, as the PyTorch TP tutorial set them
    (torchtitan's model infers them from the local width; docs/sources.md#fsdp2-tensor-parallel)."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, tensor_parallel_plan())
        layer.self_attn.n_heads //= tp
        layer.self_attn.n_kv //= tp


class FSDPEngine(TorchEngine):
    dp_mesh = None  # with tensor parallelism: the "dp" dimension of the 2-D mesh (None: 1-D FSDP)

    def data_parallel(self) -> tuple[int, int]:
        if self.dp_mesh is None:
            return super().data_parallel()
        return self.dp_mesh.get_local_rank(), self.dp_mesh.size()  # the tp ranks of a replica read one batch

    def clip_gradients(self, max_norm: float) -> None:
        """With tensor parallelism the parameters live on two meshes (the split layers' projections on
        ("dp", "tp"), the rest on "dp"), and torch's clip_grad_norm_ stacks their norms, which DTensor
        refuses across meshes: the global norm is taken per mesh (reduced over it, as torchtitan's
        dist_utils.clip_grad_norm_ does), combined, and every gradient scaled by the one coefficient."""
        if self.dp_mesh is None:
            return super().clip_gradients(max_norm)
        from torch.distributed.tensor import DTensor

        by_mesh: dict = {}
        for p in self.params:
            if p.grad is not None:
                by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        norms = []
        for params in by_mesh.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms))
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)

    def full_state_dict(self):
        out = {}
        for name, p in self.named_params:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().float().cpu()
        return out


def create_engine(ctx: WorkerContext) -> FSDPEngine:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    job, opts = ctx.job, ctx.job.backend.options
    device_type = torch.device(ctx.device.torch_device).type
    model = build_llama(job.model, seed=job.run.seed).to(ctx.device.torch_device)
    # torchtitan's order (parallelize_llama): tensor parallel, activation checkpointing, then FSDP
    if opts.tp > 1:
        mesh_2d = init_device_mesh(device_type, (ctx.world_size // opts.tp, opts.tp), mesh_dim_names=("dp", "tp"))
        apply_tensor_parallel(model, mesh_2d["tp"])
        mesh = mesh_2d["dp"]
    else:
        mesh = init_device_mesh(device_type, (ctx.world_size,))
    set_activation_checkpointing(model, opts.activation_checkpointing)
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=opts.reshard_after_forward,
        offload_policy=CPUOffloadPolicy() if opts.cpu_offload else OffloadPolicy(),
    )
    if job.run.precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)

    def sync(last: bool):
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    engine = FSDPEngine(ctx, model, list(model.named_parameters()), sync, None)
    engine.dp_mesh = mesh if opts.tp > 1 else None
    return engine
