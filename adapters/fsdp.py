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

import importlib.metadata
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parabench.adapters.base import (
    DCP_SUPPORT,
    Adapter,
    Availability,
    Capabilities,
    ConvertSupport,
    StateFormula,
    WorkerContext,
)
from parabench.adapters.fsdp_profile import PROFILE
from parabench.commvolume import tp_shard_shapes
from parabench.errors import SpecError
from parabench.spec import MODEL_FEATURES, JobSpec, ModelSpec, ParallelDims

if TYPE_CHECKING:
    from parabench.adapters.fsdp_engine import FSDPEngine

# torch 2.6's FSDP2 calls Stream.record_event/wait_event, which torch.cpu.Stream lacks there, and
# with those stubbed its reshard-after-forward overwrites tensors autograd saved; torch 2.7 runs it on
# CPU (both found by benchmarks/compat_matrix.sh). Accelerators have real streams.
CPU_FSDP2_TORCH = (2, 7)
PUBLIC_FSDP2_TORCH = (2, 6)  # torch 2.6 release notes: FSDP2's fully_shard public in torch.distributed.fsdp


def torch_release() -> tuple[int, ...]:
    """(major, minor) of the installed torch, local build tags (+cpu, +cu124) ignored."""
    version = importlib.metadata.version("torch")  # not torch.__version__: the bench parent never imports torch
    return tuple(int(x) for x in version.split("+")[0].split(".")[:2])


@dataclass(frozen=True)
class FSDPOptions:
    reshard_after_forward: bool = True  # free unsharded params after forward (ZeRO-3); false ~ ZeRO-2
    activation_checkpointing: bool = False
    cpu_offload: bool = False  # CPUOffloadPolicy: sharded states live on the host (accelerators only)
    tp: int = 1  # tensor-parallel degree: decoder layers split over tp ranks (DTensor), FSDP over world / tp


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
    plan_profile = PROFILE

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
        # by version, not by importing torch (the bench parent's check): fully_shard is public in
        # torch.distributed.fsdp from torch 2.6 on (before, only under torch.distributed._composable.fsdp)
        version = importlib.metadata.version("torch")
        if torch_release() < PUBLIC_FSDP2_TORCH:
            return Availability(
                False,
                f"FSDP2 needs torch>=2.6 (public torch.distributed.fsdp.fully_shard); torch {version} lacks it",
            )
        return Availability(True, "FSDP2 fully_shard in torch", {"torch": version})

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
                f"{importlib.metadata.version('torch')}'s FSDP2 has no CPU stream events (torch.cpu.Stream.record_event); "
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
        from parabench.adapters.fsdp_engine import create_engine

        return create_engine(ctx)
