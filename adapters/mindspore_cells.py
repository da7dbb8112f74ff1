"""The canonical Llama, its loss and its training steps as MindSpore ``nn.Cell``s (backend=mindspore).

Only the MindSpore worker imports this module (``MindSporeEngine``), so MindSpore is imported at
module level here and never by ``parabench.adapters.mindspore``, which ``bench`` imports to validate
and launch. The math mirrors ``parabench.model`` (names, shapes, RoPE layout, loss) and
``torch.optim.AdamW`` (see :class:`AdamW`); tests/test_mindspore.py checks both.
"""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from parabench.model import decay_mask
from parabench.spec import ModelSpec, OptimSpec


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
            k = ops.broadcast_to(
                k.reshape(b, self.n_kv, 1, s, self.head_dim), (b, self.n_kv, rep, s, self.head_dim)
            ).reshape(b, self.n_heads, s, self.head_dim)
            v = ops.broadcast_to(
                v.reshape(b, self.n_kv, 1, s, self.head_dim), (b, self.n_kv, rep, s, self.head_dim)
            ).reshape(b, self.n_heads, s, self.head_dim)
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
    return ms.ParameterTuple(
        Parameter(Tensor(np.zeros(p.shape, dtype=np.float32)), name=f"{prefix}.{p.name}", requires_grad=False)
        for p in params
    )


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
        self.decays = tuple(decay_mask(p.name, p) for p in params)
        self.b1, self.b2 = spec.betas
        self.fused = ops.AdamWeightDecay()

    def step_scalars(self, step: int) -> tuple[float, float, float]:
        """(lr', eps', wd') for step ``step`` (1-based), in double precision as torch computes them."""
        bc1, bc2_sqrt = 1.0 - self.b1**step, math.sqrt(1.0 - self.b2**step)
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
