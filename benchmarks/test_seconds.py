"""Write tests/test_seconds.json - each test's measured seconds (setup, call and teardown; tests of
at least --min seconds) - from the JUnit XML of a test run, for the order in which `./dev test` hands
modules to its workers (tests/schedule.py: longest first).

    ./dev test --full --junitxml=/tmp/full.xml && python benchmarks/test_seconds.py /tmp/full.xml
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def node_id(classname: str, name: str) -> str:
    """pytest's node id of a JUnit testcase: the longest dotted prefix of ``classname`` that is a file
    of the repository is the module, the rest its classes (``tests.test_x.TestY`` -> tests/test_x.py::TestY)."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        module = Path(*parts[:cut]).with_suffix(".py")
        if (REPO / module).is_file():
            return "::".join([module.as_posix(), *parts[cut:], name])
    raise SystemExit(f"test_seconds: no module of the repository for {classname}::{name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit_xml", type=Path)
    parser.add_argument("--min", type=float, default=1.0, help="leave out tests shorter than this (s)")
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "test_seconds.json")
    args = parser.parse_args(argv)
    seconds = {}
    for case in ET.parse(args.junit_xml).getroot().iter("testcase"):
        took = float(case.get("time", "0"))
        if took >= args.min:
            seconds[node_id(case.get("classname", ""), case.get("name", ""))] = round(took, 1)
    args.out.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")
    print(f"{len(seconds)} tests of at least {args.min} s ({sum(seconds.values()):.0f} s in all) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
