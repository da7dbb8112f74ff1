"""The docs never show an MLflow server open to the network without authentication (issue 33, item
7): every `mlflow server` command in a fenced block of the README or docs/ that listens beyond
loopback also runs MLflow's basic-auth app."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.DOTALL)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _server_commands(text: str) -> list[str]:
    """Each `mlflow server ...` command of the fenced blocks, continuation lines joined."""
    commands = []
    for block in FENCE.findall(text):
        for command in block.replace("\\\n", " ").splitlines():
            if re.search(r"\bmlflow server\b", command):
                commands.append(command)
    return commands


def test_no_documented_mlflow_server_listens_beyond_loopback_without_authentication():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    open_servers = []
    for page in pages:
        for command in _server_commands(page.read_text()):
            host = re.search(r"--host[ =](\S+)", command)
            if host and host.group(1) not in LOOPBACK and "--app-name basic-auth" not in command:
                open_servers.append(f"{page.relative_to(ROOT)}: {command.strip()}")
    assert not open_servers, open_servers
    assert _server_commands((ROOT / "docs" / "tracking.md").read_text())  # the check sees the commands
