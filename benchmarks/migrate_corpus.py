"""Corpus check of `bench migrate` on the real code of training packages (issue #13).

    python benchmarks/migrate_corpus.py [--cache DIR] [--jobs N] [--offline] [--compare-whole]
                                        [--markdown] [PACKAGE[==VERSION] ...]

Default packages: deepspeed, megatron-core, accelerate, trl, litgpt, torchtitan. Each package's
code comes from, in this order: its source distribution from the package index
(``pip download --no-deps --no-binary :all:``; repository-like: tests, examples, scripts,
kernels), else its wheel (``--only-binary :all:``), else the copy installed in this environment
(``--offline`` uses only that). Where the package is installed, that version is the one
downloaded. Archives are unpacked under ``--cache`` (default ~/.cache/parabench-corpus, outside
the repository); nothing from them is imported or executed (pip only reads the source
distribution's build metadata).

Per package it runs `bench migrate` (``--to npu``, static) over the tree into a scratch output tree
and prints: files, files/s (wall clock, and by CPU time of this process and its workers as in
benchmarks/migrate_speed.py), crashes (an exception out of the engine, or a file reported as an
internal error or a failed rule), changed .py outputs that do not compile (whose input does),
files a second pass over the output changes again (idempotence), guard-safety violations
(``parabench.migrate.guardcheck``: a branch unreachable without CUDA before that is reachable on
an NPU after and still holds CUDA-only code) and findings by rule. ``--compare-whole`` also
migrates every .py file with the whole-file parse and counts outputs that differ from the
partial parse's (text, findings, skip reason): there must be none.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from migrate_speed import cpu_seconds  # user+sys of this process and its joined workers

# about 4,000 files of training code (issue 13's corpus size): docs/migrate.md#corpus-check
DEFAULT_PACKAGES = (
    "deepspeed", "megatron-core", "accelerate", "trl", "litgpt", "torchtitan", "torchtune", "colossalai",
)  # fmt: skip


@dataclasses.dataclass
class Source:
    name: str
    version: str
    origin: str  # sdist | wheel | installed
    roots: list[Path]


@dataclasses.dataclass
class Row:
    source: Source
    files: int = 0
    py: int = 0
    changed: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    crashes: list[str] = dataclasses.field(default_factory=list)
    not_compiling: list[str] = dataclasses.field(default_factory=list)
    second_pass: list[str] = dataclasses.field(default_factory=list)
    guard: list[str] = dataclasses.field(default_factory=list)
    whole_diff: list[str] | None = None
    by_rule: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def _installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pip_download(spec: str, dest: Path, binary: bool) -> Path | None:
    """One archive of ``spec`` from the package index into ``dest`` (None when pip cannot)."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.iterdir())
    kind = ["--only-binary", ":all:"] if binary else ["--no-binary", ":all:", "--no-build-isolation"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *kind, spec, "-d", str(dest)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    new = sorted(set(dest.iterdir()) - before)
    if done.returncode != 0 or not new:
        return None
    return new[0]


def _cached_archive(name: str, version: str | None, dest: Path, binary: bool) -> Path | None:
    stem = name.replace("-", "_").lower()
    for p in sorted(dest.glob("*")) if dest.is_dir() else ():
        low = p.name.lower().replace("-", "_")
        is_wheel = low.endswith(".whl")
        if low.startswith(stem + "_" + (version or "")) and is_wheel == binary:
            return p
    return None


def _unpack(archive: Path, into: Path) -> list[Path]:
    """The unpacked source tree (an sdist's top folder; a wheel's packages, not its metadata)."""
    target = into / archive.name.removesuffix(".tar.gz").removesuffix(".zip").removesuffix(".whl")
    if not target.is_dir():
        tmp = Path(tempfile.mkdtemp(dir=into))
        if archive.name.endswith(".whl") or archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(tmp)
        else:
            with tarfile.open(archive) as tf:
                tf.extractall(tmp, filter="data")
        os.replace(tmp, target)
    if archive.name.endswith(".whl"):
        return sorted(p for p in target.iterdir() if p.is_dir() and not p.name.endswith((".dist-info", ".data")))
    kids = [p for p in target.iterdir() if p.is_dir()]
    return [kids[0]] if len(kids) == 1 else [target]


def _installed_roots(name: str) -> list[Path]:
    dist = importlib.metadata.distribution(name)
    tops = sorted({f.parts[0] for f in dist.files or () if f.suffix == ".py" and len(f.parts) > 1})
    base = Path(str(dist.locate_file("")))
    return [base / t for t in tops if (base / t).is_dir() and not t.endswith((".dist-info", ".data"))]


def fetch(spec: str, cache: Path, offline: bool) -> Source | None:
    """The code of one package (see the module docstring for the order of sources)."""
    name, _, version = spec.partition("==")
    installed = _installed_version(name)
    version = version or installed or ""
    pinned = f"{name}=={version}" if version else name
    if not offline:
        for binary, origin in ((False, "sdist"), (True, "wheel")):
            folder = cache / ("wheels" if binary else "sdist")
            archive = _cached_archive(name, version, folder, binary) or _pip_download(pinned, folder, binary)
            if archive is not None:
                got = archive.name[len(name) + 1 :].split("-")[0].removesuffix(".tar.gz")
                return Source(name, got, origin, _unpack(archive, cache / "src"))
    if installed is not None:
        return Source(name, installed, "installed", _installed_roots(name))
    return None


def _compiles(text: str, path: str) -> bool:
    try:
        compile(text, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return True


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _first_pass(row: Row, out: Path, jobs: int):
    """Migrate the package once (timed); a crash of the whole run is retried file by file."""
    from parabench.migrate.core import Options
    from parabench.migrate.engine import process, run

    roots = row.source.roots
    c0, t0 = cpu_seconds(), time.perf_counter()
    try:
        result = run(roots, Options(), out, jobs=jobs, progress=False)
        files = result.files
    except Exception as exc:  # counted, named and failing the exit code: the check must not stop at one
        row.crashes.append(f"engine run: {type(exc).__name__}: {exc}")
        files = _file_by_file(row, roots, out, process)
    row.wall, row.cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return files


def _file_by_file(row: Row, roots: list[Path], out: Path, process) -> list:
    from parabench.migrate.core import Options
    from parabench.migrate.engine import Task, classify, discover

    files = []
    for _root, path, rel, how in discover(roots):
        if how != "file":
            continue
        try:
            files.append(process(Task(str(path), rel, classify(path), str(out / rel), False), Options()))
        except Exception as exc:  # counted and named, see _first_pass
            row.crashes.append(f"{rel}: {type(exc).__name__}: {exc}")
    return files


def _source_of(roots: list[Path], rel: str) -> Path:
    if len(roots) == 1:
        return roots[0] / rel
    head, _, rest = rel.partition("/")
    return next(r for r in roots if r.name == head) / rest


def check(source: Source, jobs: int, compare_whole: bool) -> Row:
    from parabench.migrate.core import Options
    from parabench.migrate.engine import run
    from parabench.migrate.guardcheck import violations

    row = Row(source)
    scratch = Path(tempfile.mkdtemp(prefix="migrate_corpus_"))
    try:
        out = scratch / "out"
        files = _first_pass(row, out, jobs)
        row.files = len(files)
        for r in files:
            row.by_rule.update(f.rule for f in r.findings)
            if r.kind == "python":
                row.py += 1
            if r.reason.startswith("internal") or any(" failed here (" in f.message for f in r.findings):
                row.crashes.append(f"{r.path}: {r.reason or 'a rule failed'}")
            if r.status != "changed" or r.kind != "python":
                continue
            row.changed += 1
            before, after = _read(_source_of(source.roots, r.path)), _read(out / r.path)
            if before is None or after is None:
                continue
            if _compiles(before, r.path) and not _compiles(after, r.path):
                row.not_compiling.append(r.path)
            row.guard += [f"{r.path}: {v}" for v in violations(before, after)]
        again = run([out], Options(), None, jobs=jobs, progress=False)
        row.second_pass = [r.path for r in again.files if r.status == "changed"]
        if compare_whole:
            row.whole_diff = _partial_vs_whole(source.roots)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return row


def _partial_vs_whole(roots: list[Path]) -> list[str]:
    """.py files whose partial-parse result differs from the whole-file parse's."""
    from parabench.migrate.apply_rules import migrate_python
    from parabench.migrate.core import Options
    from parabench.migrate.engine import classify, discover

    differ = []
    for _root, path, rel, how in discover(roots):
        if how != "file" or classify(path) != "python":
            continue
        text = _read(path)
        if text is None:
            continue
        try:
            same = migrate_python(text, rel, Options()) == migrate_python(text, rel, Options(), partial=False)
        except RecursionError:
            continue
        if not same:
            differ.append(rel)
    return differ


def _rules(counter: collections.Counter, top: int = 8) -> str:
    items = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = ", ".join(f"{k} {v}" for k, v in items[:top])
    return shown + (f", +{len(items) - top} more" if len(items) > top else "")


def report(rows: list[Row], jobs: int, markdown: bool) -> None:
    cores = min(jobs, os.cpu_count() or 1)
    head = ["package", "source", "files", ".py", "changed", "files/s wall", "files/s CPU", "crashes", "not compiling"]
    head += ["2nd-pass changes", "guard violations", "partial != whole", "findings by rule"]
    lines = []
    for r in [*rows, None]:
        if r is None:  # the total over the corpus
            n, wall, cpu = sum(x.files for x in rows), sum(x.wall for x in rows), sum(x.cpu for x in rows)
            cells = ["**total**", "", f"{n:,}", f"{sum(x.py for x in rows):,}", f"{sum(x.changed for x in rows):,}"]
            rate = [f"**{n / wall:.0f}**" if wall else "-", f"**{n / (cpu / cores):.0f}**" if cpu else "-"]
            counts = [
                sum(len(getattr(x, k)) for x in rows) for k in ("crashes", "not_compiling", "second_pass", "guard")
            ]
            compared = [x.whole_diff for x in rows if x.whole_diff is not None]
            whole = sum(map(len, compared)) if compared else None
            by_rule = sum((x.by_rule for x in rows), collections.Counter())
        else:
            s = r.source
            cells = [s.name, f"{s.origin} {s.version}", f"{r.files:,}", f"{r.py:,}", f"{r.changed:,}"]
            rate = [f"{r.files / r.wall:.0f}", f"{r.files / (r.cpu / cores):.0f}"]
            counts = [len(r.crashes), len(r.not_compiling), len(r.second_pass), len(r.guard)]
            whole = len(r.whole_diff) if r.whole_diff is not None else None
            by_rule = r.by_rule
        cells += rate + [str(c) for c in counts] + ["-" if whole is None else str(whole), _rules(by_rule)]
        lines.append(cells)
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for cells in lines:
            print("| " + " | ".join(cells) + " |")
    else:
        for cells in lines:
            print("  ".join(f"{h}={c}" for h, c in zip(head, cells)))
    for r in rows:
        for label, items in (
            ("crash", r.crashes),
            ("does not compile", r.not_compiling),
            ("changed by a 2nd pass", r.second_pass),
            ("guard violation", r.guard),
            ("partial != whole", r.whole_diff or []),
        ):
            for item in items:
                print(f"  {r.source.name}: {label}: {item}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packages", nargs="*", default=list(DEFAULT_PACKAGES), help="PACKAGE[==VERSION] ...")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "parabench-corpus")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="worker processes (default: all cores)")
    ap.add_argument("--offline", action="store_true", help="use only the packages installed here")
    ap.add_argument("--compare-whole", action="store_true", help="also compare partial and whole-file parses")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = ap.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    (args.cache / "src").mkdir(exist_ok=True)
    rows = []
    for spec in args.packages:
        source = fetch(spec, args.cache, args.offline)
        if source is None:
            print(f"{spec}: neither downloadable nor installed: left out", file=sys.stderr)
            continue
        rows.append(check(source, args.jobs, args.compare_whole))
    load = os.getloadavg()
    print(
        f"{date()} on {platform.machine()} with {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"libcst {_installed_version('libcst')}, jobs {args.jobs}; load average at the end {load[0]:.1f}/{load[1]:.1f}"
    )
    report(rows, args.jobs, args.markdown)
    bad = any(r.crashes or r.not_compiling or r.second_pass or r.guard or r.whole_diff for r in rows)
    return 1 if bad else 0


def date() -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime())


if __name__ == "__main__":
    sys.exit(main())
