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
    if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
        # Residual-branch output projections (MoE experts' w2 too): GPT-2 / Megatron-LM scaled init
        # (Radford et al. 2019; Shoeybi et al. 2019, arXiv 1909.08053 section 3), std / sqrt(2 * num_layers).
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
    def __init__(self, spec: ModelSpec, intermediate_size: int | None = None):
        super().__init__()
        i = intermediate_size or spec.intermediate_size
        self.gate_proj = nn.Linear(spec.hidden_size, i, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, i, bias=False)
        self.down_proj = nn.Linear(i, spec.hidden_size, bias=False)

    def forward(self, x):  # SwiGLU (Shazeer 2020, arXiv 2002.05202)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    """One Mixtral expert: SwiGLU with Mixtral's names, w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def route(router_logits: torch.Tensor, top_k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of [tokens, experts] router logits: (the k weights; the k expert ids) per token,
    from the softmax over all experts in fp32. ``normalize``: the k weights renormalised to sum to 1
    (Mixtral, transformers' MixtralTopKRouter), else the softmax probabilities as they are
    (``norm_topk_prob: false``, transformers' Qwen2MoeTopKRouter). Counting tokens per expert
    (parabench.expertload) routes with it too."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
    top_weights, top_experts = torch.topk(probs, top_k, dim=-1)
    if not normalize:
        return top_weights, top_experts
    return top_weights / top_weights.sum(dim=-1, keepdim=True), top_experts


class SparseMoeBlock(nn.Module):
    """Mixtral's sparse MoE MLP (Jiang et al. 2024, arXiv 2401.04088 sec. 2; transformers'
    MixtralSparseMoeBlock): a bias-free router, softmax over the experts in fp32, top-k, the k weights
    renormalised to sum to 1 (or, ``norm_topk_prob: false``, not: Qwen2-MoE); dropless (every token
    reaches its k experts). Optionally Qwen2-MoE's shared expert, added with a sigmoid gate
    (transformers' Qwen2MoeSparseMoeBlock)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, self.top_k, self.num_experts = spec.hidden_size, spec.num_experts_per_tok, spec.num_local_experts
        self.norm_topk_prob = spec.norm_topk_prob
        self.gate = nn.Linear(h, self.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(h, spec.expert_intermediate_size) for _ in range(self.num_experts))
        if spec.shared_expert_intermediate_size:
            self.shared_expert = MLP(spec, spec.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, router logits of shape [tokens, experts])."""
        flat = x.reshape(-1, x.shape[-1])
        router_logits = self.gate(flat)
        top_weights, top_experts = route(router_logits, self.top_k, self.norm_topk_prob)
        out = torch.zeros_like(flat)
        # Every expert runs, also on zero tokens: its weights then get a zero gradient, so every
        # parameter takes part in each step (DDP needs no find_unused_parameters).
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(top_experts == e)
            y = expert(flat[token]) * top_weights[token, slot, None]
            out = out.index_add(0, token, y.to(out.dtype))
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(x.shape), router_logits


def load_balancing_loss(router_logits: list[torch.Tensor], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2022, arXiv 2101.03961 eq. 4-6) with top-k
    dispatch, over the tokens of all layers together as transformers' load_balancing_loss_func:
    num_experts * sum_e f_e * P_e, f_e = fraction of (token, slot) assignments to expert e (summed
    over the k slots), P_e = mean router probability of e."""
    logits = torch.cat(router_logits, dim=0)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    _, selected = torch.topk(probs, top_k, dim=-1)
    assigned = F.one_hot(selected, num_experts).float().sum(dim=1)  # [tokens, experts], no gradient
    return num_experts * torch.sum(assigned.mean(dim=0) * probs.mean(dim=0))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if spec.is_moe:
            self.block_sparse_moe = SparseMoeBlock(spec)
        else:
            self.mlp = MLP(spec)
        self.checkpoint = False  # activation checkpointing: recompute this layer in backward

    def forward(self, x, cos, sin):
        """(hidden states, router logits or None for a dense layer)."""
        if self.checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)

    def _forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        if not hasattr(self, "block_sparse_moe"):
            return x + self.mlp(self.post_attention_layernorm(x)), None
        out, router_logits = self.block_sparse_moe(self.post_attention_layernorm(x))
        return x + out, router_logits


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

    def forward(self, input_ids: torch.Tensor, with_aux_loss: bool = False):
        """The logits; with ``with_aux_loss`` (logits, MoE load-balancing loss, 0 for a dense model)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_tables(self.spec, input_ids.shape[1], x.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        router_logits = []
        for layer in self.model.layers:
            x, layer_router_logits = layer(x, cos, sin)
            if layer_router_logits is not None:
                router_logits.append(layer_router_logits)
        x = self.model.norm(x)
        if self.spec.tie_word_embeddings:
            logits = F.linear(x, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(x)
        if not with_aux_loss:
            return logits
        if not router_logits:
            return logits, torch.zeros((), device=logits.device)
        spec = self.spec
        return logits, load_balancing_loss(router_logits, spec.num_local_experts, spec.num_experts_per_tok)


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


def training_loss(model: nn.Module, spec: ModelSpec, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss a step minimises: ``causal_lm_loss``, plus for MoE ``router_aux_loss_coef`` times the
    load-balancing loss (as MixtralForCausalLM adds it). ``model``: the Llama or its DDP wrapper."""
    if not spec.is_moe:
        return causal_lm_loss(model(inputs), targets)
    logits, aux_loss = model(inputs, with_aux_loss=True)
    return causal_lm_loss(logits, targets) + spec.router_aux_loss_coef * aux_loss.float()


def decay_mask(name: str, param: torch.Tensor) -> bool:
    """Weight decay applies to matrices (2-D) only, not to norm gains (Megatron/nanoGPT convention)."""
    return param.dim() >= 2
