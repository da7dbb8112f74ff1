"""Issue 13, constructs real code contains: report wording and links (class 10), tensor type strings (3),
profiler (6), NVTX (7) and runtime entry points (8). Each test has a must-change and a must-not-change half."""

from __future__ import annotations

import re
from pathlib import Path

from parabench.migrate.cli import main
from parabench.migrate.core import Options
from parabench.migrate.engine import migrate_text, run

HERE = Path(__file__).parent


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


# --- class 10: symlink loops, NCCL wording, manual.md line links -----------------------------------


def test_symlink_loop_is_named_a_loop_and_outside_link_stays_outside(tmp_path: Path):
    src = _write(tmp_path / "src", {"a.py": "x = 1\n"})
    (src / "self_link").symlink_to("self_link")
    (src / "ping").symlink_to("pong")
    (src / "pong").symlink_to("ping")
    (src / "outside").symlink_to("/etc/hostname")
    reasons = {r.path: r.reason for r in run([src], Options(), None, jobs=1, progress=False).files}
    for loop in ("self_link", "ping", "pong"):
        assert reasons[loop].startswith("symlink loop"), reasons[loop]
        assert "outside" not in reasons[loop]
    assert reasons["outside"] == "symlink points outside the source tree: not followed"


def test_nccl_variable_wording_matches_what_happened():
    py = 'import os\nos.environ["NCCL_IB_DISABLE"] = "1"\nos.environ["NCCL_NVLS_ENABLE"] = "0"\n'
    new, findings, _ = migrate_text("python", py, "t.py", Options())
    assert new == py  # Python: reported, the lines stay
    mine = [f for f in findings if f.rule == "PY911"]
    assert len(mine) == 2
    for f in mine:
        assert not f.applied and "left in place" in f.message
        assert "dropped" not in f.message + f.tip
    sh = "export NCCL_NVLS_ENABLE=0\ntorchrun train.py\n"
    new, findings, _ = migrate_text("shell", sh, "run.sh", Options())
    assert new.startswith("# [bench migrate] dropped")  # shell: really dropped (commented out)
    (f,) = [f for f in findings if f.rule == "SH003"]
    assert f.applied and f.message.startswith("dropped")


_MD_LINK = re.compile(r"\[(?P<label>[^\]]+)\]\((?P<target>[^)#]+)#L(?P<line>\d+)\)")


def _links(md: str, rule: str) -> list[re.Match]:
    return [m for line in md.splitlines() if f"`{rule}`" in line for m in [_MD_LINK.search(line)] if m]


def test_manual_md_links_point_at_the_output_line(tmp_path: Path):
    code = "import os\nimport torch\n\nmodel = torch.nn.Linear(2, 2).cuda()\nmodel = torch.compile(model)\n"
    src = _write(tmp_path / "src", {"train.py": code})
    out, rep = tmp_path / "out", tmp_path / "rep"
    assert main([str(src), "--out", str(out), "--report", str(rep), "-q"]) == 0
    out_lines = (out / "train.py").read_text().split("\n")
    assert "import torch_npu" in out_lines  # an inserted line moves everything below it
    (m,) = _links((rep / "manual.md").read_text(), "PY909")
    line = int(m["line"])
    assert "torch.compile" in out_lines[line - 1]
    assert m["label"] == f"train.py:{line} (source line 5)" and (rep / m["target"]).resolve() == out / "train.py"
    # must not change: nothing written (--check) -> the links are the source's own lines
    rep2 = tmp_path / "rep2"
    assert main([str(src), "--check", "--report", str(rep2), "-q"]) == 1
    (m,) = _links((rep2 / "manual.md").read_text(), "PY909")
    assert m["label"] == "train.py:5" and m["line"] == "5"


# --- class 3: tensor type strings --------------------------------------------------------------------


def test_type_string_collection_used_in_another_statement_partial_parse():
    """``x.type() in NAME`` far from ``NAME = [...]``: the pre-filter keeps both statements."""
    from parabench.migrate import apply_rules, parse_plan

    filler = "".join(f"def helper_{i}(a, b):\n    return a + b * {i}\n\n\n" for i in range(40))
    text = (
        'import torch\n\n_HALF = ["torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor"]\n\n\n'
        + filler
        + "def is_half(p):\n    return p.type() in _HALF\n"
    )
    plan = parse_plan.prefilter(text, Options())
    assert plan.partial
    partial = apply_rules.migrate_python(text, "m.py", Options())
    whole = apply_rules.migrate_python(text, "m.py", Options(), partial=False)
    assert partial[0] == whole[0]
    assert '_HALF = ["torch.npu.HalfTensor", "torch.npu.BFloat16Tensor"]' in partial[0]
    # must not change: the same list never compared with a tensor's type
    unused = text.replace("return p.type() in _HALF", "return p.dtype in (torch.half,)")
    assert apply_rules.migrate_python(unused, "m.py", Options())[0].count("torch.cuda.HalfTensor") == 1


# --- classes 7 and 6: NVTX push/pop/range on mstx, the profiler on torch_npu's; the script runs to its end --


def test_migrated_nvtx_script_reaches_its_last_step_in_the_smoke_run(tmp_path: Path, capfd):
    from parabench.migrate.smoke import main as smoke

    out = tmp_path / "out"
    assert main([str(HERE / "fixtures" / "smoke_nvtx"), "--out", str(out), "-q"]) == 0
    migrated = (out / "train.py").read_text()
    code_lines = [line for line in migrated.splitlines() if not line.lstrip().startswith(("#", '"""'))]
    assert not [line for line in code_lines if "torch.cuda." in line.split("#")[0]]
    assert '_mstx_range_push(f"step {step}")' in migrated and "with _mstx_range(" in migrated
    assert "torch_npu.profiler.ProfilerActivity.NPU" in migrated  # class 6: the profiler moves along
    capfd.readouterr()
    code = smoke(["--cwd", str(out), "--env", "MAX_STEPS=3", "--", "python", "train.py"])
    stdout, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert "step 2 loss" in stdout and "reached the last step: 3" in stdout
    assert list((out / "traces").glob("*.json")), "the emulated torch_npu profiler wrote its trace"


# --- class 8: --mode runtime finds entry points without a __main__ guard -------------------------------

_RUNTIME_TREE = {
    "scripts/train.sh": (
        '#!/bin/bash\n# python tools/notes.py  (a comment, not a launch)\necho "python tools/notes.py"\n'
        "torchrun --nproc_per_node 2 --master_port 29500 pretrain.py \\\n    --lr 1e-4\n"
        "python -u -m pkg.run --steps 10\npython setup.py develop\n"
    ),
    "pyproject.toml": '[project]\nname = "pkg"\n\n[project.scripts]\npkg-train = "pkg.cli:main"\n',
    "setup.py": "from setuptools import setup\nimport torch\nsetup(name='pkg')\n",
    "pretrain.py": "import torch\nfrom pkg import run\n\nrun.main()\n",
    "pkg/__init__.py": "",
    "pkg/run.py": "import torch\n\n\ndef main():\n    return torch.ones(2)\n",
    "pkg/cli.py": "import sys\n\n\ndef main():\n    return sys.argv\n",
    "nano.py": (
        "import torch\nmodel = torch.nn.Linear(2, 2)\noptimizer = torch.optim.AdamW(model.parameters())\n"
        "for it in range(3):\n    loss = model(torch.ones(2)).sum()\n    loss.backward()\n    optimizer.step()\n"
    ),
    "lib.py": "import torch\n\n\ndef train(model, opt):\n    model(torch.ones(2)).sum().backward()\n    opt.step()\n",
    "tools/notes.py": "import torch\nprint(torch.__version__)\n",
    "main_guard.py": "import torch\n\nif __name__ == '__main__':\n    print(torch.ones(1))\n",
}


def test_runtime_mode_finds_entry_points_and_says_why(tmp_path: Path):
    src = _write(tmp_path / "src", _RUNTIME_TREE)
    out = tmp_path / "out"
    result = run([src], Options(mode="runtime"), out, jobs=1, progress=False)
    found = {f.file: f.message for f in result.findings if f.rule == "RT001"}
    assert set(found) == {"pretrain.py", "pkg/run.py", "pkg/cli.py", "nano.py", "main_guard.py"}, found
    assert "`torchrun ... pretrain.py` in scripts/train.sh:4" in found["pretrain.py"]
    assert "`python ... -m pkg.run` in scripts/train.sh:6" in found["pkg/run.py"]
    assert "[project.scripts] in pyproject.toml" in found["pkg/cli.py"]
    assert "top-level training code (line 6: loss.backward())" in found["nano.py"]
    assert "__main__" in found["main_guard.py"]
    for rel in found:
        assert "from torch_npu.contrib import transfer_to_npu" in (out / rel).read_text()
    # must not change: a library module, setup.py, a script only named in a comment and an echo
    for rel in ("lib.py", "setup.py", "tools/notes.py"):
        assert (out / rel).read_text() == _RUNTIME_TREE[rel], rel
