"""`bench migrate --in-place` checks that the target is a clean git tree without running anything
that tree's repository names (issue 33, item 7): its core.fsmonitor hook, a .gitattributes filter
driver's clean command, the post-index-change hook of an index refresh - in the repository and in a
submodule. Each payload only touches a marker file in the test's directory."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from parabench.migrate.cli import main

GIT = ["git", "-c", "user.email=t@t", "-c", "user.name=t", "-c", "protocol.file.allow=always"]
TRAIN = "import torch\n\ntorch.cuda.set_device(0)\n"


def _repo(path: Path, files: dict[str, str]) -> Path:
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=path, check=True)
    subprocess.run([*GIT, "add", "-A"], cwd=path, check=True)
    subprocess.run([*GIT, "commit", "-qm", "x"], cwd=path, check=True)
    return path


def _arm(repo: Path, markers: Path, tag: str) -> None:
    """The repository's own config and hooks run a payload that touches ``markers/<tag>-<what>``."""
    touch = f"touch {markers}/{tag}"
    git_dir = Path(
        subprocess.run(["git", "rev-parse", "--git-dir"], cwd=repo, capture_output=True, text=True).stdout.strip()
    )
    git_dir = git_dir if git_dir.is_absolute() else repo / git_dir
    subprocess.run(["git", "config", "core.fsmonitor", f"{touch}-fsmonitor; false"], cwd=repo, check=True)
    subprocess.run(["git", "config", "filter.evil.clean", f"{touch}-clean; cat"], cwd=repo, check=True)
    hook = git_dir / "hooks" / "post-index-change"
    hook.parent.mkdir(exist_ok=True)
    hook.write_text(f"#!/bin/sh\n{touch}-hook\n")
    hook.chmod(0o755)
    for tracked in repo.glob("*.py"):  # stat data the index does not have: status re-reads (and cleans) them
        os.utime(tracked, (1_000_000_000, 1_000_000_000))


def test_the_clean_tree_check_runs_nothing_the_repository_names(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    sub = _repo(tmp_path / "sub", {"util.py": "x = 1\n", ".gitattributes": "*.py filter=evil\n"})
    repo = _repo(tmp_path / "repo", {"train.py": TRAIN, ".gitattributes": "*.py filter=evil\n"})
    subprocess.run([*GIT, "submodule", "add", "-q", str(sub), "sub"], cwd=repo, check=True, capture_output=True)
    subprocess.run([*GIT, "commit", "-qm", "sub"], cwd=repo, check=True)
    _arm(repo, markers, "repo")
    _arm(repo / "sub", markers, "sub")
    assert main([str(repo), "--in-place", "-q"]) == 0  # a clean tree: migrated in place
    assert sorted(p.name for p in markers.iterdir()) == []
    assert "torch.npu.set_device" in (repo / "train.py").read_text()
