"""bench comm: sizes, bus factors, the alpha-beta fit, refusals before launch, and real 2-rank sweeps
over gloo and MindSpore's CPU backend with their results checked (a wrong reduction is an error)."""

from __future__ import annotations

import pytest

from conftest import bench, mlflow_runs
from parabench.collectives import OPS, CommOptions, fit_alpha_beta, parse_size, sweep
from parabench.errors import SpecError

SMALL = ["comm.min_bytes=1K", "comm.max_bytes=16K", "comm.factor=4", "comm.warmup_iters=1", "comm.iters=3"]


def test_sizes_and_bus_factors():
    assert [parse_size(v, "k") for v in ("1K", "256M", "4g", 1000, "12B")] == [1024, 256 << 20, 4 << 30, 1000, 12]
    # nccl-tests doc/PERFORMANCE.md: all-reduce 2(n-1)/n, gather/scatter/all-to-all (n-1)/n, else 1
    assert OPS["all_reduce"].factor(4) == 1.5 and OPS["all_gather"].factor(4) == 0.75
    assert OPS["reduce_scatter"].factor(8) == OPS["all_to_all"].factor(8) == 7 / 8
    assert OPS["broadcast"].factor(8) == OPS["send_recv"].factor(8) == 1.0
    points = sweep(CommOptions(ops=("all_gather", "all_reduce"), min_bytes=100, max_bytes=1600, factor=4), world=3)
    gathered = [(p.requested, p.size, p.count) for p in points if p.op == "all_gather"]
    assert gathered == [(100, 96, 24), (400, 396, 99), (1600, 1596, 399)]  # whole fp32 elements per rank
    assert [p.size for p in points if p.op == "all_reduce"] == [100, 400, 1600]


def test_alpha_beta_fit_recovers_a_model():
    sizes = [1 << k for k in range(10, 24, 2)]
    fit = fit_alpha_beta(sizes, [20e-6 + s / 5e9 for s in sizes])
    assert fit is not None and fit.max_rel_err < 1e-9
    assert fit.alpha_s == pytest.approx(20e-6) and 1 / fit.beta_s_per_byte == pytest.approx(5e9)
    assert fit_alpha_beta([1024], [1e-5]) is None


@pytest.mark.parametrize(
    ("args", "must_name"),
    [
        (["comm.ops=[all_reduce,scatter]"], "unknown operation scatter"),
        (["comm.max_bytes=-1K"], "comm.max_bytes"),
        (["comm.max_bytes=512G"], "exceeds the 64 GiB"),
        (["comm.min_bytes=1M", "comm.max_bytes=1K"], "comm.min_bytes"),
        (["comm.ops=[send_recv]"], "send_recv needs at least 2 ranks"),
        (["comm.ops=[reduce_scatter]", "comm.min_bytes=4", "launcher.nproc_per_node=2"], "one fp32 element per rank"),
        (["backend=fsdp"], "backend=ddp measures"),
        (["backend=mindspore", "comm.ops=[all_to_all]", "launcher.nproc_per_node=2"], "Unsupported op [AlltoAll]"),
        (["comm.iters=0"], "comm.iters"),
    ],
)
def test_bad_input_is_refused_before_launch(args, must_name, tmp_path, capsys):
    from parabench.cli import main

    results = tmp_path / "results"
    code = main(["comm", *args, f"run.results_dir={results}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("bench: error:"), err
    assert must_name in err, err
    assert not results.exists()


def test_options_checks():
    with pytest.raises(SpecError, match="comm.corrupt"):
        from parabench.collectives import options

        options({"ops": ["all_reduce"], "corrupt": "broadcast"})


def test_gloo_sweep_prints_checked_table_and_logs_mlflow(results):
    proc = bench(["comm", "launcher.nproc_per_node=2", *SMALL, f"run.results_dir={results}"], results)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "torch.distributed/gloo | cpu x2" in out
    for op in OPS:
        assert f"\n{op}  (busbw = algbw x {OPS[op].bus_factor}" in out
    assert "WRONG" not in out and out.count("fit: t =") == len(OPS)
    runs = mlflow_runs(results, "comm")
    assert len(runs) == 1 and runs.iloc[0]["status"] == "FINISHED"
    run = runs.iloc[0]
    assert run["tags.stack"] == "torch.distributed/gloo" and run["tags.world_size"] == "2"
    assert float(run["params.fit.all_reduce.max_rel_err"]) >= 0
    assert run["metrics.all_reduce.busbw_GBps"] > 0  # the last size's value; every size is a step
    from mlflow.tracking import MlflowClient

    history = MlflowClient().get_metric_history(run["run_id"], "all_gather.busbw_GBps")
    assert sorted(m.step for m in history) == [1024, 4096, 16384]


def test_a_wrong_reduction_is_an_error_not_a_bandwidth(results):
    args = ["comm", "launcher.nproc_per_node=2", *SMALL, "comm.ops=[all_reduce,broadcast]", "comm.corrupt=all_reduce"]
    proc = bench([*args, f"run.results_dir={results}"], results)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "bench comm: error: wrong results (all_reduce) at 3 (op, size) points" in proc.stderr
    table = proc.stdout.split("\nall_reduce")[1].split("\nbroadcast")[0]
    assert table.count("WRONG") == 3 and "GB/s)" in table
    runs = mlflow_runs(results, "comm")
    assert runs.iloc[0]["status"] == "FAILED" and "wrong results" in runs.iloc[0]["tags.failure_reason"]
    assert "metrics.all_reduce.busbw_GBps" not in runs.columns or runs["metrics.all_reduce.busbw_GBps"].isna().all()
    assert runs.iloc[0]["metrics.broadcast.busbw_GBps"] > 0  # the correct op still has its figures


def test_mindspore_cpu_runs_what_mccl_can_and_names_the_rest(results):
    pytest.importorskip("mindspore")
    proc = bench(
        ["comm", "backend=mindspore", "launcher.nproc_per_node=2", *SMALL, f"run.results_dir={results}"], results
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "mindspore.communication/mccl | cpu x2" in out
    for op in ("all_reduce", "all_gather", "broadcast"):
        assert f"\n{op}  (busbw" in out
    for op, kernel in (
        ("reduce_scatter", "ReduceScatter"),
        ("all_to_all", "AlltoAll"),
        ("send_recv", "InnerCommIsend"),
    ):
        assert f"\n{op}: not run: MindSpore 2.10 on CPU (mccl)" in out and kernel in out
    assert "WRONG" not in out
    runs = mlflow_runs(results, "comm")
    assert runs.iloc[0]["status"] == "FINISHED" and runs.iloc[0]["tags.refused.all_to_all"]
