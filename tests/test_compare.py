"""bench compare: grouping, ratios, efficiencies and refusals on synthetic records; renderers."""

import html
import json
from pathlib import Path

import pytest

from parabench.compare.command import render_csv, render_html, render_text
from parabench.errors import UserError
from parabench.runtable import RunRecord, build_sections, grouping_note, report_dict, scaling_metrics


def rec(run_id, variant, world, tps, gbs=None, model="llama", precision="fp32", seq=128, **kw):
    gbs = gbs if gbs is not None else 2 * world
    base = dict(
        run_id=run_id,
        backend=variant.split("(")[0],
        variant=variant,
        world_size=world,
        model=model,
        device="cpu",
        device_name="cpu",
        precision=precision,
        global_batch=gbs,
        seq_len=seq,
        tokens_per_s=tps,
        tokens_per_s_per_device=tps / world,
        mfu=0.3,
        peak_tflops=0.1,
        peak_source="measured",
        step_time_median_s=1.0,
        rank_spread_s=0.01,
        peak_memory_bytes=1e9,
        model_state_bytes=3e8,
        loss_final=9.0,
        losses=[10.0, 9.5, 9.0],
        state_per_rank=[{"params": 1e8, "grads": 1e8, "optimizer": 2e8, "optimizer_other": 0}] * world,
    )
    base.update(kw)
    return RunRecord(**base)


def test_weak_scaling_efficiency_and_bands():
    records = [rec("a", "ddp", 1, 100), rec("b", "ddp", 1, 110), rec("c", "ddp", 2, 180), rec("d", "ddp", 2, 190)]
    (sec,) = build_sections(records, None, strict=False)
    two = next(r for r in sec.rows if r.world_size == 2)
    assert two.efficiency_kind == "weak"
    assert two.efficiency == pytest.approx(185 / (2 * 105))
    assert two.efficiency_band == pytest.approx((180 / 220, 190 / 200))
    assert two.efficiency_note == ""  # band [0.82, 0.95] does not reach 1.0


def test_strong_scaling_and_noise_flags():
    records = [
        rec("a", "ddp", 1, 100, gbs=4),
        rec("b", "ddp", 1, 120, gbs=4),
        rec("c", "ddp", 2, 210, gbs=4),
        rec("d", "ddp", 2, 230, gbs=4),
        rec("e", "fsdp", 1, 100, gbs=4),
        rec("f", "fsdp", 2, 200, gbs=4),
        rec("g", "fsdp", 1, 101, gbs=4),
        rec("h", "fsdp", 2, 205, gbs=4),
    ]
    (sec,) = build_sections(records, None, strict=False)
    ddp2 = next(r for r in sec.rows if r.variant == "ddp" and r.world_size == 2)
    assert ddp2.efficiency_kind == "strong"
    assert "overlaps 1.0" in ddp2.efficiency_note and "fsdp" in ddp2.efficiency_note
    metrics, flags = scaling_metrics([sec])
    assert metrics["efficiency/ddp/N2"] == pytest.approx(220 / (2 * 110)) and flags


def test_baseline_ratio_at_same_world_and_batch_with_noise_mark():
    records = [
        rec("a", "ddp", 2, 100),
        rec("b", "ddp", 2, 104),
        rec("c", "fsdp", 2, 90),
        rec("d", "fsdp", 2, 91),
        rec("e", "deepspeed(zero_stage=3)", 2, 101),
        rec("f", "deepspeed(zero_stage=3)", 2, 103),
    ]
    (sec,) = build_sections(records, ("backend", "ddp"), strict=False)
    by = {r.variant: r for r in sec.rows}
    assert by["fsdp"].ratio == pytest.approx(90.5 / 102) and by["fsdp"].ratio_note == ""
    assert "within noise" in by["deepspeed(zero_stage=3)"].ratio_note
    assert by["ddp"].ratio == 1.0


def test_incomparable_runs_are_grouped_apart_or_refused():
    records = [
        rec("a", "ddp", 1, 100),
        rec("b", "ddp", 1, 50, model="llama2-7b"),
        rec("c", "ddp", 1, 70, precision="bf16"),
    ]
    sections = build_sections(records, ("backend", "ddp"), strict=False)
    assert len(sections) == 3 and all(len(s.rows) == 1 for s in sections)
    assert "model differs" in sections[1].note or "model differs" in sections[2].note
    with pytest.raises(UserError, match="not comparable: model differs"):
        build_sections(records[:2], ("backend", "ddp"), strict=True)


def test_missing_baseline_is_said_not_guessed():
    (sec,) = build_sections([rec("a", "fsdp", 1, 100)], ("backend", "ddp"), strict=False)
    assert sec.rows[0].ratio is None and "no backend=ddp run" in sec.rows[0].ratio_note


def test_renderers_carry_the_same_numbers():
    records = [rec("a", "ddp", 1, 100), rec("c", "ddp", 2, 180), rec("e", "fsdp", 1, 90), rec("f", "fsdp", 2, 170)]
    report = report_dict(
        build_sections(records, ("backend", "ddp"), strict=False),
        {"created": "now", "tracking_uri": "sqlite://", "run_ids": list("acef"), "baseline": "backend=ddp"},
    )
    text = render_text(report)
    assert "ddp" in text and "90.0%" in text  # 180 / (2 * 100)
    assert "| backend |" in render_text(report, markdown=True)
    assert render_csv(report).count("\n") == 5
    page = render_html(report)
    for plot in ("throughput-0", "efficiency-0", "memory-0", "loss-0"):
        assert f"id='{plot}'" in page
    data = json.loads(page.split("id='report-data'>")[1].split("</script>")[0])
    assert data["sections"][0]["rows"][1]["efficiency"] == pytest.approx(0.9)


def test_compare_cli_errors_are_one_line(tmp_path, capsys):
    from parabench.compare.command import main

    assert main(["--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no MLflow store" in err
    assert main(["--baseline", "oops", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"]) == 2


# --------------------------------------------------------------------------------------------
# Predicted (bench plan) vs measured (bench run).
# --------------------------------------------------------------------------------------------
def test_plan_rows_meet_only_the_runs_that_carry_all_their_params():
    from parabench.compare.versus import versus

    match = {"backend.name": "ddp", "data.micro_batch_size": "2", "model.hidden_size": "64", "device": "cpu"}
    row = {"rank": 1, "layout": "ddp dp1 mbs2", "overrides": "backend=ddp", "match": match,
           "step_s": 0.5, "tokens_per_s_per_device": 300.0, "device_bytes": 2e8}  # fmt: skip
    plan = {"run_id": "p", "name": "plan-x", "doc": {"context": {"calibration": "c"}, "ranked": [row]}}
    params = {k: v for k, v in match.items() if k != "device"}
    same = [rec("a", "ddp", 1, 200, step_time_median_s=0.4, peak_memory_bytes=1.6e8, params=params),
            rec("b", "ddp", 1, 260, step_time_median_s=0.6, peak_memory_bytes=2.4e8, params=params)]  # fmt: skip
    other = rec("c", "ddp", 1, 999, params={**params, "data.micro_batch_size": "4"})
    elsewhere = rec("d", "ddp", 1, 999, params=params, device="cuda")
    (entry,) = versus([plan], [*same, other, elsewhere])
    assert entry["run_ids"] == ["a", "b"]
    assert entry["step_s"] == {"predicted": 0.5, "measured": 0.5, "error": 0.0}  # median of 0.4 and 0.6
    assert entry["tokens_per_s_per_device"]["measured"] == 230.0  # tps / world of each, median
    assert entry["tokens_per_s_per_device"]["error"] == pytest.approx(300 / 230 - 1)
    assert entry["device_bytes"]["error"] == pytest.approx(0.0)


@pytest.mark.full
def test_compare_puts_a_plan_beside_the_run_of_its_row(results):
    """bench plan with tracking on, bench run of the plan's row 1 (its printed overrides), then
    bench compare: the predicted and measured step time, tokens/s and peak memory with the error. A run
    of its own: the one the plan names, in the plan's experiment."""
    from mlflow.tracking import MlflowClient

    from conftest import bench, mlflow_runs

    tiny = ["+model=llama", "model.vocab_size=1000", "model.hidden_size=64", "model.intermediate_size=172",
            "model.num_hidden_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2",
            "data.seq_len=32", "data.global_batch_size=4", "run.warmup_steps=1", "run.steps=3",
            "run.checksum=false", f"run.results_dir={results}"]  # fmt: skip
    plan_args = ["cluster=cpu", "plan.devices=1", "plan.backends=[ddp]", "plan.micro_batch_sizes=[2]", "plan.top=1"]
    proc = bench(["plan", *tiny, *plan_args, "--format", "json"], results)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout)["ranked"][0]
    # the plan is an MLflow run: kind tag, context params, both tables as artifacts, row 1's figures
    (plan,) = mlflow_runs(results, "parabench-plan").itertuples()
    client = MlflowClient(f"sqlite:///{results / 'mlflow.db'}")
    run = client.get_run(plan.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["parabench.kind"] == "plan"
    assert run.data.params["plan.cluster"] == "cpu" and run.data.params["plan.devices"] == "1"
    assert sorted(a.path for a in client.list_artifacts(plan.run_id)) == ["plan.json", "plan.md"]
    assert run.data.metrics["predicted_step_time_s"] == pytest.approx(row["step_s"])
    proc = bench(["run", *tiny, *row["overrides"].split()], results)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = mlflow_runs(results, "parabench").itertuples()
    store = f"sqlite:///{results / 'mlflow.db'}"
    out = results / "rep"
    proc = bench(
        ["compare", "--experiment", "parabench", "--tracking-uri", store, "--out", str(out), "--no-log"], results
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "predicted (bench plan) vs measured (bench run)" in proc.stdout and "ddp dp1 mbs2" in proc.stdout
    (entry,) = json.loads((out / "report.json").read_text())["predicted"]
    assert entry["run_ids"] == [job.run_id] and entry["plan_run_id"] == plan.run_id
    measured = client.get_run(job.run_id).data.metrics
    for key, metric in (("step_s", "step_time_median_s"), ("tokens_per_s_per_device", "tokens_per_s_per_device"),
                        ("device_bytes", "peak_memory_bytes_max")):  # fmt: skip
        q = entry[key]
        assert q["predicted"] == pytest.approx(row[key]) and q["measured"] == pytest.approx(measured[metric])
        assert q["error"] == pytest.approx((q["predicted"] - q["measured"]) / q["measured"])
        assert f"{100 * q['error']:+.1f}%" in proc.stdout
    assert "id='predicted'" in (out / "report.html").read_text()
    _calibrate_on(results, store, client.get_run(job.run_id), tiny, plan_args)


def _calibrate_on(results, store, run, tiny, plan_args):
    """bench plan --calibrate on the recorded run: the efficiency is the hand formula
    C / T (C = the step's model FLOPs per device at the peak the run's MFU used, T the measured
    median step; one rank: no communication, no bubble), named with its fit error in the plan."""
    from conftest import bench
    from parabench.flops import flops_per_token
    from parabench.jobs import job_from_json

    cwd = results.parent  # the calibration is stored under ./results/plan/ of the working directory
    proc = bench(["plan", "--calibrate", "parabench", "--tracking-uri", store], results, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = job_from_json((Path(run.data.tags["run_dir"]) / "spec.json").read_text())
    m = run.data.metrics
    flops = flops_per_token(job.model, job.data.seq_len) * job.tokens_per_step
    eff = flops / (m["peak_tflops_per_device"] * 1e12) / m["step_time_median_s"]
    assert f"efficiency ddp/cpu: {100 * eff:.1f}% of peak" in proc.stdout, proc.stdout
    assert (
        "calibration parabench: 1 runs" in proc.stdout
        and "fit error (median over the runs): step time 0.0%" in proc.stdout
    )
    cal = json.loads((cwd / "results" / "plan" / "parabench.json").read_text())
    assert cal["efficiency"]["ddp/cpu"] == pytest.approx(eff) and cal["time_error"] == pytest.approx(0, abs=1e-9)
    proc = bench(["plan", *tiny, *plan_args, "plan.calibration=parabench", "tracking.enabled=false"], results, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "calibration parabench (1 runs; fit error: step time 0%, memory 0%)" in proc.stdout, proc.stdout


# --------------------------------------------------------------------------------------------
# Grouping by everything that changes the numbers (issue 26, case 6).
# --------------------------------------------------------------------------------------------
def test_runs_that_differ_in_what_changes_the_numbers_are_set_apart_with_the_reason():
    """Synthetic vs text data, another rows checksum, 4 vs 10 steps, another warm-up, a resumed run:
    none is a repeat of the fresh 10-step synthetic runs; each section names its runs and why."""
    same = dict(data="synthetic seed 1234", data_checksum="aa", steps=10, warmup_steps=2)
    records = [
        rec("a", "ddp", 1, 100, **same),
        rec("b", "ddp", 1, 102, **same),
        rec("text", "ddp", 1, 300, **{**same, "data": "text:corpus.txt seed 1234"}),
        rec("edited", "ddp", 1, 300, **{**same, "data_checksum": "bb"}),
        rec("short", "ddp", 1, 300, **{**same, "steps": 4}),
        rec("warm", "ddp", 1, 300, **{**same, "warmup_steps": 0}),
        rec("resumed", "ddp", 1, 300, **same, started_at_step=5, started_from="run-a"),
    ]
    first, *apart = build_sections(records, None, strict=False)
    (row,) = first.rows
    assert [r.run_id for r in row.runs] == ["a", "b"] and row.tokens_per_s == 101
    why = {s.rows[0].runs[0].run_id: s.note for s in apart}
    assert "data differs (synthetic seed 1234 vs text:corpus.txt seed 1234)" in why["text"]
    assert "data_checksum differs (agrees vs bb (other rows))" in why["edited"]
    assert "steps differs (10 vs 4)" in why["short"]
    assert "warmup_steps differs (2 vs 0)" in why["warm"]
    assert "start differs (fresh vs resumed from step 5)" in why["resumed"]
    assert all(note.startswith(f"set apart from the first section (runs {rid})") for rid, note in why.items())
    with pytest.raises(UserError, match="start differs.*--pool-resumed"):
        build_sections([records[0], records[-1]], None, strict=True)


def test_a_weak_scaling_series_stays_one_section_though_its_rows_checksums_differ():
    """The rows checksum sums every trained row: twice the global batch, another checksum. It is
    compared among runs of one global batch, so the series keeps its efficiency."""
    records = [rec("a", "ddp", 1, 100, gbs=2, data_checksum="one"), rec("b", "ddp", 2, 180, gbs=4, data_checksum="two"),
               rec("c", "ddp", 2, 180, gbs=4, data_checksum="edited"),
               rec("d", "ddp", 2, 180, gbs=4, data_checksum="two")]  # fmt: skip
    main, edited = build_sections(records, None, strict=False)
    assert [r.run_id for row in main.rows for r in row.runs] == ["a", "b", "d"]
    assert main.rows[1].efficiency == pytest.approx(0.9) and main.rows[1].efficiency_kind == "weak"
    assert edited.note.startswith("set apart from the first section (runs c): data_checksum differs")


def test_a_resumed_run_is_a_repeat_only_when_asked():
    fresh = rec("a", "ddp", 1, 100, steps=10, data_checksum="full")
    resumed = rec("r", "ddp", 1, 120, steps=10, data_checksum="tail", started_at_step=5)
    assert len(build_sections([fresh, resumed], None, strict=False)) == 2
    (sec,) = build_sections([fresh, resumed], None, strict=False, pool_resumed=True)
    (row,) = sec.rows
    assert len(row.runs) == 2 and row.tokens_per_s == 110
    report = report_dict([sec], {"created": "now", "tracking_uri": "x", "run_ids": ["a", "r"],
                                 "grouping": grouping_note(True)})  # fmt: skip
    assert "resumed runs pooled with fresh ones as repeats (--pool-resumed" in render_text(report)
    assert "never a repeat of a fresh one" in grouping_note(False)


def test_layout_and_micro_batch_are_rows_of_their_own():
    records = [
        rec("a", "megatron", 2, 100, layout="dp2 tp1 pp1 cp1", micro_batch=2),
        rec("b", "megatron", 2, 80, layout="dp1 tp2 pp1 cp1", micro_batch=2),
        rec("c", "megatron", 2, 90, layout="dp2 tp1 pp1 cp1", micro_batch=1),
    ]
    (sec,) = build_sections(records, None, strict=False)
    assert sorted((r.layout, r.micro_batch, len(r.runs)) for r in sec.rows) == [
        ("dp1 tp2 pp1 cp1", 2, 1),
        ("dp2 tp1 pp1 cp1", 1, 1),
        ("dp2 tp1 pp1 cp1", 2, 1),
    ]
    text = render_text(report_dict([sec], {"created": "now", "tracking_uri": "x", "run_ids": list("abc")}))
    assert "dp1 tp2 pp1 cp1" in text and "micro" in text


def test_the_final_loss_is_never_a_median_over_runs_of_different_lengths():
    four = rec("a", "ddp", 1, 100, losses=[10.0, 9.0, 8.0, 7.0], loss_final=7.0)
    ten = rec("b", "ddp", 1, 100, losses=[10.0 - i / 2 for i in range(10)], loss_final=5.5)
    (sec,) = build_sections([four, ten], None, strict=False)  # no steps recorded: the histories tell
    assert sec.rows[0].as_dict()["loss_final"] is None
    report = report_dict([sec], {"created": "now", "tracking_uri": "x", "run_ids": ["a", "b"]})
    assert "no final loss (its runs' loss histories differ in length)" in render_text(report)
    (same,) = build_sections([four, rec("c", "ddp", 1, 90, losses=[9.0] * 4, loss_final=9.0)], None, strict=False)
    assert same.rows[0].as_dict()["loss_final"] == 8.0


def test_the_html_report_has_every_section_of_the_text_report_and_the_run_ids():
    records = [
        rec("run-a", "ddp", 1, 100, stability={"ckpt_save_blocking_s": 0.25, "goodput": 0.9}),
        rec("run-b", "ddp", 1, 130, stability={"ckpt_save_blocking_s": 0.35, "goodput": 0.8}),
        rec("run-c", "fsdp", 2, 150),
        rec("run-d", "ddp", 1, 100, steps=4),
    ]
    meta = {"created": "now", "tracking_uri": "x", "run_ids": ["run-a", "run-b", "run-c", "run-d"],
            "baseline": "backend=ddp", "grouping": grouping_note(False)}  # fmt: skip
    report = report_dict(build_sections(records, ("backend", "ddp"), strict=False), meta)
    text, page = render_text(report), html.unescape(render_html(report))
    notes = [line.split("note: ", 1)[1] for line in text.splitlines() if "note: " in line]
    assert "fsdp x2: no backend=ddp run at world size 2, global batch 4" in notes
    assert "stability (checkpoints and recovery)" in text and "0.300" in text and "85.0%" in text  # medians
    for piece in [*notes, "stability (checkpoints and recovery)", "0.300", "85.0%"]:
        assert piece in page, piece
    for sec in report["sections"]:
        assert sec["note"] in page
    for line in text.splitlines():
        if line.startswith(("grouping:", "tokens/s:", "eff.:", "ratio:", "comm/step:")):
            assert line in page, line
    assert "run-a run-b" in page and "run-c" in page and "run-d" in page
    assert "id='stability-0'" in page


def test_the_grouping_keys_are_read_from_the_params_and_tags_bench_run_logs():
    from parabench.runtable import _conditions

    params = {"data.source": "text", "data.path": "corpus.txt", "data.seed": "7", "run.steps": "10",
              "run.warmup_steps": "2", "data.micro_batch_size": "2", "derived.dp": "1", "derived.tp": "2",
              "derived.pp": "1", "derived.cp": "1", "launcher.nnodes": "2"}  # fmt: skip
    tags = {"data_checksum": "00ff", "parabench.resumed_step": "5", "parabench.resumed_from_run": "abc"}
    got = _conditions({"started_at_step": 5.0}, params, tags)
    assert got == {"data": "text:corpus.txt seed 7", "data_checksum": "00ff", "steps": 10, "warmup_steps": 2,
                   "micro_batch": 2, "layout": "dp1 tp2 pp1 cp1 nodes2", "started_at_step": 5,
                   "started_from": "abc"}  # fmt: skip
    fresh = _conditions({"started_at_step": 0.0}, {**params, "data.source": "synthetic", "data.path": "None"}, {})
    assert fresh["started_at_step"] == 0 and fresh["data"] == "synthetic seed 7"
