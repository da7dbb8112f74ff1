"""The project carries its own sources: every fact is cited as an entry of docs/sources.md.

Every `docs/sources.md#<anchor>` (or `sources.md#<anchor>` from a sibling doc) anywhere in the
repository - code, rules, YAML, JSON/CSV data, Markdown - must name a heading that exists in
docs/sources.md, and no file may cite a private notes file that is not part of the repository.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from conftest import REPO, SOURCE_CITATION, github_slug, source_anchors

TEXT_SUFFIXES = {"", ".py", ".md", ".yaml", ".yml", ".json", ".csv", ".txt", ".sh", ".toml", ".cfg", ".ini"}
SKIP_DIRS = {".git", ".venv", "results", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache"}
# Citations of the team's private notes, which users cannot follow (spelled in pieces so that this
# file does not cite them itself).
PRIVATE = re.compile("|".join(["REFER" + "ENCE", r"\.\./" + "shared/"]))


def _project_files() -> list[Path]:
    """Tracked and new (not ignored) files; a plain walk where git is not available."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        paths = [REPO / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in REPO.rglob("*") if not SKIP_DIRS & set(p.relative_to(REPO).parts)]
    return [p for p in paths if p.is_file() and p.suffix in TEXT_SUFFIXES]


def _texts() -> dict[str, str]:
    texts = {}
    for path in _project_files():
        try:
            texts[path.relative_to(REPO).as_posix()] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary or non-UTF-8 fixture: it cites nothing
    return texts


def test_github_slug():
    assert github_slug("FLOPs per token") == "flops-per-token"
    assert github_slug("Class A safe") == "class-a-safe"
    assert github_slug("Pattern 9") == "pattern-9"
    assert github_slug("ZeRO-Offload") == "zero-offload"


def test_every_cited_anchor_exists():
    anchors = source_anchors()
    missing = []
    for rel, text in _texts().items():
        for lineno, line in enumerate(text.splitlines(), 1):
            missing += [f"{rel}:{lineno}: #{a}" for a in SOURCE_CITATION.findall(line) if a not in anchors]
    assert not missing, "citations of anchors docs/sources.md does not have:\n" + "\n".join(missing)


def test_sources_links_within_the_page_resolve():
    anchors = source_anchors()
    links = re.findall(r"\]\(#([\w-]+)\)", (REPO / "docs" / "sources.md").read_text())
    assert links, "docs/sources.md links its entries to each other"
    assert not sorted(set(links) - anchors)


def test_the_code_cites_sources():
    cited = {a for text in _texts().values() for a in SOURCE_CITATION.findall(text)}
    # The facts the harness and the migration rules rest on are cited from the code that uses them.
    for anchor in (
        "flops-per-token",
        "peak-flops",
        "zero-model-states",
        "transfer-to-npu",
        "class-a-safe",
        "class-m-manual",
        "device-backend-autoload",
        "mindspeed-versions",
    ):
        assert anchor in cited, f"nothing cites docs/sources.md#{anchor}"


def test_no_citation_of_private_notes():
    hits = [
        f"{rel}:{lineno}: {line.strip()}"
        for rel, text in _texts().items()
        for lineno, line in enumerate(text.splitlines(), 1)
        if PRIVATE.search(line)
    ]
    assert not hits, "cite an entry of docs/sources.md instead:\n" + "\n".join(hits)
