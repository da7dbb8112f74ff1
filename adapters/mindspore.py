"""MindSpore: the canonical Llama as a native MindSpore ``nn.Cell``, data parallel over msrun.

What is the same as every other backend: the architecture and the canonical initial weights
(``parabench.model.initial_weights``, loaded through NumPy, so the initial checksum equals the
torch backends'), the data slices, the token-mean fp32 cross entropy, global grad-norm clipping,
gradient accumulation over the micro-batches and AdamW with decay on 2-D weights only.

AdamW: ``torch.optim.AdamW``'s update computed by MindSpore's fused ``AdamWeightDecay`` primitive,
with torch's bias correction folded into the primitive's lr, eps and decay inputs (the algebra is in
``AdamW`` below; a unit test checks it against torch to float32 rounding). The ready-made optimizers
do not fit: ``mindspore.mint.optim.AdamW`` (torch's formula) runs a fused ``AdamW`` primitive that
has no CPU kernel in 2.10, and ``nn.AdamWeightDecay`` computes the primitive's formula with lr, eps
and decay as given, i.e. without bias correction, so its losses drift from torch's.

Parallelism: data parallel only. Processes are started by ``msrun`` (launchers.Msrun) and join with
``mindspore.communication.init()`` (``mccl`` on CPU, ``hccl`` on Ascend). Gradients are averaged
over ranks with ``AllReduce`` (sum, then / world: the only reduction the CPU kernel implements).
MindSpore's semi_auto_parallel / auto_parallel (``mindspore.parallel.auto_parallel.AutoParallel``,
modes semi_auto, sharding_propagation, recursive_programming) split operators across devices; its
documentation lists Ascend as the only supported platform, and on CPU the mccl AllReduce kernel
implements nothing but a sum, so both are refused on CPU with that reason. On Ascend they are
refused too, because parabench does not build the sharded train network for them yet (see
docs/mindspore.md).

Model states per rank, fp32 (the same replicated layout as ddp): params 4 + accumulated grads 4 +
two AdamW moments 8 bytes per parameter = 16 * Psi (Rajbhandari et al. 2019, ZeRO, arXiv 1910.02054,
sec. 3.1, K = 8 for fp32 Adam). The step counter is a Python int: no tensor bytes.

Execution modes: Graph (``backend.mode=graph``, default) compiles the micro-step and the optimizer
step once. PyNative (``backend.mode=pynative``) runs op by op; MindSpore 2.10's PyNative kernels are
built against NumPy 1.x and fail under NumPy 2.x, so it needs ``numpy<2`` (checked before launch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from parabench.adapters.base import (
    Adapter,
    Availability,
    CanonicalIO,
    Capabilities,
    Checkpointing,
    CheckpointSupport,
    Comm,
    ConvertSupport,
    Engine,
    ModelStateBytes,
    StateFormula,
    WorkerContext,
)
from parabench.adapters.mindspore_graphs import GraphCache, graphs_cached
from parabench.adapters.profile import no_options, replicated_profile
from parabench.canonical import MOMENTS, CanonicalState
from parabench.collectives import Stack
from parabench.devices import (
    DEVICES,
    NPUDevice,
    Presence,
    ProbeFailed,
    cann_library,
    cpu_threads,
    package_version,
    run_probe,
)
from parabench.errors import SpecError
from parabench.spec import JobSpec

MS_VERSION = "2.10.0"  # the version the parity tests were written against
INSTALL_HINT = "pip install 'parabench[mindspore]'"
DEVICE_TARGETS = {"cpu": "CPU", "npu": "Ascend"}  # parabench device kind -> MindSpore device_target
COLLECTIVE_BACKENDS = {"cpu": "mccl", "npu": "hccl"}


@dataclass(frozen=True)
class MindSporeOptions:
    mode: Literal["graph", "pynative"] = "graph"  # graph: compiled (default); pynative: eager, needs numpy<2
    parallel_mode: Literal["data_parallel", "semi_auto_parallel", "auto_parallel"] = "data_parallel"
    jit_level: Literal["O0", "O1"] = "O0"  # graph mode: O0 = no graph-kernel fusion, O1 = fusion where supported
    # graph mode: load the graphs a run of the same shape compiled (adapters/mindspore_graphs.py); auto:
    # for models whose weights take up to 256 MiB (the cache holds a copy of them)
    compile_cache: Literal["auto", "always", "never"] = "auto"


def _major(version: str | None) -> int:
    try:
        return int((version or "0").split(".")[0])
    except ValueError:
        return 0


_MS_CPU = "MindSpore 2.10 on CPU (mccl)"
# bench comm backend=mindspore: MindSpore's communication operators, and what they cannot do where
COMM_STACK = Stack(
    "mindspore.communication/{lib}",
    frozenset({"fp32", "fp16"}),
    {
        # measured here (docs/sources.md#mindspore-on-cpu): ops.ReduceScatter and ops.AlltoAll
        # fail kernel selection on CPU; comm_func.send/recv: kernel InnerCommIsend unregistered
        ("cpu", "reduce_scatter"): f"{_MS_CPU} has no ReduceScatter kernel ('Unsupported op [ReduceScatter] on CPU')",
        ("cpu", "all_to_all"): f"{_MS_CPU} has no AlltoAll kernel ('Unsupported op [AlltoAll] on CPU')",
        ("cpu", "send_recv"): f"{_MS_CPU} has no send/recv kernel ('The kernel InnerCommIsend unregistered')",
        # not built: no Ascend machine here to test the hccl ops on
        **{
            ("npu", o): "parabench drives MindSpore's hccl ops only for all_reduce/all_gather/broadcast "
            "(the others are untested without an Ascend NPU)"
            for o in ("reduce_scatter", "all_to_all", "send_recv")
        },
    },
    "parabench.adapters.mindspore_collectives:MindSporeOps",
    libraries={"cpu": "mccl", "npu": "hccl"},
)


class MindSporeAdapter(Adapter):
    name = "mindspore"
    capabilities = Capabilities(
        devices=frozenset({"cpu", "npu"}),
        precisions=frozenset({"fp32"}),
        launcher="msrun",
        # mindspore.save_checkpoint(async_save="thread") snapshots the tensors, then writes in a thread.
        checkpoint=CheckpointSupport(format="mindspore-ckpt", async_save=None),
        convert=ConvertSupport(),
        # MindSpore 2.10's Python API has no MoE layer (MindFormers builds its own); its MoE operators
        # document Ascend as their only platform, and the CPU kernels are missing (docs/moe.md#mindspore)
        moe_refusal=(
            "MindSpore has no Mixture-of-Experts layer of its own, and its MoE operators (ops.moe_token_permute, "
            "moe_init_routing_v2, moe_distribute_dispatch/combine) are Ascend kernels its CPU target does not "
            "register ('The kernel MoeTokenPermute unregistered'), so expert parallelism through MindSpore's own "
            "MoE support cannot run or be checked here"
        ),
    )
    Options = MindSporeOptions
    distributions = ("mindspore",)
    plan_profile = replicated_profile(no_options, lambda j: 0.0)
    comm_stack = COMM_STACK

    @classmethod
    def availability(cls) -> Availability:
        ms = package_version("mindspore")
        if ms is None:
            return Availability(False, f"mindspore not installed ({INSTALL_HINT})")
        versions = {"mindspore": ms, "numpy": package_version("numpy") or "?"}
        note = "" if ms == MS_VERSION else f" (tested with {MS_VERSION})"
        if _major(versions["numpy"]) >= 2:
            note += f"; graph mode only: PyNative needs numpy<2, found {versions['numpy']}"
        return Availability(True, f"mindspore {ms}{note}", versions)

    @classmethod
    def device_presence(cls, kind: str):
        """MindSpore reaches Ascend through CANN itself, not through torch_npu."""
        if kind != "npu":
            return DEVICES[kind].presence()
        if cann_library() is None:
            return Presence(
                False,
                "MindSpore's Ascend target needs the CANN runtime (libhccl.so), which is not found: "
                "install CANN and source set_env.sh",
            )
        probe = "import mindspore as ms; print(ms.hal.device_count('Ascend'))"
        try:
            out = run_probe(probe, 120)
        except ProbeFailed as exc:
            return Presence(False, f"MindSpore could not open Ascend: {exc}")
        count = int((out.strip().splitlines() or ["0"])[-1] or 0)
        return Presence(
            count > 0, f"{count} x Ascend NPU (MindSpore)" if count else "MindSpore sees no Ascend NPU", count
        )

    @classmethod
    def validate(cls, job: JobSpec) -> None:
        opts = job.backend.options
        if opts.parallel_mode != "data_parallel":
            if job.device.type == "cpu":
                raise SpecError(
                    "backend.parallel_mode",
                    (
                        f"{opts.parallel_mode} is not supported on CPU: MindSpore's operator-level parallelism "
                        "(mindspore.parallel.auto_parallel.AutoParallel) supports Ascend only, and the CPU collective "
                        "backend mccl implements AllReduce(sum) alone; use backend.parallel_mode=data_parallel"
                    ),
                )
            raise SpecError(
                "backend.parallel_mode",
                (
                    f"{opts.parallel_mode} is supported by MindSpore on Ascend, but parabench does not build its sharded "
                    "train network yet; use backend.parallel_mode=data_parallel"
                ),
            )
        if opts.mode == "pynative" and _major(package_version("numpy")) >= 2:
            raise SpecError(
                "backend.mode",
                (
                    f"PyNative mode of mindspore {package_version('mindspore')} fails under numpy {package_version('numpy')} (its "
                    "kernels are built against NumPy 1.x): pip install 'numpy<2', or use backend.mode=graph"
                ),
            )
        if opts.jit_level != "O0" and opts.mode == "pynative":
            raise SpecError("backend.jit_level", "applies to graph mode only (backend.mode=graph)")

    @classmethod
    def launch_env(cls, job: JobSpec) -> dict[str, str]:
        # GLOG_v=3: MindSpore's C++ log at ERROR (its INFO/WARNING lines would bury the worker's own
        # output). Nothing of this shell (PATH: launchers.Msrun.process_env, on a local start only).
        return {"GLOG_v": "3"}

    @classmethod
    def expected_model_state(cls, job: JobSpec) -> StateFormula:
        return StateFormula.replicated_fp32_adam(job.model.num_params())

    # -- worker side ---------------------------------------------------------------------------
    @classmethod
    def init_worker(cls, ctx: WorkerContext) -> Comm:
        import mindspore as ms

        opts = ctx.job.backend.options
        kind = ctx.device.kind
        if kind not in DEVICE_TARGETS:  # capabilities refuse it before launch; a direct call must too
            raise RuntimeError(f"MindSpore backend has no device target for {kind!r}")
        ms.set_context(mode=ms.GRAPH_MODE if opts.mode == "graph" else ms.PYNATIVE_MODE)
        if opts.mode == "graph":
            ms.set_context(jit_config={"jit_level": opts.jit_level})
        ms.set_device(DEVICE_TARGETS[kind], ctx.local_rank)
        if kind == "cpu":
            # MindSpore's CPU kernels default to 25 threads; use the same per-rank count as torch
            # backends and the MFU peak measurement.
            ms.device_context.cpu.op_tuning.threads_num(
                cpu_threads(ctx.job.launch.nproc_per_node, ctx.job.device.threads_per_rank)
            )
        else:
            ctx.device = _ascend_device(ctx.local_rank)
        return MindSporeComm(COLLECTIVE_BACKENDS[kind])

    @classmethod
    def create_engine(cls, ctx: WorkerContext) -> MindSporeEngine:
        return MindSporeEngine(ctx)


# --------------------------------------------------------------------------------------------
# Collectives for the loop.
# --------------------------------------------------------------------------------------------
class MindSporeComm(Comm):
    """reduce_stats with MindSpore's AllReduce. The CPU kernel sums float32 only, so one summed
    vector carries both: [loss, 0, .., seconds at this rank's slot, .., 0] -> mean loss, max time."""

    def __init__(self, backend: str):
        import mindspore as ms
        from mindspore import communication, ops

        communication.init(backend)  # under msrun: joins the scheduler's world (its rank = RANK_ID)
        self.ms, self.np = ms, __import__("numpy")
        self.rank, self.world = communication.get_rank(), communication.get_group_size()
        self._sum = ops.AllReduce(ops.ReduceOp.SUM)

    def _allreduce(self, values):
        return self._sum(self.ms.Tensor(self.np.asarray(values, dtype=self.np.float32))).asnumpy()

    def reduce_stats(self, loss: float, seconds: float) -> tuple[float, float]:
        vec = self.np.zeros(1 + self.world, dtype=self.np.float32)
        vec[0], vec[1 + self.rank] = loss, seconds
        out = self._allreduce(vec)
        return float(out[0]) / self.world, float(out[1:].max())

    def barrier(self) -> None:
        self._allreduce([0.0])

    def close(self) -> None:
        self.barrier()


# --------------------------------------------------------------------------------------------
# The engine.
# --------------------------------------------------------------------------------------------
class MindSporeEngine(Engine, Checkpointing, CanonicalIO):
    def __init__(self, ctx: WorkerContext):
        import mindspore as ms
        import numpy as np

        from parabench.adapters import mindspore_cells as cells  # imports MindSpore: worker only
        from parabench.model import initial_weights

        self.ctx, self.ms, self.np = ctx, ms, np
        job = ctx.job
        self.rank, self.world = ctx.comm.rank, ctx.comm.world
        weights = initial_weights(job.model, job.run.seed)
        self.net = cells.Llama(job.model, weights, job.data.seq_len)
        self.named_params = cells.name_parameters(self.net)
        if sorted(self.named_params) != sorted(weights):
            raise RuntimeError(
                f"MindSpore cell and canonical names differ: {sorted(set(self.named_params) ^ set(weights))[:5]}"
            )
        self.params = [self.named_params[n] for n in weights]  # canonical order
        self.names = list(weights)
        self.grads = cells.zeros_like_params(self.params, "grad")
        self.optimizer = cells.AdamW(self.params, job.optim)
        self.micro_step = cells.MicroStep(self.net, self.params, self.grads)
        self.apply_step = cells.ApplyStep(self.params, self.grads, self.optimizer, job.optim.grad_clip, self.world)
        self.steps_done = 0
        self.graphs = GraphCache.of(job, ctx.run_dir, ctx.rank) if graphs_cached(job) else None
        if self.graphs is not None:
            self.graphs.enable()  # the cells compile at their first call, in the first step

    def data_parallel(self) -> tuple[int, int]:
        return self.rank, self.world

    def artifacts(self) -> dict[str, Any]:
        if self.graphs is None:
            return {}
        # where the graphs are once the run has closed: loaded from there, or published there
        return {"mindspore_graphs": {"folder": str(self.graphs.shared), "reused": self.graphs.reused}}

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.publish()

    def prepare_batch(self, micro_batches: Sequence[tuple[Any, Any]]) -> Any:
        ms, np = self.ms, self.np
        return [(ms.Tensor(x.astype(np.int32)), ms.Tensor(y.astype(np.int32))) for x, y in micro_batches]

    def train_step(self, micro_batches) -> float:
        ms, np = self.ms, self.np
        scale = ms.Tensor(np.float32(1.0 / len(micro_batches)))
        total = 0.0
        for inputs, targets in micro_batches:
            # The scaled loss (loss / n, as torch backends backpropagate) is accumulated into the
            # gradient buffers inside the compiled micro-step.
            total += float(self.micro_step(inputs, targets, scale).asnumpy())  # also synchronises
        self.steps_done += 1
        self.apply_step(*(ms.Tensor(np.float32(x)) for x in self.optimizer.step_scalars(self.steps_done)))
        self.params[-1].asnumpy()  # wait for the update, so the step time covers it
        return total

    def full_state_dict(self) -> dict[str, Any]:
        return {n: p.asnumpy().astype(self.np.float32) for n, p in zip(self.names, self.params)}

    # -- checkpoints: mindspore.save_checkpoint / load_checkpoint -------------------------------
    def _checkpointed(self) -> list:
        """Every Parameter that carries state between steps: weights and both AdamW moments (the
        gradient buffers are zero after each step; the step count goes in as ``step``)."""
        return [*self.params, *self.optimizer.exp_avg, *self.optimizer.exp_avg_sq]

    def save_checkpoint(self, directory, *, async_save: bool = False) -> None:
        """One ``.ckpt`` file per rank (``rank<R>.ckpt``), as MindSpore's data-parallel training
        saves it (ModelCheckpoint writes one file per device); the replicas are identical."""
        directory.mkdir(parents=True, exist_ok=True)
        self.ms.save_checkpoint(
            [{"name": p.name, "data": p} for p in self._checkpointed()],
            str(directory / f"rank{self.rank}.ckpt"),
            async_save="thread" if async_save else False,
            append_dict={"step": self.steps_done},
        )

    def finish_checkpoint(self) -> None:
        import threading

        # The writer thread save_checkpoint(async_save="thread") starts; MindSpore joins it by this
        # name itself (mindspore/train/serialization.py, _wait_async_thread_save_ckpt).
        for thread in threading.enumerate():
            if thread.name == "asyn_save_ckpt":
                thread.join()

    def load_checkpoint(self, directory) -> None:
        path = directory / f"rank{self.rank}.ckpt"
        if not path.is_file():
            raise FileNotFoundError(f"mindspore checkpoint {path} is missing")
        loaded = self.ms.load_checkpoint(str(path))
        missing = [p.name for p in self._checkpointed() if p.name not in loaded]
        if missing or "step" not in loaded:
            raise RuntimeError(f"{path} lacks {(missing or ['step'])[:3]}: not written by this model")
        for p in self._checkpointed():
            p.set_data(self.ms.Tensor(loaded[p.name].asnumpy()))
        self.steps_done = int(loaded["step"].asnumpy())

    # -- bench convert: the replicas hold full tensors under canonical names ----------------------
    def export_canonical(self):
        moments = {
            k: {n: p.asnumpy().astype(self.np.float32) for n, p in zip(self.names, getattr(self.optimizer, k))}
            for k in MOMENTS
        }
        return CanonicalState(self.full_state_dict(), moments, self.steps_done)

    def import_canonical(self, state):
        if state.moments is None:
            return
        for key, values in state.moments.items():
            for name, p in zip(self.names, getattr(self.optimizer, key)):
                p.set_data(self.ms.Tensor(values[name].numpy()))
        self.steps_done = state.step  # the bias corrections of the next step (AdamW.step_scalars)

    def model_state_bytes(self) -> ModelStateBytes:
        nbytes = lambda ps: sum(int(p.nbytes) for p in ps)  # noqa: E731
        return ModelStateBytes(
            params=nbytes(self.params),
            grads=nbytes(self.grads),
            optimizer=nbytes(self.optimizer.exp_avg) + nbytes(self.optimizer.exp_avg_sq),
            optimizer_other=0,
        )


def _ascend_device(local_rank: int):
    """The npu Device seen through MindSpore's runtime (no torch_npu in a MindSpore worker)."""

    class MindSporeAscend(NPUDevice):
        def setup(self) -> None:
            pass

        def synchronize(self) -> None:
            import mindspore as ms

            ms.runtime.synchronize()

        def reset_peak_memory(self) -> None:
            import mindspore as ms

            ms.runtime.reset_peak_memory_stats()

        def peak_memory(self) -> tuple[int, str]:
            import mindspore as ms

            return int(ms.runtime.max_memory_allocated()), "mindspore.runtime.max_memory_allocated"

        def name(self) -> str:
            import mindspore as ms

            try:  # e.g. "Ascend910B1": the MFU peak table is keyed by such names
                return str(ms.hal.get_device_name(self.local_rank, "Ascend"))
            except (RuntimeError, AttributeError):
                return f"Ascend NPU (MindSpore device_id {self.local_rank})"

    return MindSporeAscend(local_rank)
