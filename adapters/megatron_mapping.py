"""Canonical (Hugging Face Llama) weights <-> Megatron-Core GPTModel shards, in both directions.

Pure NumPy: no megatron-core import, so the mapping is testable anywhere and reusable by every
Megatron-based adapter (megatron, mindspeed).

Megatron's layout for one (pipeline stage, virtual chunk, tensor rank), with the local
(non-Transformer-Engine) layer spec; parameter names use the layer index *within the chunk*:

* ``embedding.word_embeddings.weight``   rows [r*V/t, (r+1)*V/t) of the embedding (vocab-parallel),
  first chunk of the first stage only;
* ``decoder.layers.i.input_layernorm.weight``, ``...pre_mlp_layernorm.weight``: replicated;
* ``decoder.layers.i.self_attention.linear_qkv.weight``: the fused QKV, laid out per query group as
  [q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...] (query head j belongs to group
  j // (heads / groups), as in HF's ``repeat_interleave``), then split evenly on dim 0 over the
  t tensor ranks (ColumnParallelLinear);
* ``...self_attention.linear_qkv.bias`` (``qkv_bias``, Qwen2; megatron-core ``add_qkv_bias``): the
  q/k/v biases fused and split as the weight's rows;
* ``...self_attention.linear_proj.weight``: o_proj split on dim 1 (RowParallelLinear);
* ``...mlp.linear_fc1.weight``: [gate rows of rank r; up rows of rank r] - each rank's output is
  chunked into (gate, up) by the gated-linear-unit forward, so the two halves are split separately;
* ``...mlp.linear_fc2.weight``: down_proj split on dim 1;
* ``decoder.final_layernorm.weight`` and ``output_layer.weight`` (vocab-parallel rows): last chunk
  of the last stage only.

A Mixture-of-Experts layer (``spec.is_moe``; megatron-core's ``MoELayer`` with ``SequentialMLP``
experts, the local spec with ``num_experts``) has, instead of ``mlp.linear_fc1/fc2``:

* ``...mlp.router.weight``: Mixtral's router ``block_sparse_moe.gate.weight`` ([experts, hidden]),
  replicated;
* ``...mlp.experts.local_experts.j.linear_fc1.weight`` = [w1 rows; w3 rows] and ``...linear_fc2.weight``
  = w2 of global expert ``ep_rank * E/ep + j``: with expert parallel size ep, expert-parallel rank
  ``ep_rank`` holds the E/ep consecutive experts starting there (megatron-core
  ``transformer/moe/moe_layer.py``: ``local_expert_indices`` = ``ep_rank * num_local_experts + j``;
  docs/sources.md#megatron-moe);
* with Qwen2-MoE's shared expert, ``...mlp.shared_experts.linear_fc1.weight`` = [gate_proj; up_proj],
  ``...linear_fc2.weight`` = down_proj and ``...shared_experts.gate_weight`` = ``shared_expert_gate``
  ([1, hidden]; megatron-core ``transformer/moe/shared_experts.py`` ``SharedExpertMLP``, a dense MLP
  every expert rank holds whole, scaled by sigmoid(x gate_weight^T)).

With the Transformer-Engine spec the two norms are fused into the following linear layers and are
named ``self_attention.linear_qkv.layer_norm_weight`` and ``mlp.linear_fc1.layer_norm_weight``
(``Layout.te_names``).

Which global layers a chunk holds follows megatron-core's ``get_transformer_layer_offset`` for even
splits: with p stages and v virtual chunks per stage, chunk c of stage s holds the L/(p*v) layers
starting at c*L/v + s*L/(p*v) (Narayanan et al. 2021, arXiv 2104.04473, section 2.2: interleaved
schedule, each device holds v non-contiguous chunks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from parabench.spec import ModelSpec

Key = tuple[int, int, int]  # (pipeline stage, virtual chunk, tensor rank)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual pipeline chunks per stage (1 = no interleaving)
    te_names: bool = False  # Transformer-Engine layer spec (norms fused into linear_qkv / linear_fc1)
    ep: int = 1  # expert-parallel size: each expert-parallel rank holds num_local_experts / ep experts

    def check(self, spec: ModelSpec) -> None:
        """Raise ValueError when ``spec`` cannot be laid out this way (the adapter refuses earlier)."""
        problems = [
            (spec.num_attention_heads % self.tp, f"{spec.num_attention_heads} attention heads % tp={self.tp}"),
            (spec.intermediate_size % self.tp, f"intermediate_size {spec.intermediate_size} % tp={self.tp}"),
            (spec.vocab_size % self.tp, f"vocab_size {spec.vocab_size} % tp={self.tp}"),
            (self._qkv_rows(spec) % self.tp, f"fused QKV rows {self._qkv_rows(spec)} % tp={self.tp}"),
            (
                spec.num_hidden_layers % (self.pp * self.vpp),
                f"{spec.num_hidden_layers} layers % (pp x vpp)={self.pp * self.vpp}",
            ),
            (spec.num_local_experts % self.ep, f"{spec.num_local_experts} experts % ep={self.ep}"),
        ]
        for bad, what in problems:
            if bad:
                raise ValueError(f"cannot shard: {what} != 0")

    def _qkv_rows(self, spec: ModelSpec) -> int:
        return (spec.num_attention_heads + 2 * spec.num_key_value_heads) * spec.head_dim

    def chunk_layers(self, spec: ModelSpec, stage: int, chunk: int = 0) -> range:
        """Global layer indices held by virtual chunk ``chunk`` of pipeline stage ``stage``."""
        per = spec.num_hidden_layers // (self.pp * self.vpp)
        start = chunk * (spec.num_hidden_layers // self.vpp) + stage * per
        return range(start, start + per)

    def is_first(self, stage: int, chunk: int) -> bool:
        return stage == 0 and chunk == 0

    def is_last(self, stage: int, chunk: int) -> bool:
        return stage == self.pp - 1 and chunk == self.vpp - 1

    def keys(self) -> list[Key]:
        return [(s, c, r) for s in range(self.pp) for c in range(self.vpp) for r in range(self.tp)]

    def local_experts(self, spec: ModelSpec, ep_rank: int) -> range:
        """Global indices of the experts expert-parallel rank ``ep_rank`` holds (megatron-core's
        ``local_expert_indices``: consecutive blocks of E/ep)."""
        per = spec.num_local_experts // self.ep
        return range(ep_rank * per, (ep_rank + 1) * per)


_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def _mlp_names(spec: ModelSpec, layout: Layout, ep_rank: int) -> tuple[str, ...]:
    """One layer's canonical MLP weights (suffixes of ``model.layers.<g>.``) on this expert rank."""
    if not spec.is_moe:
        return _DENSE_MLP
    moe = "block_sparse_moe."
    experts = layout.local_experts(spec, ep_rank)
    names = (moe + "gate.weight", *(f"{moe}experts.{e}.w{k}.weight" for e in experts for k in (1, 2, 3)))
    if spec.shared_expert_intermediate_size:
        names += tuple(f"{moe}shared_expert.{n}_proj.weight" for n in ("gate", "up", "down"))
        names += (moe + "shared_expert_gate.weight",)
    return names


def canonical_names(spec: ModelSpec, layout: Layout, stage: int, chunk: int = 0, ep_rank: int = 0) -> list[str]:
    """The canonical weights one chunk needs (every tensor rank of it needs the same ones; of a MoE
    model's experts only those of expert-parallel rank ``ep_rank``)."""
    names = []
    if layout.is_first(stage, chunk):
        names.append("model.embed_tokens.weight")
    for g in layout.chunk_layers(spec, stage, chunk):
        p = f"model.layers.{g}."
        biases = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias") if spec.qkv_bias else ()
        names += [
            p + n
            for n in (
                "input_layernorm.weight",
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                *biases,
                "self_attn.o_proj.weight",
                "post_attention_layernorm.weight",
                *_mlp_names(spec, layout, ep_rank),
            )
        ]
    if layout.is_last(stage, chunk):
        names.append("model.norm.weight")
        names.append("model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight")
    return list(dict.fromkeys(names))


def norm_names(layout: Layout) -> tuple[str, str]:
    if layout.te_names:
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def fuse_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """Full (unsharded) fused QKV in Megatron's per-query-group order."""
    g, d, h = spec.num_key_value_heads, spec.head_dim, q.shape[1]
    per = spec.num_attention_heads // g
    return np.concatenate([q.reshape(g, per * d, h), k.reshape(g, d, h), v.reshape(g, d, h)], axis=1).reshape(-1, h)


def split_qkv(qkv: np.ndarray, spec: ModelSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    g, d, h = spec.num_key_value_heads, spec.head_dim, qkv.shape[1]
    per = spec.num_attention_heads // g
    grouped = qkv.reshape(g, (per + 2) * d, h)
    q = grouped[:, : per * d].reshape(-1, h)
    k = grouped[:, per * d : (per + 1) * d].reshape(-1, h)
    v = grouped[:, (per + 1) * d :].reshape(-1, h)
    return np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)


def _rows(x: np.ndarray, r: int, t: int) -> np.ndarray:
    n = x.shape[0] // t
    return x[r * n : (r + 1) * n].copy()  # a copy, not a view: the full tensor is freed once mapped


def _cols(x: np.ndarray, r: int, t: int) -> np.ndarray:
    n = x.shape[1] // t
    return np.ascontiguousarray(x[:, r * n : (r + 1) * n])


def _mlp_to_megatron(
    canonical: Mapping[str, np.ndarray], spec: ModelSpec, layout: Layout, c: str, rank: int, ep_rank: int
) -> dict[str, np.ndarray]:
    """One layer's MLP (canonical prefix ``c``) -> Megatron names under ``mlp.``: the dense SwiGLU, or
    the router and this expert rank's experts (the fused fc1 [w1; w3] split over tp as gate/up is)."""
    t = layout.tp
    if not spec.is_moe:
        pairs = [(c + "mlp.", "", "gate_proj", "up_proj", "down_proj")]
        out = {}
    else:
        moe = c + "block_sparse_moe."
        out = {"mlp.router.weight": canonical[moe + "gate.weight"].copy()}
        pairs = [
            (f"{moe}experts.{e}.", f"experts.local_experts.{j}.", "w1", "w3", "w2")
            for j, e in enumerate(layout.local_experts(spec, ep_rank))
        ]
        if spec.shared_expert_intermediate_size:
            pairs.append((moe + "shared_expert.", "shared_experts.", "gate_proj", "up_proj", "down_proj"))
            out["mlp.shared_experts.gate_weight"] = canonical[moe + "shared_expert_gate.weight"].copy()
    for src, dst, gate, up, down in pairs:
        fc1 = [_rows(canonical[f"{src}{gate}.weight"], rank, t), _rows(canonical[f"{src}{up}.weight"], rank, t)]
        out[f"mlp.{dst}linear_fc1.weight"] = np.concatenate(fc1)
        out[f"mlp.{dst}linear_fc2.weight"] = _cols(canonical[f"{src}{down}.weight"], rank, t)
    return out


def _mlp_from_megatron(
    tp_shards: list[Mapping[str, np.ndarray]], spec: ModelSpec, layout: Layout, m: str, ep_rank: int
) -> dict[str, np.ndarray]:
    """Inverse of :func:`_mlp_to_megatron` (Megatron prefix ``m``): canonical suffixes -> full tensors."""
    if not spec.is_moe:
        pairs = [("mlp.", "", "gate_proj", "up_proj", "down_proj")]
        out = {}
    else:
        out = {"block_sparse_moe.gate.weight": np.array(tp_shards[0][m + "mlp.router.weight"])}
        pairs = [
            (f"block_sparse_moe.experts.{e}.", f"experts.local_experts.{j}.", "w1", "w3", "w2")
            for j, e in enumerate(layout.local_experts(spec, ep_rank))
        ]
        if spec.shared_expert_intermediate_size:
            pairs.append(("block_sparse_moe.shared_expert.", "shared_experts.", "gate_proj", "up_proj", "down_proj"))
            gate_weight = tp_shards[0][m + "mlp.shared_experts.gate_weight"]
            out["block_sparse_moe.shared_expert_gate.weight"] = np.array(gate_weight)
    for dst, src, gate, up, down in pairs:
        halves = [np.split(s[f"{m}mlp.{src}linear_fc1.weight"], 2, axis=0) for s in tp_shards]
        out[f"{dst}{gate}.weight"] = np.concatenate([h[0] for h in halves])
        out[f"{dst}{up}.weight"] = np.concatenate([h[1] for h in halves])
        out[f"{dst}{down}.weight"] = np.concatenate([s[f"{m}mlp.{src}linear_fc2.weight"] for s in tp_shards], axis=1)
    return out


def to_megatron(
    canonical: Mapping[str, np.ndarray],
    spec: ModelSpec,
    layout: Layout,
    stage: int,
    chunk: int,
    rank: int,
    ep_rank: int = 0,
) -> dict[str, np.ndarray]:
    """Megatron parameter name -> this (stage, chunk, tensor rank, expert rank)'s shard.

    ``canonical`` needs at least ``canonical_names(spec, layout, stage, chunk, ep_rank)``."""
    t = layout.tp
    ln1, ln2 = norm_names(layout)
    out: dict[str, np.ndarray] = {}
    if layout.is_first(stage, chunk):
        out["embedding.word_embeddings.weight"] = _rows(canonical["model.embed_tokens.weight"], rank, t)
    for i, g in enumerate(layout.chunk_layers(spec, stage, chunk)):
        c, m = f"model.layers.{g}.", f"decoder.layers.{i}."
        qkv = fuse_qkv(
            canonical[c + "self_attn.q_proj.weight"],
            canonical[c + "self_attn.k_proj.weight"],
            canonical[c + "self_attn.v_proj.weight"],
            spec,
        )
        out[m + ln1] = canonical[c + "input_layernorm.weight"].copy()
        out[m + "self_attention.linear_qkv.weight"] = _rows(qkv, rank, t)
        if spec.qkv_bias:  # the biases in the weight's row order: one column through fuse_qkv
            biases = [canonical[f"{c}self_attn.{x}_proj.bias"][:, None] for x in "qkv"]
            out[m + "self_attention.linear_qkv.bias"] = _rows(fuse_qkv(*biases, spec), rank, t)[:, 0].copy()
        out[m + "self_attention.linear_proj.weight"] = _cols(canonical[c + "self_attn.o_proj.weight"], rank, t)
        out[m + ln2] = canonical[c + "post_attention_layernorm.weight"].copy()
        out.update({m + n: v for n, v in _mlp_to_megatron(canonical, spec, layout, c, rank, ep_rank).items()})
    if layout.is_last(stage, chunk):
        out["decoder.final_layernorm.weight"] = canonical["model.norm.weight"].copy()
        if not spec.tie_word_embeddings:
            out["output_layer.weight"] = _rows(canonical["lm_head.weight"], rank, t)
    return out


def from_megatron(
    tp_shards: list[Mapping[str, np.ndarray]],
    spec: ModelSpec,
    layout: Layout,
    stage: int,
    chunk: int,
    ep_rank: int = 0,
) -> dict[str, np.ndarray]:
    """Canonical weights of one (stage, chunk) from its ``layout.tp`` tensor-rank shards (in rank order);
    of a MoE model's experts, those of expert-parallel rank ``ep_rank``."""
    if len(tp_shards) != layout.tp:
        raise ValueError(f"need {layout.tp} tensor-parallel shards, got {len(tp_shards)}")
    ln1, ln2 = norm_names(layout)

    def cat(name: str, axis: int) -> np.ndarray:
        return np.concatenate([s[name] for s in tp_shards], axis=axis)

    out: dict[str, np.ndarray] = {}
    if layout.is_first(stage, chunk):
        out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight", 0)
    for i, g in enumerate(layout.chunk_layers(spec, stage, chunk)):
        c, m = f"model.layers.{g}.", f"decoder.layers.{i}."
        q, k, v = split_qkv(cat(m + "self_attention.linear_qkv.weight", 0), spec)
        out[c + "input_layernorm.weight"] = np.array(tp_shards[0][m + ln1])
        out[c + "self_attn.q_proj.weight"], out[c + "self_attn.k_proj.weight"], out[c + "self_attn.v_proj.weight"] = (
            q,
            k,
            v,
        )
        if spec.qkv_bias:
            qb, kb, vb = split_qkv(cat(m + "self_attention.linear_qkv.bias", 0)[:, None], spec)
            out[c + "self_attn.q_proj.bias"], out[c + "self_attn.k_proj.bias"] = qb[:, 0].copy(), kb[:, 0].copy()
            out[c + "self_attn.v_proj.bias"] = vb[:, 0].copy()
        out[c + "self_attn.o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
        out[c + "post_attention_layernorm.weight"] = np.array(tp_shards[0][m + ln2])
        out.update({c + n: v for n, v in _mlp_from_megatron(tp_shards, spec, layout, m, ep_rank).items()})
    if layout.is_last(stage, chunk):
        out["model.norm.weight"] = np.array(tp_shards[0]["decoder.final_layernorm.weight"])
        if not spec.tie_word_embeddings:
            out["lm_head.weight"] = cat("output_layer.weight", 0)
    return out


def _one_expert_rank(layout: Layout) -> None:
    if layout.ep != 1:
        raise ValueError(f"ep={layout.ep}: map each expert rank with to_megatron / from_megatron(ep_rank=...)")


def shard_all(canonical: Mapping[str, np.ndarray], spec: ModelSpec, layout: Layout) -> dict[Key, dict[str, np.ndarray]]:
    """Every (stage, chunk, tensor rank)'s shards of a full canonical state (one expert rank: ep = 1)."""
    _one_expert_rank(layout)
    layout.check(spec)
    return {(s, c, r): to_megatron(canonical, spec, layout, s, c, r) for s, c, r in layout.keys()}


def unshard_all(
    shards: Mapping[Key, Mapping[str, np.ndarray]], spec: ModelSpec, layout: Layout
) -> dict[str, np.ndarray]:
    """The full canonical state from every shard (inverse of :func:`shard_all`)."""
    _one_expert_rank(layout)
    out: dict[str, np.ndarray] = {}
    for s in range(layout.pp):
        for c in range(layout.vpp):
            out.update(from_megatron([shards[(s, c, r)] for r in range(layout.tp)], spec, layout, s, c))
    return out


def shard_param_count(shards: Iterable[Mapping[str, np.ndarray]]) -> int:
    return sum(int(a.size) for shard in shards for a in shard.values())


__all__ = [
    "Layout",
    "canonical_names",
    "from_megatron",
    "fuse_qkv",
    "shard_all",
    "split_qkv",
    "to_megatron",
    "unshard_all",
]
