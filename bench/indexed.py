"""Megatron/MindSpeed indexed datasets: the ``.bin``/``.idx`` pair their preprocessing writes.

The layout is megatron-core's (``megatron/core/datasets/indexed_dataset.py``: ``_IndexWriter``,
``_IndexReader``, ``IndexedDatasetBuilder``); MindSpeed-LLM's preprocessing writes the same files.
All integers are little-endian:

* ``.idx``: the 9-byte magic ``MMIDIDX\\x00\\x00``; u64 version (1); u8 dtype code (megatron-core's
  ``DType`` enum); u64 sequence count S; u64 document count D; int32[S] sequence lengths in tokens;
  int64[S] sequence pointers (byte offsets into ``.bin``); int64[D] document indices (the sequence
  index at which each document starts: the first is 0, the last is S); multimodal datasets append
  int8[S] sequence modes.
* ``.bin``: the tokens of every sequence, back to back, in the dtype of the code.

Both readers here expose the same thing, the *token stream*: every sequence concatenated in file
order, addressed by token position. :class:`MegatronIndexed` goes through megatron-core's own
``IndexedDataset`` (used where megatron-core is installed); :class:`NumpyIndexed` is parabench's
NumPy memory-map reader (used otherwise, and always for the pre-launch checks, whose errors name
``data.path``). ``data.path`` is the prefix Megatron's ``--data-path`` takes (``corpus_text_document``);
a path ending in ``.bin`` or ``.idx`` is accepted too.
"""

from __future__ import annotations

import importlib.util
import struct
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np

from parabench.errors import SpecError

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
# megatron-core's DType enum, code -> NumPy dtype. Codes 6 and 7 (float64, float32) hold no token ids.
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
SCAN_CHUNK = 1 << 24  # tokens per chunk when scanning token ids


def prefix_of(path: str) -> str:
    """The dataset prefix: ``path`` without a trailing ``.bin``/``.idx``."""
    return path[:-4] if path.endswith((".bin", ".idx")) else path


def megatron_available() -> bool:
    """megatron-core is importable (checked without importing it: the import takes seconds)."""
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


@dataclass(frozen=True)
class IndexLayout:
    """The validated contents of an ``.idx`` file."""

    dtype: type
    lengths: np.ndarray  # int32[S], tokens per sequence
    pointers: np.ndarray  # int64[S], byte offset of each sequence in .bin
    document_indices: np.ndarray  # int64[D]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))


def _corrupt(path: Path, why: str) -> SpecError:
    return SpecError("data.path", f"{path} is not a valid Megatron indexed dataset: {why}")


def read_index(prefix: str) -> IndexLayout:
    """Parse and check ``prefix.idx`` against ``prefix.bin``; every defect is a SpecError naming data.path."""
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    missing = [str(p) for p in (idx, bin_) if not p.is_file()]
    if missing:
        raise SpecError("data.path", f"no Megatron indexed dataset at prefix {prefix}: missing {' and '.join(missing)}")
    raw = np.memmap(idx, dtype=np.uint8, mode="r") if idx.stat().st_size else np.zeros(0, np.uint8)
    if len(raw) < HEADER.size:
        raise _corrupt(idx, f"{len(raw)} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, code, s, d = HEADER.unpack(bytes(raw[: HEADER.size]))
    if magic != MAGIC:
        raise _corrupt(idx, f"header {magic!r}, expected {MAGIC!r}")
    if version != 1:
        raise _corrupt(idx, f"version {version}, only version 1 exists")
    if code not in DTYPES or DTYPES[code] in (np.float32, np.float64):
        raise _corrupt(
            idx,
            f"dtype code {code} is not an integer token type (codes {sorted(k for k in DTYPES if k not in (6, 7))})",
        )
    body = 4 * s + 8 * s + 8 * d
    if len(raw) not in (HEADER.size + body, HEADER.size + body + s):  # + int8 modes when multimodal
        raise _corrupt(idx, f"{len(raw)} bytes, but {s} sequences and {d} documents need {HEADER.size + body}")
    at = HEADER.size
    lengths = np.frombuffer(raw, np.int32, s, at)
    pointers = np.frombuffer(raw, np.int64, s, at + 4 * s)
    documents = np.frombuffer(raw, np.int64, d, at + 12 * s)
    layout = IndexLayout(DTYPES[code], lengths, pointers, documents)
    _check_layout(layout, idx, bin_)
    return layout


def _check_layout(layout: IndexLayout, idx: Path, bin_: Path) -> None:
    lengths, itemsize = layout.lengths.astype(np.int64), np.dtype(layout.dtype).itemsize
    if (lengths < 0).any():
        raise _corrupt(idx, "negative sequence length")
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])) * itemsize
    if not np.array_equal(starts, layout.pointers):
        raise _corrupt(idx, "sequence pointers are not the running sum of the sequence lengths")
    docs = layout.document_indices
    if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or (np.diff(docs) < 0).any():
        raise _corrupt(idx, f"document indices must rise from 0 to the sequence count {len(lengths)}")
    want = layout.num_tokens * itemsize
    if bin_.stat().st_size != want:
        raise _corrupt(
            bin_,
            f"{bin_.stat().st_size} bytes, but the index describes {layout.num_tokens} tokens x {itemsize} bytes = {want}",
        )


class NumpyIndexed:
    """parabench's reader: the ``.bin`` as one NumPy memory map (the layout checked by :func:`read_index`)."""

    name = "parabench numpy memmap"

    def __init__(self, prefix: str):
        self.layout = read_index(prefix)
        self.num_tokens = self.layout.num_tokens
        self._tokens = (
            np.memmap(prefix + ".bin", dtype=self.layout.dtype, mode="r")
            if self.num_tokens
            else np.zeros(0, self.layout.dtype)
        )

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream."""
        return np.asarray(self._tokens[start:stop])


class MegatronIndexed:
    """The same stream through megatron-core's own ``IndexedDataset`` (``get(idx, offset, length)``)."""

    def __init__(self, prefix: str):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.name = f"megatron-core {version('megatron-core')} IndexedDataset"
        self._ds = IndexedDataset(prefix)
        self._starts = np.concatenate(([0], np.cumsum(np.asarray(self._ds.sequence_lengths, dtype=np.int64))))
        self.num_tokens = int(self._starts[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the stream, gathered across sequence boundaries."""
        pieces = []
        seq = int(np.searchsorted(self._starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self._starts[seq + 1]))
            if end > start:
                pieces.append(self._ds.get(seq, offset=start - int(self._starts[seq]), length=end - start))
            start, seq = end, seq + 1
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)


def open_indexed(path: str, reader: str) -> NumpyIndexed | MegatronIndexed:
    """``data.reader``: ``auto`` (megatron-core where installed, else NumPy), ``megatron`` or ``numpy``."""
    prefix = prefix_of(path)
    if reader == "megatron" or (reader == "auto" and megatron_available()):
        return MegatronIndexed(prefix)
    return NumpyIndexed(prefix)


def check_token_ids(reader: NumpyIndexed, stop: int, vocab_size: int, path: str) -> None:
    """Every token id in ``[0, stop)`` of the stream lies in ``[0, vocab_size)``."""
    for start in range(0, stop, SCAN_CHUNK):
        chunk = reader.read(start, min(stop, start + SCAN_CHUNK))
        lo, hi = int(chunk.min()), int(chunk.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            pos = start + int(np.argmax(chunk == bad))
            raise SpecError(
                "data.path",
                f"{path}: token id {bad} at stream position {pos} is outside the model's "
                f"vocabulary [0, model.vocab_size={vocab_size})",
            )
