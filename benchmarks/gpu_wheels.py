"""Wheels of what a GPU machine without a package registry lacks, for benchmarks/gpu_check.sh.

    .venv/bin/python benchmarks/gpu_wheels.py --have benchmarks/h200_image_packages.txt \
        --python-version 3.12 --out .whl

Run it with the development venv's Python: the dependency closure of parabench (with --extras) is
read from that environment's installed metadata, and every package is fetched at the version
installed there (the tested development pins). Packages the target already has (--have: one name
a line, e.g. `pip list --format=freeze` there, cut at '==') are left out, and so are torch and
its CUDA libraries, which the target brings. Binary wheels are downloaded for the target's Python
and platform; a package published only as a source archive is built here into a wheel, which must
then be pure Python (py3-none-any), or the script stops with the package named.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ALWAYS_ON_TARGET = re.compile(r"^(torch|triton|nvidia-.*|setuptools|pip|wheel)$")  # the target's own
PLATFORMS = [
    "manylinux_2_34_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
]


def closure(root: str, extras: set[str]) -> dict[str, str]:
    """name -> installed version of root and everything it needs (with extras), from metadata."""
    dists = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions()}
    found: dict[str, str] = {}
    todo = [(root, extras)]
    while todo:
        name, wanted = todo.pop()
        key = canonicalize_name(name)
        if key in found:
            continue
        if key not in dists:
            raise SystemExit(f"gpu_wheels: {name} is needed but not installed in {sys.prefix}")
        found[key] = dists[key].version
        for text in dists[key].requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (wanted or {""})):
                todo.append((req.name, set(req.extras)))
    return found


def fetch(name: str, version: str, out: Path, python_version: str) -> None:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    download = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(out),
        f"{name}=={version}",
    ]
    if subprocess.run(download, capture_output=True, text=True).returncode == 0:
        return
    before = set(out.glob("*.whl"))
    build = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(out),
        f"{name}=={version}",
    ]
    done = subprocess.run(build, capture_output=True, text=True)
    built = set(out.glob("*.whl")) - before
    if done.returncode != 0 or not built:
        raise SystemExit(
            f"gpu_wheels: {name}=={version}: no wheel for Python {python_version} and the "
            f"source build failed:\n{done.stderr[-2000:]}"
        )
    impure = [w.name for w in built if not w.name.endswith("-py3-none-any.whl")]
    if impure:
        raise SystemExit(
            f"gpu_wheels: {name}=={version} built a platform wheel here ({impure}); it would "
            "not match the target: build it on a machine like the target"
        )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--have", type=Path, required=True, help="names installed on the target, one a line")
    p.add_argument("--python-version", required=True, help="the target's Python, e.g. 3.12")
    p.add_argument("--extras", default="deepspeed,megatron", help="parabench extras to carry")
    p.add_argument("--out", type=Path, default=Path(".whl"))
    args = p.parse_args(argv)
    have = {
        canonicalize_name(line.split("==")[0].strip())
        for line in args.have.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    need = closure("parabench", {e for e in args.extras.split(",") if e})
    carry = {
        n: v for n, v in sorted(need.items()) if n != "parabench" and n not in have and not ALWAYS_ON_TARGET.match(n)
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name, version in carry.items():
        fetch(name, version, args.out, args.python_version)
    size = sum(w.stat().st_size for w in args.out.glob("*.whl"))
    print(
        f"{len(carry)} packages the target lacks -> {args.out}/ ({size / 2**20:.1f} MiB): "
        + ", ".join(f"{n}=={v}" for n, v in carry.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
