"""The 15 patterns a text-based migrator gets wrong (docs/sources.md#migration-patterns), one fixture each.

tests/migrate/fixtures/patterns/<name>/: before.py, after.py (all rules, --to npu), expected.txt.
BENCH_MIGRATE_REGEN=1 rewrites after/expected (review the diff before committing).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from parabench.migrate.core import Options
from parabench.migrate.engine import migrate_text

FIXTURES = Path(__file__).parent / "fixtures" / "patterns"
PATTERNS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
REGEN = os.environ.get("BENCH_MIGRATE_REGEN") == "1"


def _describe(findings) -> str:
    return "".join(
        f"{f.line} {f.rule} {f.safety} {'applied' if f.applied else 'manual'}: {f.message}\n" for f in findings
    )


def _run(name: str):
    before = (FIXTURES / name / "before.py").read_text()
    new, findings, reason = migrate_text("python", before, "before.py", Options())
    assert not reason
    return before, new, findings


def test_all_fifteen_patterns_have_fixtures():
    assert len(PATTERNS) == 15 and [p[:3] for p in PATTERNS] == [f"p{i:02d}" for i in range(1, 16)]


@pytest.mark.parametrize("name", PATTERNS)
def test_pattern(name: str):
    before, new, findings = _run(name)
    d = FIXTURES / name
    if REGEN:
        (d / "after.py").write_text(new)
        (d / "expected.txt").write_text(_describe(findings))
    assert new == (d / "after.py").read_text()
    assert _describe(findings) == (d / "expected.txt").read_text()
    compile(new, name, "exec", dont_inherit=True)
    again, findings2, _ = migrate_text("python", new, "after.py", Options())
    assert again == new and not [f for f in findings2 if f.applied]


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()]


def test_p01_test_moves_with_device():
    _, new, _ = _run("p01_device_type_gate")
    assert "device_type = 'npu' if 'npu' in device else 'cpu'" in new
    assert "use_fused = fused_available and device_type == 'npu'" in new


def test_p03_backend_checks_reported_not_renamed():
    before, new, findings = _run("p03_backend_equals_nccl")
    assert new.count('== "nccl"') == 1 and "== 'nccl'" in new
    assert sum(f.rule == "PY904" for f in findings) == 2


def test_p04_backend_map_untouched():
    _, new, findings = _run("p04_backend_map")
    assert 'default_device_backend_map.get("cuda")' in new and not findings


def test_p05_capability_flagged_not_renamed():
    _, new, findings = _run("p05_capability_gates")
    assert new.count("torch.cuda.get_device_capability") == 2
    assert "torch.npu.get_device_properties(0)" in new
    assert sum(f.rule == "PY901" for f in findings) == 2


def test_p10_public_names_untouched():
    before, new, _ = _run("p10_public_cuda_names")
    for name in (
        "get_cuda_rng_tracker",
        "model_parallel_cuda_manual_seed",
        '"--no_cuda"',
        '"cuda_rng_state"',
        '"use_cuda"',
        'help="disable cuda"',
    ):
        assert before.count(name) == new.count(name) > 0, name


def test_p11_prose_untouched():
    before, new, _ = _run("p11_prose")
    assert new.splitlines()[0] == before.splitlines()[0]  # module docstring
    assert '"""Move x to \'cuda\' with x.cuda()."""' in new
    assert 'logger.info("moving batch to cuda")  # torch.cuda.synchronize() in a comment' in new
    assert "return x.npu()" in new and "torch.npu.memory_allocated()" in new


def test_p13_allow_list_reported():
    _, new, findings = _run("p13_allow_lists")
    assert 'accelerator="cuda"' in new and 'accelerator="gpu"' in new
    assert [f.rule for f in findings] == ["PY912", "PY912"]
