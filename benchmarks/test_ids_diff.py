"""Nothing lost in the split into test tiers: the full tier's test ids against the list committed
before the split (tests/collected_before_tiers.txt, `pytest --collect-only -q` on 8c7eaed).

    .venv/bin/python benchmarks/test_ids_diff.py          # exit 1 if a test id of the list is gone

Prints the ids that are gone (each must have been renamed or merged on purpose, which this script
does not accept: it fails), the ids that are new, and how many tests each tier selects.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEFORE = REPO / "tests" / "collected_before_tiers.txt"


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
    print(f"gone from the full tier: {len(gone)}")
    for test_id in gone:
        print(f"  - {test_id}")
    print(f"new in the full tier: {len(new)}")
    for test_id in new:
        print(f"  + {test_id}")
    return 1 if gone else 0


if __name__ == "__main__":
    sys.exit(main())
