"""backend=mindspore: AdamW equivalence with torch, refusals before launch, and parity with ddp
through the real CLI (msrun workers on mccl, MLflow store in a temp dir)."""

import math
import os

import numpy as np
import pytest
from run_matrix import assert_parity, pair
from test_resilience import job_of

from conftest import assert_refused_before_launch, mlflow_runs

ms = pytest.importorskip("mindspore")

pytestmark = pytest.mark.mindspore


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b))


# --------------------------------------------------------------------------------------------
# Unit: the optimizer is torch.optim.AdamW, decay on 2-D weights only.
# --------------------------------------------------------------------------------------------
def test_adamw_matches_torch_adamw_on_a_tiny_tensor():
    import torch

    from parabench.adapters import mindspore_cells as cells
    from parabench.spec import OptimSpec

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    spec = OptimSpec(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    rng = np.random.default_rng(0)
    w0, b0 = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    # Gradients of very different scales: small ones make eps and the bias correction matter.
    steps = [
        (rng.standard_normal((4, 3)).astype(np.float32) * s, rng.standard_normal(3).astype(np.float32) * s)
        for s in (1.0, 1e-3, 10.0, 1e-6, 1.0, 0.1)
    ]

    tw, tb = torch.nn.Parameter(torch.tensor(w0)), torch.nn.Parameter(torch.tensor(b0))
    from parabench.adapters.torch_common import make_adamw

    topt = make_adamw([("w", tw), ("b", tb)], spec)

    mw, mb = ms.Parameter(ms.Tensor(w0), name="w"), ms.Parameter(ms.Tensor(b0), name="b")
    params = ms.ParameterTuple([mw, mb])
    opt = cells.AdamW(params, spec)

    class Step(ms.nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.params, self.opt = params, opt

        def construct(self, gw, gb, lr, eps, wd):
            return self.opt(self.params, (gw, gb), lr, eps, wd)

    step = Step()
    for t, (gw, gb) in enumerate(steps, 1):
        tw.grad, tb.grad = torch.tensor(gw), torch.tensor(gb)
        topt.step()
        step(ms.Tensor(gw), ms.Tensor(gb), *(ms.Tensor(np.float32(x)) for x in opt.step_scalars(t)))
        for mine, ref in ((mw, tw), (mb, tb)):
            ref = ref.detach().numpy()
            np.testing.assert_allclose(mine.asnumpy(), ref, rtol=2e-6, atol=1e-7, err_msg=f"step {t}")


def test_step_scalars_fold_the_bias_correction():
    from parabench.adapters import mindspore_cells as cells
    from parabench.spec import OptimSpec

    spec = OptimSpec(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = cells.AdamW(ms.ParameterTuple([ms.Parameter(ms.Tensor(np.zeros((2, 2), np.float32)), name="p")]), spec)
    lr, eps, wd = opt.step_scalars(3)
    bc1, bc2 = 1 - 0.9**3, 1 - 0.95**3
    assert math.isclose(lr, 1e-3 * math.sqrt(bc2) / bc1) and math.isclose(eps, 1e-8 * math.sqrt(bc2))
    assert math.isclose(lr * wd, 1e-3 * 0.1)  # decoupled decay: p *= 1 - lr * wd, as torch


# --------------------------------------------------------------------------------------------
# Refusals: before any process starts, one line naming the key.
# --------------------------------------------------------------------------------------------
REFUSED = {
    "semi_auto on cpu": (["backend.parallel_mode=semi_auto_parallel"], "backend.parallel_mode", "Ascend only"),
    "auto on cpu": (["backend.parallel_mode=auto_parallel"], "backend.parallel_mode", "Ascend only"),
    "cuda": (["device=cuda"], "device", "cuda"),
    "bf16": (["run.precision=bf16"], "run.precision", "fp32"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_before_launch(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, key, reason = REFUSED[name]
    err = assert_refused_before_launch(["+model=llama", "backend=mindspore", *args], key, tmp_path, capsys)
    assert reason in err, err


@pytest.mark.parametrize(
    "operator, args",
    [
        ("moe_token_permute", lambda x, idx: (x, idx)),
        ("moe_init_routing_v2", lambda x, idx: (x, idx, 0, 0, 4, 0, 2, False)),
    ],
)
def test_mindspores_moe_operators_have_no_cpu_kernel_so_a_moe_model_is_refused(operator, args, tmp_path, capsys):
    """MindSpore has no MoE layer; its MoE operators are Ascend kernels the CPU target does not register,
    which is the reason the refusal of a MoE model gives (docs/moe.md#mindspore). When a MindSpore
    release runs them on the CPU this fails, and the refusal is to be revisited."""
    ms.set_device("CPU")
    x = ms.Tensor(np.ones((4, 8), np.float32))
    idx = ms.Tensor(np.array([[0, 1], [1, 2], [2, 3], [0, 3]], np.int32))
    with pytest.raises(RuntimeError, match="unregistered"):
        [out.asnumpy() for out in getattr(ms.ops, operator)(*args(x, idx))]  # the kernel runs when read
    line = assert_refused_before_launch(
        ["+model=moe-tiny", "backend=mindspore"], "model.num_local_experts", tmp_path, capsys
    )
    assert "The kernel MoeTokenPermute unregistered" in line and "no Mixture-of-Experts layer" in line, line


def test_pynative_needs_numpy_below_2(tmp_path, capsys, monkeypatch):
    if int(np.__version__.split(".")[0]) < 2:
        pytest.skip("numpy<2 here: PyNative is allowed")
    monkeypatch.chdir(tmp_path)
    err = assert_refused_before_launch(
        ["+model=llama", "backend=mindspore", "backend.mode=pynative"], "backend.mode", tmp_path, capsys
    )
    assert "numpy<2" in err, err


def test_msrun_command_and_coordinates(monkeypatch):
    from parabench.jobs import from_config
    from parabench.launchers import Msrun, get_launcher

    job = from_config(
        {
            "model": {
                "name": "t",
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "vocab_size": 32,
            },
            "backend": {"name": "mindspore"},
            "launcher": {"nproc_per_node": 2},
        }
    )
    from parabench.adapters.registry import get_adapter

    assert get_launcher(get_adapter("mindspore").capabilities.launcher) is Msrun
    cmd = Msrun.command(job, 12345, "/runs/x")
    assert cmd[0].endswith("msrun") and "--worker_num=2" in cmd and "--local_worker_num=2" in cmd
    assert "--join=True" in cmd and "--master_port=12345" in cmd and "--log_dir=/runs/x/logs" in cmd
    assert cmd[-4:] == ["python", "-m", "parabench.worker", "/runs/x"]
    monkeypatch.setenv("RANK_ID", "3")
    monkeypatch.setenv("DEVICE_ID", "1")
    monkeypatch.setenv("MS_WORKER_NUM", "4")
    assert Msrun.coords() == (3, 1, 4)
    import os
    import sys

    assert "PATH" not in get_adapter("mindspore").launch_env(job)  # the bundle's: nothing of this shell
    here = os.path.dirname(sys.executable)
    for path in ("/usr/bin", f"{here}{os.pathsep}/usr/bin"):  # a local start: this interpreter's bin first, once
        assert Msrun.process_env({"GLOG_v": "3"}, {"PATH": path})["PATH"] == f"{here}{os.pathsep}/usr/bin"


# --------------------------------------------------------------------------------------------
# End to end: mindspore vs ddp, same seed and data, 20 fp32 steps (the shared run matrix), 1 and 2 processes.
# --------------------------------------------------------------------------------------------
@pytest.fixture
def sweeps(matrix):
    """world size -> (results dir, backend -> summary) of ddp and mindspore in the shared run matrix (20
    fp32 steps each; the test's matrix marker names the world sizes it reads)."""

    return lambda world: pair(matrix, ("mindspore", "ddp"), world)


TWO_RANKS = pytest.mark.matrix("ddp", "mindspore")
ONE_RANK = pytest.mark.matrix("ddp@1", "mindspore@1")


@TWO_RANKS
@ONE_RANK
@pytest.mark.full
def test_same_initial_weights_as_ddp(sweeps):
    checksums = {(w, b): s["initial_checksum"] for w in (1, 2) for b, s in sweeps(w)[1].items()}
    assert len(checksums) == 4 and len(set(checksums.values())) == 1, checksums


@pytest.mark.parametrize(
    "world",
    [pytest.param(1, marks=[ONE_RANK, pytest.mark.full]), pytest.param(2, marks=[TWO_RANKS, pytest.mark.e2e])],
)
def test_loss_parity_with_ddp(sweeps, world):
    by = sweeps(world)[1]
    assert_parity(by["ddp"], by["mindspore"], first=1e-5, after_ten=1e-3)


@TWO_RANKS
@ONE_RANK
@pytest.mark.full
def test_world_size_does_not_change_the_math(sweeps):
    one, two = sweeps(1)[1]["mindspore"]["losses"], sweeps(2)[1]["mindspore"]["losses"]
    assert rel(one[0], two[0]) <= 1e-6 and rel(one[10], two[10]) <= 1e-4


@TWO_RANKS
@pytest.mark.full
def test_model_states_and_metrics_are_recorded(sweeps):
    s = sweeps(2)[1]["mindspore"]
    n = s["num_params"]
    for rank in s["model_state_per_rank"]:
        assert rank["params"] + rank["grads"] + rank["optimizer"] == 16 * n  # fp32 AdamW, replicated
    assert s["model_state_expected_bytes"] == 16 * n and s["device"] == "cpu"
    runs = mlflow_runs(sweeps(2)[0])
    run = runs[runs["tags.backend"] == "mindspore"].iloc[0]
    assert run["status"] == "FINISHED" and run["tags.world_size"] == "2"
    assert run["tags.version.mindspore"] == ms.__version__
    for metric in (
        "tokens_per_s",
        "step_time_median_s",
        "mfu",
        "peak_tflops_per_device",
        "peak_memory_bytes_max",
        "model_state_bytes_max",
        "loss",
    ):
        assert run[f"metrics.{metric}"] > 0, metric
    assert "measured" in run["tags.peak_source"]  # the CPU's own GEMM peak, never an NPU figure


# --------------------------------------------------------------------------------------------
# Unit: compiled graphs are kept per job shape (adapters/mindspore_graphs.py).
# --------------------------------------------------------------------------------------------
def _ms_job(*overrides: str):
    return job_of("backend=mindspore", *overrides)


def test_graphs_are_shared_by_jobs_of_one_shape_only():
    from parabench.adapters.mindspore_graphs import shape_key

    key = shape_key(_ms_job())
    # what the compiled graphs are built from: each change is another folder
    for other in (
        "model.hidden_size=128",
        "data.micro_batch_size=1",
        "optim.lr=1e-3",
        "launcher.nproc_per_node=2",
        "backend.jit_level=O1",
        "data.seq_len=128",
    ):
        assert shape_key(_ms_job(other)) != key, other
    # values fed to the same graphs: one folder
    for same in ("run.seed=7", "run.steps=3", "run.checkpoint.every=5", "fault.kind=kill", "tracking.enabled=false"):
        assert shape_key(_ms_job(same)) == key, same


def test_compile_cache_auto_keeps_the_graphs_of_cpu_sized_models_only():
    from parabench.adapters.mindspore_graphs import graphs_cached

    assert graphs_cached(_ms_job())  # 19.3M parameters: 77 MB of fp32 weights
    assert not graphs_cached(_ms_job("model.hidden_size=1024", "model.intermediate_size=2816"))  # 113M: 451 MB
    assert graphs_cached(
        _ms_job("model.hidden_size=1024", "model.intermediate_size=2816", "backend.compile_cache=always")
    )
    assert not graphs_cached(_ms_job("backend.compile_cache=never"))


def test_a_rank_publishes_its_graphs_once_and_never_over_another_runs(tmp_path, monkeypatch):
    from parabench.adapters import mindspore_graphs
    from parabench.adapters.mindspore_graphs import GraphCache

    monkeypatch.setattr(mindspore_graphs, "cache_root", lambda: tmp_path / "cache")
    job = _ms_job()
    first = GraphCache.of(job, tmp_path / "run1", rank=1)
    assert not first.reused and first.path == tmp_path / "run1" / "mindspore_graphs"
    second = GraphCache.of(job, tmp_path / "run2", rank=1)  # started while the first still compiles
    for run, text in ((first, "first"), (second, "second")):
        (run.local / "rank_1" / "graph_cache").mkdir(parents=True)
        (run.local / "rank_1" / "graph_cache" / "g.mindir").write_text(text)
    first.publish()
    second.publish()  # too late: the first run's graphs stay, and no staging folder is left behind
    assert sorted(p.name for p in first.shared.iterdir()) == ["rank_1"]
    assert (first.shared / "rank_1" / "graph_cache" / "g.mindir").read_text() == "first"
    assert not first.local.exists() and not second.local.exists()  # no second copies left in the run directories
    third = GraphCache.of(job, tmp_path / "run3", rank=1)
    assert third.reused and third.path == first.shared
    assert not GraphCache.of(job, tmp_path / "run3", rank=0).reused  # each rank has its own graphs
    for name in ("MS_COMPILER_CACHE_ENABLE", "MS_COMPILER_CACHE_PATH"):
        monkeypatch.delenv(name, raising=False)  # restored after the test: enable() sets them for the process
    third.enable()
    assert (os.environ["MS_COMPILER_CACHE_ENABLE"], os.environ["MS_COMPILER_CACHE_PATH"]) == ("1", str(first.shared))
