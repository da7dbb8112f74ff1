"""The migration engine: find files, classify them, migrate each (in parallel), write the result.

Input files are only read. Output goes to a new tree (default), or back into SRC with
``in_place`` (the CLI checks backups / a clean git tree first), or nowhere (diff/check).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import difflib
import errno
import gc
import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from parabench.migrate.apply_rules import migrate_python
from parabench.migrate.core import FileResult, Finding, FixedValues, Options
from parabench.migrate.encoding import decode, encode
from parabench.migrate.entries import find_entries
from parabench.migrate.notebook import migrate_notebook
from parabench.migrate.parse_plan import may_hold_cuda
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
    if _is_ci_config(path):
        return "ci"
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


# CI configuration is not training code: its `cuda` matrix values and CUDA images choose the CI's
# machines, so it is left as it is and reported (issue #29)
CI_DIRS = (".github/workflows", ".circleci", ".buildkite", ".gitlab")
CI_FILES = frozenset({".gitlab-ci.yml", "azure-pipelines.yml", ".travis.yml", "Jenkinsfile", "bitbucket-pipelines.yml"})
CI_REASON = "CI configuration: left as is (it picks the CI's machines, not the training code's device)"


def _is_ci_config(path: Path) -> bool:
    if path.name in CI_FILES:
        return True
    posix = path.parent.as_posix() + "/"
    return any(f"{d}/" in posix or posix.startswith(f"{d}/") for d in CI_DIRS)


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
    with _gc_paused():
        return _process(task, options)


@contextlib.contextmanager
def _gc_paused():
    """No cyclic garbage collection while one file is migrated: a LibCST tree is ~10^5 young
    objects that all live until the file is done, so the collector's generation passes only
    re-scan them (~8% of the run on Megatron-Core). The nodes hold no reference cycles; what little
    cyclic garbage a file leaves is collected after it, when collection is back on
    (docs.python.org/3/library/gc.html: ``gc.disable`` where no cycles are made)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _process(task: Task, options: Options) -> FileResult:
    if task.entry:
        options = dataclasses.replace(options, entry=task.entry)
    res = FileResult(task.rel, task.kind, "copied")
    if task.kind in ("file", "ci"):
        res.reason = CI_REASON if task.kind == "ci" else ""
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
        _copy(task, data)
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
    _copy(task, data)
    return res


def line_shifts(old: str, new: str) -> tuple[tuple[int, int], ...]:
    """Where the lines of ``old`` lie in ``new`` (see FileResult.line_shifts). Rewrites keep line
    counts unless a rule inserts or removes lines, so the alignment runs only when counts differ."""
    a, b = old.split("\n"), new.split("\n")
    if len(a) == len(b):
        return ()
    blocks: list[tuple[int, int, int]] = []
    _matching_lines(a, b, 0, len(a), 0, len(b), blocks)
    out: list[tuple[int, int]] = []
    i = j = 0
    for ai, bj, n in [*blocks, (len(a), len(b), 0)]:
        if ai > i and (out[-1][1] if out else 0) != j - i:  # a[i:ai] replaced by b[j:bj], or deleted
            out.append((i + 1, j - i))
        if n and (out[-1][1] if out else 0) != bj - ai:
            out.append((ai + 1, bj - ai))
        i, j = ai + n, bj + n
    return tuple(out)


def _matching_lines(a: list[str], b: list[str], alo: int, ahi: int, blo: int, bhi: int, out: list) -> None:
    """Append to ``out`` the blocks (i, j, n), a[i:i+n] == b[j:j+n], of a line alignment of
    a[alo:ahi] and b[blo:bhi], in order: common head and tail, then patience diff (lines that occur
    once on each side, in increasing order on both, anchor the rest; Bram Cohen's algorithm, as in
    ``git diff --patience``), difflib's matcher only for what no unique line splits. A migration
    changes few lines of a file; difflib alone over the whole file re-scanned every blank line."""
    start = alo
    while alo < ahi and blo < bhi and a[alo] == b[blo]:
        alo, blo = alo + 1, blo + 1
    if alo > start:
        out.append((start, blo - (alo - start), alo - start))
    n = 0
    while alo < ahi - n and blo < bhi - n and a[ahi - 1 - n] == b[bhi - 1 - n]:
        n += 1
    ahi, bhi = ahi - n, bhi - n
    if alo < ahi and blo < bhi:
        anchors = _unique_anchors(a, b, alo, ahi, blo, bhi)
        if anchors:
            pa, pb = alo, blo
            for ia, ib in anchors:
                _matching_lines(a, b, pa, ia, pb, ib, out)
                out.append((ia, ib, 1))
                pa, pb = ia + 1, ib + 1
            _matching_lines(a, b, pa, ahi, pb, bhi, out)
        else:
            matcher = difflib.SequenceMatcher(None, a[alo:ahi], b[blo:bhi], autojunk=False)
            out.extend((alo + x, blo + y, k) for x, y, k in matcher.get_matching_blocks() if k)
    if n:
        out.append((ahi, bhi, n))


def _unique_anchors(a: list[str], b: list[str], alo: int, ahi: int, blo: int, bhi: int) -> list[tuple[int, int]]:
    """Pairs (i, j) of lines that occur exactly once in a[alo:ahi] and in b[blo:bhi], the longest
    run of them increasing on both sides."""
    count: dict[str, list[int]] = {}
    for i in range(alo, ahi):
        c = count.setdefault(a[i], [0, i, 0, -1])
        c[0] += 1
    for j in range(blo, bhi):
        c = count.get(b[j])
        if c is not None:
            c[2] += 1
            c[3] = j
    pairs = sorted((c[1], c[3]) for c in count.values() if c[0] == 1 and c[2] == 1)
    # longest increasing subsequence of the b positions (patience sorting)
    tails: list[int] = []  # tails[k]: b position ending the best run of length k + 1
    ends: list[int] = []  # index in pairs of that end
    back = [-1] * len(pairs)
    for k, (_i, j) in enumerate(pairs):
        at = bisect.bisect_left(tails, j)
        back[k] = ends[at - 1] if at else -1
        if at == len(tails):
            tails.append(j)
            ends.append(k)
        else:
            tails[at], ends[at] = j, k
    run: list[tuple[int, int]] = []
    k = ends[-1] if ends else -1
    while k >= 0:
        run.append(pairs[k])
        k = back[k]
    run.reverse()
    return run


class UnsafePath(Exception):
    """A path the migration would write through (a link or an existing file it must not replace)."""


def _copy(task: Task, data: bytes | None = None) -> None:
    """The source file's bytes (``data`` when already read) and times to ``task.dest``."""
    if task.dest is None or os.path.abspath(task.dest) == os.path.abspath(task.src):
        return
    if data is None:
        with open(task.src, "rb") as fh:
            data = fh.read()
    _write(task, data)
    shutil.copystat(task.src, task.dest)


def _write(task: Task, data: bytes) -> None:
    """``data`` to ``task.dest``, never through a link: where nothing is at ``dest`` yet (a new
    output tree), the file is created there exclusively (O_CREAT | O_EXCL | O_NOFOLLOW: a link
    planted at ``dest`` makes it fail, not followed); else (in place, or something already there)
    through a temporary file created exclusively in its folder, renamed over the destination (a
    rename replaces a link at ``dest`` itself, never its target)."""
    folder, name = os.path.split(task.dest)
    os.makedirs(folder, exist_ok=True)
    mode = stat.S_IMODE(os.stat(task.src).st_mode)
    try:
        fd = os.open(task.dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        _replace(task.dest, folder, name, data, mode)
        return
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            os.fchmod(fh.fileno(), mode)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(task.dest)
        raise


def _replace(dest: str, folder: str, name: str, data: bytes, mode: int) -> None:
    """``data`` to ``dest`` through a temporary file (mkstemp: O_EXCL, so a link planted under a
    predictable name is never written through), then renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".bench-migrate.tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _check_backups(targets: list[str]) -> None:
    """Before any backup is written: none may replace a file or go through a link."""
    for target in targets:
        if os.path.lexists(target):
            raise UnsafePath(
                f"backup {target} already exists (or is a link): move it away or choose another --backup suffix"
            )


def _backup(src: str, target: str) -> None:
    """Keep ``src`` as ``target`` (--backup): created exclusively, never through a link."""
    with open(src, "rb") as fh:
        data = fh.read()
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    shutil.copystat(src, target)


def _relinked(path: Path, root: Path, dest: Path, out: Path) -> str:
    """The link text for the output's copy of the in-tree link ``path``: its target's place in the
    output, relative to the link (an absolute link text would point back into the source tree)."""
    target = Path(os.path.realpath(path)).relative_to(os.path.realpath(root))
    return os.path.relpath(out / target, dest.parent)


def fixed_values(tasks: list[Task], options: Options, pool=None) -> tuple[FixedValues, ...]:
    """Every accepted-value set of the run's Python files that the migration will not extend
    (read in ``pool``'s workers when there is one)."""
    extend = any(r.code == EXTENDER for r in rules_for("python", options))
    args = [(t.src, t.rel, extend) for t in tasks if t.kind == "python"]
    found: set[FixedValues] = set()
    for sets in pool.imap_unordered(_fixed_of, args, chunksize=16) if pool is not None else map(_fixed_of, args):
        found.update(sets)
    return tuple(sorted(found, key=lambda f: (f.where, f.why, sorted(f.names))))


def _fixed_of(args: tuple[str, str, bool]) -> list[FixedValues]:
    src, rel, extend = args
    data = _read(src)
    if not FIXED_GATE.search(data) or not (b"Enum" in data or b"choices" in data or not extend):
        return []
    source, _reason = decode(data, "python")
    return collect_fixed(source.text, rel, extend) if source is not None else []


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
    for root, path, rel, how in entries:
        if how in SYMLINK_SKIPS:
            results.append(FileResult(rel, "symlink", "skipped", SYMLINK_SKIPS[how]))
            continue
        if how == "symlink-in":
            results.append(FileResult(rel, "symlink", "copied", "symlink inside the tree: recreated"))
            if out is not None and not in_place:
                dest = out / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                if not dest.is_symlink():
                    os.symlink(_relinked(path, root, dest, out), dest)
            continue
        if in_place:
            dest: str | None = str(path)
        elif out is not None:
            dest = str(out / rel)
        else:
            dest = None
        kind = classify(path)
        if in_place and kind in ("file", "ci"):
            continue
        tasks.append(Task(str(path), rel, kind, dest, diff, starts.get(rel, "")))
    options = dataclasses.replace(options, local_packages=local_packages(entries))
    jobs = jobs or os.cpu_count() or 1
    with _workers(len(tasks), jobs) as pool:
        # the parsers' fixed value sets of the whole run, before any file is migrated (rules/_values.py)
        options = dataclasses.replace(options, fixed_values=fixed_values(tasks, options, pool))
        if in_place and backup:
            # back up exactly the files that will change, before anything is written
            probe = [dataclasses.replace(t, dest=None, diff=False) for t in tasks]
            changing = [t.src for t, r in zip(probe, _map(probe, options, pool, jobs, False)) if r.status == "changed"]
            _check_backups([src + backup for src in changing])
            for src in changing:
                _backup(src, src + backup)
        results.extend(_map(tasks, options, pool, jobs, progress))
    results.sort(key=lambda r: r.path)
    return RunResult(options, [str(r) for r in roots], str(out) if out else None, results, in_place)


def local_packages(entries: list[tuple[Path, Path, str, str]]) -> frozenset[str]:
    """Top-level package and module names of the migrated trees: the first part of each Python
    file's path below its root (below ``src/`` too, the src layout), ``.py`` stripped."""
    names: set[str] = set()
    for root, path, _rel, how in entries:
        if how != "file" or path.suffix != ".py" or path == root:
            continue
        parts = path.relative_to(root).parts
        for start in (0, 1) if parts[0] == "src" else (0,):
            if len(parts) > start:
                names.add(parts[start].removesuffix(".py"))
    return frozenset(names)


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


@contextlib.contextmanager
def _workers(n_tasks: int, jobs: int):
    """A process pool of ``jobs`` workers for the run (None: run in this process)."""
    if jobs <= 1 or n_tasks < SERIAL_BELOW:
        yield None
        return
    import multiprocessing as mp

    # fork: workers inherit the imported rules; nothing from the input is ever imported
    ctx = mp.get_context("fork") if sys.platform.startswith("linux") else mp.get_context()
    _preload()
    with ctx.Pool(processes=jobs) as pool:
        yield pool


def _map(tasks: list[Task], options: Options, pool, jobs: int, progress: bool | None) -> list[FileResult]:
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(tasks), unit="file", desc="bench migrate", file=sys.stderr, leave=False)
        except ImportError:  # pragma: no cover
            bar = None
    out: list[FileResult] = []
    if pool is None:
        for t in tasks:
            out.append(process(t, options))
            if bar:
                bar.update(1)
    else:
        # largest files first, in small chunks: a big file handed out last would leave the other
        # workers idle at the end (Megatron-Core's largest .py is 15x its median); unordered so one
        # slow file does not hold back the bar
        chunk = max(1, min(4, len(tasks) // (jobs * 32) or 1))
        slots: list[FileResult | None] = [None] * len(tasks)
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


def _preload() -> None:
    """Import libcst and the rules once in the parent so forked workers start warm."""
    import libcst

    from parabench.migrate.rules._walk import walk

    all_rules()
    walk(libcst.parse_module("import a\nx = f'{a!r:>{w}}'\n"))  # field orders of the common node types
