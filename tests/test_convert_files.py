"""bench convert from files to files (issue 30, docs/convert.md#from-files-to-files), without a launch:
DeepSpeed ZeRO-3 files read a parameter at a time, bit for bit and without holding a rank's
partition; Megatron torch_dist files written a layer at a time, read back by torch's own DCP loader
as the global tensors the adapter's mapping gives; which conversions take the path.

The end-to-end comparison with the launched conversion (files, resumed losses) is in
tests/test_convert.py (full tier)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import tracemalloc
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY
from parabench import canonical
from parabench.convert import megatron_files, zero3_files
from parabench.errors import SpecError

MiB = 2**20


def _spec(*extra: str):
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config

    return from_config(to_plain(compose(["+model=llama", *(a for a in TINY if a.startswith("model.")), *extra]))).model


def _state(shapes, seed: int = 0, step: int = 7) -> canonical.CanonicalState:
    rng = np.random.default_rng(seed)

    def make():
        return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}

    return canonical.CanonicalState(make(), {k: make() for k in canonical.MOMENTS}, step)


def _write_zero3(native: Path, state: canonical.CanonicalState, world: int, groups: list[list[str]]) -> None:
    """DeepSpeed ZeRO-3's files as engine.save_checkpoint writes them (what zero3_files reads): per
    rank the flat fp32 partitions of each parameter group and AdamW's moments of them."""
    import torch

    tag = native / "global_step7"
    tag.mkdir(parents=True)
    (native / "latest").write_text("global_step7")

    def flat(values, names, r):
        parts = []
        for n in names:
            v = np.asarray(values[n]).reshape(-1)
            part = -(-v.size // world)
            padded = np.concatenate([v, np.zeros(part * world - v.size, np.float32)])
            parts.append(padded[r * part : (r + 1) * part])
        return torch.from_numpy(np.concatenate(parts))

    shapes = [OrderedDict((n, torch.Size(np.shape(state.weights[n]))) for n in g) for g in groups]
    for r in range(world):
        base = {
            i: {"step": torch.tensor(float(state.step)), **{m: flat(state.moments[m], g, r) for m in canonical.MOMENTS}}
            for i, g in enumerate(groups)
        }
        optim = {
            "optimizer_state_dict": {
                "zero_stage": 3,
                "fp32_flat_groups": [flat(state.weights, g, r) for g in groups],
                "optimizer_state_dict": {"state": base, "param_groups": [{"params": [i]} for i in range(len(groups))]},
            }
        }
        torch.save(optim, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        torch.save(
            {"param_shapes": shapes, "dp_world_size": world}, tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        )


def test_zero3_files_read_bit_for_bit_with_padding(tmp_path):
    """3 ranks: most parameters' sizes are not multiples of 3, so every rank's last piece is padded."""
    spec = _spec()
    shapes = spec.parameter_shapes()
    state = _state(shapes)
    norms = [n for n in shapes if n.endswith("norm.weight")]
    _write_zero3(tmp_path, state, 3, [[n for n in shapes if n not in norms], norms])
    read = zero3_files.read(tmp_path, 3, shapes)
    assert read.step == 7
    for group, values in read.groups():
        expected = state.weights if not group else state.moments[group[:-1]]
        for name in shapes:
            assert np.array_equal(values[name].view(np.int32), expected[name].view(np.int32)), (group, name)
    assert canonical.checksum(read) == canonical.checksum(state)


def test_zero3_files_refuse_shapes_that_are_not_the_models(tmp_path):
    shapes = {"a": (4, 3), "b": (5,)}
    _write_zero3(tmp_path, _state(shapes), 2, [["a", "b"]])
    with pytest.raises(Exception, match="param_shapes"):
        zero3_files.read(tmp_path, 2, {"a": (4, 3), "b": (6,)})


READ_PEAK = textwrap.dedent(
    """
    import hashlib, json, sys
    from pathlib import Path
    from parabench import canonical
    from parabench.convert import zero3_files

    def rss():  # resident now (VmRSS, proc(5))
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    shapes = {n: tuple(s) for n, s in json.loads(sys.argv[2]).items()}
    state = zero3_files.read(Path(sys.argv[1]), 2, shapes)
    next(canonical.stream(state))  # torch and the readers loaded
    before, peak = rss(), 0
    for _, arr in canonical.stream(state):
        hashlib.sha256(arr).digest()
        peak = max(peak, rss())
    print(peak - before)
    """
)


def test_zero3_files_hold_one_parameter_not_a_partition(tmp_path):
    """A 2-rank checkpoint of 192 MiB (two 96 MiB optimizer files): reading it parameter by
    parameter raises the reader's resident memory by a few parameters (1 MiB each), where a
    torch.load of one rank's file (or a memory map of it, read through) holds 96 MiB."""
    import json

    shapes = {f"model.layers.{i}.w": (512, 512) for i in range(64)}
    make = lambda: {n: np.full(s, float(len(n)), dtype=np.float32) for n, s in shapes.items()}  # noqa: E731
    state = canonical.CanonicalState(make(), {k: make() for k in canonical.MOMENTS}, 3)
    _write_zero3(tmp_path, state, 2, [list(shapes)])
    del state
    proc = subprocess.run(
        [sys.executable, "-c", READ_PEAK, str(tmp_path), json.dumps(shapes)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    grown = int(proc.stdout.strip())
    assert grown < 24 * MiB, f"reading 192 MiB of ZeRO-3 files raised the resident memory by {grown / MiB:.0f} MiB"


def _expected_globals(state: canonical.CanonicalState, spec, tp: int) -> dict[str, np.ndarray]:
    """The checkpoint's global tensors put together from each tensor rank's shard as the adapter's
    mapping gives it (megatron_mapping.to_megatron, the local spec's names), layer axis first."""
    from parabench.adapters.megatron_mapping import Layout, to_megatron

    out = {}
    for prefix, values in [("", state.weights)] + [
        (f"optimizer.state.{m}.", state.moments[m]) for m in canonical.MOMENTS
    ]:
        shards = [to_megatron(values, spec, Layout(tp=tp), 0, 0, r) for r in range(tp)]
        for name in shards[0]:
            key = name.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
            key = key.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
            parts = [s[name] for s in shards]
            if "layernorm" in name or "layer_norm" in key:
                whole = parts[0]
            elif "linear_proj" in name or "linear_fc2" in name:
                whole = np.concatenate(parts, axis=1)
            elif "linear_fc1" in name:  # each rank's [gate_r; up_r]: the gates, then the ups
                halves = [np.split(p, 2) for p in parts]
                whole = np.concatenate([h[0] for h in halves] + [h[1] for h in halves])
            else:
                whole = np.concatenate(parts)
            if name.startswith("decoder.layers."):
                i, rest = name.removeprefix("decoder.layers.").split(".", 1)
                key = "decoder.layers." + rest.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
                key = key.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
                stacked = out.setdefault(prefix + key, np.zeros((spec.num_hidden_layers, *whole.shape), np.float32))
                stacked[int(i)] = whole
            else:
                out[prefix + key] = whole
    return out


def _dcp_load(native: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The global tensors as torch.distributed.checkpoint's own loader reads them (no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp

    wanted = {k: torch.zeros(s) for k, s in shapes.items()}
    dcp.load(wanted, checkpoint_id=str(native), no_dist=True)
    return {k: v.numpy() for k, v in wanted.items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_files_load_in_torch_dcp_as_the_mapping_shards(tmp_path, tp):
    """Every global tensor (weights and both moments) read by torch's DCP loader is the one the
    adapter's mapping puts together from its tensor-rank shards; the chunks are the ranks'; the
    files read back (the conversion's after-checksum) to the state they were written from."""
    import pickle

    spec = _spec()
    state = _state(spec.parameter_shapes())
    optim = type("Optim", (), {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})
    digest = megatron_files.write(tmp_path, state, spec, tp, optim)
    assert digest == canonical.checksum(state)
    expected = _expected_globals(state, spec, tp)
    got = _dcp_load(tmp_path, {k: v.shape for k, v in expected.items()})
    for key, value in expected.items():
        assert np.array_equal(got[key].view(np.int32), value.view(np.int32)), key
    with open(tmp_path / ".metadata", "rb") as f:
        meta = pickle.load(f)
    qkv = meta.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"]
    assert len(qkv.chunks) == spec.num_hidden_layers * tp  # one chunk per layer and tensor rank
    fc1 = meta.state_dict_metadata["decoder.layers.mlp.linear_fc1.weight"]
    rows, inter = spec.intermediate_size // tp, spec.intermediate_size  # each rank's gate rows and up rows
    starts = {(h * inter + r * rows) for h in range(2) for r in range(tp)}
    assert {tuple(c.offsets) for c in fc1.chunks} == {(i, s, 0) for i in range(spec.num_hidden_layers) for s in starts}
    assert set(meta.state_dict_metadata) == megatron_files._keys(spec)
    assert canonical.checksum(megatron_files.read_back(tmp_path, spec, 7)) == digest
    assert megatron_files.checked(tmp_path, spec, state, digest) == digest


def test_megatron_files_read_back_sees_a_changed_value(tmp_path):
    """The after-checksum is read from the files: one flipped bit in one chunk changes it (the files'
    own checksum, and the comparison with the source that stands for it)."""
    import io
    import pickle

    import torch

    spec = _spec()
    state = _state(spec.parameter_shapes())
    optim = type("Optim", (), {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})
    digest = megatron_files.write(tmp_path, state, spec, 2, optim)
    with open(tmp_path / ".metadata", "rb") as f:
        meta = pickle.load(f)
    index = next(
        k for k in meta.storage_data if k.fqn == "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc2.weight"
    )
    info = meta.storage_data[index]
    path = tmp_path / info.relative_path
    raw = bytearray(path.read_bytes())
    t = torch.load(io.BytesIO(bytes(raw[info.offset : info.offset + info.length])), weights_only=True)
    t.view(torch.int32)[0, 0, 0] ^= 1
    buf = io.BytesIO()
    torch.save(t, buf)
    assert len(buf.getvalue()) == info.length
    raw[info.offset : info.offset + info.length] = buf.getvalue()
    path.write_bytes(bytes(raw))
    assert canonical.checksum(megatron_files.read_back(tmp_path, spec, 7)) != digest
    assert megatron_files.checked(tmp_path, spec, state, digest) not in (digest, None)


def test_megatron_files_write_holds_one_layer(tmp_path):
    """16 layers of about 2.6 MiB per state (125 MiB in all), generated on access: the write's
    Python-heap peak (NumPy's allocations are traced) stays under a few layers."""
    spec = _spec("model.hidden_size=256", "model.intermediate_size=512", "model.num_hidden_layers=16")
    shapes = spec.parameter_shapes()
    make = lambda n: np.full(shapes[n], float(len(n)), dtype=np.float32)  # noqa: E731
    lazy = lambda: canonical.Lazy(shapes, make)  # noqa: E731
    state = canonical.CanonicalState(lazy(), {k: lazy() for k in canonical.MOMENTS}, 1)
    total = canonical.size(state)[1]
    layer = 4 * sum(math.prod(s) for n, s in shapes.items() if n.startswith("model.layers.0."))
    optim = type("Optim", (), {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1})
    tracemalloc.start()
    megatron_files.write(tmp_path, state, spec, 2, optim)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert total > 100 * MiB
    assert peak < 3 * layer, f"peak {peak / MiB:.1f} MiB writing {total / MiB:.0f} MiB (a layer: {layer / MiB:.1f} MiB)"


def _identity(**options):
    fields = canonical_model_fields(_spec())
    return {"backend": "deepspeed", "precision": "fp32", "model_name": "llama", "model": fields,
            "layout": {"world_size": 2}, "options": {"zero_stage": 3, **options}}  # fmt: skip


def canonical_model_fields(spec):
    from parabench.resilience.checkpoint import MODEL_IGNORED
    from parabench.spec import to_dict

    return {k: v for k, v in to_dict(spec).items() if k not in MODEL_IGNORED}


@pytest.mark.parametrize(
    ("zero_stage", "overrides", "why"),
    [
        (3, ["backend.tp=2"], None),
        (3, [], None),
        (2, ["backend.tp=2"], "ZeRO-3"),
        (3, ["backend.pp=2"], "tp only"),
        (3, ["backend.tp=2", "backend.distributed_optimizer=true"], "tp only"),
        (3, ["backend.tp=2", "run.precision=bf16"], "fp32"),
    ],
)
def test_which_conversions_go_from_files_to_files(zero_stage, overrides, why):
    from parabench.convert import command, files

    identity = _identity(zero_stage=zero_stage)
    tjob = command.target_job("megatron", [*overrides, "launcher.nproc_per_node=2"], identity, 2)
    found = files.refusal("native", identity, tjob)
    assert (found is None) if why is None else (why in found), found
    assert command._via("auto", "native", identity, tjob) == ("files" if why is None else "launch")
    assert command._via("launch", "native", identity, tjob) == "launch"
    if why is not None:
        with pytest.raises(SpecError, match="--via"):
            command._via("files", "native", identity, tjob)
    ddp = command.target_job("ddp", ["launcher.nproc_per_node=2"], identity, 2)
    assert files.refusal("native", _identity(), ddp) == "the target is not megatron"
