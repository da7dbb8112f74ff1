"""DDP: PyTorch DistributedDataParallel. Every rank holds the full model states.

Model states per rank, fp32 AdamW (params 4 + grads 4 + two moments 8 bytes per parameter):
16 * Psi bytes, where Psi = parameter count (Rajbhandari et al. 2019, arXiv 1910.02054, section 3.1,
with K = 8 for fp32 Adam). bf16 here is autocast: fp32 weights stay, so still 16 * Psi.
Gradients are views into DDP's communication buckets (``gradient_as_bucket_view``), so they are
held once, not twice.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from parabench.adapters.base import (
    DCP_SUPPORT,
    Adapter,
    Availability,
    Capabilities,
    ConvertSupport,
    StateFormula,
    WorkerContext,
)
from parabench.adapters.profile import replicated_profile
from parabench.collectives import DTYPE_BYTES, Stack
from parabench.errors import SpecError
from parabench.spec import MODEL_FEATURES, JobSpec

if TYPE_CHECKING:
    from parabench.adapters.ddp_engine import DDPEngine


@dataclass(frozen=True)
class DDPOptions:
    bucket_cap_mb: float = 25.0  # gradient all-reduce bucket size (torch default)
    gradient_as_bucket_view: bool = True  # grads alias the buckets: one copy, not two
    static_graph: bool = False
    activation_checkpointing: bool = False


def _ddp_options(world: int, per_node: int, offload: bool) -> Iterator[dict[str, Any]]:
    yield from ({"activation_checkpointing": ac} for ac in (False, True))


def _ddp_buffers(job: JobSpec) -> float:
    """Without ``gradient_as_bucket_view`` DDP's buckets are a second copy of every (fp32) gradient
    (torch DistributedDataParallel docs, gradient_as_bucket_view); with it (the adapter's default)
    the gradients are views into the buckets."""
    return 0.0 if job.backend.options.gradient_as_bucket_view else 4.0 * job.model.num_params()


class DDPAdapter(Adapter):
    name = "ddp"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "cuda", "npu"}),
        precisions=frozenset({"fp32", "bf16"}),
        model_features=MODEL_FEATURES,
        moe=True,  # the reference: every rank holds every expert, dropless routing (docs/moe.md)
        checkpoint=DCP_SUPPORT,
        convert=ConvertSupport(),
    )
    Options = DDPOptions
    plan_profile = replicated_profile(_ddp_options, _ddp_buffers)
    # bench comm backend=ddp: torch.distributed's collectives, which fsdp, deepspeed and megatron call too
    comm_stack = Stack(
        "torch.distributed/{lib}", frozenset(DTYPE_BYTES), {}, "parabench.adapters.torch_collectives:TorchOps"
    )

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True, "built into torch", {"torch": importlib.metadata.version("torch")})

    @classmethod
    def validate(cls, job: JobSpec) -> None:
        if job.backend.options.bucket_cap_mb <= 0:
            raise SpecError("backend.bucket_cap_mb", f"must be > 0, got {job.backend.options.bucket_cap_mb}")

    @classmethod
    def expected_model_state(cls, job: JobSpec) -> StateFormula:
        return StateFormula.replicated_fp32_adam(job.model.num_params())

    @classmethod
    def create_engine(cls, ctx: WorkerContext) -> DDPEngine:
        from parabench.adapters.ddp_engine import create_engine

        return create_engine(ctx)
