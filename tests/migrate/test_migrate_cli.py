"""End-to-end tests of `bench migrate` through parabench.migrate.cli.main.

The golden test migrates tests/migrate/fixtures/project (Python + shell + DeepSpeed JSON + YAML +
requirements + .cu + unparseable/non-UTF-8 files) and compares the output tree and the report
byte for byte with tests/migrate/golden/. BENCH_MIGRATE_REGEN=1 rewrites the golden files.
"""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parabench.migrate.cli import main

HERE = Path(__file__).parent
PROJECT = HERE / "fixtures" / "project"
GOLDEN = HERE / "golden"
REGEN = os.environ.get("BENCH_MIGRATE_REGEN") == "1"
# the project holds legacy/old_eval.py, Python 2 with CUDA code: it cannot be migrated, so every
# run over the project exits 1 (issue #29 class 9)
NOT_MIGRATED = 1


def _snapshot(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() + f":{p.stat().st_mode & 0o777:o}"
    return out


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    src = tmp_path / "project"
    shutil.copytree(PROJECT, src)
    (src / "outside_link").symlink_to("/etc/hostname")  # points out of the tree: not followed
    (src / "inside_link.py").symlink_to("model.py")  # stays inside: recreated as a link
    return src


def _tree_equal(a: Path, b: Path) -> list[str]:
    diffs = []
    cmp = filecmp.dircmp(a, b)
    stack = [(cmp, "")]
    while stack:
        c, prefix = stack.pop()
        diffs += [f"only in output: {prefix}{n}" for n in c.left_only]
        diffs += [f"missing from output: {prefix}{n}" for n in c.right_only]
        for name in c.common_files:
            if (Path(c.left) / name).read_bytes() != (Path(c.right) / name).read_bytes():
                diffs.append(f"differs: {prefix}{name}")
        stack += [(sub, f"{prefix}{name}/") for name, sub in c.subdirs.items()]
    return diffs


def test_golden_project(project: Path, tmp_path: Path, capsys):
    before = _snapshot(project)
    out, report = tmp_path / "project_npu", tmp_path / "report"
    rc = main([str(project), "--to", "npu", "--out", str(out), "--report", str(report), "--no-progress"])
    assert rc == NOT_MIGRATED
    summary = capsys.readouterr().out
    assert _snapshot(project) == before, "the input tree must not be modified"
    assert (out / "inside_link.py").is_symlink() and not (out / "outside_link").exists()
    (out / "inside_link.py").unlink()  # symlinks are not stored in the golden tree
    if REGEN:
        shutil.rmtree(GOLDEN, ignore_errors=True)
        shutil.copytree(out, GOLDEN / "project_npu")
        shutil.copytree(report, GOLDEN / "report")
        (GOLDEN / "summary.txt").write_text(summary.replace(str(out), "<out>"))
    assert _tree_equal(out, GOLDEN / "project_npu") == []
    assert _tree_equal(report, GOLDEN / "report") == []
    assert summary.replace(str(out), "<out>") == (GOLDEN / "summary.txt").read_text()
    assert os.access(out / "scripts" / "pretrain.sh", os.X_OK), "file modes survive"
    for py in out.rglob("*.py"):
        if "legacy" not in py.parts:
            compile(py.read_text(), str(py), "exec", dont_inherit=True)


def test_second_run_changes_nothing(project: Path, tmp_path: Path):
    out1, out2 = tmp_path / "o1", tmp_path / "o2"
    assert main([str(project), "--out", str(out1), "-q"]) == NOT_MIGRATED
    rep = tmp_path / "rep2"
    assert main([str(out1), "--out", str(out2), "-q", "--report", str(rep)]) == NOT_MIGRATED
    assert _snapshot(out1) == _snapshot(out2)
    data = json.loads((rep / "report.json").read_text())
    assert data["summary"]["changes"] == 0 and data["summary"]["files_changed"] == 0
    assert data["summary"]["manual_items"] > 0  # manual work is still reported


def test_report_schema(project: Path, tmp_path: Path):
    rep = tmp_path / "rep"
    assert main([str(project), "--check", "--report", str(rep), "-q"]) == 1
    data = json.loads((rep / "report.json").read_text())
    assert data["schema"] == "parabench.migrate/report-v1"
    assert set(data) >= {"summary", "files", "changes", "manual", "rules", "api_map", "target", "mode"}
    assert data["api_map"]["torch_npu_version"]
    for c in data["changes"]:
        assert set(c) == {"file", "line", "end_line", "rule", "safety", "op", "message", "before", "after", "tip"}
        assert c["safety"] in ("safe", "review") and c["rule"] in data["rules"]
    for m in data["manual"]:
        assert set(m) == {"file", "line", "end_line", "rule", "op", "message", "tip"}
    header = (rep / "change_list.csv").read_text().splitlines()[0]
    assert header.startswith("File,Start Line,End Line,Operation Type,Message")
    assert (rep / "unsupported_api.csv").read_text().startswith("File,Start Line,End Line,OP,Tips")
    md = (rep / "manual.md").read_text()
    assert "- [ ] [utils/dist_utils.py:14](" in md  # file:line links


def test_diff_writes_nothing(project: Path, tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path)
    assert main([str(project), "--diff"]) == NOT_MIGRATED
    out = capsys.readouterr().out
    assert "--- a/train.py\n+++ b/train.py\n" in out and "+import torch_npu\n" in out
    assert _snapshot(tmp_path) == before


def test_check_exit_codes(project: Path, tmp_path: Path):
    assert main([str(project), "--check", "-q"]) == 1
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "a.py").write_text("import torch\nx = torch.ones(2)\n")
    assert main([str(clean), "--check", "-q"]) == 0


def test_safe_only_and_select(project: Path, tmp_path: Path):
    rep = tmp_path / "rep"
    assert main([str(project), "--out", str(tmp_path / "o"), "--safe-only", "--report", str(rep), "-q"]) == NOT_MIGRATED
    data = json.loads((rep / "report.json").read_text())
    assert data["summary"]["changes_by_safety"]["review"] == 0
    assert data["summary"]["review_not_applied"] > 0
    rep2 = tmp_path / "rep2"
    assert (
        main([str(project), "--check", "--select", "PY102,SH", "--ignore", "SH004", "--report", str(rep2), "-q"]) == 1
    )
    rules = {c["rule"] for c in json.loads((rep2 / "report.json").read_text())["changes"]}
    assert rules and all(r == "PY102" or r.startswith("SH") for r in rules) and "SH004" not in rules


@pytest.mark.parametrize(
    "argv, message",
    [
        (["missing_dir"], "SRC not found"),
        (["{p}", "--out", "{p}/sub"], "inside SRC"),
        (["{p}", "--in-place"], "--in-place needs --backup or a clean git tree"),
        (["{p}", "--select", "XX9"], "unknown rule code"),
        (["{p}", "--to", "gpu"], "invalid choice"),
        (["{p}", "--backup"], "--backup only applies to --in-place"),
        ([], "no SRC given"),
    ],
)
def test_bad_input_exit_2(project: Path, tmp_path: Path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    rc = main([a.replace("{p}", str(project)) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


def test_out_must_be_empty_unless_force(project: Path, tmp_path: Path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "x").write_text("x")
    assert main([str(project), "--out", str(out), "-q"]) == 2
    assert main([str(project), "--out", str(out), "-q", "--force"]) == NOT_MIGRATED


def test_in_place_with_backup(project: Path):
    original = (project / "train.py").read_text()
    assert main([str(project), "--in-place", "--backup", "-q"]) == NOT_MIGRATED
    assert (project / "train.py.orig").read_text() == original
    assert "torch.npu.set_device" in (project / "train.py").read_text()
    assert not (project / "README.md.orig").exists()  # only changed files are backed up


def test_in_place_requires_clean_git(project: Path):
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    subprocess.run(git + ["add", "-A"], cwd=project, check=True)
    subprocess.run(git + ["commit", "-qm", "x"], cwd=project, check=True)
    (project / "model.py").write_text((project / "model.py").read_text() + "\n# dirty\n")
    assert main([str(project), "--in-place", "-q"]) == 2
    subprocess.run(["git", "checkout", "-q", "model.py"], cwd=project, check=True)
    assert main([str(project), "--in-place", "-q"]) == NOT_MIGRATED
    assert "import torch_npu" in (project / "train.py").read_text()


def test_mindspeed_entry_script_and_te_flags(tmp_path: Path):
    src = tmp_path / "mega"
    src.mkdir()
    (src / "pretrain_gpt.py").write_text(
        "import torch\nfrom megatron.training import pretrain\n\n\nif __name__ == '__main__':\n    pretrain()\n"
    )
    (src / "run.sh").write_text(
        "torchrun pretrain_gpt.py --transformer-impl transformer_engine --swiglu --distributed-backend nccl\n"
    )
    out = tmp_path / "out"
    assert main([str(src), "--to", "mindspeed", "--out", str(out), "-q"]) == 0
    py = (out / "pretrain_gpt.py").read_text()
    assert py.index("import mindspeed.megatron_adaptor") < py.index("from megatron.training import pretrain")
    sh = (out / "run.sh").read_text()
    assert "--transformer-impl local --swiglu --use-fused-swiglu --distributed-backend hccl" in sh
    # --to npu does not add the adaptor and reports the TE flag instead
    assert main([str(src), "--to", "npu", "--check", "-q"]) == 1


def test_runtime_mode_entry_points_only(tmp_path: Path):
    src = tmp_path / "rt"
    src.mkdir()
    (src / "train.py").write_text(
        '"""doc"""\nimport os\nimport torch\n\ntorch.cuda.synchronize()\n\nif __name__ == "__main__":\n    pass\n'
    )
    (src / "lib.py").write_text("import torch\n\ntorch.cuda.synchronize()\n")
    out = tmp_path / "out"
    assert main([str(src), "--mode", "runtime", "--out", str(out), "-q"]) == 0
    assert (
        (out / "train.py")
        .read_text()
        .startswith(
            '"""doc"""\nimport os\nimport torch\nimport torch_npu\nfrom torch_npu.contrib import transfer_to_npu'
        )
    )
    assert "torch.cuda.synchronize()" in (out / "train.py").read_text()
    assert (out / "lib.py").read_text() == (src / "lib.py").read_text()


def test_parallel_matches_serial(tmp_path: Path):
    src = tmp_path / "many"
    for i in range(60):
        d = src / f"pkg{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        body = "import torch\nx = torch.ones(2).cuda()\n" if i % 2 else "import os\nprint('hi')\n"
        (d / f"m{i}.py").write_text(body + "# pad\n" * (i * 7 % 23))  # sizes differ: the pool hands out largest first
    a, b = tmp_path / "a", tmp_path / "b"
    assert main([str(src), "--out", str(a), "-q", "-j", "1"]) == 0
    assert main([str(src), "--out", str(b), "-q", "-j", "2"]) == 0
    assert _snapshot(a) == _snapshot(b)


def test_cli_import_is_light():
    code = (
        "import sys; import parabench.migrate.cli as c; "
        "bad = [m for m in ('torch', 'libcst', 'yaml') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_list_rules(capsys):
    assert main(["--list-rules"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| Code | Name | Safety |") and "| PY101 | cuda-api | safe |" in table


def test_docs_rule_table_in_sync():
    from parabench.migrate.cli import rules_table

    doc = (HERE.parent.parent / "docs" / "migrate.md").read_text()
    table = doc.split("<!-- rules:begin -->\n", 1)[1].split("<!-- rules:end -->", 1)[0]
    assert table == rules_table(), "regenerate the table in docs/migrate.md from `bench migrate --list-rules`"
