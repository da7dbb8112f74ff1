"""The planner's GEMM-shape compute model and cluster peaks (issue 28), against hand-computed values
from outside sources: Meta's Llama 3 8B config.json (h 4096, 32 layers, 32 heads, 8 KV heads, FFN
14,336, vocabulary 128,256), PaLM's FLOPs per token (Chowdhery et al. 2022, App. B) and torchtitan's
op-level selective checkpointing policy (every second mm of a block recomputed)."""

from __future__ import annotations

import pytest
import yaml

from parabench.errors import SpecError
from parabench.spec import ModelSpec

LLAMA3_8B = ModelSpec("llama3-8b", 4096, 14336, 32, 32, 8, 128256)
# per layer: q 4096^2 + k, v 2 x 4096 x 1024 + o 4096^2 + MLP 3 x 4096 x 14336 = 218,103,808;
# x 32 layers + lm_head 128,256 x 4,096 = 7,504,658,432 matmul weights (the embedding is a lookup)
MATMUL_8B = 7_504_658_432


def test_gemm_flops_are_palm_6n_plus_causal_attention():
    from parabench.plan.gemms import forward_gemms

    seq = 8192
    gemms = forward_gemms(LLAMA3_8B, seq, micro_batch=1)
    # forward + backward = 3 x forward; PaLM's attention 12 L H Q T per token, halved by the causal kernel
    want = (6 * MATMUL_8B + 12 * 32 * 4096 * seq / 2) * seq
    assert 3 * sum(g.flops for g in gemms) == pytest.approx(want, rel=1e-12)
    assert want / seq == 51_470_401_536


def test_tensor_and_context_parallel_split_the_gemms():
    from parabench.plan.gemms import forward_gemms

    whole = {g.what: g for g in forward_gemms(LLAMA3_8B, 8192, 1)}
    split = {g.what: g for g in forward_gemms(LLAMA3_8B, 8192, 1, tp=8, cp=4)}
    # column-parallel qkv: (4096 + 2 x 1024) / 8 = 768 outputs; row-parallel down: 14336 / 8 = 1792 inputs
    assert split["qkv"].n == 768 and split["down"].k == 1792
    # context parallel: 8192 / 4 = 2048 query tokens of the micro-batch against all 8192 keys
    assert split["qkv"].m == 2048 and split["attention scores"].n == 8192
    assert sum(g.flops for g in split.values()) == pytest.approx(sum(g.flops for g in whole.values()) / 32)


def test_arithmetic_intensity_of_a_square_gemm():
    from parabench.plan.gemms import Curve, intensity

    # 2 n^3 FLOPs over 3 n^2 two-byte matrices: n / 3 FLOPs per byte
    assert intensity(4096, 4096, 4096) == pytest.approx(4096 / 3)
    curve = Curve(0.5, 4096 / 3)
    assert curve.eff(4096, 4096, 4096) == pytest.approx(0.25)  # at x = x0 the curve is at half its e_max


def test_torchtitan_op_selective_checkpointing_recomputes_k_o_and_w3():
    from parabench.plan.gemms import recompute_share

    # k 4096 x 1024 + o 4096^2 + w3 4096 x 14336 = 79,691,776 per layer, x 32 over all matmul weights
    assert recompute_share(LLAMA3_8B, "selective_op") == pytest.approx(32 * 79_691_776 / MATMUL_8B)
    assert recompute_share(LLAMA3_8B, "full") == 1.0 and recompute_share(LLAMA3_8B, "none") == 0.0


def test_cluster_peak_comes_from_the_cluster_file(tmp_path, monkeypatch):
    from parabench.plan import cluster as clusters

    h100 = clusters.load("h100-sxm")
    pk = clusters.peak(h100, "bf16", tmp_path)
    assert pk.tflops == 989 and "H100 datasheet" in pk.source  # NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16
    raw = yaml.safe_load((clusters.cluster_dir() / "h100-sxm.yaml").read_text())
    del raw["peak_tflops"]
    (tmp_path / "nopeak.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(clusters, "cluster_dir", lambda: tmp_path)
    with pytest.raises(SpecError) as err:
        clusters.load("nopeak")
    assert "no peak" in str(err.value) and "\n" not in str(err.value)


def test_tp_overlap_hides_tensor_parallel_collectives_behind_their_gemms():
    from test_plan import _job

    from parabench.plan.cluster import load
    from parabench.plan.estimate import (
        Calibration,
        Features,
        _fused_tp_gemms_s,
        estimate,
        fused_tp_hidden,
        plan_profile,
    )

    # GEMMs large enough against NVLink that each hides most of its collective (h 2048: a tiny model's
    # GEMMs hide less than megatron-core's asynchronous column backward pools behind two of them)
    wide = ("model.hidden_size=2048", "model.intermediate_size=5632", "model.num_attention_heads=16",
            "model.num_key_value_heads=16", "data.seq_len=1024")  # fmt: skip
    job = _job("megatron", 2, "run.precision=bf16", "data.global_batch_size=4", *wide, device="cuda", tp=2,
               sequence_parallel=True)  # fmt: skip
    plain = estimate(job, load("h100-sxm"), 989.0, Calibration())
    over = estimate(job, load("h100-sxm"), 989.0, Calibration(), features=Features(tp_overlap=True))
    # without tp_comm_overlap only the column-parallel backward's asynchronous collectives are hidden
    # (test_plan.py::test_column_parallel_backward_hides_its_collectives_behind_its_gemms)
    assert 0 < plain.overlap.hidden["tp"] < plain.overlap.total["tp"]
    assert (
        plain.overlap.hidden["tp"] < over.overlap.hidden["tp"] <= plain.overlap.total["tp"] * (1 + 1e-12)
    )  # at most the GEMMs' time (and the total: equal here but for the float sums' order)
    assert over.step_s == pytest.approx(plain.step_s - (over.overlap.hidden["tp"] - plain.overlap.hidden["tp"]))
    # each collective behind the GEMM it is fused with (mc2, TE userbuffers), not behind all of them
    gemm_s = _fused_tp_gemms_s(job, plan_profile(job).layout(job), load("h100-sxm"), 989.0, Calibration())
    assert set(gemm_s) == {"qkv", "o", "gate+up", "down"}
    fused = fused_tp_hidden(over.overlap.total["tp"], gemm_s)
    assert over.overlap.hidden["tp"] == pytest.approx(max(fused, plain.overlap.hidden["tp"]))
    # a GEMM large enough hides all of its collectives
    assert fused_tp_hidden(1.0, {k: 1.0 for k in gemm_s}) == pytest.approx(1.0)


def test_memory_bound_bytes_are_counted_per_op_of_the_layers_and_the_logits():
    from parabench.plan.gemms import Curve, elementwise_bytes, layer_bytes, logit_bytes, step_compute_s

    # fused kernels (TE / MindSpeed): per token and layer 2 bytes x (22 h + 4 (q + kv) + 8 i)
    fused = 2 * (22 * 4096 + 4 * (4096 + 1024) + 8 * 14336)
    assert layer_bytes(LLAMA3_8B) == fused == 450_560
    # torchtitan eager: fp32 RMSNorms (132 bytes per element, twice), residual adds (30), RoPE in complex
    # fp32 on q and k (60), the attention output's copy and repeat_kv (12 q + 12 q + 12 kv), SwiGLU (38 i)
    eager = 294 * 4096 + 84 * 4096 + 72 * 1024 + 38 * 14336
    assert layer_bytes(LLAMA3_8B, "eager") == eager == 2_166_784
    # megatron-core's fp32 vocab-parallel cross-entropy: 52 bytes per logit, V / tp logits per token
    assert logit_bytes(LLAMA3_8B, 8192, 2, tp=8) == 16384 * 52 * 128256 / 8
    # Llama 3 8B, 2 x 8192 tokens, tp 8: the logits are 32% of the fused bytes, not 80% (V / (L h + V))
    total = elementwise_bytes(LLAMA3_8B, 8192, 2, tp=8)
    assert total == 16384 * (32 * fused / 8 + 52 * 128256 / 8)
    assert logit_bytes(LLAMA3_8B, 8192, 2, tp=8) / total == pytest.approx(0.316, abs=1e-3)
    # beta seconds per byte, per micro-batch, over the pp stages: nothing else when there is no GEMM
    assert step_compute_s([], 4, 2, 1e15, Curve(0.5, 100.0, 1e-12), 0.0, total) == pytest.approx(1e-12 * total * 4 / 2)


def test_fused_tp_collectives_hide_only_behind_their_own_gemm():
    from parabench.plan.estimate import fused_tp_hidden

    # sequence parallelism: 10 collectives per layer of 1 s each, 3 in qkv's and gate+up's GEMMs
    # (forward all-gather, re-gather behind dgrad, reduce-scatter behind wgrad), 2 in o's and down's
    # (forward reduce-scatter, all-gather behind dgrad); each hidden up to its GEMM (one forward pass)
    gemm = {"qkv": 0.5, "o": 2.0, "gate+up": 3.0, "down": 0.25, "attention scores": 100.0}
    assert fused_tp_hidden(10.0, gemm) == pytest.approx(3 * 0.5 + 2 * 1.0 + 3 * 1.0 + 2 * 0.25)
    # without it 4 all-reduces: o's and down's forward, qkv's and gate+up's input gradients
    assert fused_tp_hidden(4.0, gemm, sequence_parallel=False) == pytest.approx(0.5 + 1.0 + 1.0 + 0.25)
    assert fused_tp_hidden(8.0, {}) == 0.0  # nothing to hide behind


def test_published_rows_name_their_source_and_megatron_tokens_follow_narayanan(monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "plan_published.py"
    spec = importlib.util.spec_from_file_location("plan_published", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "plan_published", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    doc = yaml.safe_load(mod.DATA.read_text())
    for raw in doc["rows"]:
        src = doc["sources"][raw["source"]]
        assert len(src["commit"]) == 40 and src["file"], raw["id"]
    # Megatron-LM README, GPT 1.7B (24 layers, h 2048, V 131,072, s 4,096) at 408.8 TFLOP/s per GPU:
    # 72 l h^2 + 12 l h s + 6 V h = 7,247,757,312 + 2,415,919,104 + 1,610,612,736 FLOPs per token
    row = next(r for r in doc["rows"] if r["id"] == "mlm-1.7b")
    assert mod.published_tokens(row) == pytest.approx(408.8e12 / 11_274_289_152)
    assert 408.8 / 989 == pytest.approx(row["published"]["mfu"], abs=0.005)  # the table's 41% MFU


def test_plan_states_each_overlap_mechanism():
    from test_plan import _job

    from parabench.plan.cluster import load
    from parabench.plan.estimate import Calibration, estimate
    from parabench.plan.search import why_wins

    job = _job("megatron", 4, "run.precision=bf16", "data.global_batch_size=8", device="cuda", tp=2,
               sequence_parallel=True, overlap_grad_reduce=True)  # fmt: skip
    e = estimate(job, load("h100-sxm"), 989.0, Calibration())
    why = why_wins(e, e)
    # dp 2 x tp 2: the gradient all-reduce is overlapped (overlap_grad_reduce), of the tp collectives
    # only the column-parallel backward's (no harness option turns on tp_comm_overlap), and the plan says both
    assert "hidden: dp grad reduce " in why and ", tp " in why
    assert 0 < e.overlap.hidden["tp"] < e.overlap.total["tp"]
    assert e.overlap.hidden["dp grad reduce"] == pytest.approx(e.overlap.total["dp grad reduce"])


def test_cluster_peaks_agree_with_the_mfu_table():
    # a cluster file's peak and the table bench run's MFU uses (parabench.flops) must not drift apart
    from parabench.flops import table_peak
    from parabench.plan import cluster as clusters

    for name in clusters.available():
        c = clusters.load(name)
        for precision, tflops in (c.peak_tflops or {}).items():
            table = table_peak(c.device_name, precision)
            assert table is None or table.tflops == tflops, (name, precision)


# Llama 3 8B's head: 4,096 / 32 heads = 128 dimensions (Meta's config.json)
def test_flash_attention_backward_is_two_and_a_half_forwards():
    from parabench.plan.gemms import Curve, forward_gemms, step_compute_s

    # FlashAttention-2 (Dao 2023, sec. 4.1): the backward's FLOPs are 2.5 x the forward's (2 matmuls
    # in the forward, 5 in the backward, which recomputes the scores)
    attention = [g for g in forward_gemms(LLAMA3_8B, 8192, 1) if g.what.startswith("attention")]
    forward = sum(g.flops for g in attention)
    at_peak = Curve(1.0, 1e-9)  # every GEMM at the peak, no exponential cost
    assert step_compute_s(attention, 1, 1, 1e15, at_peak, 0.0) == pytest.approx(forward * (1 + 2.5) / 1e15)


def test_h100_exponentials_cost_half_the_attention_matmul_time_at_head_dim_128():
    from parabench.plan.gemms import CURVES, H100_SFU_RATIO, forward_gemms

    # FlashAttention-3 (Shah et al. 2024, sec. 1): the H100 SXM5 has 989 TFLOPS of FP16 matmul but 3.9
    # TFLOPS of special functions; at head dimension 128, 512x more matmul FLOPs than exponentials,
    # so the exponential takes 50% of the matmul's cycle time
    assert 989 / H100_SFU_RATIO == pytest.approx(3.9, abs=0.05)
    assert CURVES["cuda"].sfu_ratio == H100_SFU_RATIO
    attention = [g for g in forward_gemms(LLAMA3_8B, 8192, 1) if g.what.startswith("attention")]
    scores = sum(g.scores for g in attention)
    assert sum(g.flops for g in attention) / scores == 512  # 4 x 128 matmul FLOPs per exponential
    assert scores * H100_SFU_RATIO / sum(g.flops for g in attention) == pytest.approx(0.5, abs=0.01)
    # 32 heads, 8,192 queries against 8,192 keys, half of them under the causal mask, 32 layers
    assert scores == 32 * 8192 * 8192 / 2 * 32


def test_gpu_softmax_time_adds_to_the_attention_gemms():
    from parabench.plan.gemms import Curve, forward_gemms, step_compute_s

    # FlashAttention-2 runs the softmax between its two GEMMs in the same warps: the times add up;
    # one exponential per score in the forward and one in the backward's recomputation (Algorithm 2)
    attention = [g for g in forward_gemms(LLAMA3_8B, 8192, 1) if g.what.startswith("attention")]
    gemm = sum(g.flops for g in attention) * 3.5 / 1e15  # forward + FlashAttention's backward at the peak
    exps = sum(g.scores for g in attention) * 2 / 1e15
    h100 = Curve(1.0, 1e-9, sfu_ratio=256.0)
    assert step_compute_s(attention, 1, 1, 1e15, h100, 0.0) == pytest.approx(gemm + 256 * exps)
    # at head dimension 128: 2 exponentials x 256 against 14 x 128 FLOPs per score, 2 / 7 more time
    assert step_compute_s(attention, 1, 1, 1e15, h100, 0.0) == pytest.approx(gemm * (1 + 2 * 256 / (14 * 128)))


def test_torchtitan_op_selective_checkpointing_keeps_the_saved_mm_outputs_only():
    import dataclasses

    from test_plan import _job

    from parabench.plan.estimate import activation_bytes, op_sac_layer_bytes

    base = _job("fsdp", 2, "run.precision=bf16", "data.global_batch_size=4", "data.micro_batch_size=2")
    job = dataclasses.replace(base, model=LLAMA3_8B, data=dataclasses.replace(base.data, seq_len=8192))
    # per token and layer: the block's input (h), q (4096), v (1024), the attention output (4096),
    # w1 (14336) and w2's output (h), 2 bytes each (torchtitan 9dec370 ``_custom_policy``)
    tokens = 2 * 8192
    assert op_sac_layer_bytes(job) == 2 * tokens * (2 * 4096 + 2 * 4096 + 1024 + 14336) == 1_040_187_392
    # 32 layers of it + one layer's activations during its recompute + the fp32 logits and their
    # gradient: 48.8 GiB, where Korthikanti's selective recompute (34 s b h per layer) charged 80 GiB
    # (torchtitan measured 82.4 GiB in all with 15 GiB of states on 8 GPUs)
    op = activation_bytes(job, "selective_op", fused_attention=True, vocab_parallel=False)
    korthikanti = activation_bytes(job, "selective", fused_attention=True, vocab_parallel=False)
    logits = 2 * tokens * 128256 * 4
    assert op == pytest.approx(32 * op_sac_layer_bytes(job) + 34 * tokens * 4096 + logits)
    assert korthikanti == pytest.approx(32 * 34 * tokens * 4096 + logits)


# Qwen2 0.5B's config.json (Qwen/Qwen2-0.5B): hidden 896, 14 heads (head dimension 64), 2 KV heads,
# 24 layers, FFN 4,864, vocabulary 151,936
QWEN2_05B = ModelSpec("qwen2-0.5b", 896, 4864, 24, 14, 2, 151936)


def test_npu_attention_runs_at_its_per_head_gemm_shape():
    from parabench.plan.gemms import CURVES, Curve, forward_gemms, step_compute_s

    # CANN 8.0.RC3 Ascend C guide, basic architecture: on the separated architecture (Atlas A2: the
    # 910B) AIC (cube) and AIV (vector) are two cores that pass data through global memory, so the
    # fused attention's score tiles leave the cube core for the softmax and come back: its GEMMs run
    # as GEMMs of their per-head shape, scores s x s x d and their product with V s x d x s
    assert CURVES["npu"].attention_at_shape and not CURVES["cuda"].attention_at_shape
    npu = Curve(0.5, 100.0, attention_at_shape=True)
    for model, seq, d in ((LLAMA3_8B, 8192, 128), (QWEN2_05B, 32768, 64)):
        attention = [g for g in forward_gemms(model, seq, 1) if g.what.startswith("attention")]
        forward = sum(g.flops for g in attention)
        x = seq * seq * d / (2 * seq * d + seq * seq)  # both GEMMs: s^2 d FLOPs over s d + s d + s^2
        want = forward * 3.5 / (1e15 * 0.5 * x / (x + 100.0))
        assert step_compute_s(attention, 1, 1, 1e15, npu, 0.0) == pytest.approx(want, rel=1e-12)
    # 8192 x 128 / 8448 = 124.1 FLOPs per byte at head dimension 128, 32768 x 64 / 32896 = 63.75 at
    # 64: the same scores cost 0.5 x 63.75 / 163.75 against 0.5 x 124.1 / 224.1 of the peak, 1.42 x
    # the time per FLOP; on a GPU both run at e_max
    gpu = Curve(0.5, 100.0)
    attention = [g for g in forward_gemms(QWEN2_05B, 32768, 1) if g.what.startswith("attention")]
    assert step_compute_s(attention, 1, 1, 1e15, gpu, 0.0) == pytest.approx(
        sum(g.flops for g in attention) * 3.5 / (1e15 * 0.5), rel=1e-12
    )
