"""bench plan: the memory model against published figures and the adapters' formulas, the
search's refusals, and a plan end to end (docs/plan.md)."""

from __future__ import annotations

import copy
import json
import math

import pytest

from parabench.adapters.registry import get_adapter
from parabench.confutil import compose, to_plain
from parabench.plan.estimate import gpt_parameters
from parabench.plan.profiles import PROFILES, zero_partition_grad_numel
from parabench.runner import prepare

GB = 1e9


def _job(backend: str, world: int, *overrides: str, device: str = "cpu", **options):
    plain = to_plain(compose(["+model=llama", f"backend={backend}", *overrides]))
    cfg = copy.deepcopy(plain)
    cfg["backend"].update(options)
    cfg["launcher"].update(nproc_per_node=world, dry_run=True)
    cfg["device"]["type"] = device
    cfg["tracking"]["enabled"] = False
    return prepare(cfg)


LAYOUTS = [
    ("ddp", 2, {}),
    ("mindspore", 2, {}),
    ("fsdp", 2, {}),
    ("deepspeed", 2, {"zero_stage": 0}),
    ("deepspeed", 2, {"zero_stage": 1}),
    ("deepspeed", 2, {"zero_stage": 2}),
    ("deepspeed", 2, {"zero_stage": 3, "stage3_param_persistence_threshold": 0}),  # the paper's ZeRO-3
    ("megatron", 2, {"tp": 2}),
    ("megatron", 2, {"pp": 2}),
    ("megatron", 2, {}),
    ("megatron", 2, {"distributed_optimizer": True}),
]


@pytest.mark.parametrize(
    ("backend", "world", "options", "precision"),
    [(*layout, p) for layout in LAYOUTS for p in ("fp32", "bf16") if not (layout[0] == "mindspore" and p == "bf16")],
)  # mindspore runs fp32 only
def test_breakdown_is_the_adapters_published_formula_plus_padding(backend, world, options, precision):
    # two micro-batches per step: ZeRO-1 then holds full gradients, as the paper's stage 1 does
    job = _job(backend, world, f"run.precision={precision}", "data.global_batch_size=8", **options)
    states = PROFILES[backend].states(job)
    formula = get_adapter(backend).expected_model_state(job).bytes
    pad = states.total - states.boundary - formula  # boundary: ZeRO-1/2 gradients kept beyond the partition
    assert 0 <= pad < 16 * 128 * job.parallel.dp, (states, formula)


@pytest.mark.parametrize(
    ("stage", "published_gb"),
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],
)
def test_zero_paper_figure_1(stage, published_gb):
    # Rajbhandari et al. 2020 (ZeRO, arXiv 1910.02054) Figure 1: per-device model-state memory of a
    # 7.5B-parameter model on Nd = 64 devices with mixed-precision Adam (K = 12): baseline 120 GB,
    # Pos 31.4 GB, Pos+g 16.6 GB, Pos+g+p 1.9 GB. The planner's bytes per parameter for a bf16
    # DeepSpeed job over 64 ranks, times 7.5e9 parameters, give the figure's numbers.
    job = _job(
        "deepspeed", 64, "run.precision=bf16", "data.global_batch_size=256", zero_stage=stage,
        stage3_param_persistence_threshold=0,  # the paper partitions every parameter
    )  # fmt: skip
    states = PROFILES["deepspeed"].states(job)
    # the paper partitions gradients exactly; DeepSpeed keeps boundary parameters' gradients whole
    # (the test below pins that against measured bytes), which the figure has no term for
    per_param = (states.total - states.boundary) / job.model.num_params()
    assert per_param * 7.5e9 / GB == pytest.approx(published_gb, abs=0.05)


def test_zero1_without_accumulation_keeps_only_its_gradient_partition():
    # With one micro-batch per step DeepSpeed's stage 1 reduces straight into the partition
    # (measured: benchmarks/plan_loo.py); with accumulation it keeps full gradients.
    one, two = (_job("deepspeed", 2, f"data.global_batch_size={g}", zero_stage=1) for g in (4, 8))
    assert one.grad_accum == 1 and two.grad_accum == 2
    psi = one.model.num_params()
    assert PROFILES["deepspeed"].states(two).grads == 4 * psi
    held = PROFILES["deepspeed"].states(one)
    assert held.grads == 4 * psi / 2 + held.boundary and held.boundary >= 0


def test_zero_boundary_parameters_keep_their_whole_gradient():
    # stage_1_and_2.py get_partition_info: a parameter belongs to every partition it starts in or
    # straddles into; copy_grads_in_partition keeps the whole gradient of each. By hand: one group
    # [10, 6, 8] over 2 ranks is 24 elements (already a multiple of 2 x 2), partitions of 12:
    # rank 0 holds 10 + 6 (the 6 starts at 10 < 12), rank 1 holds 6 (straddles 12) + 8 = 14.
    assert zero_partition_grad_numel([[10, 6, 8]], 2) == 16
    # a second group [3] is padded to 4, partitions of 2: rank 0 holds the 3, rank 1 too (straddles)
    assert zero_partition_grad_numel([[10, 6, 8], [3]], 2) == 16 + 3
    assert zero_partition_grad_numel([[4, 4]], 2) == 4  # boundaries on parameter edges: the exact split


def test_zero3_persistent_parameters_stay_whole():
    # DeepSpeed keeps parameters of at most stage3_param_persistence_threshold elements (default
    # 1e5) whole on every rank beside their partition (partition_parameters.py, ds_persist).
    job = _job("deepspeed", 2, zero_stage=3)
    whole = _job("deepspeed", 2, zero_stage=3, stage3_param_persistence_threshold=0)
    small = sum(-(-math.prod(s) // 2) * 2 for s in job.model.parameter_shapes().values() if math.prod(s) <= 1e5)
    extra = PROFILES["deepspeed"].states(job).params - PROFILES["deepspeed"].states(whole).params
    assert extra == 4 * small > 0


# Narayanan et al. 2021 (arXiv 2104.04473) Table 1: (parameters in billions, heads, hidden size,
# layers); vocabulary 51,200 and sequence length 2,048 (section 5.1).
TABLE_1 = [
    (1.7, 24, 2304, 24),
    (3.6, 32, 3072, 30),
    (7.5, 32, 4096, 36),
    (18.4, 48, 6144, 40),
    (39.1, 64, 8192, 48),
    (76.1, 80, 10240, 60),
    (145.6, 96, 12288, 80),
    (310.1, 128, 16384, 96),
    (529.6, 128, 20480, 105),
    (1008.0, 160, 25600, 128),
]


@pytest.mark.parametrize(("billions", "heads", "hidden", "layers"), TABLE_1)
def test_megatron_2021_eq2_parameter_count(billions, heads, hidden, layers):
    # Eq. 2 of Narayanan et al. 2021 reproduces every row of their Table 1 to its printed precision.
    assert gpt_parameters(layers, hidden, 51200, 2048) / 1e9 == pytest.approx(billions, abs=0.051)


def _plan(capsys, *args: str) -> tuple[int, str, str]:
    from parabench.cli import main

    code = main(["plan", *args, "tracking.enabled=false"])
    out, err = capsys.readouterr()
    return code, out, err


def test_unknown_cluster_one_line_exit_2(capsys):
    code, out, err = _plan(capsys, "+model=llama", "cluster=dgx-nowhere")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("bench: error: cluster: unknown cluster 'dgx-nowhere'") and "h100-sxm" in err


def test_impossible_batch_one_line_exit_2(capsys):
    code, out, err = _plan(
        capsys, "+model=llama", "cluster=cpu", "plan.backends=[ddp,fsdp]", "data.global_batch_size=3"
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "data.global_batch_size" in err and "3" in err


def test_fits_nowhere_says_by_how_much(capsys):
    code, out, err = _plan(capsys, "+model=llama3-70b", "cluster=cpu", "plan.backends=[ddp]")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "fits nowhere" in err and "GiB more than" in err


def test_plan_json_rows_are_runnable_overrides(capsys, tmp_path):
    code, out, err = _plan(
        capsys, "+model=llama", "cluster=cpu", "plan.backends=[ddp,deepspeed,megatron]", "plan.top=3",
        "--format", "json", "--emit-bundle", str(tmp_path / "bundle"),
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert len(doc["ranked"]) == 3 and doc["context"]["cluster"] == "cpu"
    best = doc["ranked"][0]
    assert best["overrides"].startswith("backend=") and math.isfinite(best["step_s"])
    assert "no calibration" in doc["context"]["calibration"]
    assert (tmp_path / "bundle" / "launch.sh").is_file()


def test_h100_70b_plan_prefers_model_parallel_and_says_why(capsys):
    code, out, err = _plan(
        capsys, "+model=llama3-70b", "cluster=h100-sxm", "plan.devices=64", "data.global_batch_size=512",
        "data.seq_len=4096", "run.precision=bf16", "--format", "json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(out)
    assert all(r["margin_gib"] >= 0 for r in doc["ranked"])
    assert doc["ranked"][0]["why"].startswith("fastest that fits")
    assert any(r["why"].startswith("does not fit by") for r in doc["rejected"])


# A small Llama whose shapes do not split evenly over 3 ranks (FSDP2 and DeepSpeed pad), one step.
TINY = [
    "+model=llama", "model.vocab_size=1000", "model.hidden_size=64", "model.intermediate_size=172",
    "model.num_hidden_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
    "data.seq_len=32", "run.warmup_steps=0", "run.steps=1", "run.checksum=false",
]  # fmt: skip
MEASURED = [  # (sweep of one bench run -m, ranks): every CPU configuration parabench runs
    (["backend=ddp"], 2),
    (["backend=mindspore"], 2),
    (["backend=fsdp"], 3),
    (["backend=deepspeed", "backend.zero_stage=0,1,2,3"], 3),
    (["backend=deepspeed", "backend.zero_stage=1", "data.global_batch_size=3"], 3),  # one micro-batch per step
    (["backend=megatron", "backend.tp=2", "backend.sequence_parallel=false,true"], 2),
    (["backend=megatron", "backend.pp=2", "data.global_batch_size=8"], 2),
    (["backend=megatron", "backend.distributed_optimizer=false,true"], 2),
]


@pytest.mark.slow
@pytest.mark.parametrize(("sweep", "ranks"), MEASURED, ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_model_state_bytes_predicted_equal_measured(sweep, ranks, tmp_path):
    from conftest import bench
    from parabench.jobs import job_from_json

    gbs = [] if any(s.startswith("data.global_batch_size") for s in sweep) else [f"data.global_batch_size={2 * ranks}"]
    res = bench(["run", "-m", *TINY, *sweep, *gbs, "data.micro_batch_size=1", f"launcher.nproc_per_node={ranks}",
                 "tracking.enabled=false"], tmp_path / "results")  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    specs = sorted((tmp_path / "results").glob("runs/*/*/*/spec.json"))
    assert specs
    for spec in specs:
        job = job_from_json(spec.read_text())
        predicted = PROFILES[job.backend.name].states(job)
        # the busiest rank (the one the plan sizes the device for: pipeline stages differ by the
        # final norm) holds exactly the predicted bytes
        held = []
        for rank_file in sorted((spec.parent / "ranks").glob("rank*.json")):
            ms = json.loads(rank_file.read_text())["model_state"]
            held.append((ms["params"] + ms["grads"] + ms["optimizer"], ms["params"], ms["grads"], ms["optimizer"]))
        busiest = max(held)[1:]
        assert busiest == (predicted.params, predicted.grads, predicted.optimizer), (spec.parent.name, held)
        if job.backend.name == "deepspeed" and job.backend.options.zero_stage == 2:
            assert predicted.boundary > 0  # on 3 ranks this model's partitions cut through parameters


# --------------------------------------------------------------------------------------------
# Activation memory and the time model, against hand-computed values.
# --------------------------------------------------------------------------------------------
# The llama config (h = 256, a = 8, L = 4, V = 32,000) at s = 128, b = 2 in bf16 (the 2-byte
# activations of Korthikanti et al. 2022, arXiv 2205.05198, Table 2): s b h = 65,536 and
# 5 a s / h = 5 * 8 * 128 / 256 = 20. Each value below is Table 2's per-layer formula times the
# layers a device holds; the fp32 logits and their gradient (2 s b V / t x 4 bytes, outside the
# table) are subtracted.
SBH, L = 128 * 2 * 256, 4
ACT = ["run.precision=bf16", "data.seq_len=128", "data.micro_batch_size=2"]


def _acts(backend, world, gbs, recompute="none", *extra, **options):
    from parabench.plan.estimate import activation_bytes

    job = _job(backend, world, *ACT, f"data.global_batch_size={gbs}", *extra, **options)
    logits = 2 * 128 * 2 * 32000 * 4 / job.parallel.tp
    return activation_bytes(job, recompute, fused_attention=False) - logits


@pytest.mark.parametrize(
    ("options", "recompute", "per_layer"),
    [
        ({}, "none", 34 + 20),  # no parallelism: sbh (34 + 5as/h)
        ({"tp": 2}, "none", 10 + 24 / 2 + 20 / 2),  # TP: sbh (10 + 24/t + 5as/(ht))
        ({"tp": 2, "sequence_parallel": True}, "none", 34 / 2 + 20 / 2),  # TP + SP: sbh (34/t + 5as/(ht))
        ({"tp": 2}, "selective", 10 + 24 / 2),  # TP + selective: sbh (10 + 24/t)
        ({"tp": 2, "sequence_parallel": True}, "selective", 34 / 2),  # TP + SP + selective: 34 sbh / t
    ],
)
def test_activation_bytes_korthikanti_table_2(options, recompute, per_layer):
    world = options.get("tp", 1)
    assert _acts("megatron", world, 2, recompute, **options) == pytest.approx(SBH * per_layer * L)


def test_activation_bytes_full_recompute_fp32_and_pipeline_in_flight():
    # full recompute: 2 sbh per layer (the layer inputs) + one layer's activations live while it is recomputed
    assert _acts("ddp", 1, 2, "full") == pytest.approx(2 * SBH * L + SBH * 54)
    assert _acts("ddp", 1, 2, "none", "run.precision=fp32") == pytest.approx(2 * SBH * 54 * L)  # 4-byte
    # 1F1B, p = 2, m = 4: the first stage holds L/p layers for min(p, m) = 2 micro-batches
    assert _acts("megatron", 2, 8, pp=2) == pytest.approx(SBH * 54 * (L / 2) * 2)
    # interleaved (v = 2): (1 + (p - 1) / (p v)) = 1.25 times that (Korthikanti et al. 2022, section 4.2.3)
    assert _acts("megatron", 2, 8, pp=2, vpp=2) == pytest.approx(SBH * 54 * (L / 2) * 2 * 1.25)


def _estimate(backend, world, *overrides, cal=None, device="cuda", **options):
    from parabench.plan.cluster import load
    from parabench.plan.estimate import Calibration, estimate

    job = _job(backend, world, "run.precision=bf16", *overrides, device=device, **options)
    return estimate(job, load("h100-sxm"), 989.0, cal or Calibration())


def test_pipeline_bubble_is_p_minus_1_over_v_m():
    # Narayanan et al. 2021, section 2.2: bubble = (p - 1) / m of the compute, (p - 1) / (v m) interleaved
    one = _estimate("megatron", 2, "data.global_batch_size=8", "data.micro_batch_size=2", pp=2)
    assert one.job.grad_accum == 4 and one.bubble_s == pytest.approx(one.compute_s * 1 / 4)
    two = _estimate("megatron", 2, "data.global_batch_size=8", "data.micro_batch_size=2", pp=2, vpp=2)
    assert two.bubble_s == pytest.approx(two.compute_s * 1 / (2 * 4))
    assert two.step_s == pytest.approx(two.compute_s + two.bubble_s + two.exposed_comm_s)


@pytest.mark.parametrize(
    ("backend", "options", "overlap"),
    [
        ("ddp", {}, 1.0),  # DDP's bucketed all-reduce runs during the backward
        ("fsdp", {}, 1.0),
        ("deepspeed", {"zero_stage": 1}, 0.0),  # overlap_comm defaults off for ZeRO-1/2
        ("deepspeed", {"zero_stage": 3}, 1.0),  # and on for ZeRO-3
        ("deepspeed", {"zero_stage": 2, "overlap_comm": True}, 1.0),
        ("megatron", {}, 0.0),  # overlap_grad_reduce off
        ("megatron", {"overlap_grad_reduce": True}, 1.0),
        ("deepspeed", {"zero_stage": 3, "device": "cpu"}, 0.0),  # a synchronized device: no reduction stream
    ],
)
def test_overlap_assumption_per_backend(backend, options, overlap):
    e = _estimate(backend, 2, "data.global_batch_size=4", **options)
    assert e.comm_s > 0
    hidden = overlap * min(e.comm_s, e.compute_s * 2 / 3)  # data-parallel only: at most 2/3 of the compute
    assert e.exposed_comm_s == pytest.approx(e.comm_s - hidden)


def test_mfu_is_the_calibrated_efficiency_without_communication_or_bubble():
    from parabench.flops import flops_per_token
    from parabench.plan.estimate import Calibration

    cal = Calibration("t", efficiency={"ddp/cuda": 0.37}, runs=1)
    e = _estimate("ddp", 1, "data.global_batch_size=2", cal=cal)
    assert e.comm_s == 0 and e.bubble_s == 0 and e.mfu == pytest.approx(0.37)
    tokens = e.job.tokens_per_step
    assert e.step_s == pytest.approx(flops_per_token(e.job.model, e.job.data.seq_len) * tokens / (989e12 * 0.37))
    full = _estimate("ddp", 1, "data.global_batch_size=2", cal=cal, activation_checkpointing=True)
    assert full.mfu == pytest.approx(0.37 * 3 / 4)  # one more forward: 4/3 the FLOPs, MFU counts the model's


def test_formats_carry_the_same_rows_and_say_the_plan_is_uncalibrated(capsys):
    import csv
    import io

    args = ["+model=llama", "cluster=cpu", "plan.backends=[ddp,fsdp]", "plan.micro_batch_sizes=[1,2]", "plan.top=2"]
    out = {fmt: _plan(capsys, *args, "--format", fmt) for fmt in ("json", "table", "md", "csv")}
    assert all(code == 0 for code, _, _ in out.values()), {k: v[2] for k, v in out.items()}
    doc = json.loads(out["json"][1])
    best = doc["ranked"][0]
    table, md = out["table"][1], out["md"][1]
    for text in (table, md):
        assert "no calibration: default efficiencies and overheads, step times uncertain by about +-50%" in text
        assert "uncertain cluster values (no solid public source): " in text
        assert f"1: bench run {doc['context']['job_overrides']} {best['overrides']}" in text
        assert best["layout"] in text and f"{best['step_s']:.4g}" in text and f"{100 * best['mfu']:.1f}%" in text
    assert any(line.split()[:3] == ["rank", "layout", "device_gib"] for line in table.splitlines())
    assert "| rank | layout | device_gib |" in md and "|---|---|" in md
    rows = list(csv.DictReader(io.StringIO(out["csv"][1])))
    assert len(rows) == len(doc["ranked"]) + len(doc["rejected"]) and "match" not in rows[0]
    assert rows[0]["layout"] == best["layout"] and float(rows[0]["step_s"]) == pytest.approx(best["step_s"])
    assert rows[0]["overrides"] == best["overrides"]


def test_cpu_efficiency_is_looked_up_at_the_ranks_thread_count_first():
    from parabench.plan.estimate import Calibration

    cal = Calibration("t", efficiency={"ddp/cpu/t2": 0.2, "*/cpu/t1": 0.4, "ddp/cpu": 0.3, "*/cpu": 0.35})
    assert cal.eff("ddp", "cpu", 2) == 0.2  # this backend at 2 threads
    assert cal.eff("ddp", "cpu", 1) == 0.4  # no ddp run at 1 thread: every backend's at 1 thread
    assert cal.eff("fsdp", "cpu", 4) == 0.35 and cal.eff("ddp", "cpu") == 0.3
    assert cal.eff("ddp", "cuda", 2) == 0.45  # no fit for the kind: the default
