"""Files as they come: encodings (BOM, PEP 263 coding lines), Jupyter notebooks, and `--check` on
files that could not be migrated (issue 13, class 9).

tests/migrate/fixtures/files/: encodings/ (must change: *_cuda.py, cp1252_crlf.py; must not:
*_plain.py), notebooks/ (must change: train.ipynb; must not: plain.ipynb, r_kernel.ipynb),
unreadable/ (skipped files, with and without CUDA code); expected/ holds the migrated tree byte
for byte. BENCH_MIGRATE_REGEN=1 rewrites expected/.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parabench.migrate.cli import main
from parabench.migrate.core import Options
from parabench.migrate.engine import run
from parabench.migrate.notebook import migrate_notebook

FILES = Path(__file__).parent / "fixtures" / "files"
EXPECTED = FILES / "expected"
REGEN = os.environ.get("BENCH_MIGRATE_REGEN") == "1"
MUST_CHANGE = ["encodings/bom_cuda.py", "encodings/cp1252_crlf.py", "encodings/latin1_cuda.py", "notebooks/train.ipynb"]
MUST_NOT_CHANGE = [
    "encodings/bom_plain.py",
    "encodings/latin1_plain.py",
    "notebooks/plain.ipynb",
    "notebooks/r_kernel.ipynb",
]


def _digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    for part in ("encodings", "notebooks"):
        shutil.copytree(FILES / part, src / part)
    return src


def test_encodings_and_notebooks_migrate_byte_for_byte(tree: Path, tmp_path: Path):
    before = _digests(tree)
    out = tmp_path / "out"
    result = run([tree], Options(), out, jobs=1, progress=False)
    assert _digests(tree) == before, "the input is never touched"
    status = {r.path: r.status for r in result.files}
    assert {p: status[p] for p in MUST_CHANGE} == dict.fromkeys(MUST_CHANGE, "changed")
    assert {p: status[p] for p in MUST_NOT_CHANGE} == dict.fromkeys(MUST_NOT_CHANGE, "unchanged")
    for rel in MUST_NOT_CHANGE:
        assert (out / rel).read_bytes() == (tree / rel).read_bytes(), rel
    if REGEN:
        shutil.rmtree(EXPECTED, ignore_errors=True)
        for rel in MUST_CHANGE:
            (EXPECTED / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out / rel, EXPECTED / rel)
    for rel in MUST_CHANGE:
        assert (out / rel).read_bytes() == (EXPECTED / rel).read_bytes(), rel
    again = run([out], Options(), None, jobs=1, progress=False)  # a second pass is a no-op
    assert [r.path for r in again.files if r.status != "unchanged"] == []
    assert not [f for f in again.findings if f.applied]


def test_encoding_kept_on_write(tree: Path, tmp_path: Path):
    out = tmp_path / "out"
    run([tree], Options(), out, jobs=1, progress=False)
    bom = (out / "encodings/bom_cuda.py").read_bytes()
    assert bom.startswith(b"\xef\xbb\xbf") and bom.count(b"\xef\xbb\xbf") == 1 and b".npu()" in bom
    latin1 = (out / "encodings/latin1_cuda.py").read_bytes()
    assert 'label = "résultat"'.encode("latin-1") in latin1 and b".npu()" in latin1
    cp1252 = (out / "encodings/cp1252_crlf.py").read_bytes()
    assert (
        "“done”".encode("cp1252") in cp1252 and b'device="npu")\r\n' in cp1252 and b"\r\nimport torch_npu\r\n" in cp1252
    )
    for rel in ("encodings/bom_cuda.py", "encodings/latin1_cuda.py", "encodings/cp1252_crlf.py"):
        compile((out / rel).read_bytes(), rel, "exec", dont_inherit=True)  # bytes: the interpreter's own decoding


def test_notebook_keeps_everything_but_migrated_sources(tree: Path, tmp_path: Path):
    text = (tree / "notebooks/train.ipynb").read_text(encoding="utf-8")
    new, findings, reason = migrate_notebook(text, "train.ipynb", Options())
    assert not reason
    old_nb, new_nb = json.loads(text), json.loads(new)
    assert old_nb["metadata"] == new_nb["metadata"] and len(old_nb["cells"]) == len(new_nb["cells"])
    for a, b in zip(old_nb["cells"], new_nb["cells"], strict=True):
        assert {k: v for k, v in a.items() if k != "source"} == {k: v for k, v in b.items() if k != "source"}
    sources = ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in new_nb["cells"]]
    assert sources[0] == "# Fine-tune on `cuda`\nRun `model.cuda()` first."  # markdown
    assert (
        sources[1] == "%matplotlib inline\n!pip install -q torch\nimport torch\nimport torch_npu\nimport torch.nn as nn"
    )
    assert "torch.device('npu')" in sources[2] and "nn.Linear(4, 4).npu()" in sources[2]
    assert "gpus = !nvidia-smi -L" in sources[2]  # shell lines are left alone
    assert sources[3] == "%%bash\nnvidia-smi\necho cuda\n"  # a shell cell is not Python
    assert (
        sources[4].startswith("%%time\n")
        and "    %time y = x + 1\n" in sources[4]
        and sources[4].endswith("torch.npu.synchronize()")
    )
    assert sources[5] == "torch.cuda.is_available?\n?nn.Linear"  # help lines: IPython, not code
    assert sources[7] == "x.cuda()"  # raw cell
    # line by line: only the changed lines of the changed cells differ in the file's text
    changed = [line for line in new.splitlines() if line not in text.splitlines()]
    assert changed == [
        '    "import torch_npu\\n",',
        "    \"device = torch.device('npu')\\n\",",
        '    "model = nn.Linear(4, 4).npu()\\n",',
        '    "    x = torch.ones(2).npu()\\n",',
        '    "torch.npu.synchronize()"',
    ]
    assert [(f.file, f.line, f.rule) for f in findings] == [
        ("train.ipynb#cell-2", 3, "PY100"),
        ("train.ipynb#cell-3", 1, "PY103"),
        ("train.ipynb#cell-3", 2, "PY102"),
        ("train.ipynb#cell-5", 3, "PY102"),
        ("train.ipynb#cell-5", 5, "PY101"),
    ]


def test_notebook_source_as_one_string_and_escapes():
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "metadata": {},
                "outputs": [],
                "source": "import torch\nx = torch.ones(1).cuda()\n",
            },
            {
                "cell_type": "code",
                "execution_count": None,
                "metadata": {},
                "outputs": [],
                "source": ["s = 'caf\u00e9'\n", "y = x.cuda()"],
            },
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 4,
    }
    text = json.dumps(nb, indent=2)  # ensure_ascii: the unchanged line keeps its \\u00e9 escape
    new, findings, reason = migrate_notebook(text, "a.ipynb", Options())
    assert not reason and "\"s = 'caf\\u00e9'\\n\"" in new
    cells = json.loads(new)["cells"]
    assert cells[0]["source"] == "import torch\nimport torch_npu\nx = torch.ones(1).npu()\n"
    assert cells[1]["source"] == ["s = 'café'\n", "y = x.npu()"]
    assert {f.file for f in findings} == {"a.ipynb#cell-1", "a.ipynb#cell-2"}
    assert migrate_notebook(new, "a.ipynb", Options())[0] == new


def test_notebook_with_a_broken_cell_is_skipped_naming_the_cell():
    nb = {
        "cells": [{"cell_type": "code", "metadata": {}, "outputs": [], "source": ["x = (\n", "y.cuda()"]}],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    text = json.dumps(nb)
    new, findings, reason = migrate_notebook(text, "b.ipynb", Options())
    assert new == text and not findings and reason.startswith("unparseable:") and "b.ipynb#cell-1" in reason


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "parabench", "migrate", *argv], capture_output=True, text=True, timeout=120
    )


def test_check_fails_on_a_skipped_file_with_cuda_code(tmp_path: Path):
    src = tmp_path / "src"
    shutil.copytree(FILES / "unreadable", src)
    proc = _cli(str(src), "--check", "-q")
    assert proc.returncode == 1, proc.stderr
    named = sorted(line.split()[3] for line in proc.stderr.splitlines() if line.startswith("bench migrate: --check:"))
    assert named == ["py2_print.py", "undeclared_latin1.py"]  # undeclared_plain.py holds no CUDA code


def test_check_passes_on_skipped_file_without_cuda_and_on_migrated_encodings(tree: Path, tmp_path: Path, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(FILES / "unreadable" / "undeclared_plain.py", plain)
    assert main([str(plain), "--check", "-q"]) == 0
    out = tmp_path / "out"
    assert main([str(tree), "--out", str(out), "-q"]) == 0
    assert main([str(out), "--check", "-q"]) == 0  # BOM, latin-1, cp1252 and the notebook: nothing left
    assert "--check:" not in capsys.readouterr().err
