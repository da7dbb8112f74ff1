"""``bench env``: every backend, available or not and exactly why; devices; the versions that matter."""

from __future__ import annotations

import json
import sys
from typing import Any

from parabench.adapters import registry
from parabench.adapters.base import Adapter
from parabench.adapters.registry import describe
from parabench.devices import AUTOLOAD_TEXT, DEVICES, cpu_info, package_version, versions

# The newest release of each distribution whose range has no upper bound that parabench has run on
# (benchmarks/compat_matrix.sh keep-torch: `pip install .` kept it, then 1- and 2-rank runs). A newer one
# is admitted and `bench env` warns that it is untested; a bound goes into pyproject.toml only where a
# release is known to break, with the reason.
NEWEST_TESTED = {"torch": "2.15.0"}


def newer_than_tested(found: dict[str, str | None]) -> list[str]:
    """One warning per installed distribution newer than the newest release parabench was tested on."""
    from packaging.version import InvalidVersion, Version

    out = []
    for dist, tested in NEWEST_TESTED.items():
        have = found.get(dist)
        try:
            newer = have is not None and Version(have).release > Version(tested).release
        except InvalidVersion:
            newer = False
        if newer:
            out.append(f"{dist} {have} is newer than the newest tested ({tested}): allowed, but untested")
    return out


def supported_ranges() -> dict[str, str]:
    """Distribution -> version range parabench declares (dependencies and every extra), plus "python"."""
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name

    # An installed copy has a RECORD; a parabench.egg-info that a source build left in the current
    # directory (first on sys.path under `python -m`) does not, and may be stale.
    dists = list(importlib.metadata.distributions(name="parabench"))
    dist = next((d for d in dists if d.read_text("RECORD") is not None), dists[0])

    def lower_first(spec: SpecifierSet) -> str:
        return ",".join(sorted(map(str, spec), key=lambda s: s[0] != ">"))

    out = {"python": lower_first(SpecifierSet(dist.metadata["Requires-Python"] or ""))}
    for line in dist.requires or []:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name != "parabench":  # the `all` extra names parabench's own extras
            out[name] = lower_first(req.specifier)
    return out


def range_status(found: dict[str, str | None], ranges: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per distribution in ``ranges``: installed version, range, and whether it lies inside."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    out = {}
    for dist, spec in ranges.items():
        have = found.get(dist)
        try:
            inside = None if have is None else SpecifierSet(spec).contains(Version(have), prereleases=True)
        except InvalidVersion:
            inside = False
        out[dist] = {"installed": have, "range": spec, "inside": inside}
    return out


def registered_adapters() -> dict[str, type[Adapter]]:
    """Every registered backend's adapter class (declarative: imports no framework)."""
    return registry.adapters()


def backends_outside(status: dict[str, dict[str, Any]], adapters: dict[str, type[Adapter]]) -> dict[str, list[str]]:
    """Backend -> '<dist> <version> (supported: <range>)' for each installed distribution it runs on
    (``Adapter.distributions``) that lies outside parabench's supported range."""
    out = {}
    for backend, adapter in adapters.items():
        bad = [
            f"{d} {status[d]['installed']} (supported: {status[d]['range']})"
            for d in adapter.distributions
            if d in status and status[d]["inside"] is False
        ]
        if bad:
            out[backend] = bad
    return out


def known_good_sets(found: dict[str, str | None], adapters: dict[str, type[Adapter]]) -> list[dict[str, Any]]:
    """The version sets the backends declare known to work together (``Adapter.known_good``, e.g.
    Ascend's MindSpeed pins), each with whether this environment matches."""
    sets = []
    for good in (g for adapter in adapters.values() for g in adapter.known_good):
        pins = {k: v for k, v in good.items() if k != "source"}
        differs = {k: found.get(k) for k, v in pins.items() if not (found.get(k) or "").split("+")[0].startswith(v)}
        sets.append({"source": good["source"], "versions": pins, "differs": differs})
    return sets


def report() -> dict[str, Any]:
    devices = {}
    for kind, cls in DEVICES.items():
        p = cls.presence()
        devices[kind] = {"available": p.available, "detail": p.reason, "count": p.count}
    backends = {}
    adapters = registered_adapters()
    for name, desc in describe().items():
        adapter = adapters[name]
        a = adapter.availability()
        usable = sorted(d for d in adapter.capabilities.devices if devices[d]["available"])
        backends[name] = {
            "available": a.available and bool(usable),
            "description": desc,
            "reason": a.reason
            if not a.available
            else (
                f"runs on {', '.join(usable)}"
                if usable
                else f"no supported device present (needs {', '.join(sorted(adapter.capabilities.devices))})"
            ),
            "devices": sorted(adapter.capabilities.devices),
            "precisions": sorted(adapter.capabilities.precisions),
            "launcher": adapter.capabilities.launcher,
            "versions": dict(a.versions),
        }
    found = versions()  # and every distribution a backend declares it runs on (a plugin's own)
    found.update({d: package_version(d) for a in adapters.values() for d in a.distributions if d not in found})
    status = range_status(found, supported_ranges())
    return {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "cpu": cpu_info(),
        "devices": devices,
        "backends": backends,
        "versions": found,
        "supported": status,
        "outside": backends_outside(status, adapters),
        "untested": newer_than_tested(found),
        "known_good": known_good_sets(found, adapters),
        "notes": [
            f"{AUTOLOAD_TEXT} is set by parabench: with torch_npu installed but no CANN, "
            "`import torch` fails otherwise."
        ]
        if package_version("torch-npu")
        else [],
    }


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="bench env", description="List backends and devices, available or not, and why."
    )
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
        print(
            f"  {'':<10} {'':<12} devices {', '.join(b['devices'])}; precisions {', '.join(b['precisions'])}; launcher {b['launcher']}"
        )
        for key, value in b["versions"].items():  # what the adapter's availability probe found
            print(f"  {'':<10} {'':<12} {key} {value}")
    print_versions(rep)
    for note in rep["notes"]:
        print(f"\nnote: {note}")
    return 0


def print_versions(rep: dict[str, Any]) -> None:
    """Installed versions against parabench's supported ranges, the backends outside them, and the known-good sets."""
    print("\nversions (supported range from parabench's package metadata)")
    marks = {True: "ok", False: "OUTSIDE", None: ""}
    for k, v in rep["versions"].items():
        s = rep["supported"].get(k)
        print(f"  {k:<14} {v or '-':<16} {s['range'] if s else '':<18} {marks[s['inside']] if s else ''}".rstrip())
    for warning in rep["untested"]:
        print(f"\nwarning: {warning}")
    if rep["outside"]:
        print("\noutside the supported ranges")
        for backend, why in rep["outside"].items():
            print(f"  {backend:<10} {'; '.join(why)}")
    else:
        print("\nevery installed backend distribution is inside the supported ranges")
    print("\nknown-good sets")
    for good in rep["known_good"]:
        pins = ", ".join(f"{k} {v}" for k, v in good["versions"].items())
        verdict = (
            "matches"
            if not good["differs"]
            else "differs: " + ", ".join(f"{k} {v or 'missing'}" for k, v in good["differs"].items())
        )
        print(f"  {pins}\n    ({good['source']}) - this environment {verdict}")
