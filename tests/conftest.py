"""Shared helpers: run the real `bench` CLI in a subprocess against a temporary results dir."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Small, fast geometry for end-to-end tests: the llama model, shorter sequences.
FAST = ["+model=llama", "data.seq_len=64", "run.warmup_steps=0"]


def bench(args: list[str], results: Path, timeout: float = 600, env: dict | None = None, cwd: Path | None = None):
    cmd = [sys.executable, "-m", "parabench", *args]
    if args and args[0] == "run":
        cmd.append(f"run.results_dir={results}")
    full_env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO)


def torchrun_script(script: str, args: list[str], env: dict[str, str], nproc: int = 2) -> None:
    """``torchrun --nproc-per-node NPROC tests/SCRIPT ARGS`` on a free port; fails the test with the
    output's tail unless every rank exits 0 (the framework-native checkpoint writers)."""
    from parabench.runner import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}"]
    proc = subprocess.run(
        [*cmd, str(REPO / "tests" / script), *args],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def assert_refused_before_launch(args: list[str], must_name: str, tmp_path: Path, capsys) -> str:
    """``bench run ARGS`` (in-process, cwd = tmp_path) exits 2 with one `bench: error:` line naming
    ``must_name``, no traceback, and nothing written. Returns that line."""
    from parabench.cli import main

    results = tmp_path / "results"
    code = main(["run", *args, f"run.results_dir={results}"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("bench: error:") and must_name in err, err
    assert "Traceback" not in err
    assert not results.exists() and not (tmp_path / "mlflow.db").exists() and not (tmp_path / "outputs").exists()
    return err


def summaries(results: Path) -> dict[str, dict]:
    """run-dir name -> summary.json for every finished job under ``results``."""
    out = {}
    for p in sorted(results.glob("runs/*/*/*/summary.json")):
        out[p.parent.name] = json.loads(p.read_text())
    return out


# A citation of an entry of docs/sources.md, from code or data (`docs/sources.md#<anchor>`) or from a
# sibling doc (`sources.md#<anchor>`).
SOURCE_CITATION = re.compile(r"(?:docs/)?\bsources\.md#([\w-]+)")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def source_anchors() -> set[str]:
    """Every anchor of docs/sources.md (one per heading; a repeated slug would shadow an entry)."""
    headings = re.findall(r"^#{1,6} (.+)$", (REPO / "docs" / "sources.md").read_text(), flags=re.M)
    slugs = [github_slug(h) for h in headings]
    repeated = sorted({s for s in slugs if slugs.count(s) > 1})
    assert not repeated, f"docs/sources.md: headings with the same anchor: {repeated}"
    return set(slugs)


def mlflow_runs(results: Path, experiment: str = "parabench"):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{results / 'mlflow.db'}")
    return mlflow.search_runs(experiment_names=[experiment])


@pytest.fixture
def results(tmp_path: Path) -> Path:
    return tmp_path / "results"
