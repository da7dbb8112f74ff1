"""Issue #29, the classes that need a whole tree or the CLI (the others are fixtures under
tests/migrate/fixtures/defects/i29_* and tests/migrate/fixtures/rules/): CI configuration is left
alone and reported (class 7); every CUDA-only package is reported with a documented source, a
project's own top-level folder never is (class 8); a file that could not be migrated is listed as
such and the exit status says so (class 9)."""

from __future__ import annotations

from pathlib import Path

from parabench.migrate import api_map
from parabench.migrate.cli import main
from parabench.migrate.core import Options
from parabench.migrate.engine import migrate_text, run

HERE = Path(__file__).parent
DEFECTS = HERE / "fixtures" / "defects"
REPO = HERE.parent.parent
WORKFLOW = "name: ci\njobs:\n  test:\n    strategy:\n      matrix:\n        device: [cpu, cuda]\n"


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_ci_workflows_are_left_alone_and_reported(tmp_path: Path, capsys):
    src = _write(
        tmp_path / "src",
        {".github/workflows/test.yml": WORKFLOW, "configs/run.yml": "device: cuda\n", ".gitlab-ci.yml": WORKFLOW},
    )
    out = tmp_path / "out"
    assert main([str(src), "--out", str(out)]) == 0
    assert (out / ".github/workflows/test.yml").read_text() == WORKFLOW
    assert (out / ".gitlab-ci.yml").read_text() == WORKFLOW
    assert (out / "configs/run.yml").read_text() == "device: npu\n"  # training configuration still migrates
    text = capsys.readouterr().out
    assert "left as is on purpose (review by hand): 2" in text
    assert ".github/workflows/test.yml: CI configuration" in text


def test_project_folder_named_like_a_cuda_package_is_not_reported(tmp_path: Path):
    uses = "import torch\nimport nvidia.kernels\nfrom nvidia import helpers\nx = torch.zeros(1).cuda()\n"
    own = _write(tmp_path / "own", {"nvidia/__init__.py": "", "nvidia/kernels.py": "", "train.py": uses})
    result = run([own], Options(), None, jobs=1, progress=False)
    assert not [f for f in result.findings if f.rule == "PY907"]
    other = _write(tmp_path / "other", {"train.py": uses})  # NVIDIA's own namespace package
    result = run([other], Options(), None, jobs=1, progress=False)
    assert [(f.line, f.op) for f in result.findings if f.rule == "PY907"] == [(2, "nvidia.kernels"), (3, "nvidia")]


def test_src_layout_packages_are_the_projects_own(tmp_path: Path):
    src = _write(tmp_path / "p", {"src/triton/__init__.py": "", "scripts/run.py": "import triton\n"})
    result = run([src], Options(), None, jobs=1, progress=False)
    assert not [f for f in result.findings if f.rule == "PY907"]


def test_every_cuda_only_package_is_reported_and_has_a_source():
    before = (DEFECTS / "i29_c8_cuda_only_imports" / "before.py").read_text()
    _new, findings, _ = migrate_text("python", before, "before.py", Options())
    reported = {f.op for f in findings if f.rule == "PY907"}
    added = ["helion", "deep_ep", "megablocks", "deepspeed.ops.sparse_attention", "torchao.prototype.mx_formats"]
    for module in added:
        assert any(r.startswith(module) for r in reported), module
    sources = (REPO / "docs" / "sources.md").read_text()
    section = sources.split("## CUDA-only packages", 1)[1].split("\n## ", 1)[0]
    for module in api_map.CUDA_ONLY_MODULES:
        assert f"`{module}`" in section, f"{module}: no entry in docs/sources.md#cuda-only-packages"
    unchanged = (DEFECTS / "i29_c8_cuda_only_imports" / "unchanged.py").read_text()
    _new, findings, _ = migrate_text("python", unchanged, "unchanged.py", Options())
    assert not [f for f in findings if f.rule == "PY907"]


def test_a_file_with_a_syntax_error_is_listed_and_fails_the_run(tmp_path: Path, capsys):
    src = _write(
        tmp_path / "src",
        {"bad.py": "import torch\ndef f(:\n    return torch.zeros(1).cuda()\n", "good.py": "import torch\n"},
    )
    assert main([str(src), "--out", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    assert "1 not migrated" in captured.out
    assert "not migrated (copied unchanged): 1\n  bad.py: unparseable: SyntaxError" in captured.out
    assert "bad.py was not migrated" in captured.err
    assert (tmp_path / "out" / "bad.py").read_text() == (src / "bad.py").read_text()
    # one without CUDA code has nothing to migrate: the run succeeds
    plain = _write(tmp_path / "plain", {"bad.py": "def f(:\n"})
    assert main([str(plain), "--out", str(tmp_path / "out2"), "-q"]) == 0
