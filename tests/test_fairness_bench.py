"""benchmarks/fairness.py's pure parts: its throughput formula against the harness's own summary, the
ratio/spread arithmetic, argument parsing, the launch commands, and that the native loops train the
job `bench run` trains (same composed spec, same batches, DeepSpeed's config and Megatron's
TransformerConfig equal to the adapters' where they shape the computation). Starts no processes."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import REPO

sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "benchmarks" / "native")]
import fairness  # noqa: E402
import native_common  # noqa: E402


def compose_job(overrides: list[str]):
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config

    return from_config(to_plain(compose(overrides)))


def test_tokens_per_s_is_the_harness_summary_figure():
    from parabench.metrics import summarize

    rng = np.random.default_rng(0)
    rank_times = [list(rng.uniform(0.05, 0.2, 7)) for _ in range(3)]
    ranks = [
        {"step_times": t, "losses": [1.0], "peak_memory_bytes": 0, "model_state": {"total": 0}} for t in rank_times
    ]
    expected = summarize(ranks, 256, 1.0, None)["tokens_per_s"]
    assert fairness.tokens_per_s(rank_times, 256) == pytest.approx(expected, rel=1e-12)


def test_ratio_is_of_the_medians_and_spread_of_the_rounds():
    pair = fairness.Pair("ddp", 2, (100.0, 300.0, 200.0), (99.0, 270.0, 210.0), (10.0, 30.0, 20.0), (9.0, 40.0, 19.0))
    assert pair.ratio == pytest.approx(210.0 / 200.0)
    assert pair.spread == pytest.approx((0.9, 1.05))  # rounds: 0.99, 0.9, 1.05
    assert pair.step_ratio == pytest.approx(19.0 / 20.0)
    assert "| 1.050 | 0.900-1.050 | 0.950 |" in pair.line()


def test_a_kept_directory_gives_the_pairs_in_the_order_they_ran(tmp_path):
    """Native rank files and bench run summaries (the fields the benchmark reads) -> the same table."""
    import json
    import os

    def native_run(name: str, rank_times: list[list[float]], mtime: int) -> None:
        out = tmp_path / name
        out.mkdir()
        for r, times in enumerate(rank_times):
            (out / f"rank{r}.json").write_text(
                json.dumps({"step_times": times, "first_loss": 7.0 + r, "tokens_per_step": 100})
            )
        os.utime(out, (mtime, mtime))

    def bench_run(stamp: str, tokens_per_s: float, median: float) -> None:
        out = tmp_path / "results" / "runs" / "parabench" / stamp / "ddp"
        out.mkdir(parents=True)
        summary = {"backend": "ddp", "world_size": 2, "tokens_per_step": 100, "tokens_per_s": tokens_per_s}
        (out / "summary.json").write_text(json.dumps(summary | {"step_time_median_s": median, "loss_first": 7.5}))

    native_run("native-ddp-x2-b", [[1.0, 4.0, 1.0], [2.0, 1.0, 1.0]], 200)  # ran second
    native_run("native-ddp-x2-a", [[0.5, 0.5, 0.5], [0.5, 0.5, 1.0]], 100)  # ran first
    bench_run("20261206-040000", 150.0, 0.5)
    bench_run("20261206-040100", 60.0, 2.0)
    (pair,) = fairness.pairs_from_kept(tmp_path)
    # first: slowest ranks 0.5, 0.5, 1.0 -> 300 tokens / 2 s; second: 2, 4, 1 -> 300 / 7 s
    assert pair.native == pytest.approx((150.0, 300.0 / 7.0)) and pair.harness == (150.0, 60.0)
    assert pair.native_step == pytest.approx((200.0, 50.0)) and pair.harness_step == (200.0, 50.0)


def test_arguments_parse_and_bad_ones_exit_with_the_flag_named(capsys):
    args = fairness.parse_args(["--backends", "fsdp, megatron", "--worlds", "2", "--rounds", "2", "--steps", "5"])
    assert (args.backends, args.worlds, args.rounds, args.steps) == (["fsdp", "megatron"], [2], 2, 5)
    defaults = fairness.parse_args([])
    assert defaults.backends == list(fairness.BACKENDS) and defaults.worlds == [1, 2]
    for bad, flag in (
        (["--backends", "ddp,jax"], "--backends"),
        (["--worlds", "3"], "--worlds"),
        (["--steps", "0"], "--steps"),
    ):
        with pytest.raises(SystemExit) as exc:
            fairness.parse_args(bad)
        assert exc.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize("world", [1, 2])
def test_native_loop_trains_the_job_bench_run_composes(tmp_path, world):
    import json

    overrides = fairness.job_overrides("fsdp", world, 3, 20)
    out, job = native_common.load_job([str(tmp_path), json.dumps(overrides)])
    assert out == tmp_path and job == compose_job(overrides)  # the spec `bench run` hands its workers
    assert (job.grad_accum, job.tokens_per_step, job.launch.nproc_per_node) == (1, 4 * 64, world)
    assert (job.model.vocab_size, job.run.warmup_steps, job.run.steps) == (2048, 3, 20)
    from parabench.data import TokenSource

    harness_rows = TokenSource(job.data, job.model.vocab_size).rank_micro_batches(5, world - 1, world)
    native_rows = native_common.batches(job, world - 1, world)(5)
    assert len(harness_rows) == 1 and all(
        np.array_equal(a, b) for a, b in zip(harness_rows[0], native_rows, strict=True)
    )


def test_native_loop_refuses_gradient_accumulation(tmp_path):
    import json

    overrides = [*fairness.job_overrides("ddp", 1, 1, 1), "data.micro_batch_size=2"]
    with pytest.raises(SystemExit, match="one micro-batch per rank"):
        native_common.load_job([str(tmp_path), json.dumps(overrides)])


def test_launch_commands(tmp_path):
    cmd = fairness.native_command("deepspeed", 2, tmp_path, ["x=1"], python="/v/bin/python")
    assert cmd[:5] == ["/v/bin/python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert cmd[5].endswith("native/deepspeed_native.py")
    assert fairness.native_command("mindspore", 1, tmp_path, [], python="/v/bin/python")[0] == "/v/bin/python"
    ms2 = fairness.native_command("mindspore", 2, tmp_path, [], python="/v/bin/python")
    assert (
        ms2[0] == "/v/bin/msrun"
        and "--worker_num=2" in ms2
        and ms2[ms2.index("python") + 1].endswith("mindspore_native.py")
    )


def test_deepspeed_native_config_is_the_adapters_where_it_shapes_the_step():
    import deepspeed_native

    from parabench.adapters.deepspeed_config import harness_config

    for world in (1, 2):
        job = compose_job(fairness.job_overrides("deepspeed", world, 1, 1))
        native = deepspeed_native.ds_config(job)
        _, owned = harness_config(job)
        for path, (value, _key) in owned.items():
            if path == ("train_batch_size",) or path == ("fp16", "enabled"):  # implied / not set natively
                continue
            node = native
            for part in path:
                node = node[part]
            assert node == value, path


def test_megatron_native_transformer_config_is_the_adapters():
    pytest.importorskip("megatron.core")
    import megatron_native
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from parabench.adapters.megatron import MegatronEngine, MegatronOptions

    job = compose_job(fairness.job_overrides("megatron", 2, 1, 1))
    fake_engine = SimpleNamespace(opts=MegatronOptions(), ctx=SimpleNamespace(job=job), device_type="cpu")
    adapter = MegatronEngine._transformer_config(fake_engine, torch.float32, use_te=False)
    native = TransformerConfig(**megatron_native.transformer_config_kwargs(job))
    shape = (
        "num_layers hidden_size ffn_hidden_size num_attention_heads num_query_groups kv_channels "
        "layernorm_epsilon normalization gated_linear_unit activation_func add_bias_linear add_qkv_bias "
        "hidden_dropout attention_dropout params_dtype tensor_model_parallel_size pipeline_model_parallel_size"
    )
    for field in shape.split():
        assert getattr(native, field) == getattr(adapter, field), field


def test_every_backend_has_a_native_loop():
    assert sorted(p.name for p in Path(fairness.NATIVE_DIR).glob("*_native.py")) == sorted(
        f"{b}_native.py" for b in fairness.BACKENDS
    )
