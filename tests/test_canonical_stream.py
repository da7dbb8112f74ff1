"""The canonical directory written and read one tensor at a time (issue 30, docs/convert.md#streaming):
sharded safetensors with Hugging Face's index read back bit for bit by safetensors' own reader and by
parabench's Hugging Face reader, the same checksum as the state in memory, and the memory a write or a
read adds bounded by a few tensors, not by the state."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from parabench import canonical

MiB = 2**20


def _state(count: int = 6, shape=(7, 5)) -> canonical.CanonicalState:
    rng = np.random.default_rng(0)
    weights = {f"model.layers.{i}.w": rng.standard_normal(shape).astype(np.float32) for i in range(count)}
    weights["model.layers.0.w"][0, 0] = -0.0  # a negative zero must survive as it is
    moments = {k: {n: rng.standard_normal(shape).astype(np.float32) for n in weights} for k in canonical.MOMENTS}
    return canonical.CanonicalState(weights, moments, 3)


def test_sharded_write_reads_back_bitwise_through_the_index(tmp_path):
    from safetensors.numpy import load_file

    state = _state()
    manifest = canonical.write(tmp_path, state, [], {}, shard_bytes=300)  # 140 bytes a tensor: 2 a shard
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert manifest["files"]["weights"][:3] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert index["metadata"]["total_size"] == 6 * 140
    assert sorted(index["weight_map"]) == sorted(state.weights)
    for name, file in index["weight_map"].items():  # safetensors' own reader, file by file
        assert load_file(str(tmp_path / file))[name].tobytes() == state.weights[name].tobytes()
    opt_index = json.loads((tmp_path / "optimizer.safetensors.index.json").read_text())
    for flat, file in opt_index["weight_map"].items():
        key, name = flat.split("/", 1)
        assert load_file(str(tmp_path / file))[flat].tobytes() == state.moments[key][name].tobytes()
    loaded, _ = canonical.load(tmp_path)
    assert canonical.checksum(loaded) == manifest["checksum"] == canonical.checksum(state)
    single = canonical.write(tmp_path / "single", state, [], {})
    assert single["files"] == {"weights": ["model.safetensors"], "optimizer": ["optimizer.safetensors"]}
    assert single["checksum"] == manifest["checksum"]


def test_sharded_weights_read_as_model_weights(tmp_path):
    """``model.weights`` (parabench.hf, the path every backend initialises from) reads the index."""
    from parabench.hf import load_weights

    state = _state()
    canonical.write(tmp_path, state, [], {}, shard_bytes=300)
    read = load_weights(str(canonical.weights_file(tmp_path)), list(state.weights))
    assert all(read[n].tobytes() == v.tobytes() for n, v in state.weights.items())


def test_an_index_naming_a_file_elsewhere_is_refused(tmp_path):
    canonical.write(tmp_path, _state(), [], {}, shard_bytes=300)
    index = tmp_path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.layers.0.w"] = "../model-00001-of-00003.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="must name files beside it"):
        canonical.load(tmp_path)
    from parabench.convert.command import find_source
    from parabench.errors import SpecError

    with pytest.raises(SpecError, match="must name files beside it"):  # bench convert: exit 2, nothing written
        find_source(str(tmp_path))


def test_lazy_tensors_are_fetched_once_each_in_name_order_and_groups_released():
    state = _state(count=3)
    fetched: list[str] = []

    def fetch(name):
        fetched.append(name)
        return state.weights[name]

    gathers: list[str] = []

    def whole(key):
        gathers.append(key)
        return state.moments[key]

    shapes = {n: v.shape for n, v in state.weights.items()}
    moments = {k: canonical.Lazy(shapes, whole=lambda k=k: whole(k)) for k in canonical.MOMENTS}
    lazy = canonical.CanonicalState(canonical.Lazy(shapes, fetch), moments, 3)
    assert canonical.checksum(lazy) == canonical.checksum(state)
    assert fetched == sorted(state.weights) and gathers == ["exp_avg", "exp_avg_sq"]
    assert all(m._held is None for m in moments.values())  # each group dropped once passed
    assert canonical.size(lazy) == canonical.size(state) == (9, 9 * 140)


def test_a_rank_that_holds_none_of_a_group_only_takes_part():
    shapes = {"model.w": (2,)}
    calls = []
    part = canonical.Lazy(shapes, whole=lambda: calls.append(1) or {}, complete=False)
    assert (
        canonical.write(Path("/nonexistent"), canonical.CanonicalState(part, None, 1), None, {}, writing=False) is None
    )
    assert calls == [1]


def test_write_holds_one_tensor_at_a_time():
    """48 tensors of 1 MiB each per group (144 MiB of state), generated on access: the write's
    Python-heap peak (NumPy's allocations are traced) stays under a few tensors."""
    shapes = {f"model.layers.{i}.w": (256, 1024) for i in range(48)}

    def make(name):
        return np.full((256, 1024), float(len(name)), dtype=np.float32)

    moments = {k: canonical.Lazy(shapes, make) for k in canonical.MOMENTS}
    state = canonical.CanonicalState(canonical.Lazy(shapes, make), moments, 1)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tracemalloc.start()
        manifest = canonical.write(Path(d), state, [], {}, shard_bytes=16 * MiB)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert manifest["bytes"] == 144 * MiB and len(manifest["files"]["weights"]) == 4
    assert peak < 4 * MiB, f"peak {peak / MiB:.1f} MiB while writing 144 MiB"


READ_PEAK = textwrap.dedent(
    """
    import hashlib
    import sys
    from pathlib import Path
    from parabench import canonical

    def rss():  # resident now (VmRSS, proc(5)); ru_maxrss would keep torch's import peak
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    state, _ = canonical.load(Path(sys.argv[1]))
    next(canonical.stream(state))  # safetensors and torch loaded
    before, peak = rss(), 0
    for _, arr in canonical.stream(state):
        hashlib.sha256(arr).digest()  # reads every byte, as the checksum does
        peak = max(peak, rss())
    print(peak - before)
    """
)


def test_load_and_checksum_read_one_tensor_at_a_time(tmp_path):
    """A 192 MiB state (48 tensors of 4 MiB): reading it back tensor by tensor raises the reader's
    resident memory (its own process, after each tensor) by a few tensors, not by the state."""
    shapes = {f"model.layers.{i}.w": (1024, 1024) for i in range(16)}
    make = lambda name: np.full((1024, 1024), float(len(name)), dtype=np.float32)  # noqa: E731
    moments = {k: canonical.Lazy(shapes, make) for k in canonical.MOMENTS}
    canonical.write(tmp_path, canonical.CanonicalState(canonical.Lazy(shapes, make), moments, 1), [], {})
    proc = subprocess.run([sys.executable, "-c", READ_PEAK, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    grown = int(proc.stdout.strip())
    assert grown < 48 * MiB, f"reading 192 MiB raised the peak by {grown / MiB:.0f} MiB"
