import numpy as np
import torch

from parabench.model import build_llama, canonical_weight, canonical_weights, weights_checksum
from parabench.spec import ModelSpec

TINY = ModelSpec(
    name="tiny",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
)


def test_parameter_names_are_hugging_face_names_and_count_matches():
    model = build_llama(TINY)
    names = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert names == TINY.parameter_shapes()
    assert sum(p.numel() for p in model.parameters()) == TINY.num_params()
    assert "model.layers.1.self_attn.k_proj.weight" in names and names["model.layers.1.self_attn.k_proj.weight"] == (
        16,
        32,
    )


def test_llama_preset_is_about_20m_parameters():
    from parabench.hydraconfig import compose, to_plain
    from parabench.spec import build

    spec = build(ModelSpec, to_plain(compose(["+model=llama"]))["model"], "model")
    assert 18e6 < spec.num_params() < 22e6
    assert spec.num_key_value_heads < spec.num_attention_heads  # GQA exercised


def test_each_weight_is_a_function_of_seed_and_name_only():
    a = canonical_weight(TINY, 7, "model.layers.0.mlp.up_proj.weight", (64, 32))
    b = canonical_weights(TINY, 7, ["model.layers.0.mlp.up_proj.weight"])["model.layers.0.mlp.up_proj.weight"]
    assert np.array_equal(a, b)
    assert not np.array_equal(a, canonical_weight(TINY, 8, "model.layers.0.mlp.up_proj.weight", (64, 32)))
    assert not np.array_equal(a, canonical_weight(TINY, 7, "model.layers.0.mlp.gate_proj.weight", (64, 32)))
    assert np.all(canonical_weights(TINY, 7)["model.norm.weight"] == 1.0)


def test_scaled_init_of_residual_projections():
    w = canonical_weights(TINY, 0)
    std_q = w["model.layers.0.self_attn.q_proj.weight"].std()
    std_o = w["model.layers.0.self_attn.o_proj.weight"].std()
    assert std_o < std_q / 1.5  # 1/sqrt(2L) = 0.5 for L=2


def test_checksum_is_stable_and_sensitive():
    m1, m2 = build_llama(TINY, seed=3), build_llama(TINY, seed=3)
    s1 = weights_checksum(dict(m1.named_parameters()))
    assert s1 == weights_checksum(dict(m2.named_parameters())) == weights_checksum(canonical_weights(TINY, 3))
    with torch.no_grad():
        next(m2.parameters()).view(-1)[0] += 1e-6
    assert weights_checksum(dict(m2.named_parameters())) != s1


def test_forward_shapes_causality_and_tied_embeddings():
    model = build_llama(TINY, seed=0)
    x = torch.randint(0, 300, (2, 10))
    y = model(x)
    assert y.shape == (2, 10, 300)
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % 300
    assert torch.allclose(model(x2)[:, :-1], y[:, :-1], atol=1e-6)  # the future does not leak
    tied = ModelSpec(**{**TINY.__dict__, "tie_word_embeddings": True})
    assert "lm_head.weight" not in tied.parameter_shapes()
    assert build_llama(tied, seed=0)(x).shape == (2, 10, 300)


def test_activation_checkpointing_changes_nothing_numerically():
    from parabench.model import causal_lm_loss, set_activation_checkpointing

    x = torch.randint(0, 300, (2, 12))
    grads = []
    for ckpt in (False, True):
        model = build_llama(TINY, seed=1)
        set_activation_checkpointing(model, ckpt)
        causal_lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        grads.append(model.model.layers[0].mlp.up_proj.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
