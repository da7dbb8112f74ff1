"""FSDP: PyTorch FSDP2 (``fully_shard``), each decoder layer and the root sharded over all ranks.

Model states per rank with full sharding over N ranks, fp32 AdamW: 16 * Psi / N bytes, plus the
padding FSDP2 adds to make every dim-0 shard equal (Rajbhandari et al. 2019, arXiv 1910.02054,
stage 3, K=8 for fp32 Adam). bf16 uses ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: sharded parameters, gradients and moments stay fp32, so the formula holds;
the bf16 copies exist only while a layer is unsharded.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from dataclasses import dataclass

import torch

from parabench.adapters.base import Adapter, Availability, Capabilities, ConvertSupport, StateFormula, WorkerContext
from parabench.adapters.torch_common import DCP_SUPPORT, TorchEngine
from parabench.errors import SpecError
from parabench.model import build_llama, set_activation_checkpointing
from parabench.spec import MODEL_FEATURES, JobSpec

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


class FSDPEngine(TorchEngine):
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
        checkpoint=DCP_SUPPORT,
        convert=ConvertSupport(),
    )
    Options = FSDPOptions

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
        return [] if options.reshard_after_forward else ["noreshard"]

    @classmethod
    def expected_model_state(cls, job: JobSpec) -> StateFormula:
        psi, n = job.model.num_params(), job.parallel.world_size
        return StateFormula(
            16.0 * psi / n,
            f"(4 + 4 + 8) * Psi / {n}: fp32 params, grads, Adam moments, fully sharded (+ padding)",
            "Rajbhandari et al. 2019 (ZeRO, arXiv 1910.02054) stage 3, K=8 for fp32 Adam",
        )

    @classmethod
    def create_engine(cls, ctx: WorkerContext) -> FSDPEngine:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        job, opts = ctx.job, ctx.job.backend.options
        device_type = torch.device(ctx.device.torch_device).type
        mesh = init_device_mesh(device_type, (ctx.world_size,))
        model = build_llama(job.model, seed=job.run.seed).to(ctx.device.torch_device)
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

        return FSDPEngine(ctx, model, list(model.named_parameters()), sync, None)
