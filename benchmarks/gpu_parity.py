"""Loss parity of two recorded runs of the same job on two devices (benchmarks/gpu_check.sh).

    python benchmarks/gpu_parity.py RUN_DIR_A RUN_DIR_B --labels cuda,cpu --out parity.json

Reads each run directory's summary.json (per-step losses, warm-up steps included) and checks the
issue's tolerances: step 0 within 1e-5 and step 10 within 1e-3, both relative to side B. The two
runs must be the same job apart from the device: same model, data, seed, precision and initial
weights (their init checksums must match, else the comparison means nothing and exits 1).
Exit status: 0 within tolerance, 1 outside it or not comparable, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TOLERANCES = {0: 1e-5, 10: 1e-3}  # step -> largest |a - b| / |b| accepted


def _summary(run_dir: Path) -> dict:
    path = run_dir / "summary.json"
    if not path.is_file():
        raise SystemExit(f"gpu_parity: no summary.json in {run_dir} (did the run finish?)")
    return json.loads(path.read_text())


def compare(a: dict, b: dict) -> dict:
    """Per-step relative differences and the verdict against TOLERANCES."""
    steps = min(len(a["losses"]), len(b["losses"]))
    rel = [abs(x - y) / abs(y) for x, y in zip(a["losses"][:steps], b["losses"][:steps])]
    checks = {
        str(s): {
            "tolerance": tol,
            "relative_difference": rel[s] if s < steps else None,
            "ok": s < steps and rel[s] <= tol,
        }
        for s, tol in TOLERANCES.items()
    }
    same_start = a.get("initial_checksum") == b.get("initial_checksum")
    return {
        "steps_compared": steps,
        "relative_difference_per_step": rel,
        "checks": checks,
        "same_initial_checksum": same_start,
        "ok": same_start and all(c["ok"] for c in checks.values()),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    p.add_argument("--labels", default="a,b", help="device labels of the two runs, e.g. cuda,cpu")
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    args = p.parse_args(argv)
    labels = args.labels.split(",")
    if len(labels) != 2:
        p.error("--labels takes two comma-separated names")
    a, b = _summary(args.run_a), _summary(args.run_b)
    result = {"labels": labels, "devices": [a.get("device_name"), b.get("device_name")], **compare(a, b)}
    if labels[0] == labels[1]:
        result["note"] = f"both runs on {labels[0]}: a rehearsal of the check, not a cross-device parity"
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    for step, check in result["checks"].items():
        print(
            f"step {step}: relative difference {check['relative_difference']!r} "
            f"(tolerance {check['tolerance']:g}) {'ok' if check['ok'] else 'OUTSIDE'}"
        )
    print(
        f"same initial checksum: {result['same_initial_checksum']}; {labels[0]} vs {labels[1]}: "
        f"{'PASS' if result['ok'] else 'FAIL'}"
    )
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
