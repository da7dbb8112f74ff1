"""A seeded random sample of the changes `bench migrate` makes on the corpus, for reading (issue #29).

    python benchmarks/migrate_sample.py [--size 300] [--seed 29] [--offline] [--out FILE] [PACKAGE ...]

The packages' code comes from benchmarks/migrate_corpus.py (``fetch``: source distribution, wheel,
or the installed copy with ``--offline``). Every applied change of every file (``--to npu``,
static, all rules) is listed in a stable order (package, file, line, rule, message); ``--size`` of
them are drawn with ``random.Random(seed)``. Each is written as one tab-separated row: id, package,
file:line, rule, the source line, the migrated text of the change, and an empty verdict column
that a reader fills with right / wrong / unneeded (docs/migrate.md#sample-of-changes says how).
Rows already judged in ``--out`` keep their verdict and note when the sample is drawn again.
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from migrate_corpus import DEFAULT_PACKAGES, fetch  # noqa: E402

FIELDS = ("id", "package", "where", "rule", "source_line", "change", "verdict", "note")


def changes(package: str, roots: list[Path]) -> list[dict[str, str]]:
    """Every applied change of one package, in a stable order."""
    from parabench.migrate.core import Options
    from parabench.migrate.engine import run

    result = run(roots, Options(), None, jobs=2, progress=False)
    rows = []
    for f in sorted((f for f in result.findings if f.applied), key=lambda f: (f.file, f.line, f.rule, f.message)):
        lines = _source_lines(roots, f.file)
        source = lines[f.line - 1].strip() if 0 < f.line <= len(lines) else ""
        rows.append(
            {
                "package": package,
                "where": f"{f.file}:{f.line}",
                "rule": f.rule,
                "source_line": source[:160],
                "change": f.message[:160],
            }
        )
    return rows


def _source_lines(roots: list[Path], rel: str) -> list[str]:
    path = (
        roots[0] / rel
        if len(roots) == 1
        else next(r for r in roots if r.name == rel.split("/")[0]) / rel.split("/", 1)[1]
    )
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []


def _judged(out: Path) -> dict[str, tuple[str, str]]:
    if not out.exists():
        return {}
    with out.open(newline="") as fh:
        return {
            r["where"] + r["rule"] + r["change"]: (r["verdict"], r["note"]) for r in csv.DictReader(fh, delimiter="\t")
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("packages", nargs="*", default=list(DEFAULT_PACKAGES))
    ap.add_argument("--size", type=int, default=300)
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--offline", action="store_true", help="only the installed copies")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "parabench-corpus")
    ap.add_argument("--out", type=Path, default=HERE / "migrate_sample.tsv")
    args = ap.parse_args(argv)
    population: list[dict[str, str]] = []
    for spec in args.packages:
        source = fetch(spec, args.cache, args.offline)
        if source is None:
            print(f"{spec}: not available, left out", file=sys.stderr)
            continue
        population += changes(f"{source.name} {source.version}", source.roots)
    if len(population) < args.size:
        print(f"only {len(population)} changes, fewer than --size {args.size}", file=sys.stderr)
        return 2
    judged = _judged(args.out)
    drawn = random.Random(args.seed).sample(population, args.size)
    with args.out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, FIELDS, delimiter="\t")
        w.writeheader()
        for i, row in enumerate(drawn, 1):
            verdict, note = judged.get(row["where"] + row["rule"] + row["change"], ("", ""))
            w.writerow({"id": i, **row, "verdict": verdict, "note": note})
    print(f"{args.size} of {len(population)} changes -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
