import dataclasses
import struct

import numpy as np
import pytest

from conftest import assert_refused_before_launch
from parabench.data import DataLedger, TokenSource, combined_checksum, global_checksum
from parabench.spec import DataSpec


def test_rank_slices_rebuild_the_global_batch_for_any_world_size():
    spec = DataSpec(global_batch_size=8, micro_batch_size=2, seq_len=16)
    src = TokenSource(spec, vocab_size=1000)
    full = src.global_batch(3)
    for world in (1, 2, 4):
        rows = []
        for r in range(world):
            for x, y in src.rank_micro_batches(3, r, world):
                assert x.shape == (2, 16) and np.array_equal(x[:, 1:], y[:, :-1])
                rows.append(np.concatenate([x, y[:, -1:]], axis=1))
        assert np.array_equal(np.concatenate(rows), full)


def test_deterministic_across_instances_and_distinct_across_steps():
    spec = DataSpec(global_batch_size=4, micro_batch_size=2, seq_len=32, seed=5)
    a, b = TokenSource(spec, 500), TokenSource(spec, 500)
    assert np.array_equal(a.global_batch(0), b.global_batch(0))
    assert not np.array_equal(a.global_batch(0), a.global_batch(1))
    assert a.global_batch(0).max() < 500 and a.global_batch(0).min() >= 0


def test_synthetic_stream_is_learnable():
    spec = DataSpec(global_batch_size=4, micro_batch_size=4, seq_len=256)
    src = TokenSource(spec, 32000)
    batch = src.global_batch(0)
    follows = (batch[:, :-1] * src._a + src._c) % 32000 == batch[:, 1:]
    assert 0.85 < follows.mean() < 0.95  # 90% follow the recurrence


def test_text_source_is_byte_level(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes("héllo wörld, parabench! ".encode() * 20)
    spec = DataSpec(source="text", path=str(path), global_batch_size=2, micro_batch_size=1, seq_len=8)
    batch = TokenSource(spec, 256).global_batch(0)
    data = path.read_bytes()
    for row in batch:
        assert bytes(row.astype(np.uint8).tolist()) in data


# --------------------------------------------------------------------------------------------
# Megatron indexed datasets (.bin/.idx).
# --------------------------------------------------------------------------------------------
def write_indexed(prefix, documents, dtype=np.uint16):
    """The .bin/.idx pair, written from the format as documented in megatron-core's indexed_dataset.py
    (one sequence per document); test_megatron_builder_writes_the_same_bytes checks it against the
    builder itself. Returns the token stream (all documents concatenated)."""
    codes = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8}
    lengths = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)[:-1])) * np.dtype(dtype).itemsize
    stream = np.concatenate([np.asarray(d, dtype=dtype) for d in documents])
    with open(f"{prefix}.bin", "wb") as f:
        f.write(stream.tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, codes[dtype], len(documents), len(documents) + 1))
        f.write(
            lengths.tobytes()
            + pointers.astype(np.int64).tobytes()
            + np.arange(len(documents) + 1, dtype=np.int64).tobytes()
        )
    return stream


def random_documents(seed, count=9, vocab=1000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(0, 60))) for _ in range(count)]  # empty documents included


def test_indexed_samples_are_cut_in_file_order_and_wrap(tmp_path):
    stream = write_indexed(tmp_path / "c", [np.arange(0, 10), np.arange(10, 23)])  # 23 tokens: 5 samples of 4+1
    spec = DataSpec(
        source="indexed", path=str(tmp_path / "c"), reader="numpy", seq_len=4, global_batch_size=4, micro_batch_size=2
    )
    src = TokenSource(spec, 1000)
    assert src.reader == "parabench numpy memmap"
    assert src.global_batch(0).tolist() == [
        stream[4 * k : 4 * k + 5].tolist() for k in range(4)
    ]  # across the document edge
    assert src.global_batch(1).tolist() == [
        stream[4 * k : 4 * k + 5].tolist() for k in (4, 0, 1, 2)
    ]  # wraps after 5 samples
    assert np.array_equal(
        TokenSource(dataclasses.replace(spec, path=str(tmp_path / "c.bin")), 1000).global_batch(1), src.global_batch(1)
    )


def test_megatron_builder_writes_the_same_bytes(tmp_path):
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    documents = random_documents(1)
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for doc in documents:
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    write_indexed(tmp_path / "p", documents)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"m.{ext}").read_bytes() == (tmp_path / f"p.{ext}").read_bytes(), ext


def test_numpy_reader_matches_megatron_core(tmp_path):
    """A file megatron-core's builder wrote (documents of several sequences, empty ones included),
    read by megatron-core's IndexedDataset and by parabench's NumPy reader: the same tokens."""
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    from parabench.indexed import MegatronIndexed, NumpyIndexed

    prefix = str(tmp_path / "corpus_text_document")
    sequences = random_documents(2, count=12, vocab=50000)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for i in range(0, 12, 3):  # documents of three sequences each
        builder.add_document(
            torch.from_numpy(np.concatenate(sequences[i : i + 3])), [len(s) for s in sequences[i : i + 3]]
        )
    builder.finalize(prefix + ".idx")
    stream = np.concatenate(sequences)
    ours, theirs = NumpyIndexed(prefix), MegatronIndexed(prefix)
    assert theirs.name.startswith("megatron-core ") and ours.num_tokens == theirs.num_tokens == len(stream)
    ds = IndexedDataset(prefix)
    assert np.array_equal(ours.layout.lengths, ds.sequence_lengths) and np.array_equal(
        ours.layout.document_indices, ds.document_indices
    )
    rng = np.random.default_rng(3)
    for start, stop in [(0, len(stream)), (len(stream) - 1, len(stream)), *rng.integers(0, len(stream), (40, 2))]:
        start, stop = sorted((int(start), int(stop)))
        assert np.array_equal(ours.read(start, stop), stream[start:stop])
        assert np.array_equal(theirs.read(start, stop), stream[start:stop]), (start, stop)
    spec = DataSpec(source="indexed", path=prefix, seq_len=16, global_batch_size=8, micro_batch_size=2)
    auto, numpy_ = TokenSource(spec, 50000), TokenSource(dataclasses.replace(spec, reader="numpy"), 50000)
    assert auto.reader == theirs.name
    for step in range(4):
        assert np.array_equal(auto.global_batch(step), numpy_.global_batch(step))


def test_data_checksum_adds_up_over_data_parallel_ranks(tmp_path):
    write_indexed(tmp_path / "c", random_documents(4, count=30))
    spec = DataSpec(
        source="indexed", path=str(tmp_path / "c"), reader="numpy", seq_len=8, global_batch_size=8, micro_batch_size=2
    )
    src = TokenSource(spec, 1000)
    want = global_checksum(src, 3)
    for world in (1, 2, 4):
        ledgers = [DataLedger(src, r, world) for r in range(world)]
        for step in range(3):
            for r, ledger in enumerate(ledgers):
                ledger.record(step, src.rank_micro_batches(step, r, world))
        parts = [ledger.as_dict() for ledger in ledgers]
        assert combined_checksum(parts + parts[:1]) == want  # a TP/PP peer of dp rank 0 logs the same
    assert combined_checksum(parts[:-1]).startswith("MISMATCH")  # a data-parallel rank missing
    other = DataLedger(TokenSource(dataclasses.replace(spec, seq_len=7), 1000), 0, 1)
    other.record(0, TokenSource(dataclasses.replace(spec, seq_len=7), 1000).rank_micro_batches(0, 0, 1))
    assert combined_checksum([parts[0], {**other.as_dict(), "dp_rank": 0, "dp_size": 4}, *parts[1:]]).startswith(
        "MISMATCH"
    )
    assert global_checksum(src, 3) != global_checksum(TokenSource(dataclasses.replace(spec, seq_len=7), 1000), 3)


# --------------------------------------------------------------------------------------------
# Local text through a local tokenizer.json.
# --------------------------------------------------------------------------------------------
TEXT = "the cat sat on the mat\nthe dog sat on the log\n\na cat and a dog ran to the mat\n"


def make_tokenizer(path):
    """A tiny WordLevel tokenizer trained here (no downloads); its vocabulary holds 14 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT.splitlines(), trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(path))
    return tok


def test_text_through_a_tokenizer_json(tmp_path):
    pytest.importorskip("tokenizers")
    from parabench.data import TOKENS_FILE, check_data, load_tokenizer, stage_data, tokenize_text
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config

    tok = make_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "t.txt").write_text(TEXT * 10)
    ids = tokenize_text(str(tmp_path / "t.txt"), load_tokenizer(str(tmp_path / "tokenizer.json")))
    assert ids.tolist() == [
        i for line in (TEXT * 10).splitlines(keepends=True) for i in tok.encode(line, add_special_tokens=False).ids
    ]
    job = from_config(
        to_plain(
            compose(
                [
                    "+model=llama",
                    "data=text",
                    f"data.path={tmp_path / 't.txt'}",
                    "data.seq_len=8",
                    f"data.tokenizer={tmp_path / 'tokenizer.json'}",
                    f"run.results_dir={tmp_path / 'r'}",
                ]
            )
        )
    )
    check_data(job, tmp_path / "cache")
    (run_dir := tmp_path / "run").mkdir()
    stage_data(job, tmp_path / "cache", run_dir)
    assert np.array_equal(np.load(run_dir / TOKENS_FILE), ids)
    staged, fresh = TokenSource(job.data, 32000, run_dir), TokenSource(job.data, 32000)
    assert "tokenizers" in staged.reader
    stream = ids.tolist()
    for step in range(3):
        assert np.array_equal(staged.global_batch(step), fresh.global_batch(step))
        for row in fresh.global_batch(step).tolist():
            assert any(stream[s : s + 9] == row for s in range(len(stream) - 8))


# --------------------------------------------------------------------------------------------
# Refused before launch: one line naming the key, exit 2, nothing written.
# --------------------------------------------------------------------------------------------
def _corrupt_files(d):
    """name -> (overrides, the key the error must name) for a set of broken datasets written into d."""
    write_indexed(d / "good", random_documents(5, count=20))
    out = {"missing prefix": ([f"data.path={d / 'nope'}"], "data.path"), "good": ([f"data.path={d / 'good'}"], None)}
    for name, edit in {
        "bad magic": lambda idx, b: (b"MMIDIDY" + idx[7:], b),
        "bad version": lambda idx, b: (idx[:9] + struct.pack("<Q", 2) + idx[17:], b),
        "float dtype": lambda idx, b: (idx[:17] + b"\x07" + idx[18:], b),
        "truncated index": lambda idx, b: (idx[:-5], b),
        "short header": lambda idx, b: (idx[:20], b),
        "truncated bin": lambda idx, b: (idx, b[:-2]),
    }.items():
        idx, b = edit((d / "good.idx").read_bytes(), (d / "good.bin").read_bytes())
        (d / f"{name}.idx").write_bytes(idx)
        (d / f"{name}.bin").write_bytes(b)
        out[name] = ([f"data.path={d / name}"], "data.path")
    write_indexed(d / "big ids", [np.array([5, 6, 7, 40000, 8] * 20)])
    out["token id over vocab"] = ([f"data.path={d / 'big ids'}", "data.seq_len=16"], "data.path")
    out["too short"] = ([f"data.path={d / 'good'}", "data.seq_len=1024"], "data.path")
    return out


@pytest.mark.parametrize(
    "name",
    [
        "missing prefix",
        "bad magic",
        "bad version",
        "float dtype",
        "truncated index",
        "short header",
        "truncated bin",
        "token id over vocab",
        "too short",
    ],
)
def test_bad_indexed_data_is_refused_before_launch(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (data := tmp_path / "data").mkdir()
    args, key = _corrupt_files(data)[name]
    assert_refused_before_launch(["+model=llama", "data=indexed", "data.reader=numpy", *args], key, tmp_path, capsys)


def test_the_uncorrupted_dataset_passes_the_checks(tmp_path):
    from parabench.data import check_data
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config

    (data := tmp_path / "data").mkdir()
    args, _ = _corrupt_files(data)["good"]
    job = from_config(to_plain(compose(["+model=llama", "data=indexed", "data.seq_len=16", *args])))
    check_data(job, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "name",
    [
        "tokenizer over vocab",
        "tokenizer missing",
        "tokenizer corrupt",
        "tokenizer on synthetic",
        "reader on text",
        "text too short",
        "text not utf-8",
    ],
)
def test_bad_tokenizer_data_is_refused_before_launch(name, tmp_path, capsys, monkeypatch):
    pytest.importorskip("tokenizers")
    monkeypatch.chdir(tmp_path)
    make_tokenizer(tmp_path / "tok.json")
    (tmp_path / "bad.json").write_text("{nope")
    (tmp_path / "t.txt").write_text(TEXT * 20)
    (tmp_path / "short.txt").write_text("the cat " * 40)  # 320 bytes, 80 tokens
    (tmp_path / "latin1.txt").write_bytes("café au lait\n".encode("latin-1") * 40)
    text = ["data=text", f"data.path={tmp_path / 't.txt'}", "data.seq_len=8"]
    args, key = {
        "tokenizer over vocab": (
            text + [f"data.tokenizer={tmp_path / 'tok.json'}", "model.vocab_size=8"],
            "data.tokenizer",
        ),
        "tokenizer missing": (text + [f"data.tokenizer={tmp_path / 'none.json'}"], "data.tokenizer"),
        "tokenizer corrupt": (text + [f"data.tokenizer={tmp_path / 'bad.json'}"], "data.tokenizer"),
        "tokenizer on synthetic": ([f"+data.tokenizer={tmp_path / 'tok.json'}"], "data.tokenizer"),
        "reader on text": (text + ["+data.reader=numpy"], "data.reader"),
        "text too short": (
            [
                "data=text",
                f"data.path={tmp_path / 'short.txt'}",
                "data.seq_len=128",
                f"data.tokenizer={tmp_path / 'tok.json'}",
            ],
            "data.path",
        ),
        "text not utf-8": (
            [
                "data=text",
                f"data.path={tmp_path / 'latin1.txt'}",
                "data.seq_len=8",
                f"data.tokenizer={tmp_path / 'tok.json'}",
            ],
            "data.path",
        ),
    }[name]
    assert_refused_before_launch(["+model=llama", *args], key, tmp_path, capsys)
