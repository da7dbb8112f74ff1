"""Deterministic token streams, identical for every backend and world size.

A step's global batch is a pure function of (data seed, step): ``global_batch(step)`` returns all
``global_batch_size`` sequences; data-parallel rank r of D takes rows
``[r * B/D, (r+1) * B/D)``, cut into micro-batches in order. So DDP on 2 ranks, FSDP on 1 rank with
gradient accumulation, and Megatron with DP=2 x TP=2 all see exactly the same tokens per step.

Sources:
* ``synthetic``: a seeded noisy affine recurrence over the vocabulary,
  ``x[i+1] = (a * x[i] + c) mod V`` with probability 0.9, else a uniform random token. It is
  learnable (the loss falls, so a broken optimizer shows), and costs nothing to generate.
* ``text``: a local file read as bytes (byte-level tokenizer: token id = byte value, so any
  vocabulary >= 256 works); each sequence starts at a seeded random offset. No downloads.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from parabench.spec import DataSpec

NOISE = 0.1  # fraction of synthetic tokens drawn uniformly instead of from the recurrence


def _rng(*key: object) -> np.random.Generator:
    digest = hashlib.sha256(":".join(str(k) for k in ("parabench-data", *key)).encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:8], "little")))


class TokenSource:
    """Produces (inputs, targets) int64 arrays of shape [batch, seq_len] per step."""

    def __init__(self, spec: DataSpec, vocab_size: int):
        self.spec = spec
        self.vocab_size = vocab_size
        if spec.source == "text":
            self._bytes = np.frombuffer(Path(spec.path).read_bytes(), dtype=np.uint8)
        else:
            params = _rng(spec.seed, "recurrence")
            self._a = int(params.integers(1, vocab_size)) | 1
            self._c = int(params.integers(0, vocab_size))

    def global_batch(self, step: int) -> np.ndarray:
        """All sequences of one optimizer step, shape [global_batch_size, seq_len + 1]."""
        b, n = self.spec.global_batch_size, self.spec.seq_len + 1
        rng = _rng(self.spec.seed, self.spec.source, step)
        if self.spec.source == "text":
            starts = rng.integers(0, len(self._bytes) - n + 1, size=b)
            return np.stack([self._bytes[s:s + n] for s in starts]).astype(np.int64)
        v = self.vocab_size
        out = np.empty((b, n), dtype=np.int64)
        out[:, 0] = rng.integers(0, v, size=b)
        noise = rng.random((b, n)) < NOISE
        random_tokens = rng.integers(0, v, size=(b, n))
        for i in range(1, n):
            nxt = (out[:, i - 1] * self._a + self._c) % v
            out[:, i] = np.where(noise[:, i], random_tokens[:, i], nxt)
        return out

    def rank_micro_batches(self, step: int, dp_rank: int, dp_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """This data-parallel rank's slice of the step, as (inputs, targets) micro-batches."""
        rows = self.spec.global_batch_size // dp_size
        mine = self.global_batch(step)[dp_rank * rows:(dp_rank + 1) * rows]
        mb = self.spec.micro_batch_size
        return [(mine[i:i + mb, :-1], mine[i:i + mb, 1:]) for i in range(0, rows, mb)]
