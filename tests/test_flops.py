"""MFU's three factors against numbers computed by hand: FLOPs per token of published models, the
datasheet peak of known devices (none for unknown ones), and the MFU arithmetic itself."""

import pytest

from parabench.devices import DEVICES
from parabench.flops import flops_per_token, table_peak
from parabench.hydraconfig import compose, to_plain
from parabench.metrics import summarize
from parabench.spec import ModelSpec, build


def _preset(name: str) -> ModelSpec:
    return build(ModelSpec, to_plain(compose([f"+model={name}"]))["model"], "model")


def _palm_flops_per_token(matmul_params: int, layers: int, heads: int, head_dim: int, seq_len: int) -> int:
    """PaLM (Chowdhery et al. 2022, arXiv 2204.02311), Appendix B: 6N + 12 L H Q T per token."""
    return 6 * matmul_params + 12 * layers * heads * head_dim * seq_len


def test_llama2_7b_parameters_and_flops_per_token_by_hand():
    # Llama-2-7B (Touvron et al. 2023, arXiv 2307.09288; meta-llama/Llama-2-7b-hf config.json):
    # d=4096, ffn=11008, 32 layers, 32 heads (no GQA), vocab 32000, untied embeddings.
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096  # q,k,v,o + gate,up,down + 2 RMSNorms
    embedding = lm_head = 32000 * 4096
    total = embedding + 32 * per_layer + 4096 + lm_head  # + final norm
    assert total == 6_738_415_616  # the published count of Llama-2-7B (6.74B)
    matmul = total - embedding  # the input embedding is a gather, lm_head a matmul
    model = _preset("llama2-7b")
    assert model.num_params() == total and model.num_matmul_params() == matmul
    expected = _palm_flops_per_token(matmul, 32, 32, 128, 4096)
    assert expected == 46_086_512_640  # 6 x 6,607,343,616 + 12 x 32 x 32 x 128 x 4096
    assert flops_per_token(model, 4096) == expected


def test_llama3_8b_grouped_query_attention_by_hand():
    # Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json): d=4096, ffn=14336, 32 layers,
    # 32 query heads, 8 key/value heads (k and v project to 8 x 128), vocab 128256, untied.
    per_layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    embedding = lm_head = 128256 * 4096
    total = embedding + 32 * per_layer + 4096 + lm_head
    assert total == 8_030_261_248  # the published count of Llama-3-8B
    model = _preset("llama3-8b")
    assert model.num_params() == total
    # The attention term counts query heads (H x Q = d): GQA shrinks N, not the score/context matmuls.
    assert flops_per_token(model, 8192) == _palm_flops_per_token(total - embedding, 32, 32, 128, 8192)


@pytest.mark.parametrize(
    ("device_name", "precision", "tflops"),
    [
        # NVIDIA datasheets, dense (without 2:4 sparsity) tensor-core peaks
        ("NVIDIA A100-SXM4-80GB", "bf16", 312),
        ("NVIDIA A100 80GB PCIe", "fp16", 312),
        ("NVIDIA A100-SXM4-40GB", "fp32", 19.5),  # fp32 without TF32
        ("NVIDIA H100 80GB HBM3", "bf16", 989),  # SXM
        ("NVIDIA H100 PCIe", "bf16", 756),  # the longer key wins over "H100"
        ("NVIDIA H200", "bf16", 989),
    ],
)
def test_known_accelerators_get_their_datasheet_peak(device_name, precision, tflops, tmp_path):
    peak = DEVICES["cuda"].peak(precision, 1, tmp_path, device_name)
    assert peak is not None and peak.tflops == tflops and not peak.uncertain and "datasheet" in peak.source
    assert not list(tmp_path.iterdir())  # a table lookup, nothing measured or cached


def test_ascend_910b_peak_is_marked_uncertain(tmp_path):
    peak = DEVICES["npu"].peak("bf16", 1, tmp_path, "Ascend910B3")
    assert peak is not None and peak.tflops == 363.7 and peak.uncertain


@pytest.mark.parametrize(
    ("device_name", "precision"),
    [
        ("NVIDIA GeForce RTX 4090", "bf16"),  # not in the table
        ("NVIDIA A10", "bf16"),  # a prefix of "A100" must not match it
        ("NVIDIA H100 NVL", "bf16"),  # an H100 variant without a figure here must not take the SXM peak
        ("Ascend910B3", "fp32"),  # known device, no published fp32 figure
    ],
)
def test_unknown_peak_gives_no_mfu(device_name, precision, tmp_path):
    assert table_peak(device_name, precision) is None
    assert DEVICES["cuda"].peak(precision, 1, tmp_path, device_name) is None
    summary = summarize(_ranks([[1.0]]), tokens_per_step=100, flops_token=1e9, peak_tflops=None)
    assert summary["mfu"] is None and summary["achieved_tflops_per_device"] == pytest.approx(1e-1)


def _ranks(step_times: list[list[float]]) -> list[dict]:
    return [
        {"rank": r, "step_times": t, "losses": [2.0, 1.0], "peak_memory_bytes": 1, "model_state": {"total": 1}}
        for r, t in enumerate(step_times)
    ]


def test_mfu_is_achieved_over_peak_with_the_slowest_rank_per_step():
    # step times: rank 0 [1.0, 2.0], rank 1 [1.5, 1.0] -> slowest per step [1.5, 2.0], 3.5 s in all;
    # 2 steps x 7000 tokens / 3.5 s = 4000 tokens/s, 2000 per device; x 1e9 FLOPs/token = 2 TFLOP/s;
    # on an 8 TFLOP/s peak: MFU 0.25.
    s = summarize(_ranks([[1.0, 2.0], [1.5, 1.0]]), tokens_per_step=7000, flops_token=1e9, peak_tflops=8.0)
    assert s["tokens_per_s"] == pytest.approx(4000)
    assert s["tokens_per_s_per_device"] == pytest.approx(2000)
    assert s["achieved_tflops_per_device"] == pytest.approx(2.0)
    assert s["mfu"] == pytest.approx(0.25)


def test_the_cpu_peak_is_the_highest_measurement_and_says_when(tmp_path, monkeypatch):
    """Three runs on one CPU model and thread count measure 0.054, 0.373 and 0.2 TFLOP/s (a loaded
    machine, then an idle one, then a loaded one): the peak is 0.054 only until a higher
    measurement, and 0.373 with its time from then on; another thread count keeps its own."""
    import parabench.flops as flops

    measured = iter([0.054, 0.373, 0.2, 0.1])
    monkeypatch.setattr(flops, "_gemm_tflops", lambda threads, precision: next(measured), raising=False)
    clock = iter(["2026-12-05T13:00:00Z", "2026-12-05T14:00:00Z", "2026-12-05T15:00:00Z", "2026-12-05T16:00:00Z"])
    monkeypatch.setattr(flops.time, "strftime", lambda fmt, t=None: next(clock))
    peaks = [flops.cpu_gemm_peak(2, "fp32", tmp_path, "Some CPU") for _ in range(3)]
    assert [p.tflops for p in peaks] == [0.054, 0.373, 0.373]
    assert peaks[2].measured_at == "2026-12-05T14:00:00Z" and "measured 2026-12-05T14:00:00Z" in peaks[2].source
    assert "this run: 0.2" in peaks[2].source
    other = flops.cpu_gemm_peak(1, "fp32", tmp_path, "Some CPU")
    assert other.tflops == 0.1 and other.measured_at == "2026-12-05T16:00:00Z"


def test_a_ranks_gemm_reading_is_kept_without_measuring_again(tmp_path, monkeypatch):
    """The bench parent takes rank 0's reading (parabench.worker) into the highest-seen cache and
    measures nothing itself; rank 0 reads only on a CPU-peak device, other ranks and a user-supplied
    peak never do."""
    import parabench.flops as flops
    from parabench import worker
    from parabench.flops import GemmReading

    def no_measurement(threads, precision):
        raise AssertionError("measured in the parent")

    monkeypatch.setattr(flops, "_gemm_tflops", no_measurement)
    peak = DEVICES["cpu"].peak("fp32", 1, tmp_path, "Some CPU", GemmReading(0.05, "2.13.0+cpu"))
    assert peak.tflops == 0.05 and "this run: 0.05" in peak.source
    assert "Some CPU|threads=1|fp32|torch=2.13.0+cpu" in (tmp_path / "cpu_gemm_peak.json").read_text()
    assert DEVICES["cpu"].peak("fp32", 1, tmp_path, "Some CPU", GemmReading(0.04, "2.13.0+cpu")).tflops == 0.05

    monkeypatch.setattr(flops, "_gemm_tflops", lambda threads, precision: 0.07)
    from parabench.jobs import from_config

    job = from_config(to_plain(compose(["+model=llama", "device=cpu"])))
    assert worker._peak_reading(job, 0) == {"tflops": 0.07, "torch_version": __import__("torch").__version__}
    assert worker._peak_reading(job, 1) is None
    assert (
        worker._peak_reading(from_config(to_plain(compose(["+model=llama", "device=cpu", "device.peak_tflops=1"]))), 0)
        is None
    )
    assert DEVICES["cuda"].read_peak("bf16", 1) is None  # a datasheet device
