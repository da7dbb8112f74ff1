"""Canonical <-> Megatron-Core weight mapping: lossless both ways, and the layout Megatron expects.

Pure NumPy (no megatron-core needed)."""

import numpy as np
import pytest

from parabench.adapters.megatron_mapping import (
    Layout,
    canonical_names,
    fuse_qkv,
    shard_all,
    split_qkv,
    to_megatron,
    unshard_all,
)
from parabench.model import canonical_weights
from parabench.spec import ModelSpec

# GQA: 8 query heads in 4 groups (2 per group), head_dim 4; 4 layers so pp x vpp = 4 divides them.
GQA = ModelSpec(
    name="t",
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=64,
)
MHA = ModelSpec(
    name="t",
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=64,
)

LAYOUTS = [
    Layout(1, 1, 1),
    Layout(2, 1, 1),
    Layout(1, 2, 1),
    Layout(2, 2, 1),
    Layout(1, 2, 2),
    Layout(2, 2, 2),
    Layout(4, 1, 1),
    Layout(2, 2, 1, te_names=True),
]


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda lay: f"tp{lay.tp}-pp{lay.pp}-vpp{lay.vpp}{'-te' if lay.te_names else ''}"
)
@pytest.mark.parametrize("spec", [GQA, MHA], ids=["gqa", "mha"])
def test_round_trip_is_lossless(spec, layout):
    canonical = canonical_weights(spec, seed=7)
    shards = shard_all(canonical, spec, layout)
    back = unshard_all(shards, spec, layout)
    assert set(back) == set(canonical)
    for name, value in canonical.items():
        assert back[name].dtype == np.float32 and np.array_equal(back[name], value), name
    # Nothing duplicated except the norms, which every tensor rank holds.
    norms = sum(v.size for n, v in canonical.items() if n.endswith("norm.weight"))
    total = sum(v.size for s in shards.values() for v in s.values())
    assert total == sum(v.size for v in canonical.values()) + (layout.tp - 1) * norms


def test_each_chunk_needs_only_its_own_weights():
    layout = Layout(tp=2, pp=2, vpp=2)
    seen = []
    for stage in range(2):
        for chunk in range(2):
            names = canonical_names(GQA, layout, stage, chunk)
            subset = canonical_weights(GQA, 7, names)
            to_megatron(subset, GQA, layout, stage, chunk, rank=1)  # raises KeyError if a name is missing
            seen += names
    assert sorted(seen) == sorted(GQA.parameter_shapes())  # every weight in exactly one chunk


def test_interleaved_chunks_follow_megatron_layer_offsets():
    # p=2, v=2, L=4: stage 0 holds layers 0 and 2, stage 1 holds 1 and 3 (get_transformer_layer_offset).
    layout = Layout(tp=1, pp=2, vpp=2)
    assert [list(layout.chunk_layers(GQA, s, c)) for s in range(2) for c in range(2)] == [[0], [2], [1], [3]]
    assert list(Layout(pp=2).chunk_layers(GQA, 1)) == [2, 3]
    assert "model.embed_tokens.weight" in canonical_names(GQA, layout, 0, 0)
    assert "lm_head.weight" in canonical_names(GQA, layout, 1, 1)
    assert "lm_head.weight" not in canonical_names(GQA, layout, 1, 0)


def test_fused_qkv_is_grouped_per_query_group():
    d, h = GQA.head_dim, GQA.hidden_size
    q = np.arange(GQA.num_attention_heads * d * h, dtype=np.float32).reshape(-1, h)
    k = -np.arange(GQA.num_key_value_heads * d * h, dtype=np.float32).reshape(-1, h) - 1
    v = k - 1000
    qkv = fuse_qkv(q, k, v, GQA)
    block = (2 + 2) * d  # per group: 2 query heads, then k, then v
    for g in range(GQA.num_key_value_heads):
        rows = qkv[g * block : (g + 1) * block]
        assert np.array_equal(rows[: 2 * d], q[2 * g * d : (2 * g + 2) * d])  # query heads 2g, 2g+1 use kv head g
        assert np.array_equal(rows[2 * d : 3 * d], k[g * d : (g + 1) * d])
        assert np.array_equal(rows[3 * d :], v[g * d : (g + 1) * d])
    assert all(np.array_equal(a, b) for a, b in zip(split_qkv(qkv, GQA), (q, k, v), strict=True))


def test_tensor_rank_shards():
    layout = Layout(tp=2)
    w = canonical_weights(GQA, 7)
    r1 = to_megatron(w, GQA, layout, 0, 0, rank=1)
    inter, vocab = GQA.intermediate_size // 2, GQA.vocab_size // 2
    # fc1 = [gate rows of this rank; up rows of this rank] (the GLU forward chunks each rank's output)
    fc1 = r1["decoder.layers.0.mlp.linear_fc1.weight"]
    assert np.array_equal(fc1[:inter], w["model.layers.0.mlp.gate_proj.weight"][inter:])
    assert np.array_equal(fc1[inter:], w["model.layers.0.mlp.up_proj.weight"][inter:])
    assert np.array_equal(
        r1["decoder.layers.0.mlp.linear_fc2.weight"], w["model.layers.0.mlp.down_proj.weight"][:, inter:]
    )
    assert np.array_equal(
        r1["decoder.layers.0.self_attention.linear_proj.weight"], w["model.layers.0.self_attn.o_proj.weight"][:, 16:]
    )
    assert np.array_equal(r1["embedding.word_embeddings.weight"], w["model.embed_tokens.weight"][vocab:])
    assert np.array_equal(r1["output_layer.weight"], w["lm_head.weight"][vocab:])
    # rank 1 holds query groups 2 and 3 with their key/value heads: the second half of the fused rows
    c = "model.layers.0.self_attn."
    full = fuse_qkv(w[c + "q_proj.weight"], w[c + "k_proj.weight"], w[c + "v_proj.weight"], GQA)
    assert np.array_equal(r1["decoder.layers.0.self_attention.linear_qkv.weight"], full[full.shape[0] // 2 :])


def test_layouts_that_cannot_shard_are_refused():
    with pytest.raises(ValueError, match="layers"):
        shard_all(canonical_weights(MHA, 1), MHA, Layout(pp=3))
    with pytest.raises(ValueError, match="heads"):
        shard_all(canonical_weights(MHA, 1), MHA, Layout(tp=3))
