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

import functools
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from parabench.adapters.base import (
    Adapter,
    Availability,
    Capabilities,
    Comm,
    Engine,
    ModelStateBytes,
    StateFormula,
    WorkerContext,
)
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
from parabench.spec import JobSpec, ModelSpec, OptimSpec

MS_VERSION = "2.10.0"  # the version the parity tests were written against
INSTALL_HINT = "pip install 'parabench[mindspore]'"
DEVICE_TARGETS = {"cpu": "CPU", "npu": "Ascend"}  # parabench device kind -> MindSpore device_target
COLLECTIVE_BACKENDS = {"cpu": "mccl", "npu": "hccl"}


@dataclass(frozen=True)
class MindSporeOptions:
    mode: Literal["graph", "pynative"] = "graph"  # graph: compiled (default); pynative: eager, needs numpy<2
    parallel_mode: Literal["data_parallel", "semi_auto_parallel", "auto_parallel"] = "data_parallel"
    jit_level: Literal["O0", "O1"] = "O0"  # graph mode: O0 = no graph-kernel fusion, O1 = fusion where supported


def _major(version: str | None) -> int:
    try:
        return int((version or "0").split(".")[0])
    except ValueError:
        return 0


class MindSporeAdapter(Adapter):
    name = "mindspore"
    capabilities = Capabilities(devices=frozenset({"cpu", "npu"}), precisions=frozenset({"fp32"}), launcher="msrun")
    Options = MindSporeOptions

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
            return Presence(False, "MindSpore's Ascend target needs the CANN runtime (libhccl.so), which is not found: "
                                   "install CANN and source set_env.sh")
        probe = "import mindspore as ms; print(ms.hal.device_count('Ascend'))"
        try:
            out = run_probe(probe, 120)
        except ProbeFailed as exc:
            return Presence(False, f"MindSpore could not open Ascend: {exc}")
        count = int((out.strip().splitlines() or ["0"])[-1] or 0)
        return Presence(count > 0, f"{count} x Ascend NPU (MindSpore)" if count else "MindSpore sees no Ascend NPU", count)

    @classmethod
    def validate(cls, job: JobSpec) -> None:
        opts = job.backend.options
        if opts.parallel_mode != "data_parallel":
            if job.device.type == "cpu":
                raise SpecError("backend.parallel_mode", (
                    f"{opts.parallel_mode} is not supported on CPU: MindSpore's operator-level parallelism "
                    "(mindspore.parallel.auto_parallel.AutoParallel) supports Ascend only, and the CPU collective "
                    "backend mccl implements AllReduce(sum) alone; use backend.parallel_mode=data_parallel"))
            raise SpecError("backend.parallel_mode", (
                f"{opts.parallel_mode} is supported by MindSpore on Ascend, but parabench does not build its sharded "
                "train network yet; use backend.parallel_mode=data_parallel"))
        if opts.mode == "pynative" and _major(package_version("numpy")) >= 2:
            raise SpecError("backend.mode", (
                f"PyNative mode of mindspore {package_version('mindspore')} fails under numpy {package_version('numpy')} (its "
                "kernels are built against NumPy 1.x): pip install 'numpy<2', or use backend.mode=graph"))
        if opts.jit_level != "O0" and opts.mode == "pynative":
            raise SpecError("backend.jit_level", "applies to graph mode only (backend.mode=graph)")

    @classmethod
    def launch_env(cls, job: JobSpec) -> dict[str, str]:
        # msrun starts each process as `python ...` found on PATH: put this interpreter's bin first,
        # so the workers run in the same environment as the runner. GLOG_v=3: MindSpore's C++ log at
        # ERROR (its INFO/WARNING lines would bury the worker's own output).
        here, path = os.path.dirname(sys.executable), os.environ.get("PATH", "")
        if path.split(os.pathsep)[0] != here:
            path = os.pathsep.join([here, path]) if path else here
        return {"PATH": path, "GLOG_v": "3"}

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
            ms.device_context.cpu.op_tuning.threads_num(cpu_threads(ctx.job.launch.nproc_per_node, ctx.job.device.threads_per_rank))
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
class MindSporeEngine(Engine):
    def __init__(self, ctx: WorkerContext):
        import mindspore as ms
        import numpy as np

        from parabench.model import initial_weights

        self.ctx, self.ms, self.np = ctx, ms, np
        job = ctx.job
        self.rank, self.world = ctx.comm.rank, ctx.comm.world
        cells = _cells()
        weights = initial_weights(job.model, job.run.seed)
        self.net = cells.Llama(job.model, weights, job.data.seq_len)
        self.named_params = cells.name_parameters(self.net)
        if sorted(self.named_params) != sorted(weights):
            raise RuntimeError(f"MindSpore cell and canonical names differ: {sorted(set(self.named_params) ^ set(weights))[:5]}")
        self.params = [self.named_params[n] for n in weights]  # canonical order
        self.names = list(weights)
        self.grads = cells.zeros_like_params(self.params, "grad")
        self.optimizer = cells.AdamW(self.params, job.optim)
        self.micro_step = cells.MicroStep(self.net, self.params, self.grads)
        self.apply_step = cells.ApplyStep(self.params, self.grads, self.optimizer, job.optim.grad_clip, self.world)
        self.steps_done = 0

    def data_parallel(self) -> tuple[int, int]:
        return self.rank, self.world

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

    def model_state_bytes(self) -> ModelStateBytes:
        nbytes = lambda ps: sum(int(p.nbytes) for p in ps)  # noqa: E731
        return ModelStateBytes(params=nbytes(self.params), grads=nbytes(self.grads),
                               optimizer=nbytes(self.optimizer.exp_avg) + nbytes(self.optimizer.exp_avg_sq),
                               optimizer_other=0)


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


# --------------------------------------------------------------------------------------------
# MindSpore cells, defined on first use so that importing this module never imports MindSpore.
# --------------------------------------------------------------------------------------------
@functools.cache
def _cells():
    import mindspore as ms
    import numpy as np
    from mindspore import Parameter, Tensor, nn, ops

    class Linear(nn.Cell):
        """y = x W^T with W of shape (out, in), as torch.nn.Linear without bias."""

        def __init__(self, weight: np.ndarray):
            super().__init__()
            self.weight = Parameter(Tensor(weight), name="weight")
            self.matmul = ops.MatMul(transpose_b=True)

        def construct(self, x):
            shape = x.shape
            y = self.matmul(x.reshape(-1, shape[-1]), self.weight)
            return y.reshape(shape[:-1] + (y.shape[-1],))

    class RMSNorm(nn.Cell):
        def __init__(self, weight: np.ndarray, eps: float):
            super().__init__()
            self.weight = Parameter(Tensor(weight), name="weight")
            self.eps = eps

        def construct(self, x):  # Zhang & Sennrich 2019 (arXiv 1910.07467), as parabench.model.RMSNorm
            x = x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + self.eps)
            return self.weight * x

    class Attention(nn.Cell):
        def __init__(self, spec: ModelSpec, w: dict, p: str, cos, sin, mask):
            super().__init__()
            self.n_heads, self.n_kv, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
            self.q_proj = Linear(w[p + "q_proj.weight"])
            self.k_proj = Linear(w[p + "k_proj.weight"])
            self.v_proj = Linear(w[p + "v_proj.weight"])
            self.o_proj = Linear(w[p + "o_proj.weight"])
            self.cos, self.sin, self.mask = cos, sin, mask
            self.scale = 1.0 / math.sqrt(spec.head_dim)
            self.qk = ops.BatchMatMul(transpose_b=True)
            self.pv = ops.BatchMatMul()

        def rope(self, x):  # Su et al. 2021 (arXiv 2104.09864), HF half-rotation layout
            half = self.head_dim // 2
            rotated = ops.concat((-x[..., half:], x[..., :half]), -1)
            return x * self.cos + rotated * self.sin

        def construct(self, x):
            b, s, _ = x.shape
            q = self.q_proj(x).reshape(b, s, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
            k = self.k_proj(x).reshape(b, s, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
            v = self.v_proj(x).reshape(b, s, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
            q, k = self.rope(q), self.rope(k)
            if self.n_kv != self.n_heads:  # GQA: query head h reads key/value head h // rep
                rep = self.n_heads // self.n_kv
                k = ops.broadcast_to(k.reshape(b, self.n_kv, 1, s, self.head_dim),
                                     (b, self.n_kv, rep, s, self.head_dim)).reshape(b, self.n_heads, s, self.head_dim)
                v = ops.broadcast_to(v.reshape(b, self.n_kv, 1, s, self.head_dim),
                                     (b, self.n_kv, rep, s, self.head_dim)).reshape(b, self.n_heads, s, self.head_dim)
            scores = self.qk(q, k) * self.scale + self.mask  # causal: -inf above the diagonal
            out = self.pv(ops.softmax(scores, -1), v)
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, s, self.n_heads * self.head_dim))

    class MLP(nn.Cell):
        def __init__(self, w: dict, p: str):
            super().__init__()
            self.gate_proj = Linear(w[p + "gate_proj.weight"])
            self.up_proj = Linear(w[p + "up_proj.weight"])
            self.down_proj = Linear(w[p + "down_proj.weight"])

        def construct(self, x):  # SwiGLU (Shazeer 2020, arXiv 2002.05202)
            return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))

    class DecoderLayer(nn.Cell):
        def __init__(self, spec: ModelSpec, w: dict, i: int, cos, sin, mask):
            super().__init__()
            p = f"model.layers.{i}."
            self.input_layernorm = RMSNorm(w[p + "input_layernorm.weight"], spec.rms_norm_eps)
            self.self_attn = Attention(spec, w, p + "self_attn.", cos, sin, mask)
            self.post_attention_layernorm = RMSNorm(w[p + "post_attention_layernorm.weight"], spec.rms_norm_eps)
            self.mlp = MLP(w, p + "mlp.")

        def construct(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Backbone(nn.Cell):
        def __init__(self, spec: ModelSpec, w: dict, cos, sin, mask):
            super().__init__()
            self.embed_tokens = nn.Cell()
            self.embed_tokens.weight = Parameter(Tensor(w["model.embed_tokens.weight"]), name="weight")
            self.layers = nn.CellList([DecoderLayer(spec, w, i, cos, sin, mask) for i in range(spec.num_hidden_layers)])
            self.norm = RMSNorm(w["model.norm.weight"], spec.rms_norm_eps)

    class Llama(nn.Cell):
        """The canonical Llama (parabench.model.Llama) with canonical parameter names; the RoPE
        tables and causal mask are built once for ``seq_len`` (float64 -> fp32, as in torch)."""

        def __init__(self, spec: ModelSpec, w: dict, seq_len: int):
            super().__init__()
            d = spec.head_dim
            inv_freq = 1.0 / (spec.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
            freqs = np.outer(np.arange(seq_len, dtype=np.float64), inv_freq)
            emb = np.concatenate((freqs, freqs), axis=-1)
            cos, sin = Tensor(np.cos(emb).astype(np.float32)), Tensor(np.sin(emb).astype(np.float32))
            mask = Tensor(np.triu(np.full((seq_len, seq_len), -np.inf, dtype=np.float32), k=1))
            self.tied = spec.tie_word_embeddings
            self.model = Backbone(spec, w, cos, sin, mask)
            if not self.tied:
                self.lm_head = Linear(w["lm_head.weight"])
            self.head_matmul = ops.MatMul(transpose_b=True)

        def construct(self, input_ids):
            x = ops.gather(self.model.embed_tokens.weight, input_ids, 0)
            for layer in self.model.layers:
                x = layer(x)
            x = self.model.norm(x)
            if self.tied:
                b, s, h = x.shape
                return self.head_matmul(x.reshape(b * s, h), self.model.embed_tokens.weight).reshape(b, s, -1)
            return self.lm_head(x)

    def causal_lm_loss(logits, targets):
        """Mean next-token cross entropy over all tokens (fp32), as parabench.model.causal_lm_loss."""
        logits = logits.reshape(-1, logits.shape[-1]).astype(ms.float32)
        logp = ops.log_softmax(logits, -1)
        picked = ops.gather_elements(logp, 1, targets.reshape(-1, 1))
        return -picked.mean()

    def name_parameters(net) -> dict:
        """Structural (canonical) names -> Parameters; also makes each Parameter.name unique."""
        out = {}
        for name, param in net.parameters_and_names():
            param.name = name
            out[name] = param
        return out

    def zeros_like_params(params, prefix: str):
        return ms.ParameterTuple(Parameter(Tensor(np.zeros(p.shape, dtype=np.float32)), name=f"{prefix}.{p.name}",
                                           requires_grad=False) for p in params)

    class MicroStep(nn.Cell):
        """Forward + backward of one micro-batch; grads of (loss * scale) added into ``grads``."""

        def __init__(self, net, params, grads):
            super().__init__(auto_prefix=False)
            self.net, self.weights, self.grads = net, ms.ParameterTuple(params), grads
            self.grad_fn = ops.value_and_grad(self.forward, None, self.weights)

        def forward(self, inputs, targets, scale):
            return causal_lm_loss(self.net(inputs), targets) * scale

        def construct(self, inputs, targets, scale):
            loss, grads = self.grad_fn(inputs, targets, scale)
            for acc, g in zip(self.grads, grads):
                ops.assign_add(acc, g)
            return loss

    class AdamW(nn.Cell):
        """torch.optim.AdamW (decoupled decay on 2-D weights, bias-corrected moments) on MindSpore's
        fused AdamWeightDecay primitive, torch's bias correction folded into its inputs:
        torch  p <- p (1 - lr wd) - lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)
        fused  p <- p - lr' (m / (sqrt(v) + eps') + wd' p)
        are equal for lr' = lr sqrt(bc2)/bc1, eps' = eps sqrt(bc2), wd' = wd bc1/sqrt(bc2),
        with bc1 = 1 - b1^t, bc2 = 1 - b2^t (moments: m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2)."""

        def __init__(self, params, spec: OptimSpec):
            super().__init__(auto_prefix=False)
            self.spec = spec
            self.exp_avg = zeros_like_params(params, "exp_avg")
            self.exp_avg_sq = zeros_like_params(params, "exp_avg_sq")
            self.decays = tuple(len(p.shape) >= 2 for p in params)  # parabench.model.decay_mask
            self.b1, self.b2 = spec.betas
            self.fused = ops.AdamWeightDecay()

        def step_scalars(self, step: int) -> tuple[float, float, float]:
            """(lr', eps', wd') for step ``step`` (1-based), in double precision as torch computes them."""
            bc1, bc2_sqrt = 1.0 - self.b1 ** step, math.sqrt(1.0 - self.b2 ** step)
            s = self.spec
            return s.lr * bc2_sqrt / bc1, s.eps * bc2_sqrt, s.weight_decay * bc1 / bc2_sqrt

        def construct(self, params, grads, lr, eps, wd):
            no_decay = ops.zeros_like(wd)
            for p, g, m, v, decay in zip(params, grads, self.exp_avg, self.exp_avg_sq, self.decays):
                self.fused(p, m, v, lr, self.b1, self.b2, eps, wd if decay else no_decay, g)
            return True

    class ApplyStep(nn.Cell):
        """Data-parallel mean of the accumulated grads, global-norm clip, AdamW, grads zeroed."""

        def __init__(self, params, grads, optimizer, max_norm: float, world: int):
            super().__init__(auto_prefix=False)
            self.params, self.grads, self.optimizer = ms.ParameterTuple(params), grads, optimizer
            self.max_norm, self.world = max_norm, world
            self.allreduce = ops.AllReduce(ops.ReduceOp.SUM) if world > 1 else None

        def construct(self, lr, eps, wd):
            grads = self.grads
            if self.world > 1:
                for acc in grads:
                    ops.assign(acc, self.allreduce(acc) / self.world)
            if self.max_norm > 0:
                # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1.
                sq = [ops.reduce_sum(g * g) for g in grads]
                total = ops.sqrt(ops.addn(sq))
                coef = ops.minimum(self.max_norm / (total + 1e-6), 1.0)
                for g in grads:
                    ops.assign(g, g * coef)
            self.optimizer(self.params, grads, lr, eps, wd)
            for g in grads:
                ops.assign(g, ops.zeros_like(g))
            return True

    class Namespace:
        pass

    ns = Namespace()
    for obj in (Linear, RMSNorm, Attention, MLP, DecoderLayer, Backbone, Llama, MicroStep, AdamW, ApplyStep):
        setattr(ns, obj.__name__, obj)
    ns.causal_lm_loss, ns.name_parameters, ns.zeros_like_params = causal_lm_loss, name_parameters, zeros_like_params
    return ns
