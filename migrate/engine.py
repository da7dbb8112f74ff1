"""The migration engine: find files, classify them, migrate each (in parallel), write the result.

Input files are only read. Output goes to a new tree (default), or back into SRC with
``in_place`` (the CLI checks backups / a clean git tree first), or nowhere (diff/check).
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import os
import re
import shutil
import stat
import sys
from pathlib import Path

from parabench.migrate.core import FileResult, Finding, FixedValues, Options
from parabench.migrate.encoding import decode, encode
from parabench.migrate.entries import find_entries
from parabench.migrate.notebook import migrate_notebook
from parabench.migrate.pyfile import may_hold_cuda, migrate_python
from parabench.migrate.rules._base import TextDoc, all_rules, rules_for
from parabench.migrate.rules._text import TextParseError
from parabench.migrate.rules._values import EXTENDER, collect_fixed

SKIP_DIRS = frozenset(
    {".git", ".hg", ".svn", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".tox", ".venv"}
)
SHELL_EXT = frozenset({".sh", ".bash", ".zsh", ".slurm", ".sbatch"})
YAML_EXT = frozenset({".yaml", ".yml"})
CUDA_EXT = frozenset({".cu", ".cuh"})
SYMLINK_SKIPS = {
    "symlink-out": "symlink points outside the source tree: not followed",
    "symlink-loop": "symlink loop (it points to itself, directly or through other links): not followed",
}
FIXED_GATE = re.compile(rb"[\"'](?:cuda|nccl|\w+:\w+,)")  # a quoted value the migration rewrites
SERIAL_BELOW = 48  # fewer files than this: no process pool (start-up costs more than it saves)


@dataclasses.dataclass(frozen=True)
class Task:
    src: str  # absolute source path
    rel: str  # report path (posix)
    kind: str
    dest: str | None  # absolute output path, None = write nothing
    diff: bool
    entry: str = ""  # --mode runtime: why this file is an entry point (migrate.entries), "" = not known to be


@dataclasses.dataclass
class RunResult:
    options: Options
    roots: list[str]
    out: str | None
    files: list[FileResult]
    in_place: bool = False  # the sources were rewritten: their lines are the output's

    @property
    def findings(self) -> list[Finding]:
        return [f for r in self.files for f in r.findings]


def classify(path: Path) -> str:
    name = path.name
    suffix = path.suffix.lower()
    if suffix == ".py":
        return "python"
    if suffix in SHELL_EXT:
        return "shell"
    if suffix == ".json":
        return "json"
    if suffix == ".ipynb":
        return "notebook"
    if suffix in YAML_EXT:
        return "yaml"
    if suffix == ".txt" and ("requirements" in name.lower() or path.parent.name == "requirements"):
        return "requirements"
    if suffix in CUDA_EXT:
        return "cuda"
    if suffix == "":
        try:
            with open(path, "rb") as fh:
                head = fh.readline(200)
        except OSError:
            return "file"
        if head.startswith(b"#!"):
            if b"python" in head:
                return "python"
            if any(s in head for s in (b"bash", b"/sh", b" sh", b"zsh")):
                return "shell"
    return "file"


def discover(roots: list[Path]) -> list[tuple[Path, Path, str, str]]:
    """-> [(root, path, rel, how)]; how: file | symlink-in | symlink-out | symlink-loop. Deterministic order."""
    multi = len(roots) > 1
    found = []
    for root in roots:
        prefix = root.name + "/" if multi else ""
        if root.is_file():
            found.append((root.parent, root, root.name, "file"))
            continue
        real_root = root.resolve()
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            here = Path(dirpath)
            entries = [(here / d) for d in dirnames if (here / d).is_symlink()]
            entries += [(here / f) for f in sorted(filenames)]
            for p in entries:
                rel = prefix + p.relative_to(root).as_posix()
                if p.is_symlink():
                    try:
                        target = p.resolve(strict=False)
                    except RuntimeError:  # "Symlink loop" (Python < 3.13)
                        found.append((root, p, rel, "symlink-loop"))
                        continue
                    except OSError as exc:  # ELOOP from Python 3.13 on
                        found.append((root, p, rel, "symlink-loop" if exc.errno == errno.ELOOP else "symlink-out"))
                        continue
                    found.append((root, p, rel, "symlink-in" if target.is_relative_to(real_root) else "symlink-out"))
                else:
                    found.append((root, p, rel, "file"))
    found.sort(key=lambda t: t[2])
    return found


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def migrate_text(kind: str, text: str, rel: str, options: Options) -> tuple[str, list[Finding], str]:
    """Apply the enabled rules of ``kind`` to ``text`` -> (new_text, findings, skip_reason)."""
    if kind == "python":
        new, findings, _full, reason = migrate_python(text, rel, options)
        return new, findings, reason
    if kind == "notebook":  # findings name their cell (file.ipynb#cell-N)
        return migrate_notebook(text, rel, options)
    rules = rules_for(kind, options)
    if not rules:
        return text, [], ""
    doc = TextDoc(text, rel, options)
    for rule in rules:
        try:
            rule().apply(doc)
        except TextParseError as exc:
            return text, [], f"unparseable: {exc}"
    findings = sorted(doc.findings, key=lambda f: (f.line, f.rule, f.end_line, f.message))
    return doc.result(), findings, ""


def process(task: Task, options: Options) -> FileResult:
    """Migrate one file; write its output (if any). Runs in worker processes."""
    if task.entry:
        options = dataclasses.replace(options, entry=task.entry)
    res = FileResult(task.rel, task.kind, "copied")
    if task.kind == "file":
        _copy(task)
        return res
    data = _read(task.src)
    source, reason = decode(data, task.kind)
    if source is None:
        return _skip(task, res, reason, data)
    text = source.text
    try:
        new, findings, reason = migrate_text(task.kind, text, task.rel, options)
    except RecursionError:
        new, findings, reason = text, [], "internal: nesting too deep for the parser"
    if reason:
        return _skip(task, res, reason, data)
    res.findings = [f if f.file else f.with_file(task.rel) for f in findings]
    res.full_parse = task.kind != "python" or bool(findings) or new != text
    if new == text:
        res.status = "unchanged"
        _copy(task)
        return res
    encoded = encode(new, source)
    if encoded is None:
        return _skip(task, res, f"the migrated text cannot be written as {source.codec}: left unchanged", data)
    res.status = "changed"
    res.line_shifts = line_shifts(text, new)
    if task.diff:
        res.diff = "".join(
            difflib.unified_diff(
                text.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{task.rel}", f"b/{task.rel}"
            )
        )
    if task.dest is not None:
        _write(task, encoded)
    return res


def _skip(task: Task, res: FileResult, reason: str, data: bytes) -> FileResult:
    """A file left as it is: copied, and marked when its bytes name a CUDA construct (``--check``)."""
    res.status, res.reason = "skipped", reason
    res.may_hold_cuda = may_hold_cuda(data.decode("latin-1"))
    _copy(task)
    return res


def line_shifts(old: str, new: str) -> tuple[tuple[int, int], ...]:
    """Where the lines of ``old`` lie in ``new`` (see FileResult.line_shifts). Rewrites keep line
    counts unless a rule inserts or removes lines, so the alignment runs only when counts differ."""
    a, b = old.split("\n"), new.split("\n")
    if len(a) == len(b):
        return ()
    out: list[tuple[int, int]] = []
    for _tag, i1, i2, j1, _j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if i2 > i1 and (out[-1][1] if out else 0) != j1 - i1:
            out.append((i1 + 1, j1 - i1))
    return tuple(out)


def _copy(task: Task) -> None:
    if task.dest is None or os.path.abspath(task.dest) == os.path.abspath(task.src):
        return
    os.makedirs(os.path.dirname(task.dest), exist_ok=True)
    shutil.copy2(task.src, task.dest)


def _write(task: Task, data: bytes) -> None:
    os.makedirs(os.path.dirname(task.dest), exist_ok=True)
    mode = stat.S_IMODE(os.stat(task.src).st_mode)
    tmp = task.dest + ".bench-migrate.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, task.dest)


def fixed_values(tasks: list[Task], options: Options) -> tuple[FixedValues, ...]:
    """Every accepted-value set of the run's Python files that the migration will not extend."""
    extend = any(r.code == EXTENDER for r in rules_for("python", options))
    found: set[FixedValues] = set()
    for task in tasks:
        if task.kind != "python":
            continue
        data = _read(task.src)
        if not FIXED_GATE.search(data) or not (b"Enum" in data or b"choices" in data or not extend):
            continue
        source, _reason = decode(data, task.kind)
        if source is not None:
            found.update(collect_fixed(source.text, task.rel, extend))
    return tuple(sorted(found, key=lambda f: (f.where, f.why, sorted(f.names))))


def _process_indexed(args: tuple[int, Task, Options]) -> tuple[int, FileResult]:
    i, task, options = args
    return i, process(task, options)


def run(
    roots: list[Path],
    options: Options,
    out: Path | None,
    *,
    in_place: bool = False,
    backup: str | None = None,
    diff: bool = False,
    jobs: int | None = None,
    progress: bool | None = None,
) -> RunResult:
    """Migrate ``roots`` into ``out`` (or in place, or nowhere when out is None and not in_place)."""
    entries = discover(roots)
    starts = _entry_points(entries) if options.mode == "runtime" else {}
    tasks: list[Task] = []
    results: list[FileResult] = []
    for _root, path, rel, how in entries:
        if how in SYMLINK_SKIPS:
            results.append(FileResult(rel, "symlink", "skipped", SYMLINK_SKIPS[how]))
            continue
        if how == "symlink-in":
            results.append(FileResult(rel, "symlink", "copied", "symlink inside the tree: recreated"))
            if out is not None and not in_place:
                dest = out / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                if not dest.is_symlink():
                    os.symlink(os.readlink(path), dest)
            continue
        if in_place:
            dest: str | None = str(path)
        elif out is not None:
            dest = str(out / rel)
        else:
            dest = None
        kind = classify(path)
        if in_place and kind == "file":
            continue
        tasks.append(Task(str(path), rel, kind, dest, diff, starts.get(rel, "")))
    # the parsers' fixed value sets of the whole run, before any file is migrated (rules/_values.py)
    options = dataclasses.replace(options, fixed_values=fixed_values(tasks, options))
    if in_place and backup:
        # back up exactly the files that will change, before anything is written
        probe = [dataclasses.replace(t, dest=None, diff=False) for t in tasks]
        for t, r in zip(probe, _map(probe, options, jobs, False)):
            if r.status == "changed":
                shutil.copy2(t.src, t.src + backup)
    results.extend(_map(tasks, options, jobs, progress))
    results.sort(key=lambda r: r.path)
    return RunResult(options, [str(r) for r in roots], str(out) if out else None, results, in_place)


def _entry_points(entries: list[tuple[Path, Path, str, str]]) -> dict[str, str]:
    """Python files that the tree's launch scripts and package metadata start (migrate.entries)."""
    texts, python = {}, []
    for _root, path, rel, how in entries:
        if how != "file":
            continue
        kind = classify(path)
        if kind == "python":
            python.append(rel)
        if kind == "shell" or path.name in ("pyproject.toml", "setup.cfg", "setup.py", "Makefile"):
            texts[rel] = path.read_text(encoding="utf-8", errors="replace")
    return find_entries(texts, python)


def _map(tasks: list[Task], options: Options, jobs: int | None, progress: bool | None) -> list[FileResult]:
    jobs = jobs or os.cpu_count() or 1
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(tasks), unit="file", desc="bench migrate", file=sys.stderr, leave=False)
        except ImportError:  # pragma: no cover
            bar = None
    out: list[FileResult] = []
    if jobs <= 1 or len(tasks) < SERIAL_BELOW:
        for t in tasks:
            out.append(process(t, options))
            if bar:
                bar.update(1)
    else:
        import multiprocessing as mp

        # fork: workers inherit the imported rules; nothing from the input is ever imported
        ctx = mp.get_context("fork") if sys.platform.startswith("linux") else mp.get_context()
        _preload(options)
        # largest files first, in small chunks: a big file handed out last would leave the other
        # workers idle at the end (Megatron-Core's largest .py is 15x its median); unordered so one
        # slow file does not hold back the bar
        chunk = max(1, min(4, len(tasks) // (jobs * 32) or 1))
        slots: list[FileResult | None] = [None] * len(tasks)
        with ctx.Pool(processes=jobs) as pool:
            for i, r in pool.imap_unordered(
                _process_indexed, [(i, tasks[i], options) for i in _largest_first(tasks)], chunksize=chunk
            ):
                slots[i] = r
                if bar:
                    bar.update(1)
        out = slots  # type: ignore[assignment]
    if bar:
        bar.close()
    return out


def _largest_first(tasks: list[Task]) -> list[int]:
    """Task indices by input size, largest first (the order results come back in does not matter)."""

    def size(i: int) -> int:
        try:
            return os.stat(tasks[i].src).st_size
        except OSError:
            return 0

    return sorted(range(len(tasks)), key=lambda i: (-size(i), i))


def _preload(options: Options) -> None:
    """Import libcst and the rules once in the parent so forked workers start warm."""
    import libcst

    from parabench.migrate.rules._walk import walk

    all_rules()
    walk(libcst.parse_module("import a\nx = f'{a!r:>{w}}'\n"))  # field orders of the common node types
