"""A local Hugging Face model as the benchmark's model: config.json -> ModelSpec, safetensors -> the
initial weights of every backend; what the canonical model cannot compute is refused before launch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_refused_before_launch, bench, mlflow_runs, summaries
from parabench import hydraconfig
from parabench.errors import SpecError
from parabench.hf import load_weights
from parabench.jobs import from_config
from parabench.model import build_llama, canonical_weights, initial_weights, rope_tables, weights_checksum
from parabench.spec import ModelSpec, RopeScaling

safetensors_torch = pytest.importorskip("safetensors.torch")

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}
QWEN2 = {
    **LLAMA,
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "sliding_window": 32,
}
FAST = ["data.seq_len=32", "run.warmup_steps=0", "run.steps=2"]


def write_model(
    directory: Path, config: dict, dtype=torch.bfloat16, seed: int = 5, shards: int = 0, edit=None
) -> dict[str, torch.Tensor]:
    """config.json plus weights (random, not parabench's own init) as safetensors: one file, or
    ``shards`` files with an index. ``edit(tensors)`` alters them before writing."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    spec = from_config(_plain(directory, load_weights=False)).model
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: (torch.randn(s, generator=gen) * 0.05).to(dtype) for n, s in spec.parameter_shapes().items()}
    if edit:
        edit(tensors)
    if not shards:
        safetensors_torch.save_file(tensors, str(directory / "model.safetensors"))
        return tensors
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        group = names[i::shards]
        safetensors_torch.save_file({n: tensors[n] for n in group}, str(directory / part))
        weight_map.update({n: part for n in group})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def _plain(directory: Path, load_weights: bool = True, extra: tuple[str, ...] = ()) -> dict:
    overrides = ["+model=hf", f"model.path={directory}", f"model.load_weights={str(load_weights).lower()}", *extra]
    return hydraconfig.to_plain(hydraconfig.compose(overrides))


def test_config_json_becomes_the_model(tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(LLAMA))
    for path in (tmp_path / "tiny", tmp_path / "tiny" / "config.json"):  # the directory or the file
        model = from_config(hydraconfig.to_plain(hydraconfig.compose(["+model=hf", f"model.path={path}"]))).model
        assert model == ModelSpec(
            name="tiny",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=320,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=512,
            source=str(tmp_path / "tiny" / "config.json"),
            weights=None,
        )


def test_qwen2_llama3_and_mistral_fields_are_mapped(tmp_path):
    write_model(tmp_path / "q", QWEN2)
    qwen = from_config(_plain(tmp_path / "q")).model
    assert qwen.qkv_bias and qwen.tie_word_embeddings and qwen.sliding_window is None
    assert qwen.weights == str(tmp_path / "q" / "model.safetensors")
    assert (
        "model.layers.1.self_attn.k_proj.bias" in qwen.parameter_shapes()
        and "lm_head.weight" not in qwen.parameter_shapes()
    )

    rope = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    (tmp_path / "l3").mkdir()
    (tmp_path / "l3" / "config.json").write_text(json.dumps({**LLAMA, "rope_scaling": rope, "head_dim": 8}))
    assert from_config(_plain(tmp_path / "l3")).model.rope_scaling == RopeScaling(**rope)

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        json.dumps({**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 16})
    )
    assert from_config(_plain(tmp_path / "m", extra=("data.seq_len=16",))).model.sliding_window == 16
    with pytest.raises(SpecError, match="model.sliding_window=16"):
        from_config(_plain(tmp_path / "m", extra=("data.seq_len=32",)))


def test_llama3_rope_scaling_follows_the_reference_formula():
    rs = RopeScaling(
        "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    spec = ModelSpec(
        name="t",
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=300,
        rope_scaling=rs,
    )
    cos, sin = rope_tables(spec, 2, "cpu")
    freqs = torch.atan2(sin[1, :16].double(), cos[1, :16].double())  # position 1: angle = inv_freq (all < pi)
    base = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    wavelen = 2 * torch.pi / base
    for f, b, w in zip(freqs.tolist(), base.tolist(), wavelen.tolist(), strict=True):
        if w < 64 / 4:  # short wavelengths kept
            assert f == pytest.approx(b, rel=1e-5)
        elif w > 64 / 1:  # long wavelengths divided by the factor
            assert f == pytest.approx(b / 8, rel=1e-5)
        else:  # in between: interpolated
            assert b / 8 < f < b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_initial_weights_are_the_files_tensors_widened_exactly(tmp_path, dtype):
    tensors = write_model(tmp_path / "m", LLAMA, dtype=dtype)
    spec = from_config(_plain(tmp_path / "m")).model
    weights = initial_weights(spec, seed=1234)
    assert list(weights) == list(spec.parameter_shapes())
    for name, value in weights.items():
        assert value.dtype == np.float32 and np.array_equal(value, tensors[name].float().numpy()), name
    # the seed no longer matters; a pipeline stage's subset comes in the order asked for
    assert weights_checksum(initial_weights(spec, seed=1)) == weights_checksum(weights)
    subset = ["model.norm.weight", "model.layers.1.mlp.up_proj.weight"]
    assert list(initial_weights(spec, 0, subset)) == subset
    # the torch model (ddp, fsdp, deepspeed) holds exactly these values
    model = build_llama(spec, seed=0)
    assert weights_checksum(dict(model.named_parameters())) == weights_checksum(weights)
    assert weights_checksum(weights) != weights_checksum(canonical_weights(spec, 1234))


def test_sharded_checkpoint_equals_the_single_file(tmp_path):
    one = write_model(tmp_path / "one", QWEN2)
    write_model(tmp_path / "three", QWEN2, shards=3)
    a = initial_weights(from_config(_plain(tmp_path / "one")).model, 0)
    spec = from_config(_plain(tmp_path / "three")).model
    assert spec.weights.endswith("model.safetensors.index.json")
    assert weights_checksum(initial_weights(spec, 0)) == weights_checksum(a) == weights_checksum(one)


def test_qkv_bias_model_runs_forward_and_backward(tmp_path):
    write_model(tmp_path / "q", QWEN2)
    spec = from_config(_plain(tmp_path / "q")).model
    model = build_llama(spec, seed=0)
    assert (
        model.model.layers[0].self_attn.q_proj.bias is not None and model.model.layers[0].self_attn.o_proj.bias is None
    )
    logits = model(torch.randint(0, 320, (2, 16)))
    logits.float().mean().backward()
    assert logits.shape == (2, 16, 320) and model.model.layers[0].self_attn.v_proj.bias.grad is not None


REFUSED_CONFIGS = {
    "unsupported architecture": ({**LLAMA, "architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    "attention_bias on o_proj too": ({**LLAMA, "attention_bias": True}, "attention_bias"),
    "mlp_bias": ({**LLAMA, "mlp_bias": True}, "mlp_bias"),
    "activation": ({**LLAMA, "hidden_act": "gelu"}, "hidden_act"),
    "other rope scaling": ({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    "head_dim not hidden/heads": ({**LLAMA, "head_dim": 16}, "head_dim"),
    "missing shape": ({k: v for k, v in LLAMA.items() if k != "intermediate_size"}, "intermediate_size"),
}


@pytest.mark.parametrize("case", REFUSED_CONFIGS)
def test_what_the_canonical_model_cannot_compute_is_refused(tmp_path, capsys, case):
    config, must_name = REFUSED_CONFIGS[case]
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    assert_refused_before_launch(["+model=hf", f"model.path={tmp_path / 'm'}"], must_name, tmp_path, capsys)


def _drop(name):
    return lambda t: t.pop(name)


REFUSED_WEIGHTS = {
    "shape mismatch": (
        lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(65, 32)}),
        "model.layers.0.mlp.up_proj.weight in model.safetensors has shape [65, 32]",
    ),
    "missing tensor": (_drop("model.layers.1.self_attn.k_proj.weight"), "lacks model.layers.1.self_attn.k_proj.weight"),
    "unexpected tensor": (
        lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(32)}),
        "model.layers.0.self_attn.o_proj.bias",
    ),
    "integer dtype": (lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int8)}), "I8"),
}


@pytest.mark.parametrize("where", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors"])
def test_an_index_naming_a_file_outside_its_directory_is_refused(tmp_path, capsys, where):
    """A crafted model.safetensors.index.json must not make parabench read (and checksum into the run) a
    file outside the model's directory: the shard it names is really there, valid, and still refused."""
    write_model(tmp_path / "m", QWEN2, shards=2)
    index = tmp_path / "m" / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = sorted(set(data["weight_map"].values()))[0]
    (tmp_path / "outside.safetensors").write_bytes((tmp_path / "m" / first).read_bytes())
    where = str(tmp_path / "outside.safetensors") if where == "ABSOLUTE" else where
    data["weight_map"] = {n: (where if f == first else f) for n, f in data["weight_map"].items()}
    index.write_text(json.dumps(data))
    assert_refused_before_launch(
        ["+model=hf", f"model.path={tmp_path / 'm'}"], "outside its directory", tmp_path, capsys
    )


@pytest.mark.parametrize("case", REFUSED_WEIGHTS)
def test_weights_that_do_not_fit_the_config_are_refused(tmp_path, capsys, case):
    edit, must_name = REFUSED_WEIGHTS[case]
    write_model(tmp_path / "m", LLAMA, edit=edit)
    assert_refused_before_launch(["+model=hf", f"model.path={tmp_path / 'm'}"], must_name, tmp_path, capsys)


def test_backends_without_a_model_feature_refuse_it(tmp_path, capsys):
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text(json.dumps(QWEN2))
    for backend in ("mindspore",):  # megatron maps the q/k/v biases (add_qkv_bias)
        assert_refused_before_launch(
            ["+model=hf", f"model.path={tmp_path / 'q'}", f"backend={backend}"], "model.qkv_bias", tmp_path, capsys
        )
    assert_refused_before_launch(["+model=llama3.2-1b", "backend=megatron"], "model.rope_scaling", tmp_path, capsys)


def test_tied_checkpoint_may_store_lm_head_and_inv_freq(tmp_path):
    def add(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)

    write_model(tmp_path / "q", QWEN2, edit=add)
    spec = from_config(_plain(tmp_path / "q")).model
    assert "lm_head.weight" not in initial_weights(spec, 0)


@pytest.mark.e2e
def test_run_starts_from_the_checkpoint(tmp_path, results):
    """The acceptance test: a Llama config.json + bf16 safetensors written here run as the model, and
    the run's init_checksum is the checksum of the file's tensors."""
    write_model(tmp_path / "tiny-llama", LLAMA)
    proc = bench(["run", "+model=hf", f"model.path={tmp_path / 'tiny-llama'}", *FAST], results)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = from_config(_plain(tmp_path / "tiny-llama")).model
    file_checksum = weights_checksum(load_weights(spec.weights, spec.parameter_shapes()))
    run = mlflow_runs(results).iloc[0]
    assert run["status"] == "FINISHED" and run["tags.model"] == "tiny-llama"
    assert run["tags.initial_checksum"] == file_checksum
    assert run["params.model.hidden_size"] == "32" and run["params.model.weights"] == spec.weights


BACKENDS_FROM_FILE = {
    "fsdp x2": (None, ["backend=fsdp", "launcher.nproc_per_node=2"]),
    "megatron tp2": ("megatron.core", ["backend=megatron", "backend.tp=2", "launcher.nproc_per_node=2"]),
    "mindspore": ("mindspore", ["backend=mindspore", "backend.mode=graph"]),
    # bf16: DeepSpeed derives fp32 masters from its bf16 copies; initial_weights puts the file's back
    "deepspeed zero3 bf16": ("deepspeed", ["backend=deepspeed/zero3", "run.precision=bf16"]),
}


@pytest.mark.full
@pytest.mark.parametrize("case", BACKENDS_FROM_FILE)
def test_sharded_and_other_framework_backends_start_from_the_checkpoint(tmp_path, results, case):
    """initial_weights feeds FSDP's shards, Megatron's tensor-parallel shards, MindSpore's cells and
    DeepSpeed's fp32 masters: the gathered initial weights are the file's tensors on each."""
    module, overrides = BACKENDS_FROM_FILE[case]
    if module:
        pytest.importorskip(module)
    write_model(tmp_path / "tiny-llama", LLAMA)
    proc = bench(
        ["run", "+model=hf", f"model.path={tmp_path / 'tiny-llama'}", *FAST, *overrides, "tracking.enabled=false"],
        results,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = from_config(_plain(tmp_path / "tiny-llama")).model
    (summary,) = summaries(results).values()
    assert summary["initial_checksum"] == weights_checksum(load_weights(spec.weights, spec.parameter_shapes()))
