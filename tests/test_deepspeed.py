"""backend=deepspeed: refusals before launch, config merging, and end to end through the real CLI
(parity with ddp, ZeRO formula for the optimizer states, one MLflow parent per sweep)."""

import importlib.util
import json
from pathlib import Path

import pytest
from run_matrix import assert_parity, sweep_jobs

from conftest import FAST, assert_refused_before_launch, bench, mlflow_runs

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip(
        "deepspeed is not installed (pip install --no-build-isolation deepspeed==0.19.8 torch==2.13.0)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.deepspeed

DS = ["+model=llama", "backend=deepspeed"]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b))


def _cpu_fp16() -> bool:
    from parabench.adapters.deepspeed import _cpu_fp16_supported

    return _cpu_fp16_supported()


# --------------------------------------------------------------------------------------------
# Before launch: one line, exit 2, nothing written.
# --------------------------------------------------------------------------------------------
def _write(tmp_path, doc) -> str:
    p = tmp_path / "ds_config.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


INVALID = {
    "stage 4": (lambda t: [*DS, "backend.zero_stage=4"], "backend.zero_stage"),
    "offload with stage 0": (
        lambda t: [*DS, "backend.zero_stage=0", "backend.offload_optimizer=cpu"],
        "backend.offload_optimizer",
    ),
    "param offload below stage 3": (
        lambda t: [*DS, "backend.zero_stage=2", "backend.offload_param=cpu"],
        "backend.offload_param",
    ),
    "fp16 and bf16 both on": (
        lambda t: [*DS, f"backend.config_file={_write(t, {'fp16': {'enabled': True}, 'bf16': {'enabled': True}})}"],
        "backend.config_file",
    ),
    "file precision differs": (
        lambda t: [*DS, f"backend.config_file={_write(t, {'bf16': {'enabled': True}})}"],
        "run.precision",
    ),
    "file batch differs": (
        lambda t: [*DS, f"backend.config_file={_write(t, {'train_batch_size': 8})}"],
        "data.global_batch_size",
    ),
    "file stage differs": (
        lambda t: [
            *DS,
            "backend.zero_stage=1",
            f"backend.config_file={_write(t, {'zero_optimization': {'stage': 3}})}",
        ],
        "backend.zero_stage",
    ),
    "file optimizer block": (
        lambda t: [*DS, f"backend.config_file={_write(t, {'optimizer': {'type': 'Adam'}})}"],
        "optimizer",
    ),
    "file missing": (lambda t: [*DS, "backend.config_file=/nonexistent/ds.json"], "backend.config_file"),
    "file not json": (lambda t: [*DS, f"backend.config_file={_write(t, '{oops')}"], "backend.config_file"),
    "micro-batch does not divide the batch": (
        lambda t: [*DS, "data.global_batch_size=6", "data.micro_batch_size=4"],
        "data.global_batch_size",
    ),
    "micro-batch x ranks does not divide": (
        lambda t: [*DS, "data.global_batch_size=4", "data.micro_batch_size=4", "launcher.nproc_per_node=2"],
        "data.global_batch_size",
    ),
    "negative bucket": (lambda t: [*DS, "backend.reduce_bucket_size=-1"], "backend.reduce_bucket_size"),
    "zero_stage swept over ddp too": (
        lambda t: ["-m", "+model=llama", "backend=ddp,deepspeed", "backend.zero_stage=1"],
        "backend.zero_stage",
    ),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_deepspeed_settings_are_refused_before_launch(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make, must_name = INVALID[name]
    assert_refused_before_launch(make(tmp_path), must_name, tmp_path, capsys)


@pytest.mark.skipif(_cpu_fp16(), reason="hardware: this CPU runs fp16 (the test checks the refusal on CPUs without it)")
def test_fp16_refused_on_a_cpu_without_fp16(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_refused_before_launch([*DS, "run.precision=fp16"], "run.precision", tmp_path, capsys)


# --------------------------------------------------------------------------------------------
# The config: built from the spec, merged with a user's file.
# --------------------------------------------------------------------------------------------
def _job(*overrides):
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config

    return from_config(to_plain(compose([*DS, *overrides])))


def test_config_is_built_from_the_spec():
    from parabench.adapters.deepspeed import deepspeed_config

    cfg = deepspeed_config(
        _job(
            "backend.zero_stage=3",
            "run.precision=bf16",
            "launcher.nproc_per_node=2",
            "data.global_batch_size=8",
            "backend.stage3_param_persistence_threshold=0",
        )
    )
    assert (
        cfg["train_batch_size"] == 8
        and cfg["train_micro_batch_size_per_gpu"] == 2
        and cfg["gradient_accumulation_steps"] == 2
    )
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    assert cfg["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 0}
    assert cfg["gradient_clipping"] == 1.0 and cfg["zero_allow_untested_optimizer"] is True
    off = deepspeed_config(_job("backend.offload_optimizer=cpu"))
    assert off["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert "zero_force_ds_cpu_optimizer" not in off  # DeepSpeedCPUAdam: DeepSpeed's default check stays on


def test_jit_ops_are_built_in_a_folder_of_their_own_environment(monkeypatch, tmp_path):
    """Two Python environments sharing TORCH_EXTENSIONS_DIR rebuilt each other's ops on every run (the
    build command names the environment's include paths) and could load an op built against another
    torch: the default folder is one per environment; backend.extensions_dir is used as given."""
    import sys

    from parabench.adapters.deepspeed import extensions_dir
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import prepare

    job = prepare(to_plain(compose(["+model=llama", "backend=deepspeed", "launcher.dry_run=true"])))
    here = Path(extensions_dir(job))
    assert here.parent == Path.home() / ".cache" / "parabench" / "torch_extensions"
    assert here.name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}-")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    assert Path(extensions_dir(job)) != here and Path(extensions_dir(job)).parent == here.parent
    assert job.backend.adapter.launch_env(job)["TORCH_EXTENSIONS_DIR"] == extensions_dir(job)
    mine = prepare(to_plain(compose(["+model=llama", "backend=deepspeed", f"backend.extensions_dir={tmp_path}/ops"])))
    assert extensions_dir(mine) == str(tmp_path / "ops")


def test_workers_import_deepspeed_without_its_autotuners_mlflow():
    """import_deepspeed (the engine's import) leaves mlflow unimported - DeepSpeed's autotuner tries it
    at package import, 3.7 CPU-seconds of every rank - and importable afterwards; and imports the Muon
    optimizer's module (ZeRO's first step would) without the Inductor its @torch.compile imported."""
    import subprocess
    import sys

    code = (
        "import sys, torch; compile_ = torch.compile\n"
        "from parabench.adapters.deepspeed_engine import MUON, import_deepspeed; import_deepspeed()\n"
        "import deepspeed.autotuning.autotuner as tuner; print('mlflow' in sys.modules, tuner.has_mlflow)\n"
        "print(MUON in sys.modules, 'torch._inductor.compile_fx' in sys.modules, torch.compile is compile_)\n"
        "import mlflow; print(mlflow.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # after DeepSpeed's log lines: no mlflow; Muon's module imported without Inductor, torch.compile put back
    assert out.stdout.split()[-6:] == ["False", "False", "True", "False", "True", "mlflow"], out.stdout


def test_user_file_merges_auto_equal_values_and_free_knobs(tmp_path):
    from parabench.adapters.deepspeed import deepspeed_config

    path = _write(
        tmp_path,
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": 2,
            "bfloat16": {"enabled": False},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000, "sub_group_size": 7},
            "communication_data_type": "fp32",
        },
    )
    cfg = deepspeed_config(_job(f"backend.config_file={path}"))
    assert cfg["train_batch_size"] == 4  # "auto" -> the harness's value
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 1000 and cfg["zero_optimization"]["sub_group_size"] == 7
    assert cfg["communication_data_type"] == "fp32" and "bfloat16" not in cfg
    with pytest.raises(Exception) as exc:  # a knob set on both sides, differently
        deepspeed_config(_job(f"backend.config_file={path}", "backend.reduce_bucket_size=2000"))
    assert "reduce_bucket_size" in str(exc.value)


def test_zero_formula_per_stage():
    from parabench.adapters.deepspeed import zero_formula

    psi = _job().model.num_params()
    expect = {0: 16 * psi, 1: 8 * psi + 6 * psi, 2: 4 * psi + 8 * psi, 3: 10 * psi}  # fp32 on 2 ranks
    for stage, value in expect.items():
        assert zero_formula(_job(f"backend.zero_stage={stage}", "launcher.nproc_per_node=2")).bytes == value
    assert (
        zero_formula(_job("backend.zero_stage=2", "run.precision=bf16", "launcher.nproc_per_node=2")).bytes
        == 2 * psi + 7 * psi
    )


def test_stage_presets_and_the_experiment_expand_and_validate(tmp_path, monkeypatch):
    from hydra._internal.utils import get_args_parser

    from parabench.cli import _preflight
    from parabench.hydraconfig import compose, to_plain

    for s in range(4):
        assert (
            to_plain(compose(["+model=llama", f"backend=deepspeed/zero{s}", "backend.overlap_comm=true"]))["backend"][
                "zero_stage"
            ]
            == s
        )
    monkeypatch.chdir(tmp_path)
    args = get_args_parser().parse_args(
        ["-m", "+model=llama", "+experiment=zero_stages", f"run.results_dir={tmp_path / 'r'}"]
    )
    prepared = _preflight(args)
    stages = sorted(job.backend.options.zero_stage for job in prepared.jobs.values() if job.backend.name == "deepspeed")
    assert len(prepared.jobs) == 7 and stages == [0, 1, 2, 2, 3]  # ddp, fsdp, zero0-3, zero2_offload
    assert not (tmp_path / "r").exists()


def test_bench_env_reports_version_accelerator_and_ops(tmp_path):
    proc = bench(["env", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    ds = json.loads(proc.stdout)["backends"]["deepspeed"]
    assert ds["available"] and ds["versions"]["deepspeed"] == "0.19.8"
    assert ds["versions"]["accelerator"].startswith("cpu") and "cpu_adam" in ds["versions"]["ops_buildable"]


# --------------------------------------------------------------------------------------------
# End to end (torchrun, gloo). One sweep at 2 ranks, one at 1 rank.
# --------------------------------------------------------------------------------------------
STAGES = [0, 1, 2, 3]


def _by_label(results) -> dict[str, dict]:
    """'zero<S>' -> summary (with the job's spec beside it) of a sweep of DeepSpeed stages."""
    out = {}
    for path in sorted(results.glob("runs/*/*/*/summary.json")):
        summary = json.loads(path.read_text())
        spec = json.loads((path.parent / "spec.json").read_text())
        summary["spec"], summary["run_dir"] = spec, path.parent
        out[f"zero{spec['backend']['options']['zero_stage']}"] = summary
    return out


TWO_RANK_LABELS = ["ddp", "zero0", "zero1", "zero2", "zero3", "zero2_offload"]
TWO_RANKS = pytest.mark.matrix(*TWO_RANK_LABELS)


@pytest.fixture
def two_ranks(matrix):
    """ddp, ZeRO 0-3 and ZeRO-2 + optimizer offload from the shared run matrix: 20 fp32 steps on 2 ranks,
    one sweep (with the other variants of its shard: tests/run_matrix.py SHARDS)."""
    results = matrix["ddp"].results
    return results, {label: _with_spec(matrix[label]) for label in TWO_RANK_LABELS if label in matrix}


def _with_spec(run) -> dict:
    return {**run.summary, "spec": run.spec, "run_dir": run.run_dir}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """ZeRO-1 and ZeRO-3 on one rank in bf16 (fp32 masters restored to the canonical weights). A sweep of
    its own: the matrix is fp32 on 2 ranks."""
    results = tmp_path_factory.mktemp("ds1")
    proc = bench(
        ["run", "-m", *FAST, "backend=deepspeed/zero1,deepspeed/zero3", "run.steps=2", "run.precision=bf16"],
        results,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results, _by_label(results)


@TWO_RANKS
@pytest.mark.full
def test_identical_initial_weights_as_ddp(two_ranks, one_rank):
    checksums = {f"{k}@2": s["initial_checksum"] for k, s in two_ranks[1].items()}
    checksums.update({f"{k}@1 bf16": s["initial_checksum"] for k, s in one_rank[1].items()})
    assert len(checksums) == 8 and len(set(checksums.values())) == 1, checksums


@pytest.mark.parametrize(
    "stage",
    [
        pytest.param(s, marks=[pytest.mark.matrix("ddp", f"zero{s}"), pytest.mark.e2e if s == 3 else pytest.mark.full])
        for s in STAGES
    ],
)
def test_fp32_loss_parity_with_ddp(two_ranks, stage):
    assert_parity(two_ranks[1]["ddp"], two_ranks[1][f"zero{stage}"], first=1e-6, after_ten=1e-4)


@TWO_RANKS
@pytest.mark.full
def test_offload_with_cpu_adam_trains_like_ddp(two_ranks):
    ddp, ds = two_ranks[1]["ddp"]["losses"], two_ranks[1]["zero2_offload"]["losses"]
    assert rel(ddp[0], ds[0]) <= 1e-6
    # DeepSpeedCPUAdam: the same AdamW, a different (vectorised C++) implementation
    assert max(rel(a, b) for a, b in zip(ddp, ds, strict=True)) <= OFFLOAD_TOLERANCE
    art = json.loads((two_ranks[1]["zero2_offload"]["run_dir"] / "backend_artifacts.json").read_text())
    assert art["client_optimizer"] == "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam"


OFFLOAD_TOLERANCE = 1e-4  # measured: 9.2e-8 over 11 steps on 2 ranks (AVX2 CPU)


def _check_optimizer_bytes(summary, world: int) -> None:
    psi = summary["num_params"]
    spec = summary["spec"]
    stage = spec["backend"]["options"]["zero_stage"]
    k = 8 if stage == 0 and spec["run"]["precision"] == "fp32" else 12
    for rank in summary["model_state_per_rank"]:
        d = rank["detail"]
        formula = k * psi if stage == 0 else k * psi / world
        assert d["optimizer_formula_bytes"] == int(formula)
        pad = d.get("padding_elements", 0)
        assert 0 <= pad < 64 * world, pad  # alignment padding only, and reported
        assert rank["optimizer"] == (k * psi if stage == 0 else k * (psi + pad) // world), (stage, rank)
        assert rank["optimizer_other"] <= 8 * 64  # Adam step counters (one per tensor for torch AdamW at stage 0)


@pytest.mark.parametrize(
    "label",
    [
        pytest.param(
            label, marks=[pytest.mark.matrix(label), pytest.mark.e2e if label == "zero3" else pytest.mark.full]
        )
        for label in ("zero0", "zero1", "zero2", "zero3", "zero2_offload")
    ],
)
def test_optimizer_state_bytes_equal_the_zero_formula_on_two_ranks(two_ranks, label):
    s = two_ranks[1][label]
    _check_optimizer_bytes(s, 2)
    assert s["model_state_expected_bytes"] > 0 and "ZeRO stage" in s["model_state_expected_formula"]
    assert "model_state_diff_bytes" in s
    if label == "zero2_offload":
        assert all(r["host"] == r["optimizer"] for r in s["model_state_per_rank"])


@pytest.mark.full
@pytest.mark.parametrize("label", ["zero1", "zero3"])
def test_optimizer_state_bytes_equal_the_zero_formula_on_one_rank(one_rank, label):
    s = one_rank[1][label]
    _check_optimizer_bytes(s, 1)
    psi = s["num_params"]
    rank = s["model_state_per_rank"][0]
    assert rank["params"] >= 2 * psi and rank["params"] < 2 * psi + 1024**2  # bf16 working copies (+ padding)


@TWO_RANKS
@pytest.mark.full
def test_sweep_is_one_parent_with_a_child_per_configuration_and_the_config_is_an_artifact(two_ranks):
    results, by = two_ranks
    runs = mlflow_runs(results)
    parents = runs[runs["tags.parabench.kind"] == "sweep"]
    children = runs[runs["tags.parabench.kind"] == "job"]
    assert len(parents) == 1 and len(children) == len(sweep_jobs(results))  # a child per job of the matrix
    assert set(children["tags.mlflow.parentRunId"]) == {parents.iloc[0]["run_id"]}
    assert set(runs["status"]) == {"FINISHED"}
    ds = children[children["tags.backend"] == "deepspeed"]
    assert sorted(ds["params.backend.zero_stage"]) == ["0", "1", "2", "2", "3"]
    offload = ds[ds["params.backend.offload_optimizer"] == "cpu"]
    assert list(offload["params.backend.zero_stage"]) == ["2"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{results / 'mlflow.db'}")
    run_id = ds[ds["params.backend.zero_stage"] == "3"].iloc[0]["run_id"]
    local = client.download_artifacts(run_id, "backend_artifacts.json", str(results))
    doc = json.loads(open(local).read())
    assert doc["deepspeed_config"]["zero_optimization"]["stage"] == 3
    assert (
        doc["deepspeed_config"]["train_batch_size"] == 4
        and doc["deepspeed_optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    )
