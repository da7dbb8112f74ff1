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


def _job(backend: str, world: int, *overrides: str, **options):
    plain = to_plain(compose(["+model=llama", f"backend={backend}", *overrides]))
    cfg = copy.deepcopy(plain)
    cfg["backend"].update(options)
    cfg["launcher"].update(nproc_per_node=world, dry_run=True)
    cfg["device"]["type"] = "cpu"
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
