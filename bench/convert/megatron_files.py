"""parabench's megatron checkpoint (``native/``) written from canonical tensors without Megatron.

What ``Engine.save_checkpoint`` of adapters/megatron.py writes through megatron-core's
``dist_checkpointing.save`` in the ``torch_dist`` format, for a dense model on CPU (megatron-core's
local layer spec), fp32, without the distributed optimizer, pp=1: PyTorch DCP files holding every
tensor under its *global* key with its shape over the whole model - the layers stacked on a leading
axis (``decoder.layers.<name>``, shape ``[L, ...]``, layer i at offset i), column-parallel weights
(embedding, fused QKV, output layer) split over tensor ranks on their rows, row-parallel ones
(``linear_proj``, ``linear_fc2``) on their columns, the SwiGLU ``linear_fc1`` = [gate; up] as two
chunks per rank, the norms whole (under the TE-compatible names ``linear_qkv.layer_norm_weight`` /
``linear_fc1.layer_norm_weight`` megatron-core maps the local spec's to) - and the AdamW moments under
``optimizer.state.exp_avg.<key>`` / ``exp_avg_sq.<key>`` chunked alike; ``common.pt`` holds the
optimizer's param groups and its step; ``metadata.json`` the backend (megatron-core
``dist_checkpointing/serialization.py``, ``strategies/torch.py``, ``optimizer/optimizer.py``
``FP32Optimizer.sharded_state_dict``; docs/sources.md#megatron-dist_checkpointing). Megatron loads
global tensors and reshards them on load, so these files load at any tensor-parallel size.

Each chunk is a ``torch.save`` of its own tensor appended to one ``.distcp`` file per tensor rank,
as torch's ``FileSystemWriter`` writes them (``filesystem._write_item``), and the ``.metadata`` is
DCP's ``Metadata``. Written one layer at a time: the host memory is a layer's tensors.
"""

from __future__ import annotations

import io
import json
import pickle
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parabench import untrusted
from parabench.adapters.megatron_mapping import fuse_qkv, split_qkv
from parabench.canonical import MOMENTS, CanonicalState, Lazy, checksum, stream
from parabench.convert.megatron_checkpoint import megatron_shapes
from parabench.errors import RunFailed
from parabench.spec import ModelSpec

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
METADATA_JSON.update(common_backend="torch", common_backend_version=1)
EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
# megatron-core's param group keys beside torch AdamW's (optimizer/__init__.py, _get_param_groups)
GROUP_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "default_config", "max_lr", "min_lr")


@dataclass(frozen=True)
class Entry:
    """One global tensor of the checkpoint at one layer: its key, global shape, the canonical names it
    is built from, how, and the axis (of the layer's own tensor) split over tensor ranks."""

    key: str
    shape: tuple[int, ...]  # global, the layer axis first for decoder.layers.*
    layer: int | None  # None: not stacked
    sources: tuple[str, ...]
    build: str  # "copy", "qkv", "fc1"
    split: int | None  # None: whole on every rank (written once)


def entries(spec: ModelSpec) -> list[Entry]:
    """Every global tensor of the model part, in the order written (layer by layer); the keys and
    global shapes are those a Megatron checkpoint of ``spec`` holds (``megatron_shapes``, the names of
    the TE-compatible norms megatron-core saves)."""
    g, L = megatron_shapes(spec, te_names=True), spec.num_hidden_layers
    out = [Entry("embedding.word_embeddings.weight", g["embedding.word_embeddings.weight"], None,
                 ("model.embed_tokens.weight",), "copy", 0)]  # fmt: skip
    for i in range(L):
        c, d = f"model.layers.{i}.", "decoder.layers."
        qkv = tuple(c + f"self_attn.{x}_proj.weight" for x in "qkv")
        gate_up = (c + "mlp.gate_proj.weight", c + "mlp.up_proj.weight")
        layer = [  # (key, canonical sources, build, split axis)
            ("self_attention.linear_qkv.layer_norm_weight", (c + "input_layernorm.weight",), "copy", None),
            ("self_attention.linear_qkv.weight", qkv, "qkv", 0),
            ("self_attention.linear_proj.weight", (c + "self_attn.o_proj.weight",), "copy", 1),
            ("mlp.linear_fc1.layer_norm_weight", (c + "post_attention_layernorm.weight",), "copy", None),
            ("mlp.linear_fc1.weight", gate_up, "fc1", 0),
            ("mlp.linear_fc2.weight", (c + "mlp.down_proj.weight",), "copy", 1),
        ]
        out += [Entry(d + key, g[d + key], i, sources, how, split) for key, sources, how, split in layer]
    out.append(
        Entry("decoder.final_layernorm.weight", g["decoder.final_layernorm.weight"], None, ("model.norm.weight",),
              "copy", None)
    )  # fmt: skip
    out.append(Entry("output_layer.weight", g["output_layer.weight"], None, ("lm_head.weight",), "copy", 0))
    return out


def build(entry: Entry, values: Mapping[str, Any], spec: ModelSpec) -> np.ndarray:
    """The entry's tensor for its layer (without the layer axis), from canonical ``values``."""
    parts = [np.asarray(values[n], dtype="<f4") for n in entry.sources]
    if entry.build == "qkv":
        return fuse_qkv(*parts, spec)  # megatron's per-query-group order (megatron_mapping)
    if entry.build == "fc1":
        return np.concatenate(parts)
    return parts[0]


def chunks(entry: Entry, tp: int) -> list[tuple[int, tuple[int, ...], tuple[slice, ...]]]:
    """(tensor rank, global offsets, slices of the layer's tensor) of each chunk the checkpoint holds."""
    local = entry.shape[1:] if entry.layer is not None else entry.shape
    lead = (entry.layer,) if entry.layer is not None else ()
    whole = tuple(slice(0, n) for n in local)
    if entry.split is None:
        return [(0, (*lead, *(0 for _ in local)), whole)]
    out = []
    halves = 2 if entry.build == "fc1" else 1  # SwiGLU: gate rows then up rows, each split over tp
    for h in range(halves):
        span = local[entry.split] // halves
        for r in range(tp):
            n = span // tp
            start = h * span + r * n
            sl = list(whole)
            sl[entry.split] = slice(start, start + n)
            offsets = [0] * len(local)
            offsets[entry.split] = start
            out.append((r, (*lead, *offsets), tuple(sl)))
    return out


class DcpWriter:
    """Appends chunks (``torch.save`` each) to ``__<r>_0.distcp`` files and keeps DCP's metadata."""

    def __init__(self, directory: Path):
        self.directory, self.files = directory, {}
        directory.mkdir(parents=True, exist_ok=True)
        self.tensors: dict[str, Any] = {}
        self.storage: dict[Any, Any] = {}

    def _file(self, rank: int):
        if rank not in self.files:
            self.files[rank] = open(self.directory / f"__{rank}_0.distcp", "wb")
        return self.files[rank]

    def _put(self, fqn: str, rank: int, payload, offsets) -> None:
        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import MetadataIndex

        f = self._file(rank)
        start = f.tell()
        if isinstance(payload, bytes):
            f.write(payload)
        else:
            torch.save(payload, f)
        index = MetadataIndex(fqn, None if offsets is None else torch.Size(offsets))
        self.storage[index] = _StorageInfo(f"__{rank}_0.distcp", start, f.tell() - start)

    def tensor(self, key: str, shape: tuple[int, ...], rank: int, offsets, value: np.ndarray) -> None:
        import torch
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            TensorProperties,
            TensorStorageMetadata,
        )

        # a tensor over exactly the chunk's bytes (a contiguous view is not copied): torch.save writes its storage
        t = torch.from_numpy(np.ascontiguousarray(value, dtype="<f4"))
        meta = self.tensors.setdefault(
            key, TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), [])
        )
        meta.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(t.shape)))
        self._put(key, rank, t, offsets)

    def obj(self, key: str, value: Any) -> None:
        import torch
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        buf = io.BytesIO()
        torch.save(value, buf)
        self.tensors[key] = BytesStorageMetadata()
        self._put(key, 0, buf.getvalue(), None)

    def close(self) -> None:
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        for f in self.files.values():
            f.close()
        meta = Metadata(
            state_dict_metadata=self.tensors,
            planner_data=None,
            storage_data=self.storage,
            storage_meta=StorageMeta(checkpoint_id=str(self.directory), save_id=str(uuid.uuid4()), modules=[]),
        )
        with open(self.directory / ".metadata", "wb") as f:
            pickle.dump(meta, f)


def param_groups(optim: Any) -> list[dict[str, Any]]:
    """The two param groups megatron-core's FP32Optimizer saves (weight decay, none): megatron-core's
    keys (optimizer/__init__.py ``_get_param_groups``), then torch AdamW's defaults in torch's order
    (the group dict megatron hands to AdamW, which fills in the rest); their ``params`` are not saved."""
    import torch

    groups = []
    for wd, mult in ((optim.weight_decay, 1.0), (0.0, 0.0)):
        group = {"is_expert_parallel": False, "default_config": True, "wd_mult": mult, "lr_mult": 1.0}
        group.update(is_decoupled_lr=False, max_lr=optim.lr, min_lr=optim.lr)
        adam = torch.optim.AdamW(
            [torch.zeros(1, requires_grad=True)], lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=wd
        )
        group.update({k: v for k, v in adam.param_groups[0].items() if k != "params"})
        groups.append(group)
    return groups


def write(native: Path, state: CanonicalState, spec: ModelSpec, tp: int, optim: Any) -> str:
    """``native/`` of a megatron (tp=``tp``, pp=1, fp32, no distributed optimizer) checkpoint of
    ``state``, written in the pass that computes its canonical checksum (returned): each tensor is read
    once, in the checksum's name order, and each global tensor written as soon as the canonical
    tensors it is built from have passed (a layer's q/k/v, gate/up): one layer's tensors held."""
    import torch

    if state.moments is None:
        raise RunFailed("the files-to-files path carries the optimizer state: the source has none")
    writer, where = DcpWriter(native), {n: e for e in entries(spec) for n in e.sources}
    pending: dict[tuple[str, str, int | None], dict[str, np.ndarray]] = {}

    def visit(flat: str, arr: np.ndarray) -> None:
        group, _, name = flat.rpartition("/")  # "" for the weights, else the moment
        entry = where[name]
        got = pending.setdefault((group, entry.key, entry.layer), {})
        got[name] = arr
        if len(got) < len(entry.sources):
            return
        del pending[(group, entry.key, entry.layer)]
        layer = build(entry, got, spec)
        prefix = f"optimizer.state.{group}." if group else ""
        for rank, offsets, sl in chunks(entry, tp):
            part = layer[sl]
            writer.tensor(
                prefix + entry.key, entry.shape, rank, offsets, part[None] if entry.layer is not None else part
            )
        if not group:
            _extra_states(writer, entry, spec)

    digest = checksum(state, visit=visit)
    if pending or set(writer.tensors) != _keys(spec):
        left = sorted(pending)[:3] or sorted(_keys(spec) ^ set(writer.tensors))[:3]
        raise RunFailed(f"{native}: the tensors written are not the checkpoint's: {left}")
    writer.close()
    # in the order megatron-core saves them: the state (the step all parameters share), then the groups
    common = {
        "optimizer": {"state": {"common_step": torch.tensor(float(state.step))}, "param_groups": param_groups(optim)}
    }
    torch.save(common, native / "common.pt")
    (native / "metadata.json").write_text(json.dumps(METADATA_JSON))
    return digest


def _keys(spec: ModelSpec) -> set[str]:
    """Every key the checkpoint holds: the model's, each moment's, the layers' extra states."""
    table = entries(spec)
    keys = {prefix + e.key for prefix in ["", *(f"optimizer.state.{m}." for m in MOMENTS)] for e in table}
    L = spec.num_hidden_layers
    return keys | {f"decoder.layers.{n}._extra_state/shard_{i}_{L}" for n in EXTRA_STATE for i in range(L)}


def _extra_states(writer: DcpWriter, entry: Entry, spec: ModelSpec) -> None:
    """The linear layers' ``_extra_state`` (megatron-core's ShardedObject of each layer: ``[None]``
    without FP8), once per layer after its last linear tensor."""
    if entry.key != "decoder.layers.mlp.linear_fc2.weight":
        return
    L = spec.num_hidden_layers
    for name in EXTRA_STATE:
        writer.obj(f"decoder.layers.{name}._extra_state/shard_{entry.layer}_{L}", [None])


class _Reader:
    """The global tensors of a DCP directory written by :class:`DcpWriter` (or Megatron), read back
    chunk by chunk with torch.load (weights only) and put together one layer at a time."""

    def __init__(self, native: Path):
        self.native = native
        self.meta = untrusted.dcp_metadata(native)

    def layer(self, key: str, layer: int | None) -> np.ndarray:
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex

        md = self.meta.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "chunks"):
            raise RunFailed(f"{self.native}: no tensor {key}")
        shape = tuple(md.size)[1:] if layer is not None else tuple(md.size)
        out = np.empty(shape, dtype="<f4")
        for c in md.chunks:
            if layer is not None and c.offsets[0] != layer:
                continue
            info = self.meta.storage_data[MetadataIndex(key, c.offsets)]
            with open(self.native / info.relative_path, "rb") as f:
                f.seek(info.offset)
                t = torch.load(io.BytesIO(f.read(info.length)), weights_only=True).numpy()
            offs, sizes = tuple(c.offsets), tuple(c.sizes)
            if layer is not None:
                offs, sizes, t = offs[1:], sizes[1:], t[0]
            out[tuple(slice(o, o + s) for o, s in zip(offs, sizes))] = t
        return out


def read_back(native: Path, spec: ModelSpec, step: int) -> CanonicalState:
    """The canonical state the files of ``native/`` hold (the checksum after a conversion), one
    layer's tensors held at a time."""
    reader = _Reader(native)
    where = {n: e for e in entries(spec) for n in e.sources}
    shapes = spec.parameter_shapes()

    def values(prefix: str) -> Lazy:
        held: dict[tuple[str, int | None], np.ndarray] = {}

        def fetch(name: str) -> np.ndarray:
            e = where[name]
            if (e.key, e.layer) not in held:
                if any(layer != e.layer for _, layer in held):
                    held.clear()  # name order visits one layer's names together: one layer held
                held[(e.key, e.layer)] = reader.layer(prefix + e.key, e.layer)
            return _unbuild(e, held[(e.key, e.layer)], name, spec)

        return Lazy(shapes, fetch)

    moments = {m: values(f"optimizer.state.{m}.") for m in MOMENTS}
    return CanonicalState(values(""), moments, step)


def _unbuild(entry: Entry, value: np.ndarray, name: str, spec: ModelSpec) -> np.ndarray:
    i = entry.sources.index(name)
    if entry.build == "qkv":
        return split_qkv(value, spec)[i]
    if entry.build == "fc1":
        return np.ascontiguousarray(np.split(value, 2, axis=0)[i])
    return value


def checked(native: Path, spec: ModelSpec, state: CanonicalState, before: str) -> str:
    """The canonical checksum of what the files of ``native/`` hold: each tensor read back (torch.load,
    chunk by chunk, mapped back) and compared bit for bit with the source's, in name order; all equal,
    it is ``before`` (SHA-256 over equal names, shapes, bytes and step), which needs no second hashing
    pass; any difference, the files' own checksum."""
    back = read_back(native, spec, state.step)
    for (name, value), (other, source) in zip(stream(back), stream(state), strict=True):
        if name != other or value.shape != source.shape or not np.array_equal(value.view("<i4"), source.view("<i4")):
            return checksum(read_back(native, spec, state.step))
    return before
