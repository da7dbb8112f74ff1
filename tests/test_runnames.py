"""MLflow run names and experiments (issue 26 case 7): nine runs of one afternoon were all named
``ddp-llama-x1``, two plans had the same name, and comparisons landed in the training experiment."""

from __future__ import annotations

import argparse
import calendar
import time

import pytest
from mlflow.tracking import MlflowClient
from test_resilience import job_of

from parabench.runnames import job_run_name

NOON = calendar.timegm(time.strptime("2026-12-05 12:00:00", "%Y-%m-%d %H:%M:%S"))


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ([], "ddp-llama-x1-20261205-120000"),
        (["launcher.nproc_per_node=2", "backend=deepspeed", "backend.zero_stage=3"], "deepspeed-llama-x2-zero3-20261205-120000"),
        (["launcher.nproc_per_node=2", "backend=fsdp", "backend.reshard_after_forward=false"], "fsdp-llama-x2-noreshard-20261205-120000"),
        (["launcher.nproc_per_node=4", "backend=megatron", "backend.tp=2", "backend.pp=2"], "megatron-llama-x4-tp2-pp2-20261205-120000"),
        (["launcher.nproc_per_node=8", "backend=megatron", "backend.tp=2", "backend.pp=2", "backend.vpp=2",
          "backend.sequence_parallel=true", "model.num_hidden_layers=4"], "megatron-llama-x8-tp2-pp2-vpp2-sp-20261205-120000"),
    ],
)  # fmt: skip
def test_a_job_run_is_named_by_backend_model_world_layout_and_utc_time(overrides, name):
    assert job_run_name(job_of(*overrides), repeat=0, now=NOON) == name


def test_runs_of_one_job_differ_by_time_and_repeats_by_index():
    job = job_of()
    assert job_run_name(job, 0, NOON) != job_run_name(job, 0, NOON + 1)
    repeated = job_of("run.repeats=3")
    names = {job_run_name(repeated, rep, NOON) for rep in range(3)}
    assert names == {f"ddp-llama-x1-r{rep}-20261205-120000" for rep in range(3)}


def test_a_comparison_is_logged_in_an_experiment_of_its_own_with_a_dated_name(tmp_path):
    """bench compare --experiment E logs its run in ``E-comparisons``; the training experiment E
    keeps only the training runs."""
    from parabench.compare.command import _log_comparison

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    training = client.create_experiment("E")
    out = tmp_path / "rep"
    out.mkdir()
    (out / "report.md").write_text("# report\n")
    args = argparse.Namespace(experiment="E", baseline=None)
    _log_comparison(client, args, [], out)
    _log_comparison(client, args, [], out)
    assert client.search_runs([training]) == []
    runs = client.search_runs([client.get_experiment_by_name("E-comparisons").experiment_id])
    assert len(runs) == 2 and all(r.data.tags["parabench.kind"] == "compare" for r in runs)
    assert all(r.info.run_name.startswith("compare-E-") for r in runs), [r.info.run_name for r in runs]


def test_two_plans_of_one_model_get_different_names_in_the_plan_experiment(tmp_path, monkeypatch, capsys):
    """bench plan twice (a second apart): two runs in ``parabench-plan``, named with the model, the
    cluster, the devices and the time; none in the training experiment."""
    from parabench.cli import main

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["plan", "+model=llama", "cluster=cpu", "plan.devices=1", "plan.backends=[ddp]", "plan.top=1",
            f"run.results_dir={tmp_path}", f"tracking.uri={store}"]  # fmt: skip
    for now in (NOON, NOON + 1):
        monkeypatch.setattr(time, "time", lambda now=now: float(now))
        assert main(args) == 0, capsys.readouterr().err
    client = MlflowClient(store)
    assert client.get_experiment_by_name("parabench") is None
    runs = client.search_runs([client.get_experiment_by_name("parabench-plan").experiment_id])
    names = sorted(r.info.run_name for r in runs)
    assert names == ["plan-llama-cpux1-20261205-120000", "plan-llama-cpux1-20261205-120001"], names
