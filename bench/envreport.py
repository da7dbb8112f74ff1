"""``bench env``: every backend, available or not and exactly why; devices; the versions that matter."""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any

from parabench.devices import AUTOLOAD_TEXT, cann_version, package_version

# distribution names whose versions are recorded with every run
VERSIONED = ["torch", "deepspeed", "megatron-core", "mindspore", "torch-npu", "mindspeed", "mlflow", "hydra-core", "numpy"]



def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {d: package_version(d) for d in VERSIONED}
    out["python"] = platform.python_version()
    out["cann"] = cann_version()
    return out


def cpu_info() -> dict[str, Any]:
    from parabench.devices import cpu_model

    return {"model": cpu_model(), "cores": os.cpu_count(), "machine": platform.machine()}


def report() -> dict[str, Any]:
    from parabench.adapters.registry import describe, get_adapter
    from parabench.devices import DEVICES

    devices = {}
    for kind, cls in DEVICES.items():
        p = cls.presence()
        devices[kind] = {"available": p.available, "detail": p.reason, "count": p.count}
    backends = {}
    for name, desc in describe().items():
        adapter = get_adapter(name)
        a = adapter.availability()
        usable = sorted(d for d in adapter.capabilities.devices if devices[d]["available"])
        backends[name] = {
            "available": a.available and bool(usable), "description": desc,
            "reason": a.reason if not a.available else (f"runs on {', '.join(usable)}" if usable else
                                                         f"no supported device present (needs {', '.join(sorted(adapter.capabilities.devices))})"),
            "devices": sorted(adapter.capabilities.devices), "precisions": sorted(adapter.capabilities.precisions),
            "launcher": adapter.capabilities.launcher, "versions": dict(a.versions),
        }
    return {"python": sys.version.split()[0], "executable": sys.executable, "cpu": cpu_info(), "devices": devices,
            "backends": backends, "versions": versions(),
            "notes": [f"{AUTOLOAD_TEXT} is set by parabench: with torch_npu installed but no CANN, "
                      "`import torch` fails otherwise."] if package_version("torch-npu") else []}


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="bench env", description="List backends and devices, available or not, and why.")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    rep = report()
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    print(f"python {rep['python']} ({rep['executable']})")
    print(f"cpu    {rep['cpu']['model']}, {rep['cpu']['cores']} cores")
    print("\ndevices")
    for kind, d in rep["devices"].items():
        print(f"  {kind:<5} {'yes' if d['available'] else 'no ':<4} {d['detail']}")
    print("\nbackends")
    for name, b in rep["backends"].items():
        mark = "available" if b["available"] else "unavailable"
        print(f"  {name:<10} {mark:<12} {b['reason']}")
        print(f"  {'':<10} {'':<12} devices {', '.join(b['devices'])}; precisions {', '.join(b['precisions'])}; launcher {b['launcher']}")
        for key, value in b["versions"].items():  # what the adapter's availability probe found
            print(f"  {'':<10} {'':<12} {key} {value}")
    print("\nversions")
    for k, v in rep["versions"].items():
        print(f"  {k:<14} {v or '-'}")
    for note in rep["notes"]:
        print(f"\nnote: {note}")
    return 0
