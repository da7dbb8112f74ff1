"""Supported version ranges: one source (pyproject.toml), read back by `bench env`; the dev pins lie inside them.

The install-into-an-existing-torch check and the oldest-version parity runs are slow jobs of
benchmarks/compat_matrix.sh (README "Compatibility"); these tests are the fast, always-run part.
"""

from __future__ import annotations

import re

import pytest

from conftest import REPO


def pyproject_ranges() -> dict[str, str]:
    """Distribution -> range, parsed from pyproject.toml itself (not from the installed metadata)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    out = {"python": project["requires-python"]}
    for line in lines:
        req = Requirement(line)
        if canonicalize_name(req.name) != "parabench":
            out[canonicalize_name(req.name)] = req.specifier
    return out


def test_bench_env_reads_the_ranges_of_pyproject():
    from packaging.specifiers import SpecifierSet

    from parabench.env.command import supported_ranges

    installed = supported_ranges()
    declared = pyproject_ranges()
    assert set(installed) == set(declared)
    assert SpecifierSet(installed.pop("python")) == SpecifierSet(declared.pop("python"))
    assert {k: SpecifierSet(v) for k, v in installed.items()} == declared


def test_every_bound_says_why():
    """Each dependency line with an upper or lower bound carries a comment on it or just above it."""
    text = (REPO / "pyproject.toml").read_text().splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith("requires-python"))
    end = next(i for i, line in enumerate(text) if line.startswith("[project.scripts]"))
    silent = [
        line.strip()
        for i, line in enumerate(text[start:end], start)
        if re.search(r'"[\w-]+(\[[\w,]+\])?\s*[<>=~]', line)
        and "#" not in line
        and not text[i - 1].strip().startswith("#")
        and not line.strip().startswith(("test =", "all ="))
    ]
    assert not silent, silent


def test_dev_constraints_lie_inside_the_supported_ranges():
    """constraints/dev-cpu.txt (what ./dev installs) must be an instance of the declared ranges."""
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pins = {}
    for line in (REPO / "constraints" / "dev-cpu.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    ranges = pyproject_ranges()
    assert Version("3.11") in SpecifierSet(ranges.pop("python"))  # ./dev's interpreter
    outside = {d: (str(pins[d]), str(spec)) for d, spec in ranges.items() if d in pins and not spec.contains(pins[d])}
    assert not outside, outside
    assert str(pins["torch"]) == "2.13.0+cpu"  # the CPU wheel, never a CUDA build


def test_a_backend_outside_its_range_is_named():
    from parabench.env.command import backends_outside, range_status, registered_adapters

    ranges = {"torch": ">=2.6", "megatron-core": ">=0.12,<0.17", "deepspeed": ">=0.16.9,<0.20"}
    found = {"torch": "2.5.1+cu121", "megatron-core": "0.12.1", "deepspeed": None}
    status = range_status(found, ranges)
    assert status["torch"]["inside"] is False and status["megatron-core"]["inside"] is True
    assert status["deepspeed"]["inside"] is None  # not installed: neither inside nor outside
    outside = backends_outside(status, registered_adapters())
    assert set(outside) == {"ddp", "fsdp", "deepspeed", "megatron", "mindspeed"}  # all that run on torch
    assert outside["megatron"] == ["torch 2.5.1+cu121 (supported: >=2.6)"]
    found["torch"] = "2.7.1"
    assert backends_outside(range_status(found, ranges), registered_adapters()) == {}


def test_bench_env_prints_ranges_outside_backends_and_the_mindspeed_set(capsys):
    from parabench.devices import package_version
    from parabench.env.command import main, report

    assert main([]) == 0
    out = capsys.readouterr().out
    versions = out[out.index("\nversions (supported range") :]
    torch_line = next(line for line in versions.splitlines() if line.split()[:1] == ["torch"])
    assert package_version("torch") in torch_line and ">=2.6" in torch_line
    assert torch_line.split()[-1] in ("ok", "OUTSIDE")
    assert "torch 2.7.1, torch-npu 2.7.1.post4, cann 9.0.0" in out and "megatron-core 0.12.1" in out  # MindSpeed's set
    rep = report()
    assert set(rep["outside"]) <= set(rep["backends"])
    assert ("outside the supported ranges" in out) == bool(rep["outside"])


def test_fsdp_on_cpu_with_an_old_torch_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    """On torch < 2.7 (the compat matrix's torch 2.6) fsdp on CPU is refused with the version it needs;
    on newer torch the same command passes validation (the e2e parity tests then run it)."""
    from conftest import assert_refused_before_launch
    from parabench.adapters.fsdp import CPU_FSDP2_TORCH, torch_release

    monkeypatch.chdir(tmp_path)
    args = ["+model=llama", "backend=fsdp", "device=cpu"]
    if torch_release() < CPU_FSDP2_TORCH:
        assert_refused_before_launch(args, "needs torch>=2.7", tmp_path, capsys)
    else:
        from parabench.adapters.fsdp import FSDPAdapter
        from parabench.hydraconfig import compose, to_plain
        from parabench.jobs import from_config

        FSDPAdapter.validate(from_config(to_plain(compose(args))))  # no refusal


def test_every_package_of_the_tree_is_in_the_wheel():
    """A non-editable install (pip install .) ships only the packages pyproject lists: a new
    subpackage left out of the list imports in the dev venv and fails for every user."""
    import tomllib

    setuptools_cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools_cfg["packages"])
    dirs = {name: folder for name, folder in setuptools_cfg["package-dir"].items()}
    found = set()
    for root_name, folder in dirs.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((root_name, *rel)))
    for init in (REPO / "hydra_plugins").rglob("__init__.py"):
        found.add(".".join(init.parent.relative_to(REPO).parts))
    assert found - listed == set(), f"packages missing from pyproject's [tool.setuptools] packages: {found - listed}"


def test_a_torch_newer_than_the_newest_tested_is_admitted_with_a_warning(monkeypatch, capsys):
    """torch has no upper bound (a bound would make pip replace a user's newer torch): a release newer
    than the newest one parabench ran on is inside the range, and `bench env` says it is untested."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from parabench.env import command as envreport

    assert Version("99.0") in SpecifierSet(pyproject_ranges()["torch"])  # the metadata admits it
    tested = envreport.NEWEST_TESTED["torch"]
    assert envreport.newer_than_tested({"torch": tested}) == []
    assert envreport.newer_than_tested({"torch": f"{tested}+cu128"}) == []  # a local build of the same release
    newer = f"{Version(tested).major}.{Version(tested).minor + 1}.0"
    (warning,) = envreport.newer_than_tested({"torch": newer})
    assert warning == f"torch {newer} is newer than the newest tested ({tested}): allowed, but untested"
    real = envreport.versions
    monkeypatch.setattr(envreport, "versions", lambda: {**real(), "torch": newer})
    assert envreport.main([]) == 0
    assert f"warning: torch {newer} is newer than the newest tested ({tested})" in capsys.readouterr().out
