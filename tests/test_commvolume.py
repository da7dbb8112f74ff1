"""bench/commvolume.py against the published per-step volumes (docs/sources.md#communication-volume)."""

from __future__ import annotations

import pytest

from parabench.commvolume import (
    Batch,
    Layout,
    Widths,
    bus_factor,
    deepspeed_flat_numel,
    fsdp2_padded_numel,
    step_comm,
    zero3_padded_numel,
)
from parabench.spec import ModelSpec

MODEL = ModelSpec(
    "t",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
FP32 = Widths.for_precision("fp32")
ONE = Batch(seq_len=32, micro_batch_size=2, micro_batches=1)


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_factor("all_gather", 8) == bus_factor("reduce_scatter", 8) == 7 / 8
    assert bus_factor("send", 2) == 1.0 and bus_factor("all_reduce", 1) == 0.0


@pytest.mark.parametrize(
    ("sharding", "psis"),
    [("none", 2), ("zero1", 2), ("zero2", 2), ("distributed_optimizer", 2), ("zero3", 3)],
)
def test_zero_paper_section_7_volumes(sharding, psis):
    # Rajbhandari et al. 2020 (ZeRO) sec. 7: DDP and ZeRO-1/2 move 2 Psi per rank, ZeRO-3 3 Psi
    # (in the limit of many ranks: bus factors (n-1)/n -> 1).
    n, psi = 1024, 1_000_000
    comm = step_comm(MODEL, Layout(dp=n, sharding=sharding), ONE, Widths(1, 1, 1), dp_elements=psi)
    assert comm.bus_bytes("dp") == pytest.approx(psis * psi * (n - 1) / n)


def test_gradient_accumulation_changes_only_what_syncs_per_micro_batch():
    four = Batch(seq_len=32, micro_batch_size=2, micro_batches=4)
    kw = dict(dp_elements=1000)
    base = {
        s: step_comm(MODEL, Layout(dp=2, sharding=s), ONE, FP32, **kw).bus_bytes() for s in ("none", "zero2", "zero3")
    }
    acc = {
        s: step_comm(MODEL, Layout(dp=2, sharding=s), four, FP32, **kw).bus_bytes() for s in ("none", "zero2", "zero3")
    }
    assert acc["none"] == base["none"]  # DDP syncs on the last micro-batch only
    assert acc["zero2"] == pytest.approx(base["zero2"] * 2.5)  # RS x4 + AG x1 vs RS + AG
    assert acc["zero3"] == pytest.approx(base["zero3"] * 4)


def test_fsdp_root_gathered_once_per_micro_batch():
    psi = MODEL.num_params()
    comm = step_comm(MODEL, Layout(dp=2, sharding="fsdp"), ONE, FP32, dp_elements=psi, root_elements=100)
    gathers = sum(c.size_bytes * c.calls for c in comm.collectives if c.kind == "all_gather")
    assert gathers == 4 * (2 * (psi - 100) + 100)


def test_tensor_parallel_four_all_reduces_per_layer():
    # Shoeybi et al. 2019 sec. 3: 2 fwd + 2 bwd all-reduces of b*s*h per layer and micro-batch.
    comm = step_comm(MODEL, Layout(tp=2), ONE, FP32)
    layer = [c for c in comm.collectives if c.what.startswith("TP:")]
    assert layer[0].calls == 4 * MODEL.num_hidden_layers and layer[0].size_bytes == 2 * 32 * 64 * 4
    sp = step_comm(MODEL, Layout(tp=2, sequence_parallel=True), ONE, FP32)
    kinds = sp.by_kind()
    assert set(kinds) == {"all_gather", "reduce_scatter", "all_reduce"}  # all_reduce: cross entropy only
    full = step_comm(MODEL, Layout(tp=2, recompute="full"), ONE, FP32)
    assert [c.calls for c in full.collectives if c.what.startswith("TP:")] == [6 * MODEL.num_hidden_layers]


def test_pipeline_boundaries():
    # Narayanan et al. 2021 sec. 2.2: one activation forward, its gradient back, per boundary and micro-batch.
    m8 = Batch(seq_len=32, micro_batch_size=2, micro_batches=8)
    two = step_comm(MODEL, Layout(pp=2), m8, FP32)
    four = step_comm(MODEL, Layout(pp=4, vpp=2), m8, FP32)
    sends = lambda c: [x for x in c.collectives if x.kind == "send"][0]  # noqa: E731
    assert sends(two).calls == 8 and sends(two).size_bytes == 2 * 32 * 64 * 4
    assert sends(four).calls == 2 * 2 * 8


def test_padding_rules():
    assert fsdp2_padded_numel([(5, 3), (4,)], 2) == 6 * 3 + 4
    assert deepspeed_flat_numel([7, 8], 2) == 8 + 8
    assert zero3_padded_numel([7, 9], 4) == 8 + 12
