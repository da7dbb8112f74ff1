"""backend=mindspeed on a machine without NPUs: precise refusals, and the launch bundles pinned."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_refused_before_launch

GOLDEN = REPO / "tests" / "golden"
ENV = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
BUNDLES = {
    "mindspeed_1x8": [
        "+model=llama2-7b",
        "launcher.nproc_per_node=8",
        "backend.tp=8",
        "backend.distributed_optimizer=true",
        "run.precision=bf16",
        "data.seq_len=4096",
        "data.global_batch_size=64",
        "data.micro_batch_size=1",
    ],
    "mindspeed_2x8": [
        "+model=llama2-13b",
        "launcher.nnodes=2",
        "launcher.nproc_per_node=8",
        "launcher.master_addr=node0",
        "launcher.master_port=6000",
        "backend.tp=8",
        "backend.pp=2",
        "backend.sequence_parallel=true",
        "backend.distributed_optimizer=true",
        "backend.use_flash_attn=true",
        "run.precision=bf16",
        "data.seq_len=4096",
        "data.global_batch_size=32",
        "data.micro_batch_size=1",
    ],
}


def dry_run(name: str, out: Path) -> subprocess.CompletedProcess:
    args = [
        sys.executable,
        "-m",
        "parabench",
        "run",
        "backend=mindspeed",
        "launcher.dry_run=true",
        *BUNDLES[name],
        f"hydra.run.dir={out}",
        f"run.results_dir={out.parent / 'results'}",
    ]
    return subprocess.run(args, capture_output=True, text=True, env=ENV, cwd=out.parent)


@pytest.mark.parametrize("name", sorted(BUNDLES))
def test_launch_bundle_matches_golden(name, tmp_path):
    out = tmp_path / name
    proc = dry_run(name, out)
    assert proc.returncode == 0, proc.stderr
    assert str(out / "launch.sh") in proc.stdout
    for file in ("launch.sh", "mindspeed_args.txt"):
        assert (out / file).read_text() == (GOLDEN / name / file).read_text(), (
            f"{name}/{file} differs from the golden copy"
        )
    spec = json.loads((out / "spec.json").read_text())
    assert spec["device"]["type"] == "npu" and spec["backend"]["name"] == "mindspeed"
    assert not (tmp_path / "results" / "mlflow.db").exists()  # a dry run records nothing


@pytest.mark.e2e
def test_run_without_npu_is_refused_with_pointer_to_dry_run(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "parabench",
            "run",
            "+model=llama",
            "backend=mindspeed",
            "device=npu",
            f"run.results_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "torch_npu is not installed" in err and "launcher.dry_run=true" in err
    proc = subprocess.run(
        [sys.executable, "-m", "parabench", "run", "+model=llama", "backend=mindspeed", f"run.results_dir={tmp_path}"],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=tmp_path,
    )
    assert (
        proc.returncode == 2 and "torch_npu is not installed" in proc.stderr and "launcher.dry_run=true" in proc.stderr
    )


def _fake_site(root: Path, cann: bool, mindspeed: bool) -> dict[str, str]:
    """torch_npu as pip leaves it without CANN (its import fails), optionally a CANN lib and mindspeed."""
    (root / "torch_npu").mkdir(parents=True)
    (root / "torch_npu" / "__init__.py").write_text("raise ImportError('libhccl.so: cannot open shared object file')\n")
    (root / "torch_npu-2.13.0.dist-info").mkdir()
    (root / "torch_npu-2.13.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch-npu\nVersion: 2.13.0\n"
    )
    env = {"PYTHONPATH": str(root), "LD_LIBRARY_PATH": "", "ASCEND_HOME_PATH": str(root / "ascend")}
    if cann:
        (root / "ascend" / "lib64").mkdir(parents=True)
        (root / "ascend" / "lib64" / "libhccl.so").write_text("")
    if mindspeed:
        (root / "mindspeed").mkdir()
        (root / "mindspeed" / "__init__.py").write_text("")
        (root / "mindspeed-26.0.0.dist-info").mkdir()
        (root / "mindspeed-26.0.0.dist-info" / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: mindspeed\nVersion: 26.0.0\n"
        )
    return env


def _reason(extra_env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "parabench", "env", "--json"],
        capture_output=True,
        text=True,
        env={**ENV, **extra_env},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    backend = json.loads(out.stdout)["backends"]["mindspeed"]
    assert backend["available"] is False
    return backend["reason"]


def test_env_states_torch_npu_absent_without_cann_and_mindspeed_absent(tmp_path):
    assert "torch_npu is not installed" in _reason({})
    reason = _reason(_fake_site(tmp_path / "a", cann=False, mindspeed=False))
    assert "torch_npu 2.13.0 is installed but the CANN runtime (libhccl.so) is not found" in reason
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in reason
    assert "mindspeed is not installed" in _reason(_fake_site(tmp_path / "b", cann=True, mindspeed=False))
    # with everything installed, the NPU probe itself says why (the fake torch_npu cannot import)
    assert "failed to import" in _reason(_fake_site(tmp_path / "c", cann=True, mindspeed=True))


def test_version_matrix_is_data_with_sources():
    from parabench.adapters.mindspeed import KNOWN_GOOD, check_matrix

    assert all(entry["source"] for entry in KNOWN_GOOD)
    good = {k: v for k, v in KNOWN_GOOD[0].items() if k != "source"}
    assert check_matrix(good) is None
    bad = {**good, "torch-npu": "2.13.0"}
    assert "not known to work together" in check_matrix(bad) and "torch-npu 2.13.0" in check_matrix(bad)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["backend.tp=3"], "backend.tp"),
        (["backend.optimization_level=5"], "backend.optimization_level"),
        (["backend.reuse_fp32_param=true"], "backend.reuse_fp32_param"),
        (["backend.cp=2", "launcher.nproc_per_node=2", "data.seq_len=6"], "backend.cp"),
    ],
)
def test_invalid_mindspeed_settings_refused(overrides, key, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_refused_before_launch(
        ["+model=llama", "backend=mindspeed", "launcher.dry_run=true", *overrides], key, tmp_path, capsys
    )


def test_mindspeed_switches_travel_on_the_worker_command_line(tmp_path):
    """MindSpeed parses sys.argv when its adaptor is imported: the launcher passes the switches to
    each worker, and an engine built in a process that lacks them refuses instead of running without them."""
    from parabench.adapters.base import WorkerContext
    from parabench.adapters.mindspeed import MindSpeedAdapter, mindspeed_argv
    from parabench.devices import DEVICES
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config
    from parabench.launchers import Torchrun

    job = from_config(
        to_plain(compose(["+model=llama", "backend=mindspeed", "launcher.nproc_per_node=2", "backend.tp=2"]))
    )
    cmd = Torchrun.command(job, 29500, str(tmp_path))
    assert cmd[cmd.index(str(tmp_path)) + 1 :] == mindspeed_argv(job) and "--tensor-model-parallel-size=2" in cmd
    ctx = WorkerContext(job=job, rank=0, world_size=1, local_rank=0, device=DEVICES["cpu"](0), run_dir=tmp_path)
    with pytest.raises(RuntimeError, match="sys.argv"):
        MindSpeedAdapter.create_engine(ctx)


def test_mindspeed_recompute_flags_are_megatron_lms():
    """backend.recompute_* (shared with the megatron adapter) reach MindSpeed's parser as Megatron-LM's
    --recompute-granularity / --recompute-method / --recompute-num-layers; none without recompute."""
    from parabench.adapters.mindspeed import mindspeed_argv
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config

    def argv(*overrides: str) -> list[str]:
        job = from_config(to_plain(compose(["+model=llama", "backend=mindspeed", *overrides])))
        return [a for a in mindspeed_argv(job) if a.startswith("--recompute-") and "activation" not in a]

    assert argv() == []
    assert argv("backend.recompute_granularity=selective") == ["--recompute-granularity=selective"]
    assert argv("backend.recompute_granularity=full", "backend.recompute_method=block") == [
        "--recompute-granularity=full",
        "--recompute-method=block",
        "--recompute-num-layers=1",
    ]


# Megatron-LM core_v0.12.1 megatron/training/arguments.py, ``_add_moe_args``: the MoE flags of the
# parser MindSpeed 26.0.0_core_r0.12.1 (KNOWN_GOOD) extends (mindspeed/arguments.py ``process_args``
# adds MindSpeed's own to it), with their type, choices or store_true and their default.
MEGATRON_LM_MOE_FLAGS = {
    "--expert-model-parallel-size": {"type": int, "default": 1},
    "--num-experts": {"type": int, "default": None},
    "--moe-ffn-hidden-size": {"type": int, "default": None},
    "--moe-shared-expert-intermediate-size": {"type": int, "default": None},
    "--moe-grouped-gemm": {"action": "store_true"},
    "--moe-router-load-balancing-type": {
        "choices": ["aux_loss", "seq_aux_loss", "sinkhorn", "none"],
        "default": "aux_loss",
    },
    "--moe-router-score-function": {"choices": ["softmax", "sigmoid"], "default": "softmax"},
    "--moe-router-topk": {"type": int, "default": 2},
    "--moe-router-pre-softmax": {"action": "store_true"},
    "--moe-aux-loss-coeff": {"type": float, "default": 0.0},
    "--moe-token-dispatcher-type": {
        "choices": ["allgather", "alltoall", "flex", "alltoall_seq"],
        "default": "allgather",
    },
    "--moe-expert-capacity-factor": {"type": float, "default": None},
}


@pytest.mark.parametrize(
    "overrides",
    [
        ["backend.ep=2", "launcher.nproc_per_node=2"],
        ["backend.moe_token_dispatcher=allgather", "+model.norm_topk_prob=false"],
    ],
)
def test_mindspeed_moe_flags_parse_to_the_megatron_engines_moe_config(overrides):
    """The MoE flags mindspeed_argv writes for a MoE model parse with Megatron-LM's MoE arguments (the
    parser MindSpeed extends) into exactly the TransformerConfig fields the megatron engine builds
    its MoELayer from (moe_config; Megatron-LM core_transformer_config_from_args reads each field from
    the argument of its name, num_moe_experts from --num-experts). The job is megatron's: mindspeed
    refuses a MoE model before launch (Capabilities.moe)."""
    import argparse

    from parabench.adapters.megatron_build import moe_config
    from parabench.adapters.mindspeed import moe_argv
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config

    parser = argparse.ArgumentParser(exit_on_error=False)
    for flag, kwargs in MEGATRON_LM_MOE_FLAGS.items():
        parser.add_argument(flag, **kwargs)
    job = from_config(to_plain(compose(["+model=moe-tiny", "backend=megatron", *overrides])))
    argv = moe_argv(job)
    parsed = vars(parser.parse_args(argv))
    fields = moe_config(job.model, job.backend.options)
    expected = {("num_experts" if k == "num_moe_experts" else k): v for k, v in fields.items()}
    assert {k: parsed[k] for k in expected if k in parsed} == {k: v for k, v in expected.items() if k in parsed}
    # fields Megatron-LM 0.12.1 has no flag for (moe_shared_expert_gate, newer) must stay at their default
    assert all(v in (False, None) for k, v in expected.items() if k not in parsed), expected
    assert ("--moe-router-pre-softmax" in argv) == (not job.model.norm_topk_prob)
    dense = from_config(to_plain(compose(["+model=llama", "backend=mindspeed"])))
    assert moe_argv(dense) == []
