"""bench comm: sizes, bus factors, the alpha-beta fit, refusals before launch, and real 2-rank sweeps
over gloo and MindSpore's CPU backend with their results checked (a wrong reduction is an error)."""

from __future__ import annotations

import json

import pytest

from conftest import VOCAB, bench, mlflow_runs
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
    ("times", "says"),
    [
        ([100e-6, 60e-6, 30e-6], "does not grow with the size"),  # a loaded host: bigger sizes ran faster
        ([10e-6, 400e-6, 20e-6, 900e-6], "misses a measured time by"),  # noise: a slope, but no model
    ],
)
def test_a_meaningless_fit_prints_a_warning_not_a_bandwidth(times, says):
    from parabench.comm.command import fit_line

    sizes = [1 << k for k in range(10, 10 + 2 * len(times), 2)]
    fit = fit_alpha_beta(sizes, times)
    line = fit_line(fit)
    assert "warning" in line and says in line and "GB/s" not in line and "inf" not in line, line
    assert says in fit.as_params("all_reduce")["fit.all_reduce.warning"]
    good = [1 << k for k in range(10, 24, 2)]
    assert fit_line(fit_alpha_beta(good, [20e-6 + s / 5e9 for s in good])).startswith("  fit: t = 20.0 us + S / 5 GB/s")


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
        (["launcher.dry_run=true"], "launcher.dry_run"),
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


@pytest.mark.e2e
def test_gloo_sweep_prints_checked_table_and_logs_mlflow(results):
    proc = bench(["comm", "launcher.nproc_per_node=2", *SMALL, f"run.results_dir={results}"], results)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "torch.distributed/gloo | cpu x2" in out
    for op in OPS:
        assert f"\n{op}  (busbw = algbw x {OPS[op].bus_factor}" in out
    assert "WRONG" not in out and out.count("  fit: ") == len(OPS)  # a model or a warning per op
    runs = mlflow_runs(results, "comm")
    assert len(runs) == 1 and runs.iloc[0]["status"] == "FINISHED"
    run = runs.iloc[0]
    assert run["tags.stack"] == "torch.distributed/gloo" and run["tags.world_size"] == "2"
    assert float(run["params.fit.all_reduce.max_rel_err"]) >= 0
    assert run["metrics.all_reduce.busbw_GBps"] > 0  # the last size's value; every size is a step
    from mlflow.tracking import MlflowClient

    history = MlflowClient().get_metric_history(run["run_id"], "all_gather.busbw_GBps")
    assert sorted(m.step for m in history) == [1024, 4096, 16384]
    # the run directory's files reach the run as artifacts (docs/comm.md), none refused on the way
    top = {a.path for a in MlflowClient().list_artifacts(run["run_id"])}
    logs = {a.path for a in MlflowClient().list_artifacts(run["run_id"], "logs")}
    assert {"comm.json", "results.json", "command.txt"} <= top and {"logs/rank0.log", "logs/rank1.log"} <= logs
    assert "not uploaded" not in proc.stderr, proc.stderr[-2000:]
    assert_busbw_is_size_over_time_times_the_bus_factor(run["run_id"])
    store = f"sqlite:///{results / 'mlflow.db'}"
    proc = bench(["compare", "--experiment", "comm", "--tracking-uri", store, "--out", str(results / "rep")], results)
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = (results / "rep" / "report.html").read_text()
    for op in OPS:
        assert f"id='busbw-{op}'" in page
    data = json.loads(page.split("id='report-data'>")[1].split("</script>")[0])
    assert [p[0] for p in data["comm"]["all_reduce"]["torch.distributed/gloo x2"]] == [1024, 4096, 16384]


# nccl-tests doc/PERFORMANCE.md's bus factors at n = 2 ranks: all-reduce 2(n-1)/n = 1, all-gather,
# reduce-scatter and all-to-all (n-1)/n = 1/2, broadcast and send/recv 1 (docs/sources.md#collectives-benchmark)
BUS_FACTOR_AT_2 = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5,
                   "broadcast": 1.0, "send_recv": 1.0}  # fmt: skip


def assert_busbw_is_size_over_time_times_the_bus_factor(run_id: str) -> None:
    """Every logged (op, size): busbw = size / time x the op's bus factor, from the run's own time."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    assert set(BUS_FACTOR_AT_2) == set(OPS)
    for op, factor in BUS_FACTOR_AT_2.items():
        time_us = {m.step: m.value for m in client.get_metric_history(run_id, f"{op}.time_us")}
        busbw = {m.step: m.value for m in client.get_metric_history(run_id, f"{op}.busbw_GBps")}
        assert sorted(busbw) == sorted(time_us) == [1024, 4096, 16384], op
        for size, t in time_us.items():
            assert busbw[size] == pytest.approx(size / (t * 1e-6) / 1e9 * factor, rel=1e-9), (op, size)


@pytest.mark.full
@pytest.mark.parametrize("backend", ["ddp", "mindspore"])
def test_a_wrong_reduction_is_an_error_not_a_bandwidth(backend, results):
    if backend == "mindspore":
        pytest.importorskip("mindspore")
    args = ["comm", f"backend={backend}", "launcher.nproc_per_node=2", *SMALL, "comm.ops=[all_reduce,broadcast]"]
    proc = bench([*args, "comm.corrupt=all_reduce", f"run.results_dir={results}"], results)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "bench comm: error: wrong results (all_reduce) at 3 (op, size) points" in proc.stderr
    table = proc.stdout.split("\nall_reduce")[1].split("\nbroadcast")[0]
    assert table.count("WRONG") == 3 and "GB/s)" in table
    runs = mlflow_runs(results, "comm")
    assert runs.iloc[0]["status"] == "FAILED" and "wrong results" in runs.iloc[0]["tags.failure_reason"]
    assert "metrics.all_reduce.busbw_GBps" not in runs.columns or runs["metrics.all_reduce.busbw_GBps"].isna().all()
    assert runs.iloc[0]["metrics.broadcast.busbw_GBps"] > 0  # the correct op still has its figures


@pytest.mark.full
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


# --------------------------------------------------------------------------------------------
# Communication accounting in bench run, and bench compare.
# --------------------------------------------------------------------------------------------
# one warm-up step: the measured step is a steady one (DeepSpeed ZeRO-3 traces the module order in its first
# step). The matrix's vocabulary (VOCAB, conftest's FAST): the byte counts are checked against the formula of
# the same model whatever its size, and the 32k embeddings made each job's start-up and step several times longer.
TINY = ["+model=llama", f"model.vocab_size={VOCAB}", "data.seq_len=64", "run.warmup_steps=1", "run.steps=1",
        "run.checksum=false"]  # fmt: skip


def _assert_measured_equals_formula(summary: dict) -> dict:
    """Every kind of the formula moved exactly its bus bytes; returns the measured kinds the formula
    has no term for (scalars apart), which the summary lists."""
    got, want = summary["comm_measured"], summary["comm_formula"]
    for kind, w in want.items():
        assert kind in got, (summary["backend"], kind, got)
        assert got[kind]["bus_bytes"] == pytest.approx(w["bus_bytes"]), (summary["backend"], kind, got[kind], w)
    # kinds without a term that move bytes (Megatron's all-reduce over a one-rank data-parallel group moves none)
    extra = {k: v["bus_bytes"] for k, v in got.items() if k not in want and k != "scalar" and v["bus_bytes"] > 0}
    # the printed difference is the difference of the two totals, each the sum over its own kinds
    measured, formula = summary["comm_bus_bytes_per_step"], summary["comm_formula_bus_bytes_per_step"]
    assert measured == pytest.approx(sum(v["bus_bytes"] for k, v in got.items() if k != "scalar"))  # scalars apart
    assert formula == pytest.approx(sum(w["bus_bytes"] for w in want.values()))
    assert summary["comm_diff_bus_bytes"] == pytest.approx(measured - formula)
    return extra


@pytest.fixture(scope="module")
def comm_runs(tmp_path_factory):
    """(results dir, stdout of the megatron pp=2 run): a sweep of its own (ddp, fsdp, ZeRO 1-3, megatron
    tp=2 without and with sequence parallelism) and megatron pp=2 beside it, in one MLflow store. One warm-up and one measured step is all a
    per-step byte count needs (the run matrix trains 20 and has no warm-up step, and ZeRO-3 traces the
    module order in its first). Read by the formula test and by the compare test (its ddp and fsdp rows)."""
    results = tmp_path_factory.mktemp("comm_runs")
    backends = "ddp,fsdp,deepspeed/zero1,deepspeed/zero2,deepspeed/zero3,megatron/tp,megatron/tp_sp"
    proc = bench(["run", "-m", *TINY, f"backend={backends}", "launcher.nproc_per_node=2"], results, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = bench(["run", *TINY, "backend=megatron", "backend.pp=2", "launcher.nproc_per_node=2"], results)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results, proc.stdout


@pytest.mark.full
def test_measured_bytes_per_step_equal_the_formula(comm_runs):
    from conftest import summaries

    results, pp_stdout = comm_runs
    assert "communication" in pp_stdout and "measured - formula = +0 B" in pp_stdout  # pp=2
    found = summaries(results)
    assert len(found) == 8, sorted(found)
    extras = {}  # by run directory: one per job, so the ZeRO stages (and megatron's layouts) stay apart
    for job_dir, summary in found.items():
        extras[job_dir] = _assert_measured_equals_formula(summary)
    assert len(extras) == 8
    # what the formulas leave out, pinned: DeepSpeed ZeRO-3 broadcasts a few hundred bytes per step
    specs = {d: json.loads(next(results.glob(f"runs/*/*/{d}/spec.json")).read_text())["backend"] for d in found}
    megatron = {d: spec["options"]["sequence_parallel"] for d, spec in specs.items() if spec["name"] == "megatron"}
    assert sorted(megatron.values()) == [False, False, True], megatron  # tp, tp_sp and pp=2
    stage = {d: spec["options"]["zero_stage"] for d, spec in specs.items() if spec["name"] == "deepspeed"}
    assert sorted(stage.values()) == [1, 2, 3], stage
    assert all(not e for d, e in extras.items() if stage.get(d) != 3), extras
    assert all(v < 4096 for d, e in extras.items() if stage.get(d) == 3 for v in e.values()), extras
    ddp = next(s for s in found.values() if s["backend"] == "ddp")
    psi = ddp["num_params"]
    assert ddp["comm_measured"]["all_reduce"]["bytes"] == 4 * psi  # fp32 gradients, once per step
    assert ddp["comm_bus_bytes_per_step"] == pytest.approx(2 * (2 - 1) / 2 * 4 * psi)  # the ZeRO paper's 2 Psi
    assert all(s["comm_padding_bytes"] == 0 for s in found.values())  # 2 ranks: every dimension divides


@pytest.mark.full
def test_comm_columns_and_bus_bandwidth_plots_render(tmp_path):
    import shutil
    import subprocess

    from parabench.compare.command import RunRecord, build_sections, render_html, render_text, report_dict

    base = dict(device="cpu", device_name="cpu", precision="fp32", global_batch=4, seq_len=64, model="llama")
    base |= dict(mfu=None, peak_tflops=None, peak_source="", rank_spread_s=0.0, peak_memory_bytes=1.0)
    base |= dict(model_state_bytes=1.0, loss_final=9.0, step_time_median_s=1.0, tokens_per_s=10.0)
    records = [
        RunRecord(run_id="a", backend="ddp", variant="ddp", world_size=2, tokens_per_s_per_device=5.0, **base,
                  comm_bytes_per_step=4 * 2**20, comm_formula_bytes_per_step=4 * 2**20, comm_share_of_step=0.25)
    ]  # fmt: skip
    report = report_dict(
        build_sections(records, None, strict=False), {"created": "now", "tracking_uri": "x", "run_ids": ["a"]}
    )
    report["comm"] = {
        "all_reduce": {"torch.distributed/gloo x2": [[1024.0, 0.01], [1048576.0, 0.9]]},
        "all_gather": {"torch.distributed/gloo x2": [[1024.0, 0.02], [1048576.0, 0.5]]},
    }
    text = render_text(report)
    assert "comm/step" in text and "4.000 MiB" in text and "25.0%" in text
    page = render_html(report)
    assert "id='busbw-all_reduce'" in page and "id='busbw-all_gather'" in page
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed (.ci/run installs it)")
    (tmp_path / "report.html").write_text(page)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={tmp_path / 'chrome'}"]
    dom = subprocess.run(
        [chromium, *flags, "--dump-dom", (tmp_path / "report.html").as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert 'id="busbw-all_reduce"' in dom and "all_reduce bus bandwidth" in dom and "polyline" in dom
    assert json.loads(dom.split('id="report-data">')[1].split("</script>")[0])["comm"]["all_reduce"]


@pytest.mark.full
def test_compare_over_a_real_sweep_shows_the_comm_columns(comm_runs):
    """The formula test's runs on 2 ranks (a sweep and megatron pp=2 in one MLflow experiment), then
    bench compare: for ddp and fsdp the measured bus bytes per step, the formula's and the
    communication share, the numbers of the runs' own summaries. Runs of their own, not the matrix's:
    compare reads a whole experiment, and the matrix's holds every variant."""
    from conftest import summaries

    results, _ = comm_runs
    found = {s["backend"]: s for s in summaries(results).values() if s["backend"] in ("ddp", "fsdp")}
    assert sorted(found) == ["ddp", "fsdp"]
    out = results / "rep"
    store = f"sqlite:///{results / 'mlflow.db'}"
    proc = bench(
        ["compare", "--experiment", "parabench", "--tracking-uri", store, "--out", str(out), "--no-log"], results
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["backend"]: r for r in json.loads((out / "report.json").read_text())["sections"][0]["rows"]}
    lines: dict[str, str] = {}  # the first line per backend: the main table (the stability table follows)
    for line in proc.stdout.splitlines():
        if line.split()[:1] in (["ddp"], ["fsdp"]):
            lines.setdefault(line.split()[0], line)
    for name, s in found.items():
        row = rows[name]
        assert (
            row["comm_bytes_per_step"] == pytest.approx(s["comm_bus_bytes_per_step"]) and s["comm_bus_bytes_per_step"]
        )
        assert row["comm_formula_bytes_per_step"] == pytest.approx(s["comm_formula_bus_bytes_per_step"])
        assert row["comm_share_of_step"] == pytest.approx(s["comm_share_of_step"]) and s["comm_share_of_step"] > 0
        cells = (f"{row['comm_bytes_per_step'] / 2**20:.3f} MiB", f"{row['comm_formula_bytes_per_step'] / 2**20:.3f} MiB",
                 f"{100 * row['comm_share_of_step']:.1f}%")  # fmt: skip
        assert all(c in lines[name] for c in cells), (lines[name], cells)
    psi = found["ddp"]["num_params"]
    assert (
        rows["ddp"]["comm_bytes_per_step"] == rows["ddp"]["comm_formula_bytes_per_step"] == 4 * psi
    )  # 2(n-1)/n x 4 Psi


@pytest.mark.full
def test_sizes_that_do_not_split_are_rounded_and_the_rounding_shown(results):
    # 1002 B is 250.5 fp32 elements: all_gather/reduce_scatter on 2 ranks run 1000 B (125 elements per rank)
    args = ["comm", "launcher.nproc_per_node=2", "comm.ops=[all_gather,reduce_scatter,all_reduce]",
            "comm.min_bytes=1002", "comm.max_bytes=1002", "comm.warmup_iters=1", "comm.iters=2"]  # fmt: skip
    proc = bench([*args, f"run.results_dir={results}"], results)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for op in ("all_gather", "reduce_scatter"):
        (line,) = [x for x in proc.stdout.split(f"\n{op}  (busbw")[1].splitlines()[2:3]]
        assert line.split()[:2] == ["1000", "250"] and line.endswith("(rounded from 1002 B)"), line
    line = proc.stdout.split("\nall_reduce  (busbw")[1].splitlines()[2]
    assert line.split()[:2] == ["1000", "250"] and line.endswith("(rounded from 1002 B)"), line  # whole elements
