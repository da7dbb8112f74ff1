"""The README's quick tour runs as printed (issue 26): its cluster examples are run here for real (a
dry run writes the launch bundle, `bench plan` only computes), so they cannot drift from the config."""

from __future__ import annotations

import re
import shlex

import pytest

from conftest import REPO


def quick_tour() -> list[str]:
    """The commands of the README's "quick tour" block, continuation lines joined, comments dropped."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## A quick tour of the CLI\s*```bash\n(.*?)```", text, re.S)
    assert block, "README.md: no quick-tour bash block"
    joined = block.group(1).replace("\\\n", " ")
    return [" ".join(shlex.split(line, comments=True)) for line in joined.splitlines() if line.startswith("bench ")]


def command(prefix: str) -> list[str]:
    (found,) = [c for c in quick_tour() if c.startswith(prefix)]
    return shlex.split(found)[1:]


@pytest.mark.parametrize(
    "prefix",
    ["bench run +model=llama2-7b", "bench plan +model=llama3-70b"],
)
def test_the_readme_cluster_examples_run(prefix, tmp_path, monkeypatch, capsys):
    from parabench.cli import main

    monkeypatch.chdir(tmp_path)
    args = command(prefix)
    code = main([*args, f"run.results_dir={tmp_path / 'results'}", "tracking.enabled=false"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "launcher.dry_run=true" in args or args[0] != "run"  # the run example must not train here


def test_the_plan_example_plans_a_realistic_batch_not_the_toy_one():
    """The default batch (4 sequences of 256 tokens) is the CPU toy's; a 70B plan names its own."""
    args = dict(a.split("=", 1) for a in command("bench plan +model=llama3-70b") if "=" in a)
    assert int(args["data.global_batch_size"]) * int(args["data.seq_len"]) >= 1 << 20  # >= 1M tokens per step
