"""Values the migration writes are accepted by the code that parses them, across files (issue 13, class 2).

tests/migrate/fixtures/values/extended (must change): a dataclass whose Literal fields become
argparse choices through typing.get_args, an argparse choices list, a launch script and a YAML
config that pass those values. After migration the launch script's flags still parse, by running
the migrated parser. fixtures/values/fixed (must not change): an enum and a constant tuple used as
choices, which the migration cannot extend: no value is rewritten anywhere, each is reported.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from parabench.migrate.core import Options
from parabench.migrate.engine import run

VALUES = Path(__file__).parent / "fixtures" / "values"


def _parse(cwd: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60)


def _migrate(name: str, tmp_path: Path, **options):
    src = tmp_path / name
    shutil.copytree(VALUES / name, src)
    out = tmp_path / f"{name}_npu"
    return src, out, run([src], Options(**options), out, jobs=1, progress=False)


def _launch_flags(out: Path) -> list[str]:
    line = (out / "launch.sh").read_text().splitlines()[1]
    return line.split("train.py" if "train.py" in line else "opts.py", 1)[1].split()


def test_literal_and_choices_extended_so_migrated_flags_parse(tmp_path: Path):
    _src, out, result = _migrate("extended", tmp_path)
    args = (out / "args.py").read_text()
    assert 'distributed_backend: Literal["nccl", "hccl", "gloo"] = "hccl"' in args
    assert 'device: Literal["cuda", "npu", "cpu"] = "npu"' in args
    assert 'precision: Literal["bf16", "fp32"] = "bf16"' in args
    assert 'default="hccl", choices=["nccl", "hccl", "gloo", "mpi"]' in (out / "train.py").read_text()
    assert (out / "train.yaml").read_text() == "distributed_backend: hccl\ndevice: npu\n"
    flags = _launch_flags(out)
    assert flags[:4] == ["--distributed-backend", "hccl", "--device", "npu"]
    # the migrated parser accepts the migrated launch flags, and the original values still
    check = "from args import parse; import sys; a = parse(sys.argv[1:]); print(a.distributed_backend, a.device)"
    for argv in (flags[:4], ["--distributed-backend", "nccl", "--device", "cuda"], []):
        proc = _parse(out, f"import sys; sys.argv[1:] = {argv!r}; {check}")
        assert proc.returncode == 0, proc.stderr
    assert _parse(out, f"import sys; sys.argv[1:] = []; {check}").stdout.split() == ["hccl", "npu"]
    assert (
        sorted(f.rule for f in result.findings if f.rule == "PY130") == ["PY130"] * 3
    )  # two Literal fields, one choices list
    again = run([out], Options(), None, jobs=1, progress=False)
    assert not [f for f in again.findings if f.applied]


def test_fixed_sets_keep_their_values_everywhere(tmp_path: Path):
    src, out, result = _migrate("fixed", tmp_path)
    for p in src.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), f"{p.name} must not change"
    kept = sorted((f.file, f.line, f.rule) for f in result.findings if "kept: its parser accepts only" in f.message)
    assert kept == [
        ("config.json", 2, "JS001"),
        ("config.json", 3, "JS001"),
        ("config.yaml", 1, "YM001"),
        ("config.yaml", 2, "YM001"),
        ("launch.sh", 2, "SH005"),
        ("launch.sh", 2, "SH006"),
        ("opts.py", 6, "PY103"),
        ("opts.py", 10, "PY106"),
        ("opts.py", 17, "PY104"),
    ]
    assert all(not f.applied for f in result.findings if f.rule != "PY100")
    flags = _launch_flags(out)
    proc = _parse(out, f"import opts; print(opts.build().parse_args({flags!r}))")
    assert proc.returncode == 0, proc.stderr


def test_literals_are_fixed_when_py130_does_not_run(tmp_path: Path):
    _src, out, result = _migrate("extended", tmp_path, ignore=frozenset({"PY130"}))
    args = (out / "args.py").read_text()
    assert 'distributed_backend: Literal["nccl", "gloo"] = "nccl"' in args
    assert _launch_flags(out)[:4] == ["--distributed-backend", "nccl", "--device", "cuda"]
    assert "Literal, not extended: PY130 off" in " ".join(f.message for f in result.findings)
