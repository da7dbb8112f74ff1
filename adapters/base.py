"""The adapter interface: what a training stack must provide to run under the harness.

An adapter has two halves, both in the backend's one file:

* the class itself is declarative and cheap to import (no DeepSpeed/Megatron/MindSpore at module
  level): its ``Options`` dataclass (the typed ``backend.*`` keys), its ``capabilities``, its
  availability diagnosis for ``bench env``, how it splits the world into parallel dimensions, and
  the checks that must pass before any process starts;
* ``create_engine`` runs inside a worker process only. It may import the framework, apply the
  framework's monkeypatches (scoped to that process), and returns an :class:`Engine` that trains the
  canonical model on this rank.

The harness never branches on the backend's name: everything backend-specific lives here.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from parabench.adapters.profile import Profile
from parabench.collectives import Stack
from parabench.commlog import CommLog
from parabench.devices import DEVICES, Device, Presence
from parabench.errors import SpecError
from parabench.metrics import ModelStateBytes
from parabench.spec import JobSpec, ModelSpec, ParallelDims

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from _typeshed import DataclassInstance

    from parabench.canonical import CanonicalState


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports; checked against the job before launch."""

    devices: frozenset[str]
    precisions: frozenset[str]
    launcher: str = "torchrun"  # how its workers are started: torchrun | msrun
    shards_model_states: bool = False  # ZeRO/FSDP-style sharding of params/grads/optimizer states
    multi_node: bool = True
    model_features: frozenset[str] = frozenset()  # optional model parts it implements (spec.MODEL_FEATURES)
    moe: bool = False  # trains a Mixture-of-Experts model (model.num_local_experts > 0; docs/moe.md)
    # why it does not (moe False): the reason the refusal of a MoE model gives; empty: the generic one
    moe_refusal: str = ""
    # splits each decoder layer's heads, key/value heads and MLP columns over parallel.tp ranks (no
    # key/value head replication): check_capabilities refuses a model they do not divide
    tensor_parallel: bool = False
    checkpoint: CheckpointSupport | None = None  # None: run.checkpoint / run.resume are refused before launch
    convert: ConvertSupport | None = None  # None: bench convert refuses it as source or target


@dataclass(frozen=True)
class CheckpointSupport:
    """How a backend checkpoints (docs/resilience.md): checked against ``run.checkpoint``/``run.resume``
    before launch."""

    format: str  # "dcp" | "deepspeed" | "megatron-dist" | "mindspore-ckpt"
    async_save: str | None = "not implemented"  # None: run.checkpoint.async works; else why it is refused
    # Layout keys that may differ between the saving and the resuming job ("world_size", "dp", "tp"...);
    # any other difference is refused before launch, naming the key.
    reshard: frozenset[str] = frozenset()
    # backend.* option keys that shape the saved state (e.g. zero_stage): must match on resume
    options: frozenset[str] = frozenset()


# ddp and fsdp: torch.distributed.checkpoint, resharded on load to any data-parallel world size
DCP_SUPPORT = CheckpointSupport(
    format="dcp",
    # measured on 2 gloo ranks (fsdp): async_save's background collectives ran on the training
    # process group and interleaved with FSDP's all-gathers ("Application timeout caused pair closure")
    async_save="DCP async_save shares the training process group with its background thread; not enabled "
    "until it gets a process group of its own (docs/resilience.md)",
    reshard=frozenset({"world_size", "dp", "dp_shard"}),
)


@dataclass(frozen=True)
class ConvertSupport:
    """How a backend takes part in ``bench convert`` (docs/convert.md): its engine maps its state to
    the canonical full tensors (``CanonicalIO.export_canonical``) and back (``CanonicalIO.import_canonical``)."""

    optimizer: str | None = None  # None: AdamW moments and step are carried; else why they are not
    # backend.* switches (booleans) under which the state is laid out in a way export/import does not map
    unsupported_options: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and if not, exactly why (shown by ``bench env``)."""

    available: bool
    reason: str
    versions: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StateFormula:
    """A predicted per-rank model-state size, with the formula and its source."""

    bytes: float
    formula: str
    source: str

    @classmethod
    def replicated_fp32_adam(cls, psi: int) -> StateFormula:
        """Plain data parallel, fp32, (Adam)W: every rank holds params, grads and both moments."""
        return cls(
            16.0 * psi,
            "(4 + 4 + 8) * Psi: fp32 params, grads, AdamW moments, replicated",
            "Rajbhandari et al. 2019 (ZeRO, arXiv 1910.02054) sec. 3.1, K=8 for fp32 Adam",
        )


class Comm(ABC):
    """The few collectives the measured loop needs, in the backend's own framework."""

    @abstractmethod
    def reduce_stats(self, loss: float, seconds: float) -> tuple[float, float]:
        """(mean of ``loss`` over all ranks, max of ``seconds`` over all ranks)."""

    @abstractmethod
    def barrier(self) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        pass


def subgroups_default_to(timeout: timedelta) -> None:
    """Every process group this worker creates without a timeout gets the job's collective timeout.
    Frameworks make their subgroups with ``new_group(ranks)`` and no timeout (DeepSpeed's expert- and
    data-parallel groups, deepspeed/utils/groups.py), which torch then gives its module default
    (``distributed_c10d._get_default_timeout``: 30 minutes, NCCL's 10), not the job's: a rank hung in
    such a group held its peers that long. Worker processes only (adapters run there)."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def _uncompiled(model: Any = None, **_options: Any) -> Any:
    """``torch.compile``'s signature, compiling nothing: the function itself (or a decorator)."""
    return model if model is not None else (lambda fn: fn)


@contextlib.contextmanager
def torch_compile_as_identity(torch: Any) -> Iterator[Any]:
    """``torch.compile`` returns what it is given while a framework's package is imported (worker
    processes only), then is put back; yields the identity decorator. Megatron-core and DeepSpeed
    decorate helpers with ``torch.compile`` at import (megatron's fusions through ``jit_fuser``,
    DeepSpeed's Muon optimizer): the first decoration imports TorchDynamo's and Inductor's compile
    stack, 2-3 CPU-seconds of every rank here, for functions a parabench CPU run never calls
    compiled (docs/testing.md#less-work-in-every-process-2026-12-07)."""
    compile_ = torch.compile
    torch.compile = _uncompiled
    try:
        yield _uncompiled
    finally:
        torch.compile = compile_


class TorchComm(Comm):
    """torch.distributed: the device's backend (gloo on CPU, nccl on CUDA, hccl on NPU)."""

    def __init__(self, job: JobSpec, device: Device):
        import datetime

        import torch.distributed as dist

        self.dist = dist
        self.tensor_device = device.torch_device
        timeout = datetime.timedelta(seconds=job.launch.collective_timeout_s)
        subgroups_default_to(timeout)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if restart in ("", "0"):
            dist.init_process_group(backend=device.dist_backend, timeout=timeout)
            return
        # A worker restarted by torchrun (launcher.max_restarts) joins through the agent's store, which
        # still holds the previous attempt's keys: without a fresh prefix a rank read its dead peer's
        # gloo address and failed to connect (docs/sources.md#torchrun-restarts).
        from torch.distributed.rendezvous import rendezvous

        store, rank, world = next(rendezvous("env://", timeout=timeout))
        store = dist.PrefixStore(f"parabench/attempt{restart}", store)
        dist.init_process_group(backend=device.dist_backend, store=store, rank=rank, world_size=world, timeout=timeout)

    def reduce_stats(self, loss: float, seconds: float) -> tuple[float, float]:
        import torch

        dist = self.dist
        loss_sum = torch.tensor([loss], dtype=torch.float64, device=self.tensor_device)
        slowest = torch.tensor([seconds], dtype=torch.float64, device=self.tensor_device)
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(loss_sum) / dist.get_world_size(), float(slowest)

    def barrier(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        self.dist.barrier()
        self.dist.destroy_process_group()


@dataclass
class WorkerContext:
    """Everything a worker-side engine gets: the spec and where in the world it sits."""

    job: JobSpec
    rank: int
    world_size: int
    local_rank: int
    device: Device
    run_dir: Path
    comm: Comm | None = None
    comm_log: CommLog | None = None  # the collectives train_step calls (torchrun backends; parabench.commlog)


# The engine's roles: what each command asks of one rank's training state. ``create_engine`` returns an
# ``Engine`` (stepping and accounting: every backend runs ``bench run``); an engine whose adapter
# declares ``capabilities.checkpoint`` also has the ``Checkpointing`` role, one that declares
# ``capabilities.convert`` the ``CanonicalIO`` role (``check_roles``, run where a worker builds its engine).
class Stepping(ABC):
    """Role of the measured loop (``loop.train``, ``bench run``): take a step, say which slice of the
    batch this rank takes, and report per-step extras. Engines keep their WorkerContext in ``self.ctx``."""

    ctx: WorkerContext

    def prepare_batch(self, micro_batches: Sequence[tuple[Any, Any]]) -> Any:
        """NumPy (inputs, targets) micro-batches -> what ``train_step`` takes (called before the
        step's clock starts, as a prefetching data loader would). Default: torch tensors on the device."""
        import torch

        dev = self.ctx.device.torch_device
        return [(torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)) for x, y in micro_batches]

    @abstractmethod
    def train_step(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward/backward over the micro-batches (gradient accumulation), then one optimizer step.

        Returns the mean token loss over this rank's micro-batches, as anything ``float()`` accepts
        (a 0-dim tensor), on every rank that takes part in the step (also every tensor/pipeline
        rank of a replica)."""

    def data_parallel(self) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size) of this rank: which slice of the batch it takes."""
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()

    def tokens_per_expert(self) -> list[list[int]] | None:
        """Collective, after each step: the (token, slot) assignments the router made to each expert of
        each MoE layer during that step, [layer][expert], summed over the ranks that routed distinct
        tokens so every token of the global batch counts once (parabench.expertload); None for a
        dense model or a backend that does not count them."""
        return None

    def extra_metrics(self) -> dict[str, float]:
        """Backend-specific per-rank numbers (e.g. a measured pipeline bubble)."""
        return {}

    def artifacts(self) -> dict[str, Any]:
        """Backend-specific documents for rank 0 to log (e.g. the effective DeepSpeed config)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        pass


class Accounting(ABC):
    """Role of what a rank holds: its model-state bytes (the rank file, the published formula) and the
    full weights (the initial-weights checksum every backend must match)."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full, unsharded weights under canonical (Hugging Face) names, as fp32 CPU tensors.
        Collective: every rank calls it."""

    @abstractmethod
    def model_state_bytes(self) -> ModelStateBytes:
        """Bytes of parameters, gradients and optimizer states this rank holds."""


class Engine(Stepping, Accounting):
    """One rank's training state for one backend (worker side): what ``Adapter.create_engine`` returns."""


class Checkpointing(ABC):
    """Role of step checkpoints (``resilience.checkpoint``) and of a conversion's native files
    (``bench convert``), in the backend's native format (``capabilities.checkpoint``)."""

    @abstractmethod
    def save_checkpoint(self, directory: Path, *, async_save: bool = False) -> None:
        """Collective (every rank calls it): write model + optimizer state in the backend's native
        format into ``directory`` (created by the harness under a temporary name). With
        ``async_save`` it may return before the files are written; ``finish_checkpoint`` waits."""

    def finish_checkpoint(self) -> float | None:
        """Block until the last ``save_checkpoint(async_save=True)`` is fully written; return the
        ``time.perf_counter()`` at which its background write ended (None: no save pending)."""
        return None

    @abstractmethod
    def load_checkpoint(self, directory: Path) -> None:
        """Collective: restore model + optimizer state from ``directory`` (native format)."""


class CanonicalIO(ABC):
    """Role of ``bench convert``: the state as canonical full tensors and back (``capabilities.convert``)."""

    @abstractmethod
    def export_canonical(self) -> CanonicalState:
        """Collective: the full canonical state (weights, AdamW moments, optimizer step) as fp32 CPU
        tensors under canonical names, complete on rank 0 at least (``bench convert``)."""

    @abstractmethod
    def import_canonical(self, state: CanonicalState) -> None:
        """Collective: take the AdamW moments and step of ``state`` (the weights already came in
        through ``model.weights``, the path every backend initialises from)."""


def declared_roles(caps: Capabilities) -> tuple[type, ...]:
    """The engine roles a backend's capabilities promise: Engine always, Checkpointing with
    ``checkpoint``, CanonicalIO with ``convert``."""
    return (
        Engine,
        *((Checkpointing,) if caps.checkpoint is not None else ()),
        *((CanonicalIO,) if caps.convert is not None else ()),
    )


def check_roles(adapter: type[Adapter], engine: object) -> None:
    """Fail where the worker builds its engine when the engine lacks a role its adapter declares."""
    missing = [role.__name__ for role in declared_roles(adapter.capabilities) if not isinstance(engine, role)]
    if missing:
        raise TypeError(
            f"backend {adapter.name}'s engine {type(engine).__name__} lacks the role(s) {', '.join(missing)} "
            "its capabilities declare (adapters/base.py: Engine, Checkpointing, CanonicalIO)"
        )


class Adapter(ABC):
    """A training stack. Subclasses set the ClassVars and implement ``create_engine``; the one-line
    description lives in ``adapters/registry.py`` (listing backends imports no framework)."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    Options: ClassVar[type[DataclassInstance]]
    # The distributions it runs on (``bench env`` reads their supported ranges from parabench's
    # installed metadata, i.e. pyproject.toml, and names the backends outside them).
    distributions: ClassVar[tuple[str, ...]] = ("torch",)
    # Version sets known to work together, each {"source": where that is stated, dist: version prefix}
    # (``bench env`` says whether this environment matches one).
    known_good: ClassVar[tuple[Mapping[str, str], ...]] = ()
    # What ``bench comm backend=<name>`` measures, in this backend's own framework; None: refused.
    comm_stack: ClassVar[Stack | None] = None
    # How bench plan and a run's communication report see it (adapters/profile.py); None: not planned.
    plan_profile: ClassVar[Profile | None] = None

    @classmethod
    @abstractmethod
    def availability(cls) -> Availability:
        """Can this backend run here? Must not import heavy frameworks in-process if that can fail."""

    @classmethod
    def parallel_dims(cls, options: Any, world_size: int, model: ModelSpec) -> ParallelDims:
        """Split the world; pure data parallelism unless overridden."""
        return ParallelDims(world_size=world_size, dp=world_size)

    @classmethod  # noqa: B027 - optional hook: no checks beyond the generic ones
    def validate(cls, job: JobSpec) -> None:
        """Backend-specific checks before launch; raise SpecError naming the key."""

    @classmethod
    def launch_env(cls, job: JobSpec) -> dict[str, str]:
        """Extra environment for the workers (logged with the run)."""
        return {}

    @classmethod
    def device_presence(cls, kind: str) -> Presence:
        """Is a device of this kind usable by this backend here? Default: torch's view (devices.py);
        a backend with its own runtime (MindSpore) answers for itself."""
        return DEVICES[kind].presence()

    @classmethod
    def bundle_files(cls, job: JobSpec) -> dict[str, str]:
        """Extra files (name -> text) for the run directory and launch bundle, e.g. the flags a
        framework reads from its command line."""
        return {}

    @classmethod
    def worker_args(cls, job: JobSpec) -> list[str]:
        """Arguments after the run directory on every worker's command line, for a framework that
        reads its switches from ``sys.argv`` (MindSpeed); the worker itself ignores them."""
        return []

    @classmethod
    def layout_words(cls, options: Any) -> list[str]:
        """Words naming this backend's layout beyond the parallel degrees (e.g. ``zero3``), for run names."""
        return []

    @classmethod
    def expected_model_state(cls, job: JobSpec) -> StateFormula | None:
        """The per-rank model-state bytes a published formula predicts for this job, if any."""
        return None

    @classmethod
    def init_worker(cls, ctx: WorkerContext) -> Comm:
        """Set up the device and join the world (worker only). Default: torch.distributed.
        An adapter with its own runtime may replace ``ctx.device`` with its own view of the device
        (the worker reads the device name and memory from ``ctx.device`` afterwards)."""
        ctx.device.setup()
        return TorchComm(ctx.job, ctx.device)

    @classmethod
    @abstractmethod
    def create_engine(cls, ctx: WorkerContext) -> Engine:
        """Build the canonical model with the canonical weights on this rank (worker only)."""


def check_capabilities(adapter: type[Adapter], job: JobSpec) -> None:
    """Refuse a job the backend declares it cannot run (before any process starts)."""
    caps = adapter.capabilities
    if job.device.type != "auto" and job.device.type not in caps.devices:
        raise SpecError(
            "device",
            f"backend {adapter.name} does not run on {job.device.type} (supported: {', '.join(sorted(caps.devices))}; "
            "launcher.dry_run=true writes the launch bundle for a machine that has one)",
        )
    if job.run.precision not in caps.precisions:
        raise SpecError(
            "run.precision",
            f"backend {adapter.name} does not support {job.run.precision} (supported: {', '.join(sorted(caps.precisions))})",
        )
    if job.launch.nnodes > 1 and not caps.multi_node:
        raise SpecError("launcher.nnodes", f"backend {adapter.name} runs on a single node only")
    if job.model.is_moe and not caps.moe:
        why = caps.moe_refusal or "it lacks expert parallelism and a mapping of the experts onto the canonical weights"
        raise SpecError(
            "model.num_local_experts",
            f"backend {adapter.name} does not train Mixture-of-Experts models (model {job.model.name} has "
            f"{job.model.num_local_experts} experts): {why} (issue #31, docs/moe.md); backend=ddp trains them",
        )
    if caps.tensor_parallel and job.parallel.tp > 1:
        check_tensor_parallel_split(adapter.name, job.model, job.parallel.tp)
    missing = sorted(job.model.features() - caps.model_features)
    if missing:
        raise SpecError(
            f"model.{missing[0]}",
            f"backend {adapter.name} does not implement {missing[0]} (used by model "
            f"{job.model.name}); the PyTorch backends (ddp, fsdp, deepspeed) do",
        )


def check_tensor_parallel_split(backend: str, model: ModelSpec, tp: int) -> None:
    """Megatron's split of a decoder layer (Shoeybi et al. 2019, sec. 3): every tp rank holds whole
    query and key/value heads and an equal share of the MLP's columns."""
    for key, what in (
        ("num_attention_heads", "attention heads"),
        ("num_key_value_heads", "key/value heads"),
        ("intermediate_size", "MLP columns"),
    ):
        value = getattr(model, key)
        if value % tp:
            raise SpecError(
                "backend.tp",
                f"backend {backend} splits each layer's {what} over tp={tp}, but model.{key}={value} is not "
                "divisible by it: choose a tp that divides it",
            )
