"""backend=megatron: refusals before launch, an in-process engine check, and end-to-end parity with
ddp through the real CLI (torchrun workers on gloo, CUDA redirected to the host).

Parity (fp32, same seed, the shared run matrix's global batch of 4 sequences): identical canonical checksum after
loading; step-0 loss within 1e-5 relative; loss after 10 optimizer steps within 1e-3 relative.
"""

import dataclasses

import pytest

pytest.importorskip("megatron.core")

from run_matrix import STEPS, assert_parity

from conftest import (
    FAST,
    REPO,
    TWENTY,
    assert_refused_before_launch,
    assert_trains_like_the_canonical_model,
    bench,
    summaries,
)

pytestmark = pytest.mark.megatron

M = ["+model=llama", "backend=megatron"]
INVALID = {
    "heads not divisible by tp": (M + ["backend.tp=3", "launcher.nproc_per_node=3"], "backend.tp"),
    "layers not divisible by pp": (M + ["backend.pp=3", "launcher.nproc_per_node=3"], "backend.pp"),
    "world not divisible by tp x pp x cp": (M + ["backend.tp=2", "launcher.nproc_per_node=3"], "backend.tp"),
    "sequence parallel without tp": (M + ["backend.sequence_parallel=true"], "backend.sequence_parallel"),
    "interleaving without enough layers": (
        M + ["backend.pp=2", "backend.vpp=4", "launcher.nproc_per_node=2"],
        "backend.vpp",
    ),
    "interleaving without pipeline": (M + ["backend.vpp=2"], "backend.vpp"),
    "context parallel on cpu": (M + ["backend.cp=2", "launcher.nproc_per_node=2"], "backend.cp"),
    "micro-batch count inconsistent": (M + ["backend.num_microbatches=4"], "backend.num_microbatches"),
    "param gather overlap without distributed optimizer": (
        M + ["backend.overlap_param_gather=true"],
        "backend.overlap_param_gather",
    ),
    "interleaving with micro-batches not a multiple of pp": (
        M + ["backend.pp=2", "backend.vpp=2", "launcher.nproc_per_node=2", "data.global_batch_size=6"],
        "backend.vpp",
    ),
    "transformer engine on cpu": (M + ["backend.transformer_impl=transformer_engine"], "backend.transformer_impl"),
    "key of another backend": (M + ["+backend.zero_stage=2"], "backend.zero_stage"),
    "recompute granularity unknown": (M + ["backend.recompute_granularity=partial"], "backend.recompute_granularity"),
    "recompute method without full": (M + ["backend.recompute_method=block"], "backend.recompute_method"),
    "recompute layers with selective": (
        M + ["backend.recompute_granularity=selective", "backend.recompute_num_layers=1"],
        "backend.recompute_num_layers",
    ),
    "uniform recompute units not dividing a chunk's layers": (
        M + ["backend.recompute_granularity=full", "backend.recompute_num_layers=3"],
        "backend.recompute_num_layers",
    ),
    "block recompute of more layers than a chunk has": (
        M
        + ["backend.recompute_granularity=full", "backend.recompute_method=block", "backend.pp=2"]
        + ["backend.recompute_num_layers=3", "launcher.nproc_per_node=2"],
        "backend.recompute_num_layers",
    ),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_megatron_config_is_refused_before_launch(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, must_name = INVALID[name]
    assert_refused_before_launch(args, must_name, tmp_path, capsys)


def test_version_and_availability_are_stated():
    from parabench.adapters.megatron import MegatronAdapter, supported

    avail = MegatronAdapter.availability()
    assert avail.available and supported(avail.versions["megatron-core"]), avail


def test_supported_series():
    from parabench.adapters.megatron import supported
    from parabench.adapters.mindspeed import KNOWN_GOOD

    assert all(supported(v) for v in ("0.12.0", "0.12.1", "0.12.3", "0.16.0", "0.16.1"))
    assert not any(supported(v) for v in (None, "0.9.0", "0.11.0", "0.13.1", "0.17.0", "1.12.1"))
    assert all(supported(good["megatron-core"]) for good in KNOWN_GOOD)  # MindSpeed's pins run the Megatron engine


def test_unsupported_version_is_refused(monkeypatch):
    import parabench.adapters.megatron as mg

    monkeypatch.setattr(mg, "package_version", lambda dist: "0.9.0" if dist == "megatron-core" else "2.13.0")
    avail = mg.MegatronAdapter.availability()
    assert not avail.available and "0.9.0 is not supported" in avail.reason and "0.12.x, 0.16.x" in avail.reason
    monkeypatch.setattr(mg, "package_version", lambda dist: None if dist == "megatron-core" else "2.13.0")
    assert "pip install 'parabench[megatron]'" in mg.MegatronAdapter.availability().reason


def test_a_cpu_engine_imports_megatron_core_without_its_compile_stack():
    """On a CPU the engine imports megatron-core with jit_fuser the plain function (its fusions are off
    there): building one imports no Inductor (3 CPU-s of every rank) and leaves torch.compile itself
    untouched. That the engine still trains like the canonical model is test_moe's in-process test and
    the parity tests; this one checks only the import."""
    import subprocess
    import sys

    code = (
        "import sys, tempfile, torch; from pathlib import Path; sys.path.insert(0, 'tests'); import test_moe\n"
        "compile_ = torch.compile; job = test_moe._one_rank_megatron_job()\n"
        "with test_moe._megatron_engine_in_process(job, Path(tempfile.mkdtemp())) as engine: pass\n"
        "import megatron.core.jit as jit; f = lambda x: x\n"
        "print('torch._inductor.compile_fx' in sys.modules, torch.compile is compile_, jit.jit_fuser(f) is f)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["False", "True", "True"], out.stdout


def test_distributed_optimizer_steps_without_transformer_engine():
    """On any supported release, after the engine's compat patch the distributed optimizer's fp8 cast
    of a rank holding no fp8 parameter is a no-op (0.12's TE-less fallback raised), and it is undone."""
    from megatron.core.optimizer import distrib_optimizer

    from parabench.adapters.megatron_compat import patch_fp8_fallback

    before, undo = distrib_optimizer.quantize_param_shard, []

    def patch(obj, name, make):
        old = getattr(obj, name)
        setattr(obj, name, make(old))
        undo.append(lambda: setattr(obj, name, old))

    patch_fp8_fallback(patch)
    try:
        assert distrib_optimizer.quantize_param_shard([], [], [], None) is None
    finally:
        for u in undo:
            u()
    assert distrib_optimizer.quantize_param_shard is before


def test_engine_in_process_matches_the_canonical_model(tmp_path):
    """World of 1 (TP=PP=DP=1): the engine's checksum is the canonical one, 3 AdamW steps follow the
    canonical torch model + torch.optim.AdamW, and close() undoes every patch."""
    import datetime

    import torch
    import torch.distributed as dist

    from parabench import redirect
    from parabench.adapters.base import WorkerContext
    from parabench.adapters.megatron import MegatronAdapter
    from parabench.devices import DEVICES
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config
    from parabench.spec import resolve_device

    job = resolve_device(
        from_config(
            to_plain(compose(M + ["data.seq_len=32", "data.global_batch_size=4", "model.num_hidden_layers=2"]))
        ),
        "cpu",
    )
    dist.init_process_group(  # a file store: no port to pick and release
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    apply_before = torch.autograd.function.BackwardCFunction.apply
    try:
        engine = MegatronAdapter.create_engine(
            WorkerContext(job=job, rank=0, world_size=1, local_rank=0, device=DEVICES["cpu"](0), run_dir=tmp_path)
        )
        try:
            assert engine.data_parallel() == (0, 1)
            assert_trains_like_the_canonical_model(engine, job)
            state = engine.model_state_bytes()
            n = job.model.num_params()
            assert state.params + state.grads + state.optimizer == 16 * n  # fp32 AdamW, replicated
        finally:
            engine.close()
        assert redirect.current() is None and not torch.cuda.is_available()
        assert torch.autograd.function.BackwardCFunction.apply is apply_before
    finally:
        dist.destroy_process_group()


def test_expected_model_state_formulas():
    from parabench.adapters.megatron import MegatronAdapter, rank_param_counts
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config

    def job(*extra):
        return from_config(to_plain(compose(M + list(extra))))

    j = job("backend.distributed_optimizer=true", "launcher.nproc_per_node=2")
    psi = job().model.num_params()
    assert rank_param_counts(j) == {(0, 0): psi}
    assert MegatronAdapter.expected_model_state(j).bytes == (4 + 4 + 8 / 2) * psi
    bf16 = dataclasses.replace(j, run=dataclasses.replace(j.run, precision="bf16"))
    assert MegatronAdapter.expected_model_state(bf16).bytes == (6 + 12 / 2) * psi  # Megatron's 6 + 12/d
    j = job("backend.tp=2", "backend.pp=2", "launcher.nproc_per_node=4")
    counts = rank_param_counts(j)
    m = j.model
    norms = (2 * m.num_hidden_layers + 1) * m.hidden_size
    assert sum(counts.values()) == psi + norms  # only the norms are replicated over TP
    assert (
        counts[(0, 0)] == counts[(0, 1)] and counts[(1, 0)] > counts[(0, 0)]
    )  # the last stage holds the norm + lm_head


# --------------------------------------------------------------------------------------------
# End to end: each configuration against one ddp reference (2 ranks, same global batch of 8).
# --------------------------------------------------------------------------------------------
# The matrix variant of each configuration (backend presets: tp = pp = nproc_per_node = 2; global batch 4
# in micro-batches of 2, so tp2 runs 2 micro-batches on dp=1 and pp2 runs 2 through its 2 stages).
VARIANTS = {
    "ddp": "ddp",
    "tp2": "megatron_tp",
    "tp2-sp": "megatron_tp_sp",
    "pp2": "megatron_pp",
    "pp2-vpp2": "megatron_pp_vpp",
    "dp2-distopt": "megatron_distopt",
}
CONFIGS = [*(label for label in VARIANTS if label != "ddp"), "tp2pp2"]
DEFAULT_TIER = {"tp2"}  # the rest of the layouts run in the full tier


def _config_param(label: str):
    reads = pytest.mark.matrix("ddp", *([VARIANTS[label]] if label in VARIANTS else []))
    return pytest.param(label, marks=[reads, pytest.mark.e2e if label in DEFAULT_TIER else pytest.mark.full])


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory) -> dict:
    """tp2 x pp2 on 4 ranks (oversubscribed) at the matrix's geometry: a run of its own, the matrix has
    2 ranks."""
    results = tmp_path_factory.mktemp("tp2pp2")
    args = [*FAST, f"run.steps={STEPS}", "backend=megatron", "backend.tp=2", "backend.pp=2"]
    proc = bench(["run", *args, "launcher.nproc_per_node=4", "tracking.enabled=false"], results)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (summary,) = summaries(results).values()
    return summary


@pytest.fixture
def e2e(matrix, request):
    """label -> summary: the matrix's runs, and tp2pp2's own run when a test asks for it."""

    def get(label: str) -> dict:
        return request.getfixturevalue("tp2pp2") if label == "tp2pp2" else matrix[VARIANTS[label]].summary

    return get


@pytest.mark.parametrize("config", [_config_param(label) for label in CONFIGS])
def test_megatron_matches_ddp(e2e, config):
    mg = e2e(config)
    assert mg["backend"] == "megatron"
    assert_parity(e2e("ddp"), mg, first=1e-5, after_ten=1e-3)


@pytest.mark.matrix(*VARIANTS.values())
@pytest.mark.full
def test_megatron_metrics(e2e):
    n = e2e("ddp")["num_params"]
    # Distributed optimizer over dp=2, fp32: 4 + 4 + 8/2 bytes per parameter (+ buffer padding).
    dist = e2e("dp2-distopt")
    assert dist["world_size"] == 2 and dist["model_state_expected_bytes"] == 12 * n
    for rank in dist["model_state_per_rank"]:
        core = rank["params"] + rank["grads"] + rank["optimizer"]
        assert 12 * n <= core <= 12 * n + 64 * 1024, (core, 12 * n)
    # Replicated optimizer on a TP shard: exactly 16 bytes per parameter held (no padding without dp).
    tp = e2e("tp2")
    for rank in tp["model_state_per_rank"]:
        assert rank["params"] + rank["grads"] + rank["optimizer"] == tp["model_state_expected_bytes"]
    assert tp["model_state_bytes_max"] < 0.6 * e2e("ddp")["model_state_bytes_max"]
    # Pipeline bubble: (p-1)/m for 1F1B, (p-1)/(v m) interleaved (Narayanan et al. 2021, sec. 2.2);
    # m = global batch 4 / micro-batch 2 = 2 micro-batches at dp = 1; measured on every rank.
    assert e2e("pp2")["extra.pipeline_bubble_predicted"] == 1 / 2
    assert e2e("pp2-vpp2")["extra.pipeline_bubble_predicted"] == 1 / 4
    assert all(0 <= e2e("pp2")[f"extra.rank{r}.pipeline_bubble_measured"] < 1 for r in (0, 1))
    # TP communication counted: at least the 4 decoder all-reduces (2 forward, 2 backward) per layer and
    # micro-batch: 4 layers x 2 micro-batches.
    for config in ("tp2", "tp2-sp"):
        s = e2e(config)
        assert s["extra.tp_decoder_allreduces_predicted_per_step"] == 4 * 4 * 2
        assert s["extra.rank0.tp_collectives_per_step"] >= s["extra.tp_decoder_allreduces_predicted_per_step"]
        assert s["extra.rank0.tp_comm_bytes_per_step"] > 0


# Activation recompute (backend.recompute_*): label -> (overrides, the module whose forward the
# backward runs again, how many of them one micro-batch recomputes on the 4-layer llama)
RECOMPUTE = {
    "full": (["backend.recompute_granularity=full"], "TransformerLayer", 4),
    "full-uniform2": (
        ["backend.recompute_granularity=full", "backend.recompute_method=uniform", "backend.recompute_num_layers=2"],
        "TransformerLayer",
        4,
    ),
    "full-block1": (
        ["backend.recompute_granularity=full", "backend.recompute_method=block", "backend.recompute_num_layers=1"],
        "TransformerLayer",
        1,
    ),
    "selective": (["backend.recompute_granularity=selective"], "DotProductAttention", 4),
}


def _train_in_process(tmp_path, overrides: list[str]) -> tuple[list[float], dict[str, float]]:
    """A world of 1 trains 3 steps, checked against the canonical model (conftest); returns its losses
    and how often each recomputable module's forward ran per micro-batch."""
    import datetime

    import torch.distributed as dist

    from parabench.adapters.base import WorkerContext
    from parabench.adapters.megatron import MegatronAdapter
    from parabench.devices import DEVICES
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config
    from parabench.spec import resolve_device

    cfg = to_plain(compose([*M, "data.seq_len=32", "data.global_batch_size=4", *overrides]))
    job = resolve_device(from_config(cfg), "cpu")
    store = tmp_path / f"store{len(list(tmp_path.iterdir()))}"  # a fresh file store per process group
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1, timeout=timeout)
    calls = {"TransformerLayer": 0, "DotProductAttention": 0}
    try:
        ctx = WorkerContext(job=job, rank=0, world_size=1, local_rank=0, device=DEVICES["cpu"](0), run_dir=tmp_path)
        engine = MegatronAdapter.create_engine(ctx)
        try:
            losses, step = [], engine.train_step
            for chunk in engine.chunks:
                for m in chunk.modules():
                    if (name := type(m).__name__) in calls:
                        m.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
            engine.train_step = lambda batches: losses.append(step(batches)) or losses[-1]
            assert_trains_like_the_canonical_model(engine, job, steps=3)
        finally:
            engine.close()
    finally:
        dist.destroy_process_group()
    return [float(x) for x in losses], {k: n / (3 * job.grad_accum) for k, n in calls.items()}


@pytest.fixture(scope="module")
def without_recompute(tmp_path_factory) -> tuple[list[float], dict[str, float]]:
    return _train_in_process(tmp_path_factory.mktemp("no-recompute"), [])


@pytest.mark.parametrize(
    "label",
    [pytest.param(k, marks=[] if k in ("full", "selective") else [pytest.mark.full]) for k in sorted(RECOMPUTE)],
)
def test_recompute_trains_bitwise_like_no_recompute(label, tmp_path, without_recompute):
    """backend.recompute_*: the losses are the canonical model's (1e-5, as every engine) and bitwise
    those of the same job without recompute, and the backward really ran the forwards again.
    (full with uniform 2 and block 1: full tier.)"""
    overrides, module, recomputed = RECOMPUTE[label]
    plain, plain_calls = without_recompute
    losses, calls = _train_in_process(tmp_path, overrides)
    assert losses == plain, (label, losses, plain)
    assert (plain_calls[module], calls[module]) == (4, 4 + recomputed), (label, plain_calls, calls)


@pytest.mark.matrix("ddp", "megatron_tp")
@pytest.mark.full
@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_with_tp2_matches_ddp(matrix, granularity, tmp_path):
    """tp2 on 2 gloo ranks with recompute (the recomputed forward repeats its TP all-reduces and uses
    megatron's RNG tracker): the matrix's geometry, parity with ddp at the matrix's bounds, and losses
    bitwise equal to the matrix's tp2 run without recompute."""
    args = [*TWENTY, "backend=megatron/tp", f"backend.recompute_granularity={granularity}", "tracking.enabled=false"]
    proc = bench(["run", *args], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (summary,) = summaries(tmp_path).values()
    assert_parity(matrix["ddp"].summary, summary, first=1e-5, after_ten=1e-3)
    assert summary["losses"] == matrix["megatron_tp"].summary["losses"]


@pytest.mark.full
def test_interleaving_deeper_than_two_matches_ddp(tmp_path):
    """pp2 x vpp4 (4 model chunks per rank, as the planner searches: MindSpeed-LLM's Llama 2 70B runs
    vpp 4) trains like ddp: an 8-layer llama, 4 micro-batches of 2 through 2 stages. Every
    step's loss within 1e-5 relative of ddp's (``assert_parity``'s step-0 bound, at all 20 steps: its
    "fell by 0.1 in 10 steps" check does not hold for 8 layers on the random tokens, ddp's included)."""
    geometry = [*FAST, f"run.steps={STEPS}", "model.num_hidden_layers=8", "data.global_batch_size=8",
                "data.micro_batch_size=2", "launcher.nproc_per_node=2", "tracking.enabled=false"]  # fmt: skip
    runs = {}
    for name, backend in (("ddp", ["backend=ddp"]), ("vpp4", ["backend=megatron", "backend.pp=2", "backend.vpp=4"])):
        proc = bench(["run", *geometry, *backend], tmp_path / name)
        assert proc.returncode == 0, proc.stderr[-4000:]
        (runs[name],) = summaries(tmp_path / name).values()
    assert runs["vpp4"]["extra.pipeline_bubble_predicted"] == 1 / (4 * 4)  # (p - 1) / (v m), Narayanan et al. 2021
    ref, got = runs["ddp"]["losses"], runs["vpp4"]["losses"]
    assert runs["vpp4"]["initial_checksum"] == runs["ddp"]["initial_checksum"] and len(got) == len(ref) == STEPS
    assert all(abs(g - r) <= 1e-5 * abs(r) for g, r in zip(got, ref, strict=True)), (got, ref)
    assert got[-1] < got[0]  # it trains
