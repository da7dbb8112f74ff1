"""Models from where users have them: a local Hugging Face ``config.json`` and its safetensors.

``+model=hf model.path=/path/to/model`` (the directory, or its ``config.json``) is read here once,
when the runner composes the job: the config becomes the fields of a ModelSpec, and the weights
beside it (``model.safetensors``, or the shards listed by ``model.safetensors.index.json``) become
``ModelSpec.weights``. Workers only see the resolved spec. Every tensor name, shape and dtype is
checked against the spec before a process starts (one line, exit 2).

Accepted: the Llama family, Mixtral and Qwen2-MoE (MoE, docs/moe.md), as far as the canonical model (bench/model.py) computes the same
function. Each config field that changes the math is either mapped or refused by name; fields that
do not (token ids, ``torch_dtype``, ``use_cache``, ``pretraining_tp``, which only slices the same
matmuls) are not read. Field names, defaults and the file format: docs/sources.md#hugging-face-checkpoints.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from parabench.errors import SpecError
from parabench.spec import ModelSpec

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
)
# Widened to float32 exactly; anything else (F64, integer or 8-bit formats) is refused.
DTYPES = ("F32", "F16", "BF16")
REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "max_position_embeddings",
)
# transformers' defaults for these three architectures (LlamaConfig, MistralConfig, Qwen2Config agree).
DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "initializer_range": 0.02}
# MixtralConfig's own defaults where they differ (rope_theta 1e6, rms_norm_eps 1e-5), and its MoE fields.
MIXTRAL_DEFAULTS = {**DEFAULTS, "rope_theta": 1e6, "rms_norm_eps": 1e-5}
MIXTRAL_MOE = {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}
# Qwen2MoeConfig's MoE fields and defaults (transformers models/qwen2_moe/configuration_qwen2_moe.py),
# under the canonical names: num_experts is ModelSpec.num_local_experts.
QWEN2_MOE = {
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001,
}
# Qwen2MoeForCausalLM's checkpoint names of a sparse layer's MLP (transformers modeling_qwen2_moe.py:
# Qwen2MoeSparseMoeBlock's gate, experts.E.{gate,up,down}_proj, shared_expert, shared_expert_gate);
# the canonical names are Mixtral's: block_sparse_moe.gate, experts.E.w1 (gate), w3 (up), w2 (down).
QWEN2_MOE_NAME = re.compile(
    r"(?P<layer>model\.layers\.\d+\.)mlp\.(?:(?P<router>gate\.weight)|experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj"
    r"\.weight|(?P<shared>shared_expert\.(?:gate|up|down)_proj\.weight|shared_expert_gate\.weight))"
)
EXPERT_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}
HF_KEYS = ("name", "path", "load_weights")


def _refuse(message: str) -> SpecError:
    return SpecError("model.path", message)


# --------------------------------------------------------------------------------------------
# config.json -> ModelSpec fields
# --------------------------------------------------------------------------------------------
def spec_fields(node: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelSpec fields of a ``+model=hf`` node ({name, path, load_weights})."""
    extra = sorted(set(node) - set(HF_KEYS))
    if extra:
        raise SpecError(
            f"model.{extra[0]}",
            f"not a key of +model=hf (keys: {', '.join(HF_KEYS)}); the model's shape comes from its config.json",
        )
    path = node.get("path")
    if not isinstance(path, str) or not path or path == "???":
        raise _refuse("required: +model=hf model.path=/path/to/model-dir (or its config.json)")
    config_path = config_file(path)
    cfg = _read_json(config_path)
    arch = architecture(cfg, config_path)
    fields: dict[str, Any] = {"name": node.get("name") or config_path.parent.name, "source": str(config_path)}
    fields.update(_shape(cfg, arch, config_path))
    fields.update(_math(cfg, arch, config_path))
    if node.get("load_weights", True) is True:
        fields["weights"] = find_weights(config_path.parent)
    elif node.get("load_weights") is not False:
        raise SpecError("model.load_weights", f"expected true or false, got {node.get('load_weights')!r}")
    return fields


def config_file(path: str) -> Path:
    p = Path(path).expanduser().resolve()
    if p.is_dir():
        p = p / CONFIG
    if not p.is_file():
        raise _refuse(f"no such file: {p}")
    return p


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _refuse(f"{path} is not readable JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _refuse(f"{path} holds no JSON object")
    return doc


def architecture(cfg: Mapping[str, Any], path: Path) -> str:
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1:
        raise _refuse(f"{path}: expected one entry in 'architectures', got {archs!r}")
    if archs[0] not in ARCHITECTURES:
        raise _refuse(
            f"architecture {archs[0]} ({path}) is not supported: parabench trains the Llama family "
            f"({', '.join(ARCHITECTURES)})"
        )
    return archs[0]


def _shape(cfg: Mapping[str, Any], arch: str, path: Path) -> dict[str, Any]:
    missing = [k for k in REQUIRED if k not in cfg]
    if "num_key_value_heads" not in cfg and arch != "LlamaForCausalLM":  # only Llama defaults it to the heads
        missing.append("num_key_value_heads")
    if missing:
        raise _refuse(f"{path} lacks {missing[0]}")
    fields = {k: cfg[k] for k in REQUIRED}
    fields["num_key_value_heads"] = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    for key, default in (MIXTRAL_DEFAULTS if arch == "MixtralForCausalLM" else DEFAULTS).items():
        fields[key] = cfg[key] if cfg.get(key) is not None else default
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim * cfg["num_attention_heads"] != cfg["hidden_size"]:
        raise _refuse(
            f"head_dim={head_dim} ({path}) is not hidden_size / num_attention_heads: the canonical model "
            "derives the head size from them"
        )
    return fields


def _math(cfg: Mapping[str, Any], arch: str, path: Path) -> dict[str, Any]:
    """Fields that change what the network computes: mapped, or refused by name."""
    for key, ok in (
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("mlp_bias", False),
        ("attention_dropout", 0.0),
        ("partial_rotary_factor", 1.0),
    ):
        if cfg.get(key) is not None and cfg[key] != ok:
            raise _refuse(f"{key}={cfg[key]!r} ({path}) is not in the canonical model (it needs {key}={ok!r})")
    if cfg.get("quantization_config") is not None:
        raise _refuse(f"{path} is a quantized checkpoint (quantization_config): not supported")
    fields: dict[str, Any] = {"qkv_bias": arch == "Qwen2ForCausalLM"}  # Qwen2Attention: q/k/v biased, o_proj not
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")  # transformers >= 5 / older name
    if isinstance(rope, Mapping) and rope.get("rope_theta") is not None:
        fields["rope_theta"] = rope["rope_theta"]
    fields["rope_scaling"] = _rope_scaling(rope, path)
    if arch == "MixtralForCausalLM":
        fields.update(_mixtral_moe(cfg, path))
    elif arch == "Qwen2MoeForCausalLM":
        fields["qkv_bias"] = cfg.get("qkv_bias", True)  # Qwen2MoeAttention: biased unless qkv_bias=false
        fields.update(_qwen2_moe(cfg, path))
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        fields["sliding_window"] = cfg.get("sliding_window")
    elif arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") and cfg.get("use_sliding_window"):
        fields["sliding_window"] = cfg.get("sliding_window")
    return fields


def _mixtral_moe(cfg: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """MixtralConfig's MoE fields (its defaults where absent). Its checkpoint names (block_sparse_moe.gate,
    block_sparse_moe.experts.E.w1/w2/w3) are the canonical model's, so the weights load as they are."""
    jitter = cfg.get("router_jitter_noise")
    if jitter:  # multiplicative noise on the router input in training: not in the canonical model
        raise _refuse(f"router_jitter_noise={jitter!r} ({path}) is not in the canonical model (it needs 0)")
    return {key: cfg[key] if cfg.get(key) is not None else default for key, default in MIXTRAL_MOE.items()}


def _qwen2_moe(cfg: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """Qwen2MoeConfig's MoE fields (its defaults where absent) as the canonical ones. Every layer must
    be sparse: Qwen2MoeDecoderLayer puts the dense Qwen2MoeMLP (intermediate_size) on the layers of
    mlp_only_layers and those whose (index + 1) is not a multiple of decoder_sparse_step, and the
    canonical model has one kind of layer. Its checkpoint names are mapped by :func:`canonical_name`."""
    step = cfg.get("decoder_sparse_step")
    if step is not None and step != 1:
        raise _refuse(
            f"decoder_sparse_step={step!r} ({path}) makes some layers dense; the canonical model has a MoE "
            "block in every layer (it needs decoder_sparse_step=1)"
        )
    if cfg.get("mlp_only_layers"):
        raise _refuse(
            f"mlp_only_layers={cfg['mlp_only_layers']!r} ({path}) makes those layers dense; the canonical model "
            "has a MoE block in every layer (it needs mlp_only_layers=[])"
        )
    moe = {key: cfg[key] if cfg.get(key) is not None else default for key, default in QWEN2_MOE.items()}
    if not moe["num_experts"]:  # no experts: every layer is the dense Qwen2MoeMLP, the canonical dense MLP
        return {}
    moe["num_local_experts"] = moe.pop("num_experts")
    return moe


def canonical_name(stored: str) -> str:
    """The canonical name of a checkpoint tensor: a Qwen2-MoE sparse block's names mapped onto the
    canonical (Mixtral) ones, every other name as it is."""
    m = QWEN2_MOE_NAME.fullmatch(stored)
    if m is None:
        return stored
    block = m["layer"] + "block_sparse_moe."
    if m["router"]:
        return block + "gate.weight"
    if m["expert"] is not None:
        return f"{block}experts.{m['expert']}.{EXPERT_PROJ[m['proj']]}.weight"
    return block + m["shared"]


def _rope_scaling(rope: Any, path: Path) -> dict[str, Any] | None:
    if rope is None:
        return None
    if not isinstance(rope, Mapping):
        raise _refuse(f"rope_scaling={rope!r} ({path}) is not an object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise _refuse(f"rope_scaling type {kind!r} ({path}) is not supported (the canonical model implements 'llama3')")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in rope]
    if missing:
        raise _refuse(f"rope_scaling ({path}) lacks {missing[0]}")
    return {"rope_type": "llama3", **{k: rope[k] for k in keys}}


# --------------------------------------------------------------------------------------------
# Weights: where they are, what they hold, reading them
# --------------------------------------------------------------------------------------------
def find_weights(directory: Path) -> str | None:
    """The index of a sharded checkpoint, else the single file, else None (weights generated)."""
    for name in (INDEX, SINGLE):
        if (directory / name).is_file():
            return str(directory / name)
    return None


def weight_files(weights: str) -> dict[str, tuple[Path, str]]:
    """Canonical tensor name (:func:`canonical_name`) -> (the safetensors file that holds it, its name
    there). Two tensors of the files with one canonical name are refused."""
    files: dict[str, tuple[Path, str]] = {}
    for stored, file in _stored_files(weights).items():
        name = canonical_name(stored)
        if name in files:
            raise _refuse(f"{Path(weights).name} holds {name} twice: as {files[name][1]} and as {stored}")
        files[name] = (file, stored)
    return files


def _stored_files(weights: str) -> dict[str, Path]:
    """Tensor name, as stored -> the safetensors file that holds it."""
    path = Path(weights)
    if path.name.endswith(".index.json"):
        weight_map = _read_json(path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise _refuse(f"{path} has no weight_map")
        # Hugging Face writes shard names beside the index; a crafted index naming '../x' or '/x' would
        # have parabench read (and checksum into the run) a file outside the model's directory.
        outside = sorted({f for f in weight_map.values() if not isinstance(f, str) or Path(f).name != f or f == ".."})
        if outside:
            raise _refuse(
                f"{path}: its weight_map names files outside its directory ({outside[0]!r}); shards lie beside the index"
            )
        return {name: path.parent / file for name, file in weight_map.items()}
    return {name: path for name in _header(path)}


def _safe_open(path: Path, framework: str):
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise _refuse(
            f"reading {path.name} needs the safetensors package: pip install 'parabench[hf]' "
            "(or model.load_weights=false to generate the weights)"
        ) from None
    if not path.is_file():
        raise _refuse(f"no such weights file: {path}")
    try:
        return safe_open(str(path), framework=framework)
    except (OSError, SafetensorError) as exc:
        raise _refuse(f"{path} is not a readable safetensors file ({exc})") from None


def _header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape), from the file's header only."""
    with _safe_open(path, "numpy") as f:
        return {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape())) for n in f.keys()}


def ignored(name: str, spec: ModelSpec) -> bool:
    """Tensors a checkpoint may hold that the canonical model derives itself: rotary ``inv_freq``
    buffers (older Llama-2 files) and, with tied embeddings, ``lm_head.weight`` (transformers ties it
    to the input embedding after loading, so the stored copy is never used)."""
    return name.endswith("rotary_emb.inv_freq") or (spec.tie_word_embeddings and name == "lm_head.weight")


def check_weights(spec: ModelSpec) -> None:
    """Every canonical tensor is in the files with its shape and a float dtype; nothing unknown is there."""
    files = weight_files(spec.weights)
    headers: dict[tuple[Path, str], tuple[str, tuple[int, ...]]] = {}
    for path in sorted({file for file, _ in files.values()}):
        headers.update({(path, stored): header for stored, header in _header(path).items()})
    shapes = spec.parameter_shapes()
    where = Path(spec.weights).name
    for name, shape in shapes.items():
        if name not in files or files[name] not in headers:
            raise _refuse(f"{where} lacks {name} (model {spec.name} needs {len(shapes)} tensors)")
        dtype, got = headers[files[name]]
        if got != shape:
            raise _refuse(f"{name} in {where} has shape {list(got)}, but the config gives {list(shape)}")
        if dtype not in DTYPES:
            raise _refuse(f"{name} in {where} is {dtype}; supported: {', '.join(DTYPES)}")
    unexpected = sorted(files[n][1] for n in files if n not in shapes and not ignored(n, spec))
    if unexpected:
        raise _refuse(f"{where} holds {unexpected[0]}, which the canonical model of {spec.name} does not have")


def load_weights(weights: str, names: Iterable[str]) -> dict[str, Any]:
    """The named tensors (canonical names) as float32 NumPy arrays (bf16/fp16 widened exactly), in
    ``names`` order."""
    files = weight_files(weights)
    wanted = list(names)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in wanted:
        by_file[files[name][0]].append(name)
    out = {}
    for path, group in by_file.items():
        with _safe_open(path, "pt") as f:  # NumPy has no bfloat16: read through torch, widen to float32
            for name in group:
                out[name] = f.get_tensor(files[name][1]).float().numpy()
    return {name: out[name] for name in wanted}


# --------------------------------------------------------------------------------------------
# ModelSpec -> config.json (bench convert --to hf): the reverse of spec_fields
# --------------------------------------------------------------------------------------------
def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """A transformers config.json for the canonical model: LlamaForCausalLM, or Qwen2 (q/k/v biases)
    and Mistral (a sliding window), the architectures spec_fields reads back to the same spec."""
    if spec.is_moe:
        return _mixtral_config(spec)
    arch = "Qwen2ForCausalLM" if spec.qkv_bias else "MistralForCausalLM" if spec.sliding_window else "LlamaForCausalLM"
    cfg: dict[str, Any] = {
        "architectures": [arch],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}.get(arch, "qwen2"),
        **{k: getattr(spec, k) for k in REQUIRED},
        "num_key_value_heads": spec.num_key_value_heads,
        **{k: getattr(spec, k) for k in DEFAULTS},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "rope_scaling": dict(vars(spec.rope_scaling)) if spec.rope_scaling else None,
    }
    if spec.sliding_window:
        cfg.update(sliding_window=spec.sliding_window, use_sliding_window=True)
    return cfg


def _mixtral_config(spec: ModelSpec) -> dict[str, Any]:
    """A MixtralForCausalLM config.json for a Mixtral-shaped MoE model (no shared expert, no q/k/v bias,
    the top-k weights renormalised). A Qwen2-MoE-shaped model is refused: its checkpoint would need
    Qwen2-MoE's tensor names, and the export copies the canonical files as they are."""
    if (
        spec.shared_expert_intermediate_size
        or spec.qkv_bias
        or spec.moe_intermediate_size
        or spec.rope_scaling
        or not spec.norm_topk_prob
    ):
        raise SpecError(
            "model.num_local_experts",
            f"model {spec.name} is not Mixtral-shaped (shared expert, q/k/v biases, moe_intermediate_size, "
            "rope_scaling or norm_topk_prob=false): no Hugging Face config is written for it yet (issue #31)",
        )
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **{k: getattr(spec, k) for k in REQUIRED},
        "num_key_value_heads": spec.num_key_value_heads,
        **{k: getattr(spec, k) for k in MIXTRAL_DEFAULTS},
        **{k: getattr(spec, k) for k in MIXTRAL_MOE},
        "hidden_act": "silu",
        "sliding_window": spec.sliding_window,
        "torch_dtype": "float32",
    }
