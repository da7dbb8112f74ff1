"""The same rows reach every backend: an indexed dataset written here with megatron-core's own
builder, trained on by ddp and fsdp (2 ranks, dp=2, megatron-core's reader) and by megatron with
TP=2 (dp=1, parabench's NumPy reader). Every run logs a checksum of the rows its ranks trained on;
all equal the checksum of the global batches computed here, and the step-0 losses agree. A text
file tokenized by a local tokenizer.json reaches the workers through the run directory."""

import numpy as np
import pytest

from conftest import FAST, VOCAB, bench, mlflow_runs, summaries
from parabench.data import TOKENS_FILE, TokenSource, global_checksum
from parabench.spec import DataSpec

pytestmark = pytest.mark.full

STEPS = 2
COMMON = [*FAST, "data.seq_len=32", "data.global_batch_size=4", "data.micro_batch_size=1", f"run.steps={STEPS}"]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path_factory.mktemp("data") / "corpus_text_document")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(20):
        builder.add_item(torch.from_numpy(rng.integers(0, VOCAB, int(rng.integers(5, 40)))))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.mark.megatron
def test_identical_batches_across_backends_from_an_indexed_dataset(corpus, tmp_path):
    runs = {
        "torch": ["-m", "backend=ddp,fsdp"],
        "megatron": ["backend=megatron", "backend.tp=2", "data.reader=numpy"],
    }
    jobs = []
    for name, args in runs.items():
        results = tmp_path / name
        proc = bench(
            ["run", *args, *COMMON, "data=indexed", f"data.path={corpus}", "launcher.nproc_per_node=2"], results
        )
        assert proc.returncode == 0, (name, proc.stderr[-4000:])
        jobs += list(summaries(results).values())
        runs = mlflow_runs(results)
        assert set(runs[runs["tags.parabench.kind"] == "job"]["tags.data_checksum"]) == {jobs[-1]["data_checksum"]}
    by = {s["backend"]: s for s in jobs}
    assert sorted(by) == ["ddp", "fsdp", "megatron"]
    spec = DataSpec(source="indexed", path=corpus, reader="numpy", seq_len=32, global_batch_size=4, micro_batch_size=1)
    want = global_checksum(TokenSource(spec, 32000), STEPS)
    assert {s["data_checksum"] for s in jobs} == {want}, [(s["backend"], s["data_checksum"]) for s in jobs]
    assert (
        by["ddp"]["data_reader"].startswith("megatron-core ")
        and by["megatron"]["data_reader"] == "parabench numpy memmap"
    )
    for other in ("fsdp", "megatron"):
        assert rel(by[other]["losses"][0], by["ddp"]["losses"][0]) <= 1e-5, (
            other,
            by[other]["losses"],
            by["ddp"]["losses"],
        )


def test_text_through_a_tokenizer_json_reaches_the_workers(tmp_path):
    pytest.importorskip("tokenizers")
    from test_data import TEXT, make_tokenizer

    make_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "t.txt").write_text(TEXT * 30)
    args = ["data=text", f"data.path={tmp_path / 't.txt'}", f"data.tokenizer={tmp_path / 'tokenizer.json'}"]
    results = tmp_path / "r"
    proc = bench(["run", *COMMON, *args, "launcher.nproc_per_node=2"], results)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (summary,) = summaries(results).values()
    run_dir = next(results.glob("runs/*/*/*/summary.json")).parent
    assert (run_dir / TOKENS_FILE).is_file() and "tokenizers" in summary["data_reader"]
    spec = DataSpec(
        source="text",
        path=str(tmp_path / "t.txt"),
        tokenizer=str(tmp_path / "tokenizer.json"),
        seq_len=32,
        global_batch_size=4,
        micro_batch_size=1,
    )
    assert summary["data_checksum"] == global_checksum(TokenSource(spec, 32000), STEPS)  # tokenized in this process
