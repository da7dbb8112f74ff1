"""Guard safety as a property (issue #13): no migration turns a branch that was unreachable on a
machine without CUDA into one that an NPU reaches while it still holds CUDA-only code.

Checked with parabench.migrate.guardcheck (the checks of the input evaluated without CUDA, those
of the output on an NPU, see its docstring) over every Python fixture of tests/migrate, migrated
with every rule and with the fixture's own rule selection; and the checker itself is shown to
catch the rewrites the issue reported (guards renamed by spelling).
"""

from __future__ import annotations

import tokenize
from pathlib import Path

import pytest

from parabench.migrate.core import Options
from parabench.migrate.engine import migrate_text
from parabench.migrate.guardcheck import violations

HERE = Path(__file__).parent
FIXTURES = HERE / "fixtures"


def _decodable(path: Path) -> bool:
    """Python source the interpreter can read (PEP 263 coding lines and BOMs included); the
    undecodable encoding fixtures are files bench migrate skips, so they have no output to check."""
    try:
        with tokenize.open(path) as f:
            f.read()
    except (SyntaxError, UnicodeDecodeError):
        return False
    return True


PY_FILES = sorted(
    p.relative_to(FIXTURES).as_posix()
    for p in FIXTURES.rglob("*.py")
    if "__pycache__" not in p.parts and not p.name.startswith("after") and _decodable(p)
)


def _fixture_options(path: Path) -> Options | None:
    """The rule selection a rule fixture is tested with (tests/migrate/test_rules.py), if any."""
    if path.parent.parent.name != "rules":
        return None
    kw: dict = {"select": frozenset({path.parent.name})}
    opt = path.parent / "options.txt"
    if opt.exists():
        for item in opt.read_text().split():
            k, v = item.split("=", 1)
            kw[k] = frozenset(v.split(",")) if k == "select" else v
    return Options(**kw)


def test_fixtures_found():
    assert len(PY_FILES) >= 100, PY_FILES


@pytest.mark.parametrize("rel", PY_FILES)
def test_guard_safety(rel: str):
    path = FIXTURES / rel
    with tokenize.open(path) as f:  # PEP 263 coding lines and BOMs (the encoding fixtures)
        text = f.read()
    selected = _fixture_options(path)
    for options in [Options(), Options(target="mindspeed"), *([selected] if selected else [])]:
        new, _findings, reason = migrate_text("python", text, path.name, options)
        if reason:
            continue  # skipped files are copied unchanged
        found = violations(text, new)
        assert found == [], f"{rel} ({options.target}, select={options.select}): " + "; ".join(map(str, found))


ISSUE_EXAMPLES = """
import torch
import torch.nn.functional as F

def attention(q, k, v):
    if not torch.cuda.is_available():
        return F.scaled_dot_product_attention(q, k, v)
    from flash_attn import flash_attn_func
    return flash_attn_func(q, k, v)

def dtype():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        return torch.bfloat16
    return torch.float32

def gpu_count():
    n = torch.cuda.device_count()
    if torch.cuda.device_count() > 0:
        import pynvml
        return pynvml.nvmlDeviceGetCount()
    return n
"""


def test_checker_catches_guards_renamed_by_spelling():
    """What fa95ee4 produced for the issue's examples: every guard renamed, the guarded code not."""
    renamed = ISSUE_EXAMPLES.replace("torch.cuda.is_available", "torch.npu.is_available").replace(
        "torch.cuda.device_count", "torch.npu.device_count"
    )
    found = violations(ISSUE_EXAMPLES, renamed)
    assert [(v.line, v.construct) for v in found] == [
        (8, "flash_attn"),
        (12, "torch.cuda.get_device_capability"),
        (19, "pynvml"),
    ]
    assert "torch.npu.device_count() > 0" in found[2].guard


def test_checker_accepts_kept_guards_and_migrated_bodies():
    assert violations(ISSUE_EXAMPLES, ISSUE_EXAMPLES) == []
    src = "import torch\nif torch.cuda.is_available():\n    x = torch.zeros(1).cuda()\n"
    assert violations(src, src.replace("cuda", "npu")) == []
    assert [v.construct for v in violations(src, src.replace("cuda.is", "npu.is"))] == [".cuda()"]


def test_checker_three_valued_logic():
    """Unknown operands leave a branch reachable; `and`/`or` short-circuits and early exits count."""
    src = (
        "import torch\n"
        "def f(flag):\n"
        "    if flag or torch.cuda.is_available():\n"  # reachable before (flag): not a new branch
        "        torch.cuda.synchronize()\n"
        "    if torch.cuda.device_count() > 1 and flag:\n"
        "        torch.cuda.synchronize()\n"
        "    if torch.cuda.device_count() < 1:\n"
        "        return 0\n"
        "    return torch.cuda.get_device_capability()\n"
    )
    after = src.replace("cuda.is_available", "npu.is_available").replace("cuda.device_count", "npu.device_count")
    found = [(v.line, v.construct) for v in violations(src, after)]
    # device_count() > 1 is unknown with an NPU (1 or more devices): reachable, so it counts
    assert found == [(6, "torch.cuda.synchronize"), (9, "torch.cuda.get_device_capability")]


def test_unparseable_input_gives_no_violation():
    assert violations("def f(:\n", "x = 1\n") == []


GATES = FIXTURES / "defects" / "i29_c1_device_gates" / "unchanged.py"


def test_checker_reports_every_device_gate_of_issue_29():
    """Issue #29 class 1: each gate form of the fixture renamed by spelling (as a text migrator does,
    and as bench migrate did for most of them) is reported once, at the CUDA-only code it let in:
    `.is_cuda`, `and` of two, `device.type == 'cuda'`, `device_type == 'cuda' and ...`,
    `in ('cuda',)`, `!= 'cuda'` in a conditional expression, `str(device).startswith('cuda')`,
    `for i in range(torch.cuda.device_count())`."""
    src = GATES.read_text()
    renamed = (
        src.replace(".is_cuda", ".is_npu")
        .replace('"cuda"', '"npu"')
        .replace("torch.cuda.is_available", "torch.npu.is_available")
        .replace("torch.cuda.device_count", "torch.npu.device_count")
    )
    found = [(v.line, v.construct) for v in violations(src, renamed)]
    assert found == [
        (28, "_scale_kernel (a triton kernel)"),
        (34, "_add (a helion kernel)"),
        (40, "torch.cuda.CUDAGraph"),
        (47, "fused_dense_cuda"),
        (55, "deep_ep"),
        (62, "_scale_kernel (a triton kernel)"),
        (67, "torch.cuda.CUDAGraph"),
        (103, "torch.cuda.default_generators"),  # for ... in range(torch.cuda.device_count())
    ]


def test_checker_accepts_gates_that_also_admit_the_host():
    """`device.type in ('cuda', 'cpu')` took the branch on the machine without CUDA too: not a gate."""
    src = "import torch\ndef f(x):\n    if x.device.type in ('cuda', 'cpu'):\n        torch.cuda.synchronize()\n"
    assert violations(src, src.replace("'cuda'", "'npu'")) == []
