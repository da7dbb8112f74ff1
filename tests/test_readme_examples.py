"""Every `bench ...` command of the README runs as printed (issue 26), so the README cannot drift from
the config and the CLI. The commands are parsed from README.md's code blocks: a new line is covered
(or fails here, naming itself) without editing this file.

How each is run here:
- cheap commands run for real: `bench env`, `bench plan`, `--help`, `bench migrate` on a small CUDA
  project made in the working directory, `bench compare` on a store holding runs of its experiment;
- `bench run` gets `launcher.dry_run=true` (the job is composed, validated and its launch bundle
  written; nothing trains), or `--cfg job` where it names a file this machine does not have
  (NEEDS_FILES, with the reason);
- commands that start worker processes (`bench comm`: torchrun; `bench smoke`: the migrated program)
  run for real in the full tier.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import REPO

# Files a README command names that no machine of ours has: composed with --cfg job only.
NEEDS_FILES = {
    "/models/": "a downloaded Hugging Face model (Llama-3.2-1B, Qwen2.5-0.5B); tests/test_hf_model.py covers +model=hf",
    "/data/": "a Megatron/MindSpeed preprocessed .bin/.idx dataset; tests/test_data_e2e.py covers data=indexed",
}
# Subcommands that start worker processes: run for real in the full tier only.
PROCESS_STARTING = {
    "comm": "torchrun with 2 ranks over every collective and size",
    "smoke": "starts the migrated program under the NPU emulation",
}
CUDA_PROGRAM = 'import torch\n\nx = torch.ones(2, device="cuda")\nprint("sum", (x * 2).sum().item())\n'
TEXT = "a small text corpus for the byte-level tokenizer of the README's text-data example.\n" * 200


def readme_commands() -> list[str]:
    """Every `bench ...` line of README.md's code blocks (`./dev bench` too), continuation lines
    joined, comments dropped, in README order, without repeats."""
    text = (REPO / "README.md").read_text()
    found: list[str] = []
    for block in re.findall(r"```[\w-]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:2] == ["./dev", "bench"]:
                words = words[1:]
            command = shlex.join(words)
            if words[:1] == ["bench"] and command not in found:
                found.append(command)
    return found


def subcommand(command: str) -> str:
    return shlex.split(command)[1]


def cheap(command: str) -> bool:
    return subcommand(command) not in PROCESS_STARTING or "--help" in shlex.split(command)


def how(command: str) -> list[str]:
    """The argv that runs ``command`` here (see the module docstring)."""
    args = shlex.split(command)[1:]
    if args[0] != "run" or "--help" in args:
        return args
    flags = args[args.index("--cfg") :] if "--cfg" in args else []  # Hydra takes no override after --cfg job
    overrides = [*args[: len(args) - len(flags)], "tracking.enabled=false"]
    if flags or "launcher.dry_run=true" in args:
        return [*overrides, *flags]
    if any(marker in command for marker in NEEDS_FILES):
        return [*overrides, "--cfg", "job"]
    return [*overrides, "launcher.dry_run=true"]


def make_inputs(cwd: Path) -> None:
    """The relative files the README's commands name, made small: my.txt, a CUDA project, train.py, src/."""
    (cwd / "my.txt").write_text(TEXT)
    for folder in (cwd / "path/to/gpu-project", cwd / "src", cwd):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "train.py").write_text(CUDA_PROGRAM)


def seed_store(cwd: Path, experiment: str) -> None:
    """Two finished job runs of ``experiment`` in the default store (results/mlflow.db), as bench run logs them."""
    from mlflow.tracking import MlflowClient

    (cwd / "results").mkdir(exist_ok=True)
    client = MlflowClient(f"sqlite:///{cwd / 'results' / 'mlflow.db'}")
    exp_id = client.create_experiment(experiment)
    for backend, tps in (("ddp", 1000.0), ("fsdp", 900.0)):
        tags = {"parabench.kind": "job", "backend": backend, "world_size": "1", "model": "llama", "device": "cpu",
                "precision": "fp32", "data_checksum": "00ff"}  # fmt: skip
        run = client.create_run(exp_id, tags=tags)
        for key, value in {"backend.name": backend, "data.global_batch_size": "4", "data.seq_len": "256",
                           "run.steps": "10", "run.warmup_steps": "2", "data.source": "synthetic"}.items():  # fmt: skip
            client.log_param(run.info.run_id, key, value)
        for key, value in {"tokens_per_s": tps, "loss_final": 9.0, "step_time_median_s": 1.0}.items():
            client.log_metric(run.info.run_id, key, value)
        client.log_metric(run.info.run_id, "loss", 9.0, step=0)
        client.set_terminated(run.info.run_id, "FINISHED")


def expected_exit(command: str) -> int:
    """`bench migrate --check` exits 1 while work remains (the README says so): the fixture is unmigrated."""
    return 1 if "--check" in shlex.split(command) else 0


def run_readme_command(command: str, cwd: Path, monkeypatch, capsys) -> str:
    from parabench.cli import main

    monkeypatch.chdir(cwd)
    make_inputs(cwd)
    args = how(command)
    if args[0] == "compare":
        seed_store(cwd, args[args.index("--experiment") + 1])
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's --help exits, as it does on the command line
        code = exc.code
    out = capsys.readouterr()
    assert code == expected_exit(command), f"{command}\n{out.out[-2000:]}\n{out.err[-3000:]}"
    return out.out


def test_the_readme_commands_are_found():
    commands = readme_commands()
    assert len(commands) >= 20 and "bench env" in commands
    assert {subcommand(c) for c in commands} >= {"run", "compare", "comm", "plan", "env", "migrate", "smoke"}
    for command in commands:
        assert subcommand(command) in {"run", "compare", "comm", "plan", "env", "migrate", "smoke"}, (
            f"README command {command!r}: this test does not know how to run `bench {subcommand(command)}`; add it"
        )


CHEAP = [c for c in readme_commands() if cheap(c)]
STARTING = [c for c in readme_commands() if not cheap(c)]


@pytest.mark.parametrize("command", CHEAP, ids=CHEAP)
def test_a_readme_command_runs_as_printed(command, tmp_path, monkeypatch, capsys):
    out = run_readme_command(command, tmp_path, monkeypatch, capsys)
    args = how(command)
    if args[0] == "run" and "--cfg" not in args:
        assert "dry run: launch bundle written to" in out  # composed and validated, nothing trained
    if args[0] == "compare":
        assert list((tmp_path / "results" / "reports").glob("compare-*/report.html"))


@pytest.mark.full
@pytest.mark.parametrize("command", STARTING, ids=STARTING)
def test_a_readme_command_that_starts_processes_runs_as_printed(command, tmp_path, monkeypatch, capsys):
    if subcommand(command) == "smoke":  # it runs what the README's migrate example wrote
        run_readme_command(next(c for c in readme_commands() if c.startswith("bench migrate path/to/gpu-project")),
                           tmp_path, monkeypatch, capsys)  # fmt: skip
    run_readme_command(command, tmp_path, monkeypatch, capsys)


def test_the_plan_example_plans_a_realistic_batch_not_the_toy_one():
    """The default batch (4 sequences of 256 tokens) is the CPU toy's; a 70B plan names its own."""
    (plan,) = [c for c in readme_commands() if c.startswith("bench plan +model=llama3-70b")]
    args = dict(a.split("=", 1) for a in shlex.split(plan) if "=" in a)
    assert int(args["data.global_batch_size"]) * int(args["data.seq_len"]) >= 1 << 20  # >= 1M tokens per step
