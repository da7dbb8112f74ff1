import json
import os
import resource
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

ENV = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}


def py(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**ENV, **env}, timeout=300)


def test_help_is_fast_and_imports_no_framework():
    out = py(
        "import sys, time; t=time.perf_counter(); from parabench.cli import main; main(['--help']); "
        "print('ELAPSED', time.perf_counter()-t); "
        "print('HEAVY', [m for m in ('torch','deepspeed','mindspore','megatron','mlflow','hydra') if m in sys.modules])"
    )
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout
    best = min(_cpu_seconds([sys.executable, "-m", "parabench", "--help"]) for _ in range(3))
    assert best < 0.5, best


def test_checking_a_torch_backends_job_imports_no_torch():
    """The parent checks a ddp or fsdp job (composed, validated, device=auto resolved against a CPU
    build of torch) from the adapters' declarations: their engines, which need torch, live in
    ``*_engine`` modules the workers import (torch's import is 2-3 CPU-seconds of every `bench run`)."""
    out = py(
        "import sys; from parabench.hydraconfig import compose, to_plain; from parabench.jobs import prepare\n"
        "for b in ('ddp', 'fsdp'):\n"
        "    job = prepare(to_plain(compose(['+model=llama', f'backend={b}', 'device=auto'])))\n"
        "    print(b, job.device.type, 'torch' in sys.modules)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ddp", "cpu", "False", "fsdp", "cpu", "False"]


def _cpu_seconds(cmd):
    """The command's CPU time (user + system), not its wall time: two test workers and a loaded CI
    machine stretch the wall clock of a 0.4 s command past any fixed limit (a failure of CI, not of
    the command)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, capture_output=True, check=True, env=ENV)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_unknown_command_exits_2():
    out = subprocess.run([sys.executable, "-m", "parabench", "frobnicate"], capture_output=True, text=True, env=ENV)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def test_cfg_job_prints_the_composed_config_without_running(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "parabench", "run", "+model=llama", "backend=fsdp", "--cfg", "job"],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "name: fsdp" in out.stdout and "hidden_size: 256" in out.stdout
    assert not (tmp_path / "results").exists()


def test_env_lists_every_backend_and_device_with_reasons():
    out = subprocess.run([sys.executable, "-m", "parabench", "env", "--json"], capture_output=True, text=True, env=ENV)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    from parabench.adapters.registry import names

    assert set(rep["backends"]) == set(names())
    assert rep["backends"]["ddp"]["available"] and rep["devices"]["cpu"]["available"]
    for kind in ("cuda", "npu"):
        assert rep["devices"][kind]["detail"]  # a reason, available or not
    assert rep["versions"]["torch"].startswith("2.13")
    text = subprocess.run([sys.executable, "-m", "parabench", "env"], capture_output=True, text=True, env=ENV).stdout
    assert "backends" in text and "ddp" in text and "devices" in text


def _fake_torch_npu(root: Path) -> None:
    """A torch_npu that is installed but cannot load CANN, as pip leaves it on a machine without CANN."""
    pkg = root / "torch_npu"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')\n"
    )
    info = root / "torch_npu-2.13.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-npu\nVersion: 2.13.0\n")


def test_npu_absent_and_installed_without_cann_are_told_apart(tmp_path):
    code = "from parabench.devices import NPUDevice; print(NPUDevice.presence().reason)"
    absent = py(code)
    assert "torch_npu is not installed" in absent.stdout, absent.stderr
    _fake_torch_npu(tmp_path / "site")
    no_cann = py(code, PYTHONPATH=str(tmp_path / "site"), ASCEND_HOME_PATH=str(tmp_path / "none"), LD_LIBRARY_PATH="")
    assert "torch_npu 2.13.0 is installed but the CANN runtime (libhccl.so) is not found" in no_cann.stdout, (
        no_cann.stderr
    )
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in no_cann.stdout


def test_backend_configs_and_registry_agree():
    from parabench.adapters.registry import get_adapter, names
    from parabench.hydraconfig import available_options

    shipped = {n for n in available_options("backend")}
    assert set(names()) <= shipped
    import yaml

    for name in shipped:
        node = yaml.safe_load((REPO / "conf" / "backend" / f"{name}.yaml").read_text())
        adapter = get_adapter(node.pop("name"))
        from parabench.spec import build

        build(adapter.Options, node, "backend")  # every shipped key is a typed option


TOY = REPO / "tests" / "data" / "toy_backend"  # a backend of another package: entry point + Hydra search path
COMM_LIBRARY = (
    "from parabench.comm.command import prepare; from parabench.hydraconfig import compose, to_plain; "
    "print(prepare(to_plain(compose(['backend=toy', 'launcher.nproc_per_node=2'], config_name='comm'))).library)"
)
COMM_FORMULAS = (
    "import json; from parabench.run.comm_report import formula; from parabench.hydraconfig import compose, to_plain; "
    "from parabench.jobs import prepare; jobs = [prepare(to_plain(compose(['+model=llama', f'backend={b}', "
    "'launcher.nproc_per_node=2']))) for b in ('toy', 'ddp')]; print(json.dumps([formula(j) for j in jobs]))"
)


def test_a_backend_of_another_package_is_found_by_bench_env_run_and_comm(tmp_path):
    """A backend registered only through an entry point (group parabench.backends) and a Hydra
    search-path plugin (tests/data/toy_backend): bench env lists it with what its adapter declares (its
    distributions' versions, its known-good set), bench run composes and validates it (a dry run),
    bench comm drives the collective stack it declares, bench plan searches and ranks its layouts and
    a run's communication formula prices it, both through the plan profile it declares (ddp's) - and
    no file of parabench's names it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TOY), os.environ.get("PYTHONPATH")]))}
    run = lambda *args: subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # noqa: E731
    out = run(sys.executable, "-m", "parabench", "env", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    toy = rep["backends"]["toy"]
    assert toy["available"] and toy["description"].startswith("Toy backend") and toy["devices"] == ["cpu"]
    assert rep["versions"]["toy-backend"] == "0.1"
    (good,) = [g for g in rep["known_good"] if g["source"] == "tests/data/toy_backend"]
    assert good["differs"] == {}  # torch 2.x and toy-backend 0.1 are installed
    dry = run(sys.executable, "-m", "parabench", "run", "+model=llama", "backend=toy", "launcher.dry_run=true")
    assert dry.returncode == 0, dry.stderr
    (spec,) = tmp_path.glob("results/runs/*/*/toy/spec.json")
    assert json.loads(spec.read_text())["backend"]["name"] == "toy"
    comm = run(sys.executable, "-c", COMM_LIBRARY)
    assert comm.returncode == 0 and comm.stdout.strip() == "torch.distributed/gloo", comm.stderr
    plan = run(
        sys.executable,
        "-m",
        "parabench",
        "plan",
        "+model=llama",
        "cluster=cpu",
        "plan.devices=2",
        "plan.backends=[toy]",
        "data.global_batch_size=4",
        "--format",
        "json",
    )
    assert plan.returncode == 0, plan.stderr
    best = json.loads(plan.stdout)["ranked"][0]
    assert best["layout"] == "toy dp2 mbs1" and best["comm_bytes_per_step"] > 0, best
    formulas = run(sys.executable, "-c", COMM_FORMULAS)
    assert formulas.returncode == 0, formulas.stderr
    toy_formula, ddp_formula = json.loads(formulas.stdout)
    assert toy_formula == ddp_formula and toy_formula["all_reduce"]["bytes"] > 0  # ddp's profile, ddp's bytes
    from parabench.adapters.registry import _BUILTIN, names

    assert "toy" not in names() and "toy" not in _BUILTIN and not (REPO / "conf" / "backend" / "toy.yaml").exists()


def test_every_shipped_model_composes_into_a_spec():
    from parabench.hydraconfig import available_options, compose, to_plain
    from parabench.jobs import from_config

    for model in available_options("model"):
        if model == "hf":  # not a preset: it reads a local config.json (model.path); tests/test_hf_model.py
            continue
        job = from_config(to_plain(compose([f"+model={model}"])))
        assert job.model.name == model and job.model.num_params() > 0
    big = from_config(to_plain(compose(["+model=llama2-7b"]))).model.num_params()
    assert 6.6e9 < big < 6.8e9  # Llama-2-7B has 6.74B parameters


@pytest.mark.full
def test_wheel_ships_the_config_tree(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next(tmp_path.glob("parabench-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for must in (
        "parabench/cli.py",
        "parabench/adapters/registry.py",
        "parabench/migrate/__init__.py",
        "parabench/conf/config.yaml",
        "parabench/conf/model/llama.yaml",
        "parabench/conf/backend/fsdp.yaml",
    ):
        assert must in names, must
    entry = [n for n in names if n.endswith("entry_points.txt")]
    assert entry and "bench = parabench.cli:main" in zipfile.ZipFile(wheel).read(entry[0]).decode()


def test_each_job_is_composed_and_validated_once(tmp_path, monkeypatch, capsys):
    """The pre-flight validates every job of a sweep (backend and device probes included) and the
    Hydra task reuses that job: jobs.prepare runs once per job, not twice."""
    from parabench.adapters.registry import get_adapter
    from parabench.cli import main

    calls = []

    def counting(real):
        def validate(cls, job):
            calls.append(cls.name)
            return real(job)

        return classmethod(validate)

    for name in ("ddp", "fsdp"):  # jobs.prepare ends with the adapter's own validation: count those
        monkeypatch.setattr(get_adapter(name), "validate", counting(get_adapter(name).validate))
    monkeypatch.chdir(tmp_path)
    code = main(
        ["run", "-m", "+model=llama", "backend=ddp,fsdp", "launcher.dry_run=true", f"run.results_dir={tmp_path / 'r'}"]
    )
    assert code == 0, capsys.readouterr().err
    assert sorted(calls) == ["ddp", "fsdp"]
    assert len(list((tmp_path / "r").glob("runs/*/*/*/launch.sh"))) == 2
