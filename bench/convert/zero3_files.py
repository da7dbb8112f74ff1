"""A ZeRO-3 checkpoint's canonical state read from its files, one parameter at a time, without DeepSpeed.

DeepSpeed's ZeRO-3 ``engine.save_checkpoint`` writes per data-parallel rank r
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: ``optimizer_state_dict.fp32_flat_groups`` (one flat
fp32 tensor per sub-group) and the base AdamW state of each sub-group's flat tensor (``exp_avg``,
``exp_avg_sq``, ``step``); and ``..._model_states.pt``, whose ``param_shapes`` (one ordered dict per
parameter group) name the parameters in the flat order. Each parameter of n values owns
ceil(n / world) values of every rank's flat tensor, consecutively in that order; the full tensor is
the ranks' pieces concatenated, its first n values (DeepSpeed's own ``zero_to_fp32.py``,
``_zero3_merge_trainable_params`` and ``zero3_partitioned_param_info``;
docs/sources.md#deepspeed-own-checkpoints).

A ``torch.save`` file is a zip archive whose storages are stored (uncompressed) entries
``<archive>/data/<key>`` (torch/serialization.py, ``_save``). :func:`tensor_refs` reads only the
archive's ``data.pkl`` - with an unpickler that builds no foreign object: tensors become
:class:`TensorRef` (storage entry, dtype, offset, shape), DeepSpeed's own classes inert stand-ins -
and a parameter's values are read with ``os.pread`` from each rank's file when asked for: the host
memory is one parameter's, not a rank's partition (a ``torch.load`` of one rank's optimizer file
alone holds half of a 2-rank checkpoint's state).
"""

from __future__ import annotations

import collections
import math
import os
import pickle
import struct
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parabench.canonical import MOMENTS, CanonicalState, Lazy
from parabench.errors import RunFailed

LOCAL_HEADER = 30  # a zip local file header's fixed part (PKWARE APPNOTE 4.3.7); name and extra follow
STATES = {"fp32": "fp32_flat_groups", **{m: m for m in MOMENTS}}


@dataclass(frozen=True)
class TensorRef:
    """A contiguous tensor of a ``torch.save`` file: its storage's bytes start at ``start`` in ``path``."""

    path: Path
    start: int  # file offset of the tensor's first value
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def read(self, first: int, count: int, into: np.ndarray | None = None) -> np.ndarray:
        """Values ``first .. first + count`` of the flattened tensor, read from the file (into ``into``,
        an array of ``count`` values of this dtype, where given)."""
        if first < 0 or first + count > self.numel:
            raise RunFailed(f"{self.path}: values {first}..{first + count} of a tensor of {self.numel}")
        out = np.empty(count, dtype=self.dtype) if into is None else into
        view, done, size = memoryview(out).cast("B"), 0, self.dtype.itemsize
        with open(self.path, "rb", buffering=0) as f:
            while done < len(view):  # pread may return less than asked (2 GiB at most on Linux)
                got = os.preadv(f.fileno(), [view[done:]], self.start + first * size + done)
                if got <= 0:
                    raise RunFailed(f"{self.path}: ends inside a tensor")
                done += got
        return out


class _Inert:
    """What a global outside torch's tensor machinery unpickles to: nothing of it runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: Any


class _RefUnpickler(pickle.Unpickler):
    """``data.pkl`` of a torch.save archive with storages as :class:`_Storage` and tensors as
    (storage, offset, size, stride); the storages are not read."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return lambda storage, offset, size, stride, *_rest: (storage, int(offset), tuple(size), tuple(stride))
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":  # a tensor saved with its type
            return lambda func, _type, args, _state: func(*args)
        if module == "torch" and name == "Tensor":
            return torch.Tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, *_rest: data
        if module == "torch" and name.endswith("Storage"):
            return getattr(torch, name)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name == "Size":
            return tuple
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        import torch

        _, storage_type, key, _location, _numel = pid
        with warnings.catch_warnings():  # TypedStorage's dtype warns that TypedStorage is deprecated
            warnings.simplefilter("ignore")
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        return _Storage(str(key), dtype)


def tensor_refs(path: Path) -> Any:
    """The object a ``torch.save`` file holds, each tensor a :class:`TensorRef`, no storage read."""
    import torch

    with zipfile.ZipFile(path) as archive:
        names = {i.filename: i for i in archive.infolist()}
        pkl = next((n for n in names if n.endswith("/data.pkl")), None)
        if pkl is None:
            raise RunFailed(f"{path}: not a torch.save archive (no data.pkl)")
        prefix = pkl[: -len("data.pkl")]
        loaded = _RefUnpickler(archive.open(pkl)).load()
    with open(path, "rb") as f:

        def ref(raw: tuple) -> TensorRef:
            storage, offset, size, stride = raw
            info = names[f"{prefix}data/{storage.key}"]
            if info.compress_type != zipfile.ZIP_STORED:
                raise RunFailed(f"{path}: storage {storage.key} is compressed")
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            dtype = np.dtype(str(torch.empty(0, dtype=storage.dtype).numpy().dtype)).newbyteorder("<")
            contiguous = tuple(int(math.prod(size[i + 1 :])) for i in range(len(size)))
            if size and stride != contiguous:
                raise RunFailed(f"{path}: a tensor of storage {storage.key} is not contiguous")
            start = info.header_offset + LOCAL_HEADER + name_len + extra_len + offset * dtype.itemsize
            return TensorRef(path, start, dtype, size)

        return _walk(loaded, ref)


def _walk(obj: Any, ref) -> Any:
    if isinstance(obj, tuple) and len(obj) == 4 and isinstance(obj[0], _Storage):
        return ref(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, ref) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_walk(v, ref) for v in obj)
    return obj


@dataclass(frozen=True)
class _Piece:
    """Where one parameter sits in each rank's (virtually concatenated) flat groups."""

    offset: int  # in the concatenation of the rank's sub-groups
    partitioned: int  # ceil(numel / world)


def _flat(groups: list[TensorRef], first: int, into: np.ndarray) -> None:
    """Values ``first ..`` of the concatenation of ``groups`` read into ``into`` (all of it)."""
    at, done = 0, 0
    for g in groups:
        lo, hi = max(first + done, at), min(first + into.size, at + g.numel)
        if lo < hi:
            g.read(lo - at, hi - lo, into[done : done + hi - lo])
            done += hi - lo
        at += g.numel


def _rank_groups(path: Path) -> tuple[dict[str, list[TensorRef]], set[int]]:
    """One rank's flat groups per state (fp32, exp_avg, exp_avg_sq) and its AdamW step counts."""
    outer = tensor_refs(path).get("optimizer_state_dict")
    if not isinstance(outer, dict) or "fp32_flat_groups" not in outer or "optimizer_state_dict" not in outer:
        raise RunFailed(f"{path}: not a ZeRO-3 optimizer file (no fp32_flat_groups)")
    base = outer["optimizer_state_dict"]["state"]
    order = sorted(base)
    groups = {"fp32": list(outer["fp32_flat_groups"])}
    groups.update({m: [base[i][m] for i in order] for m in MOMENTS})
    steps = set()
    for i in order:
        step = base[i]["step"]
        steps.add(int(float(step.read(0, 1)[0])) if isinstance(step, TensorRef) else int(float(step)))
    if len(groups["fp32"]) != len(order):
        raise RunFailed(f"{path}: {len(groups['fp32'])} flat groups, {len(order)} optimizer states")
    return groups, steps


def read(native: Path, world: int, shapes: dict[str, tuple[int, ...]]) -> CanonicalState:
    """The canonical state of a parabench ZeRO-3 checkpoint's ``native/`` (DeepSpeed's files), each
    tensor read from the ranks' files when asked for (canonical.Lazy)."""
    tag = native / (native / "latest").read_text().strip()
    model = tensor_refs(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    order = [(n, tuple(s)) for group in model["param_shapes"] for n, s in group.items()]
    if dict(order) != {n: tuple(s) for n, s in shapes.items()}:
        raise RunFailed(f"{tag}: its param_shapes are not the model's parameters and shapes")
    ranks = [_rank_groups(tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in range(world)]
    steps = set().union(*(s for _, s in ranks))
    if len(steps) != 1:
        raise RunFailed(f"{tag}: AdamW step counts differ between groups or ranks: {sorted(steps)}")
    pieces, offset = {}, 0
    for name, shape in order:
        part = -(-math.prod(shape) // world)  # zero3_partitioned_param_info: ceil(numel / world)
        pieces[name], offset = _Piece(offset, part), offset + part
    held = {sum(g.numel for g in groups["fp32"]) for groups, _ in ranks}
    if held != {offset}:
        raise RunFailed(f"{tag}: flat groups of {sorted(held)} values; the parameters need {offset} per rank")

    def value(name: str, state: str) -> np.ndarray:
        p, shape = pieces[name], shapes[name]
        full = np.empty(p.partitioned * world, dtype="<f4")  # each rank's piece read into its place
        for r, (groups, _) in enumerate(ranks):
            if groups[state][0].dtype != full.dtype:
                raise RunFailed(f"{tag}: rank {r}'s {state} is {groups[state][0].dtype}, not fp32")
            _flat(groups[state], p.offset, full[r * p.partitioned : (r + 1) * p.partitioned])
        return full[: math.prod(shape)].reshape(shape)

    weights = Lazy(shapes, lambda n: value(n, "fp32"))
    moments = {m: Lazy(shapes, lambda n, m=m: value(n, m)) for m in MOMENTS}
    return CanonicalState(weights, moments, steps.pop())
