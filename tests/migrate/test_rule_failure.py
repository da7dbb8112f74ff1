"""A rule that raises loses only its own edit, never silently: the failure is a manual item, so
``bench migrate --check`` fails and the summary names the rule."""

from __future__ import annotations

import libcst as cst

from parabench.migrate.cli import main
from parabench.migrate.core import REVIEW
from parabench.migrate.rules import _base
from parabench.migrate.rules._py import PyRule

SOURCE = "import torch\n\nx = torch.zeros(2).cuda()\ntorch.cuda.synchronize()\n"
NOTHING_ELSE = (
    "def wait(cuda_stream):\n    cuda_stream.synchronize()\n"  # passes the pre-filter; no other rule has work here
)


class RaisingRule(PyRule):
    """A rule with a bug: its replacement function raises on every ``synchronize`` attribute."""

    code = "PY899"
    name = "raising-rule"
    description = "test rule whose replacement raises"
    safety = REVIEW

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if node.attr.value == "synchronize":
            self.change(node, lambda n: n.attr.value.no_such_method(), "never applied", op="torch.cuda.synchronize")


def _migrate(tmp_path, monkeypatch, capsys, source: str, *flags: str) -> tuple[int, str]:
    monkeypatch.setitem(_base._REGISTRY, RaisingRule.code, RaisingRule)
    src = tmp_path / "train.py"
    src.write_text(source)
    code = main([*flags, "-j", "1", "--out", str(tmp_path / "out"), str(src)])
    return code, capsys.readouterr().out


def test_a_failing_rule_is_a_manual_item_and_fails_check(tmp_path, monkeypatch, capsys):
    code, out = _migrate(tmp_path, monkeypatch, capsys, NOTHING_ELSE, "--check")
    assert code == 1, out  # without the finding nothing would be pending: exit 0
    assert "PY899" in out and "AttributeError" in out, out


def test_the_other_rules_still_migrate_the_file(tmp_path, monkeypatch, capsys):
    code, out = _migrate(tmp_path, monkeypatch, capsys, SOURCE)
    assert code == 0, out
    migrated = (tmp_path / "out" / "train.py").read_text()
    assert "torch.zeros(2).npu()" in migrated and "torch.npu.synchronize()" in migrated, migrated
    assert "PY899" in out, out
