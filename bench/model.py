"""The canonical Llama and its framework-neutral, deterministic initialisation.

Every backend trains this architecture. Weights are identified by their Hugging Face names
(``model.layers.0.self_attn.q_proj.weight``), and each full, unsharded weight is generated from
(seed, name) alone with NumPy, so that DDP, FSDP, ZeRO, Megatron shards and MindSpore all start
from bit-identical numbers whatever the sharding or the process count. A model read from a Hugging
Face checkpoint (``+model=hf``, bench/hf.py) starts from the checkpoint's tensors instead;
:func:`initial_weights` is the one source of initial weights for every backend. ``weights_checksum``
is the fingerprint logged with every run.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from parabench.hf import load_weights
from parabench.spec import ModelSpec

INIT_SCHEME = "normal(0, initializer_range); o_proj/down_proj scaled by 1/sqrt(2*layers); norms = 1; biases = 0"


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"parabench-init:{seed}:{name}".encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:8], "little")))


def canonical_weight(spec: ModelSpec, seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One full weight as float32, a pure function of (seed, name, shape, spec)."""
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    if name.endswith(".bias"):  # as Hugging Face initialises nn.Linear biases
        return np.zeros(shape, dtype=np.float32)
    std = spec.initializer_range
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        # Residual-branch output projections: GPT-2 / Megatron-LM scaled init (Radford et al. 2019;
        # Shoeybi et al. 2019, arXiv 1909.08053 section 3), std / sqrt(2 * num_layers).
        std = std / math.sqrt(2.0 * spec.num_hidden_layers)
    return (_rng(seed, name).standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)


def canonical_weights(spec: ModelSpec, seed: int, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    shapes = spec.parameter_shapes()
    wanted = shapes if names is None else {n: shapes[n] for n in names}
    return {n: canonical_weight(spec, seed, n, s) for n, s in wanted.items()}


def initial_weights(spec: ModelSpec, seed: int, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """The full float32 weights every backend starts from, checked against the spec: read from the
    safetensors checkpoint ``spec.weights`` when set, else generated from (seed, name). ``names``:
    a subset (e.g. one pipeline stage's), in that order."""
    shapes = spec.parameter_shapes()
    wanted = list(shapes) if names is None else list(names)
    unknown = [n for n in wanted if n not in shapes]
    if unknown:
        raise RuntimeError(f"not parameters of model {spec.name}: {unknown[:5]}")
    if spec.weights:
        weights = load_weights(spec.weights, wanted)
    else:
        weights = {n: canonical_weight(spec, seed, n, shapes[n]) for n in wanted}
    for name in wanted:
        value = weights[name]
        if value.shape != shapes[name] or value.dtype != np.float32:
            raise RuntimeError(
                f"{name}: got {value.dtype} {value.shape}, model {spec.name} needs float32 {shapes[name]}"
            )
    return weights


def weights_checksum(state: Mapping[str, np.ndarray | object]) -> str:
    """SHA-256 over (name, shape, float32 little-endian bytes) in name order; first 16 hex digits."""
    h = hashlib.sha256()
    for name in sorted(state):
        value = state[name]
        if isinstance(value, torch.Tensor):
            value = value.detach().to("cpu").float().contiguous().numpy()
        arr = np.ascontiguousarray(value, dtype="<f4")
        h.update(name.encode())
        h.update(repr(tuple(arr.shape)).encode())
        h.update(arr.tobytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# The PyTorch definition.
# --------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Zhang & Sennrich 2019 (arXiv 1910.07467); normalised in fp32 as Hugging Face Llama does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def llama3_inv_freq(inv_freq: torch.Tensor, rs) -> torch.Tensor:
    """Llama 3.1's frequency scaling (``rope_type: llama3``; Meta's llama-models reference, as in
    transformers' ``modeling_rope_utils._compute_llama3_parameters``): wavelengths shorter than
    original_max_position_embeddings / high_freq_factor are kept, longer than .../low_freq_factor are
    divided by ``factor``, and those between are interpolated smoothly (docs/sources.md#hugging-face-checkpoints)."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(spec: ModelSpec, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of rotary embeddings (Su et al. 2021, arXiv 2104.09864), HF half-rotation layout."""
    d = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
    if spec.rope_scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, spec.rope_scaling)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float(), emb.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        d = spec.head_dim
        self.n_heads, self.n_kv, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, d
        self.q_proj = nn.Linear(spec.hidden_size, self.n_heads * d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, self.n_kv * d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, self.n_kv * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * d, spec.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv != self.n_heads:  # grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245)
            rep = self.n_heads // self.n_kv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x):  # SwiGLU (Shazeer 2020, arXiv 2002.05202)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)
        self.checkpoint = False  # activation checkpointing: recompute this layer in backward

    def forward(self, x, cos, sin):
        if self.checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)

    def _forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class Llama(nn.Module):
    """Decoder-only Llama: RMSNorm, RoPE (optionally Llama 3.1-scaled), SwiGLU, GQA, optional tied
    embeddings and q/k/v biases (Qwen2); HF parameter names."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_tables(self.spec, input_ids.shape[1], x.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        if self.spec.tie_word_embeddings:
            return F.linear(x, self.model.embed_tokens.weight)
        return self.lm_head(x)


def build_llama(spec: ModelSpec, seed: int | None = None) -> Llama:
    """The canonical PyTorch Llama; with ``seed`` it holds the initial weights (:func:`initial_weights`)."""
    model = Llama(spec)
    if seed is not None:
        load_canonical(model, spec, seed)
    return model


def set_activation_checkpointing(model: Llama, enabled: bool) -> None:
    """Full recompute of every decoder layer in backward (Chen et al. 2016, arXiv 1604.06174)."""
    for layer in model.model.layers:
        layer.checkpoint = enabled


@torch.no_grad()
def load_canonical(model: nn.Module, spec: ModelSpec, seed: int) -> None:
    """Copy the initial weights (:func:`initial_weights`) into a freshly built Llama (in place)."""
    weights = initial_weights(spec, seed)
    params = dict(model.named_parameters())
    differ = set(weights) ^ set(params)
    if differ:
        raise RuntimeError(f"canonical and model parameter names differ: {sorted(differ)[:5]}")
    for name, value in weights.items():
        params[name].copy_(torch.from_numpy(value))


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all tokens of the micro-batch (computed in fp32)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def decay_mask(name: str, param: torch.Tensor) -> bool:
    """Weight decay applies to matrices (2-D) only, not to norm gains (Megatron/nanoGPT convention)."""
    return param.dim() >= 2
