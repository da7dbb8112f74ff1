"""Nothing lost in the split into test tiers: the full tier's test ids against the list committed
before the split (tests/collected_before_tiers.txt, `pytest --collect-only -q` on 8c7eaed).

    .venv/bin/python benchmarks/test_ids_diff.py          # exit 1 if a test id of the list is gone

Prints the ids that are gone, the ids that are new, and how many tests each tier selects. A gone id
fails the script unless tests/merged_test_ids.txt lists it with the test that now runs its checks in
fewer launches (its holder), and that holder is collected in the full tier.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEFORE = REPO / "tests" / "collected_before_tiers.txt"
MERGED = REPO / "tests" / "merged_test_ids.txt"


def merged_into() -> dict[str, str]:
    """Old id -> the id holding its checks, from MERGED ("OLD -> HOLDER  (why)")."""
    pairs = {}
    for line in MERGED.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            old, rest = line.split(" -> ", 1)
            pairs[old.strip()] = rest.split()[0]
    return pairs


def collected(*flags: str) -> set[str]:
    """Test ids pytest collects (and does not deselect) with these flags."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    ids = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    if proc.returncode != 0 or not ids:
        sys.exit(f"pytest --collect-only {' '.join(flags)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return ids


def main() -> int:
    before = {line.strip() for line in BEFORE.read_text().splitlines() if line.strip()}
    full, default = collected("--full"), collected()
    gone, new = sorted(before - full), sorted(full - before)
    print(f"before the split: {len(before)} tests; full tier: {len(full)}; default tier: {len(default)}")
    holders = merged_into()
    merged = [t for t in gone if holders.get(t) in full]
    lost = [t for t in gone if t not in merged]
    print(f"merged into a collected test (tests/merged_test_ids.txt): {len(merged)}")
    for test_id in merged:
        print(f"  = {test_id} -> {holders[test_id]}")
    print(f"gone from the full tier: {len(lost)}")
    for test_id in lost:
        print(f"  - {test_id}")
    print(f"new in the full tier: {len(new)}")
    for test_id in new:
        print(f"  + {test_id}")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
