"""Deterministic token streams, identical for every backend and world size.

A step's global batch is a pure function of (data seed, step): ``global_batch(step)`` returns all
``global_batch_size`` sequences of ``seq_len + 1`` tokens (inputs and the targets shifted by one);
data-parallel rank r of D takes rows ``[r * B/D, (r+1) * B/D)``, cut into micro-batches in order. So
DDP on 2 ranks, FSDP on 1 rank with gradient accumulation, and Megatron with DP=2 x TP=2 all see
exactly the same tokens per step.

Sources:

* ``synthetic``: a seeded noisy affine recurrence over the vocabulary,
  ``x[i+1] = (a * x[i] + c) mod V`` with probability 0.9, else a uniform random token. It is
  learnable (the loss falls, so a broken optimizer shows), and costs nothing to generate.
* ``text``: a local file. Without ``data.tokenizer`` it is read as bytes (token id = byte value, so
  any vocabulary >= 256 works). With ``data.tokenizer=/path/to/tokenizer.json`` it is tokenized by the
  Hugging Face ``tokenizers`` library: line by line (each line keeps its line break, so no text is
  lost), no special tokens added, the lines' ids concatenated. The runner tokenizes once before
  launch (cached by content under ``<results_dir>/.cache/tokens/``) and puts the ids in the run
  directory as ``tokens.npy``, which every worker memory-maps. Each sequence of either kind starts at
  a seeded random offset into the token stream. No downloads.
* ``indexed``: a Megatron/MindSpeed ``.bin``/``.idx`` pair (see :mod:`parabench.indexed`), read through
  megatron-core's own ``IndexedDataset`` where installed. Samples are cut like Megatron's GPTDataset
  cuts them, without its shuffle: the documents are concatenated in file order into one stream and
  sample k is tokens ``[k * seq_len, k * seq_len + seq_len + 1)``, so consecutive samples share one
  token and every token is a target once. Global sample ``g = step * B + row`` is sample
  ``g mod S`` (S = ``(tokens - 1) // seq_len`` samples): past the end of the data the run wraps to the
  start and reads the same samples again (a second epoch, in the same order). ``data.seed`` is not
  used. Documents are not separated by anything the file does not hold itself (Megatron's
  preprocessing appends an end-of-document token with ``--append-eod``).

Before launch the runner calls :func:`check_data`: a missing or corrupt file, a tokenizer larger than
the model's vocabulary or a token id outside it (among the tokens the run will read) is refused with
one line naming the key (exit 2). Every rank logs which reader it used and a checksum of the rows it
trained on (:class:`DataLedger`); the runner adds them up to one ``data_checksum`` per run that is
equal for any backend and world size given the same data (tag ``data_checksum``, with ``data_reader``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
from importlib.metadata import version
from pathlib import Path

import numpy as np

from parabench.errors import SpecError
from parabench.indexed import NumpyIndexed, check_token_ids, megatron_available, open_indexed, prefix_of
from parabench.spec import DataSpec, JobSpec

NOISE = 0.1  # fraction of synthetic tokens drawn uniformly instead of from the recurrence
TOKENS_FILE = "tokens.npy"  # the tokenized text in the run directory (text source with data.tokenizer)
TOKENIZE_LINES = 4096  # lines per tokenizers.encode_batch call (it runs on all cores)
CHECKSUM_MOD = 1 << 64


def _rng(*key: object) -> np.random.Generator:
    digest = hashlib.sha256(":".join(str(k) for k in ("parabench-data", *key)).encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:8], "little")))


def indexed_samples(num_tokens: int, seq_len: int) -> int:
    """Samples of seq_len + 1 tokens (overlapping by one) in a stream of ``num_tokens``."""
    return max(num_tokens - 1, 0) // seq_len


class TokenSource:
    """Produces (inputs, targets) int64 arrays of shape [batch, seq_len] per step.

    ``run_dir``: a worker's run directory, where the runner put the tokenized text; without it (tests,
    scripts) a text source with a tokenizer tokenizes in this process.
    """

    def __init__(self, spec: DataSpec, vocab_size: int, run_dir: Path | None = None):
        self.spec = spec
        self.vocab_size = vocab_size
        if spec.source == "indexed":
            self._indexed = open_indexed(spec.path, spec.reader)
            self._samples = indexed_samples(self._indexed.num_tokens, spec.seq_len)
            self.reader = self._indexed.name
        elif spec.source == "text" and spec.tokenizer:
            self._stream = (
                np.load(run_dir / TOKENS_FILE, mmap_mode="r")
                if run_dir is not None
                else tokenize_text(spec.path, load_tokenizer(spec.tokenizer))
            )
            self.reader = f"tokenizer.json via tokenizers {_tokenizers_version()}"
        elif spec.source == "text":
            self._stream = np.frombuffer(Path(spec.path).read_bytes(), dtype=np.uint8)
            self.reader = "bytes (token id = byte value)"
        else:
            params = _rng(spec.seed, "recurrence")
            self._a = int(params.integers(1, vocab_size)) | 1
            self._c = int(params.integers(0, vocab_size))
            self.reader = "synthetic recurrence"

    def global_batch(self, step: int) -> np.ndarray:
        """All sequences of one optimizer step, shape [global_batch_size, seq_len + 1]."""
        if self.spec.source == "indexed":
            return self._indexed_batch(step)
        if self.spec.source == "text":
            return self._text_batch(step)
        return self._synthetic_batch(step)

    def _synthetic_batch(self, step: int) -> np.ndarray:
        b, n, v = self.spec.global_batch_size, self.spec.seq_len + 1, self.vocab_size
        rng = _rng(self.spec.seed, self.spec.source, step)
        out = np.empty((b, n), dtype=np.int64)
        out[:, 0] = rng.integers(0, v, size=b)
        noise = rng.random((b, n)) < NOISE
        random_tokens = rng.integers(0, v, size=(b, n))
        for i in range(1, n):
            nxt = (out[:, i - 1] * self._a + self._c) % v
            out[:, i] = np.where(noise[:, i], random_tokens[:, i], nxt)
        return out

    def _text_batch(self, step: int) -> np.ndarray:
        b, n = self.spec.global_batch_size, self.spec.seq_len + 1
        starts = _rng(self.spec.seed, self.spec.source, step).integers(0, len(self._stream) - n + 1, size=b)
        return np.stack([self._stream[s : s + n] for s in starts]).astype(np.int64)

    def _indexed_batch(self, step: int) -> np.ndarray:
        b, length = self.spec.global_batch_size, self.spec.seq_len
        samples = [(step * b + row) % self._samples for row in range(b)]
        return np.stack([self._indexed.read(k * length, k * length + length + 1) for k in samples]).astype(np.int64)

    def rank_micro_batches(self, step: int, dp_rank: int, dp_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """This data-parallel rank's slice of the step, as (inputs, targets) micro-batches."""
        rows = self.spec.global_batch_size // dp_size
        mine = self.global_batch(step)[dp_rank * rows : (dp_rank + 1) * rows]
        mb = self.spec.micro_batch_size
        return [(mine[i : i + mb, :-1], mine[i : i + mb, 1:]) for i in range(0, rows, mb)]


# --------------------------------------------------------------------------------------------
# Which rows were consumed: a checksum that adds up over data-parallel ranks.
# --------------------------------------------------------------------------------------------
def rows_checksum(step: int, first_row: int, rows: np.ndarray) -> int:
    """Sum over rows of blake2b-64(step, global row index, tokens), mod 2**64. Keyed by the row's
    place in the global batch, so the sums of the ranks' slices equal the sum over the whole batch."""
    total = 0
    for i, row in enumerate(rows):
        h = hashlib.blake2b(struct.pack("<qq", step, first_row + i), digest_size=8)
        h.update(np.ascontiguousarray(row, dtype="<i8").tobytes())
        total += int.from_bytes(h.digest(), "little")
    return total % CHECKSUM_MOD


class DataLedger:
    """What one rank trained on: the reader it used and the checksum of every row of every step."""

    def __init__(self, source: TokenSource, dp_rank: int, dp_size: int):
        self.reader, self.dp_rank, self.dp_size = source.reader, dp_rank, dp_size
        self.first_row = dp_rank * (source.spec.global_batch_size // dp_size)
        self.checksum = 0

    def record(self, step: int, micro_batches: list[tuple[np.ndarray, np.ndarray]]) -> None:
        rows = np.concatenate([np.concatenate([x, y[:, -1:]], axis=1) for x, y in micro_batches])
        self.checksum = (self.checksum + rows_checksum(step, self.first_row, rows)) % CHECKSUM_MOD

    def as_dict(self) -> dict:
        return {
            "reader": self.reader,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "checksum": f"{self.checksum:016x}",
        }


def combined_checksum(ledgers: list[dict]) -> str:
    """The run's data checksum from every rank's ledger: ranks of one data-parallel rank (TP/PP peers)
    must agree; one per data-parallel rank is summed. ``MISMATCH ...`` when they disagree."""
    by_dp: dict[int, set[str]] = {}
    for ledger in ledgers:
        by_dp.setdefault(ledger["dp_rank"], set()).add(ledger["checksum"])
    dp_size = ledgers[0]["dp_size"] if ledgers else 0
    if sorted(by_dp) != list(range(dp_size)) or any(len(v) != 1 for v in by_dp.values()):
        return f"MISMATCH {sorted((k, sorted(v)) for k, v in by_dp.items())}"
    return f"{sum(int(next(iter(v)), 16) for v in by_dp.values()) % CHECKSUM_MOD:016x}"


def global_checksum(source: TokenSource, steps: int) -> str:
    """The same checksum computed from the global batches directly (what one rank of DP=1 logs)."""
    total = sum(rows_checksum(step, 0, source.global_batch(step)) for step in range(steps))
    return f"{total % CHECKSUM_MOD:016x}"


# --------------------------------------------------------------------------------------------
# Tokenizing text with a local tokenizer.json.
# --------------------------------------------------------------------------------------------
def _tokenizers_version() -> str:
    return version("tokenizers")


def load_tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` from a local tokenizer.json; problems are SpecErrors naming data.tokenizer."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SpecError("data.tokenizer", "needs the tokenizers package: pip install 'parabench[hf]'") from None
    if not Path(path).is_file():
        raise SpecError("data.tokenizer", f"no such file: {path}")
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises a bare Exception for any parse error; it is reported, not hidden
        raise SpecError("data.tokenizer", f"{path} is not a Hugging Face tokenizer.json: {exc}") from None


def tokenize_text(path: str, tokenizer) -> np.ndarray:
    """The ids of a UTF-8 file, line by line (line breaks kept), no special tokens added."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(
            "data.path",
            f"{path} is not UTF-8 text (byte {exc.start}); a tokenizer needs text "
            "(drop data.tokenizer to read it as bytes)",
        ) from None
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    lines = text.splitlines(keepends=True)
    parts = [np.zeros(0, dtype)]
    for i in range(0, len(lines), TOKENIZE_LINES):
        parts += [
            np.asarray(e.ids, dtype)
            for e in tokenizer.encode_batch(lines[i : i + TOKENIZE_LINES], add_special_tokens=False)
        ]
    return np.concatenate(parts)


def _file_digest(*paths: str) -> str:
    h = hashlib.sha256(b"parabench-tokens-v1")
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()[:32]


def _cached_tokens(spec: DataSpec, cache_dir: Path) -> Path:
    """``<cache_dir>/tokens/<sha256 of tokenizer and text>.npy``, tokenized now if not there yet."""
    out = cache_dir / "tokens" / f"{_file_digest(spec.tokenizer, spec.path)}.npy"
    if out.is_file():
        return out
    tokens = tokenize_text(spec.path, load_tokenizer(spec.tokenizer))
    if len(tokens) < spec.seq_len + 1:
        raise SpecError(
            "data.path",
            f"{spec.path} tokenizes to {len(tokens)} tokens; one sequence needs seq_len+1 = {spec.seq_len + 1}",
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, tokens)
    os.replace(tmp, out)
    return out


# --------------------------------------------------------------------------------------------
# Before launch (runner): refuse bad data, put the tokenized text into the run directory.
# --------------------------------------------------------------------------------------------
def check_data(job: JobSpec, cache_dir: Path) -> None:
    """Refuse, with a SpecError naming the key, data a worker could not train on."""
    data = job.data
    if data.source == "text" and data.tokenizer:
        vocab = load_tokenizer(data.tokenizer).get_vocab_size(with_added_tokens=True)
        if vocab > job.model.vocab_size:
            raise SpecError(
                "data.tokenizer",
                f"{data.tokenizer} has {vocab} tokens, more than model.vocab_size={job.model.vocab_size}",
            )
        _cached_tokens(data, cache_dir)
    elif data.source == "indexed":
        if data.reader == "megatron" and not megatron_available():
            raise SpecError(
                "data.reader",
                "megatron-core is not installed (pip install 'parabench[megatron]'); use data.reader=numpy or auto",
            )
        reader = NumpyIndexed(prefix_of(data.path))
        samples = indexed_samples(reader.num_tokens, data.seq_len)
        if samples < 1:
            raise SpecError(
                "data.path",
                f"{data.path} holds {reader.num_tokens} tokens; one sample needs seq_len+1 = {data.seq_len + 1}",
            )
        used = min((job.run.warmup_steps + job.run.steps) * data.global_batch_size, samples)
        check_token_ids(reader, used * data.seq_len + 1, job.model.vocab_size, data.path)


def stage_data(job: JobSpec, cache_dir: Path, run_dir: Path) -> None:
    """Put what the workers read into the run directory: the tokenized text (a hard link to the cache
    where the file system allows, else a copy)."""
    if not (job.data.source == "text" and job.data.tokenizer):
        return
    cached, target = _cached_tokens(job.data, cache_dir), run_dir / TOKENS_FILE
    target.unlink(missing_ok=True)
    try:
        os.link(cached, target)
    except OSError:  # another file system, or no hard links: copy instead
        shutil.copyfile(cached, target)
