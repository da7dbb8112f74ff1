"""FSDP: PyTorch FSDP2 (``fully_shard``), each decoder layer and the root sharded over all ranks.

Model states per rank with full sharding over N ranks, fp32 AdamW: 16 * Psi / N bytes, plus the
padding FSDP2 adds to make every dim-0 shard equal (Rajbhandari et al. 2019, arXiv 1910.02054,
stage 3, K=8 for fp32 Adam). bf16 uses ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: sharded parameters, gradients and moments stay fp32, so the formula holds;
the bf16 copies exist only while a layer is unsharded.

With ``backend.tp`` > 1 (FSDP2 + tensor parallel, torchtitan's 2-D layout): a ("dp", "tp") device
mesh; each decoder layer's attention (q/k/v column-parallel, o row-parallel) and MLP (gate/up
column-parallel, down row-parallel) split over "tp" with ``parallelize_module`` (DTensor), then
``fully_shard`` over "dp". The embedding, the norms and lm_head stay whole on every tp rank and are
sharded over dp only. Per rank: 16 * Psi_tp / dp, Psi_tp the parameters of one tp rank
(docs/sources.md#fsdp2-tensor-parallel).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
from dataclasses import dataclass

import torch

from parabench.adapters.base import Adapter, Availability, Capabilities, ConvertSupport, StateFormula, WorkerContext
from parabench.adapters.torch_common import DCP_SUPPORT, TorchEngine
from parabench.commvolume import tp_shard_shapes
from parabench.errors import SpecError
from parabench.model import build_llama, set_activation_checkpointing
from parabench.spec import MODEL_FEATURES, JobSpec, ModelSpec, ParallelDims

# torch 2.6's FSDP2 calls Stream.record_event/wait_event, which torch.cpu.Stream lacks there, and
# with those stubbed its reshard-after-forward overwrites tensors autograd saved; torch 2.7 runs it on
# CPU (both found by benchmarks/compat_matrix.sh). Accelerators have real streams.
CPU_FSDP2_TORCH = (2, 7)


def torch_release() -> tuple[int, ...]:
    """(major, minor) of the installed torch, local build tags (+cpu, +cu124) ignored."""
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


@dataclass(frozen=True)
class FSDPOptions:
    reshard_after_forward: bool = True  # free unsharded params after forward (ZeRO-3); false ~ ZeRO-2
    activation_checkpointing: bool = False
    cpu_offload: bool = False  # CPUOffloadPolicy: sharded states live on the host (accelerators only)
    tp: int = 1  # tensor-parallel degree: decoder layers split over tp ranks (DTensor), FSDP over world / tp


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


class FSDPAdapter(Adapter):
    name = "fsdp"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda", "npu"}),
        precisions=frozenset({"fp32", "bf16"}),
        shards_model_states=True,
        model_features=MODEL_FEATURES,
        tensor_parallel=True,
        checkpoint=DCP_SUPPORT,
        convert=ConvertSupport(),
        # the canonical MoE block under fully_shard: every expert a parameter sharded over all ranks
        # like any other (no expert parallelism), the canonical dropless routing (docs/moe.md)
        moe=True,
    )
    Options = FSDPOptions

    @classmethod
    def parallel_dims(cls, options: FSDPOptions, world_size: int, model: ModelSpec) -> ParallelDims:
        if options.tp < 1 or world_size % options.tp:
            raise SpecError(
                "backend.tp",
                f"world size {world_size} is not divisible by tp={options.tp}: FSDP shards over world / tp ranks",
            )
        return ParallelDims(world_size=world_size, dp=world_size // options.tp, tp=options.tp)

    @classmethod
    def availability(cls) -> Availability:
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError as exc:  # torch < 2.6 had FSDP2 only under torch.distributed._composable.fsdp
            return Availability(
                False,
                f"FSDP2 needs torch>=2.6 (public torch.distributed.fsdp.fully_shard); torch "
                f"{importlib.metadata.version('torch')} lacks it: {exc}",
            )
        return Availability(True, "FSDP2 fully_shard in torch", {"torch": importlib.metadata.version("torch")})

    @classmethod
    def validate(cls, job: JobSpec) -> None:
        if job.model.is_moe and job.parallel.tp > 1:
            raise SpecError(
                "backend.tp",
                f"tp={job.parallel.tp} splits the dense MLP (torchtitan's plan), and a Mixture-of-Experts model's "
                "experts have no tensor-parallel plan here: use tp=1 (the experts sharded over every rank) or "
                "backend=megatron with backend.ep",
            )
        if job.backend.options.cpu_offload and job.device.type == "cpu":
            raise SpecError(
                "backend.cpu_offload", "offloading to the host needs an accelerator device (device=cuda or npu)"
            )
        if job.device.type == "cpu" and torch_release() < CPU_FSDP2_TORCH:
            raise SpecError(
                "backend",
                f"fsdp on device=cpu needs torch>={'.'.join(map(str, CPU_FSDP2_TORCH))}: torch "
                f"{torch.__version__}'s FSDP2 has no CPU stream events (torch.cpu.Stream.record_event); "
                "use backend=ddp or an accelerator device, or upgrade torch",
            )

    @classmethod
    def layout_words(cls, options: FSDPOptions) -> list[str]:
        # reshard_after_forward=false keeps the gathered params until backward: ZeRO-2-like
        return ([f"tp{options.tp}"] if options.tp > 1 else []) + (
            [] if options.reshard_after_forward else ["noreshard"]
        )

    @classmethod
    def expected_model_state(cls, job: JobSpec) -> StateFormula:
        psi, n, tp = job.model.num_params(), job.parallel.world_size, job.parallel.tp
        if tp == 1:
            return StateFormula(
                16.0 * psi / n,
                f"(4 + 4 + 8) * Psi / {n}: fp32 params, grads, Adam moments, fully sharded (+ padding)",
                "Rajbhandari et al. 2019 (ZeRO, arXiv 1910.02054) stage 3, K=8 for fp32 Adam",
            )
        psi_tp, dp = sum(math.prod(s) for s in tp_shard_shapes(job.model, tp).values()), job.parallel.dp
        return StateFormula(
            16.0 * psi_tp / dp,
            f"(4 + 4 + 8) * Psi_tp / {dp}: Psi_tp = {psi_tp} parameters of one tp={tp} rank (layers' attention and "
            "MLP split, embedding, norms and lm_head whole), fully sharded over dp (+ padding)",
            "Shoeybi et al. 2019 (Megatron-LM, arXiv 1909.08053) sec. 3 split; Rajbhandari et al. 2019 (ZeRO) "
            "stage 3 over dp, K=8 for fp32 Adam (docs/sources.md#fsdp2-tensor-parallel)",
        )

    @classmethod
    def create_engine(cls, ctx: WorkerContext) -> FSDPEngine:
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
