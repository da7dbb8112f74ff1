"""The canonical training state every backend converts to and from (``bench convert``, docs/convert.md).

One directory, format ``parabench-canonical`` version 1::

    manifest.json          format, version, step, the source's job identity, checksums, sizes, files
    model.safetensors      full fp32 weights under the canonical (Hugging Face) names; past
                           SHARD_BYTES: model-0000K-of-0000N.safetensors + model.safetensors.index.json
    optimizer.safetensors  AdamW moments, ``exp_avg/<name>`` and ``exp_avg_sq/<name>`` (full, fp32);
                           sharded the same way (optimizer.safetensors.index.json)
    harness.pt             the source ranks' harness states (step, RNG streams, data ledger, losses)

The shards and index follow Hugging Face's layout (``weight_map``: tensor name -> file; ``metadata``
with ``total_size``; docs/sources.md#hugging-face-checkpoints), so ``model.weights`` and transformers read them.

Streaming: the state's tensors may be :class:`Lazy` (fetched one at a time, or one group at a time,
on access), and :func:`write` and :func:`checksum` visit them one at a time in name order, writing
each into its place in a pre-sized safetensors file: the memory a conversion adds is one tensor
(or one lazily gathered group), not the model. :func:`load` returns :class:`Lazy` readers.

The canonical checksum is SHA-256 over every tensor (name, shape, float32 little-endian bytes, in
name order) and the optimizer step: the same number before and after a conversion means the target
holds exactly the source's weights, moments and step.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "parabench-canonical"
VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
INDEX = ".index.json"  # <file>.index.json: Hugging Face's sharded layout
HARNESS = "harness.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")  # torch.optim.AdamW's state keys (docs/sources.md#canonical-conversion)
SHARD_BYTES = 2 * 2**30  # one safetensors file holds at most this many tensor bytes (a single larger tensor alone)


class Lazy(Mapping):
    """Tensors under names with known shapes, fetched on access: ``fetch(name)`` one at a time (it
    may be a collective: every rank then reads the names in the same order), or with ``whole`` one
    group gathered at the first access and kept until :meth:`release`; with ``complete=False`` the
    group may hold none of the names on this rank (a rank that only takes part in the gather: its
    tensors read as None)."""

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        fetch: Callable[[str], Any] | None = None,
        whole: Callable[[], Mapping[str, Any]] | None = None,
        complete: bool = True,
    ):
        if (fetch is None) == (whole is None):
            raise ValueError("Lazy needs fetch or whole")
        self.shapes = {n: tuple(int(d) for d in s) for n, s in shapes.items()}
        self._fetch, self._whole, self._held, self._complete = fetch, whole, None, complete

    def __getitem__(self, name: str):
        if name not in self.shapes:
            raise KeyError(name)
        if self._fetch is not None:
            return self._fetch(name)
        if self._held is None:
            held = self._whole()
            if self._complete and set(held) != set(self.shapes):
                raise ValueError(
                    f"gathered tensors differ from the names given: {sorted(set(held) ^ set(self.shapes))[:3]}"
                )
            self._held = held
        return self._held[name] if self._complete else self._held.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def release(self) -> None:
        self._held = None


@dataclass
class CanonicalState:
    """Full, unsharded training state under canonical names (fp32 CPU tensors, NumPy arrays, or
    :class:`Lazy` mappings of them). ``moments`` is None where the optimizer state is not carried
    (say why in ``no_optimizer``)."""

    weights: Mapping[str, Any]
    moments: Mapping[str, Mapping[str, Any]] | None  # "exp_avg"/"exp_avg_sq" -> name -> tensor
    step: int  # optimizer steps taken (AdamW's bias-correction counter)
    no_optimizer: str | None = None

    def groups(self) -> list[tuple[str, Mapping[str, Any]]]:
        """(flat-name prefix, tensors): the weights, then each moment under ``<key>/``."""
        return [("", self.weights)] + [(f"{k}/", v) for k, v in (self.moments or {}).items()]

    def tensors(self) -> dict[str, Any]:
        """Every tensor under its flat name, materialised: small states and tests only."""
        return {prefix + n: values[n] for prefix, values in self.groups() for n in values}


def view(values: Mapping[str, Any], names: list[str], convert: Callable[[Any], Any]) -> Lazy:
    """``names`` of ``values``, each read (and ``convert``-ed) only when it is accessed."""
    return Lazy({n: _shape(values, n) for n in names}, lambda n: convert(values[n]))


def _array(value):
    import numpy as np

    if hasattr(value, "detach"):
        value = value.detach().to("cpu").float().contiguous().numpy()
    return np.ascontiguousarray(value, dtype="<f4")


def _shape(values: Mapping[str, Any], name: str) -> tuple[int, ...]:
    if isinstance(values, Lazy):
        return values.shapes[name]
    return tuple(int(d) for d in values[name].shape)


def entries(state: CanonicalState) -> list[tuple[str, tuple[int, ...]]]:
    """(flat name, shape) of every tensor, in the checksum's (name) order, without fetching any."""
    return sorted((prefix + n, _shape(values, n)) for prefix, values in state.groups() for n in values)


def stream(state: CanonicalState, fetch_plain: bool = True) -> Iterator[tuple[str, Any]]:
    """(flat name, float32 array) of every tensor in name order, one at a time; a :class:`Lazy`
    group is released once its last name is passed. ``fetch_plain=False`` (a rank that writes
    nothing) fetches only the Lazy tensors, whose fetch may be a collective, and yields those."""
    groups = state.groups()
    where = {prefix + n: (values, n) for prefix, values in groups for n in values}
    order = sorted(where)
    last = {id(values): max((prefix + n for n in values), default="") for prefix, values in groups}
    for flat in order:
        values, name = where[flat]
        if fetch_plain:
            yield flat, _array(values[name])
        elif isinstance(values, Lazy):
            yield flat, values[name]  # as fetched (None on a rank that holds none of the group)
        if isinstance(values, Lazy) and last[id(values)] == flat:
            values.release()


def _hash(h, name: str, arr) -> None:
    h.update(name.encode())
    h.update(repr(tuple(arr.shape)).encode())
    h.update(arr.tobytes())


def _hash_beside(h, state: CanonicalState, visit: Callable[[str, Any], None]) -> None:
    """Each tensor hashed in a thread (hashlib releases the GIL for large buffers) while ``visit``
    takes it in this one: in name order, at most two tensors held."""
    with ThreadPoolExecutor(1) as pool:
        hashed = None
        for name, arr in stream(state):
            if hashed is not None:
                hashed.result()
            hashed = pool.submit(_hash, h, name, arr)
            visit(name, arr)
        if hashed is not None:
            hashed.result()


def checksum(state: CanonicalState, hashing: bool = True, visit: Callable[[str, Any], None] | None = None) -> str:
    """SHA-256 over (name, shape, float32 bytes) of every tensor in name order, then the step.
    Collective where the state's tensors are (every rank calls it; ``hashing=False``: fetch only).
    ``visit(flat name, array)`` sees each tensor as it is hashed (a writer in the same pass)."""
    h = hashlib.sha256()
    if visit is not None and hashing:
        _hash_beside(h, state, visit)
    else:
        for name, arr in stream(state, fetch_plain=hashing):
            if hashing:
                _hash(h, name, arr)
            if visit is not None:
                visit(name, arr)
    h.update(f"step={state.step}".encode())
    return h.hexdigest()[:16]


def size(state: CanonicalState) -> tuple[int, int]:
    """(tensors, bytes as fp32), from the shapes."""
    found = entries(state)
    return len(found), sum(4 * math.prod(shape) for _, shape in found)


class ShardedWriter:
    """Pre-sized safetensors files (float32) for tensors named in advance, filled one tensor at a time
    at its offset: a single file ``single`` up to ``shard_bytes`` of tensor data, else Hugging Face's
    shards ``<stem>-0000K-of-0000N.safetensors`` and ``<single>.index.json``. The file format: an
    8-byte little-endian header length, the JSON header (dtype, shape, data_offsets per tensor), then
    the tensors' bytes (docs/sources.md#hugging-face-checkpoints)."""

    def __init__(self, directory: Path, single: str, order: list[tuple[str, tuple[int, ...]]], shard_bytes: int):
        runs: list[list[tuple[str, tuple[int, ...]]]] = [[]]
        used = 0
        for name, shape in order:
            nbytes = 4 * math.prod(shape)
            if runs[-1] and used + nbytes > shard_bytes:
                runs.append([])
                used = 0
            runs[-1].append((name, shape))
            used += nbytes
        stem = single.removesuffix(".safetensors")
        self.files = (
            [single]
            if len(runs) == 1
            else [f"{stem}-{k:05d}-of-{len(runs):05d}.safetensors" for k in range(1, len(runs) + 1)]
        )
        self._at: dict[str, tuple[int, int, int]] = {}  # name -> (fd, offset in the file, bytes)
        self._fds = [self._create(directory / file, run) for file, run in zip(self.files, runs)]
        if len(runs) > 1:
            weight_map = {name: file for file, run in zip(self.files, runs) for name, _ in run}
            total = sum(4 * math.prod(shape) for _, shape in order)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (directory / (single + INDEX)).write_text(json.dumps(index, indent=1))
            self.files.append(single + INDEX)

    def _create(self, path: Path, run: list[tuple[str, tuple[int, ...]]]) -> int:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in run:
            nbytes = 4 * math.prod(shape)
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors pads it
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, struct.pack("<Q", len(blob)) + blob)
        os.ftruncate(fd, 8 + len(blob) + offset)
        for name, shape in run:
            start = header[name]["data_offsets"][0]
            self._at[name] = (fd, 8 + len(blob) + start, 4 * math.prod(shape))
        return fd

    def put(self, name: str, arr) -> None:
        fd, offset, nbytes = self._at.pop(name)
        view = memoryview(arr).cast("B")
        if len(view) != nbytes:
            raise ValueError(f"{name}: {len(view)} bytes, its header says {nbytes}")
        done = 0
        while done < nbytes:  # pwrite may write less than asked (large tensors)
            done += os.pwrite(fd, view[done:], offset + done)

    def close(self) -> None:
        if self._at:
            raise ValueError(f"tensors never written: {sorted(self._at)[:3]}")
        for fd in self._fds:
            os.close(fd)


def write(
    directory: Path,
    state: CanonicalState,
    harness: list[dict[str, Any]] | None,
    info: dict[str, Any],
    writing: bool = True,
    shard_bytes: int = SHARD_BYTES,
) -> dict | None:
    """Write the canonical directory one tensor at a time; returns its manifest. Collective where the
    state's tensors are: every rank calls it, the one with ``writing`` (rank 0) writes, the others
    only take part in the fetches and get None."""
    import torch

    if not writing:
        checksum(state, hashing=False)
        return None
    directory.mkdir(parents=True, exist_ok=True)
    order = entries(state)
    weights = {n for n in state.weights}
    writers = {True: ShardedWriter(directory, WEIGHTS, [e for e in order if e[0] in weights], shard_bytes)}
    if state.moments is not None:
        writers[False] = ShardedWriter(directory, OPTIMIZER, [e for e in order if e[0] not in weights], shard_bytes)
    h = hashlib.sha256()
    for name, arr in stream(state):
        _hash(h, name, arr)
        writers[name in weights].put(name, arr)
    h.update(f"step={state.step}".encode())
    for writer in writers.values():
        writer.close()
    torch.save(harness or [], directory / HARNESS)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": state.step,
        "checksum": h.hexdigest()[:16],
        "tensors": len(order),
        "bytes": sum(4 * math.prod(shape) for _, shape in order),
        "optimizer": state.moments is not None,
        "no_optimizer": state.no_optimizer,
        "files": {"weights": writers[True].files, "optimizer": writers[False].files if False in writers else []},
        **info,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest, its format and version checked (ValueError with one line otherwise)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{directory / MANIFEST}: unreadable ({exc})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(
            f"{directory / MANIFEST}: format {manifest.get('format')!r} version {manifest.get('version')!r} "
            f"is not one this parabench reads ({FORMAT} version {VERSION})"
        )
    return manifest


def weights_file(directory: Path, single: str = WEIGHTS) -> Path:
    """The index of sharded tensors (``<single>.index.json``), else the single file."""
    index = directory / (single + INDEX)
    return index if index.is_file() else directory / single


def tensor_files(directory: Path, single: str = WEIGHTS) -> dict[str, Path]:
    """Tensor name -> the safetensors file of ``directory`` that holds it (through the index if sharded)."""
    from safetensors import safe_open

    path = weights_file(directory, single)
    if path.name.endswith(INDEX):
        weight_map = json.loads(path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or any(Path(f).name != f for f in weight_map.values()):
            raise ValueError(f"{path}: its weight_map must name files beside it")
        return {name: directory / file for name, file in weight_map.items()}
    with safe_open(str(path), framework="numpy") as f:
        return {name: path for name in f.keys()}


def reader(files: Mapping[str, Path], prefix: str = "") -> Lazy:
    """The tensors of ``files`` whose names start with ``prefix`` (the prefix cut), read one at a time
    (safetensors' ``safe_open``: only that tensor's bytes are read), as torch tensors."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="numpy") as f:
            shapes.update(
                {n[len(prefix) :]: tuple(f.get_slice(n).get_shape()) for n in f.keys() if n.startswith(prefix)}
            )

    def fetch(name: str):
        with safe_open(str(files[prefix + name]), framework="pt") as f:
            return f.get_tensor(prefix + name)

    return Lazy(shapes, fetch)


def load(directory: Path) -> tuple[CanonicalState, list[dict[str, Any]]]:
    """The canonical state (:class:`Lazy` readers of torch tensors) and the source ranks' harness states."""
    import torch

    manifest = read_manifest(directory)
    weights = reader(tensor_files(directory, WEIGHTS))
    moments = None
    if manifest["optimizer"]:
        files = tensor_files(directory, OPTIMIZER)
        moments = {k: reader(files, prefix=k + "/") for k in MOMENTS}
    harness = torch.load(directory / HARNESS, weights_only=True)
    return CanonicalState(weights, moments, int(manifest["step"]), manifest.get("no_optimizer")), harness
