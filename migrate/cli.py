"""`bench migrate`: static migration of CUDA PyTorch projects to Ascend (torch_npu / MindSpeed).

Exit codes: 0 done; 1 ``--check`` found changes or manual items, or skipped a file that may hold
CUDA code; 2 bad input (one line on stderr).
This module imports neither torch nor the code being migrated; libcst loads only when needed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from parabench.migrate.core import MODES, TARGETS, Options
from parabench.migrate.engine import UnsafePath, run
from parabench.migrate.report import summary_text, write_report
from parabench.migrate.rules._base import all_rules


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="bench migrate",
        description="Migrate GPU (CUDA) PyTorch training code to Ascend NPU: torch_npu (--to npu) or MindSpeed (--to mindspeed).",
        epilog="Rules: `bench migrate --list-rules`. Exit codes: 0 ok, 1 --check found work, 2 bad input.",
    )
    p.add_argument(
        "src", nargs="*", metavar="SRC", help="files or directory trees to migrate (never modified without --in-place)"
    )
    p.add_argument("--to", dest="target", choices=TARGETS, default="npu", help="target stack (default: npu)")
    p.add_argument(
        "--mode",
        choices=MODES,
        default="static",
        help="static: rewrite the code (default); runtime: only add torch_npu's transfer_to_npu import to entry scripts",
    )
    p.add_argument(
        "--out", type=Path, help="output tree (default: <SRC>_<target> next to a single SRC; must not be inside SRC)"
    )
    p.add_argument("--force", action="store_true", help="allow writing into an existing non-empty --out")
    p.add_argument("--in-place", action="store_true", help="rewrite SRC itself (needs --backup or a clean git tree)")
    p.add_argument(
        "--backup",
        nargs="?",
        const=".orig",
        default=None,
        metavar="SUFFIX",
        help="with --in-place: keep a copy of each changed file as FILE+SUFFIX (default .orig)",
    )
    p.add_argument("--diff", action="store_true", help="print unified diffs, write nothing")
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if changes or manual items remain, or a file that may hold CUDA code could not be migrated (CI)",
    )
    p.add_argument("--select", help="comma-separated rule codes or prefixes to run (e.g. PY1,SH001)")
    p.add_argument("--ignore", help="comma-separated rule codes or prefixes to skip")
    p.add_argument(
        "--safe-only", action="store_true", help="apply only safe rewrites; review rewrites are reported instead"
    )
    p.add_argument(
        "--report",
        type=Path,
        metavar="DIR",
        help="write report.json, change_list.csv, unsupported_api.csv, unknown_api.csv, manual.md",
    )
    p.add_argument("-j", "--jobs", type=int, default=None, help="worker processes (default: all cores)")
    prog = p.add_mutually_exclusive_group()
    prog.add_argument("--progress", dest="progress", action="store_true", default=None, help="force the progress bar")
    prog.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary")
    p.add_argument("--list-rules", action="store_true", help="print the rule table (Markdown) and exit")
    return p


def _codes(text: str | None, known: list[str]) -> frozenset[str] | None:
    if text is None:
        return None
    codes = frozenset(c.strip().upper() for c in text.split(",") if c.strip())
    bad = sorted(c for c in codes if not any(k.startswith(c) for k in known))
    if bad:
        raise UsageError(f"unknown rule code(s) {', '.join(bad)}; valid: {', '.join(known)}")
    return codes


# `git status` runs code the repository's own config names: its core.fsmonitor hook, the clean
# filter of a .gitattributes driver (filter.<name>.clean/process, run on files whose stat data
# changed) and, when it refreshes the index, the post-index-change hook (git-config(1), githooks(5);
# docs/sources.md#git-status-runs-code). The target tree is someone else's: none of them may run.
SAFE_GIT = ["git", "--no-optional-locks", "-c", "core.fsmonitor=false", "-c", f"core.hooksPath={os.devnull}"]
FILTER_KEY = re.compile(r"^filter\.(.+)\.[^.]+$")


def _filter_names(cwd: Path) -> set[str]:
    """The filter drivers the repository's config (and its submodules' under its git dir) defines;
    reading config runs nothing."""
    common = subprocess.run(
        SAFE_GIT + ["rev-parse", "--git-common-dir"], cwd=cwd, capture_output=True, text=True, timeout=30
    )
    configs = [["config", "--null", "--get-regexp", r"^filter\."]]
    if common.returncode == 0:
        git_dir = (cwd / common.stdout.strip()).resolve()
        configs += [
            ["config", "--file", str(c), "--includes", "--null", "--get-regexp", r"^filter\."]
            for c in sorted(git_dir.glob("modules/**/config"))
        ]
    names = set()
    for args in configs:
        out = subprocess.run(SAFE_GIT + args, cwd=cwd, capture_output=True, text=True, timeout=30).stdout
        names |= {m.group(1) for item in out.split("\0") if (m := FILTER_KEY.match(item.split("\n", 1)[0]))}
    return names


def _safe_git(cwd: Path) -> list[str]:
    """``git`` with every command the repository could make it run switched off."""
    names = sorted(_filter_names(cwd))
    off = [f"filter.{n}.{var}=" for n in names for var in ("clean", "smudge", "process")]
    off += [f"filter.{n}.required=false" for n in names]
    return SAFE_GIT + [arg for setting in off for arg in ("-c", setting)]


def _git_clean(path: Path) -> tuple[bool, str]:
    """True when ``path`` lies in a git work tree with nothing uncommitted or untracked under it."""
    cwd = path if path.is_dir() else path.parent
    try:
        inside = subprocess.run(
            SAFE_GIT + ["rev-parse", "--is-inside-work-tree"], cwd=cwd, capture_output=True, text=True, timeout=30
        )
        if inside.returncode != 0 or inside.stdout.strip() != "true":
            return False, "not a git work tree"
        st = subprocess.run(
            _safe_git(cwd) + ["status", "--porcelain", "--", str(path.resolve())],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"git unavailable ({exc})"
    if st.returncode != 0:
        return False, "git status failed"
    if st.stdout.strip():
        return False, "uncommitted or untracked changes"
    return True, ""


def rules_table() -> str:
    """The rule table of docs/migrate.md (Markdown; the Sources links are relative to docs/)."""
    lines = ["| Code | Name | Safety | Kind | Targets | Description | Sources |", "|---|---|---|---|---|---|---|"]
    for code, r in all_rules().items():
        targets = ",".join(sorted(r.targets)) + ("" if r.modes == {"static"} else f" ({','.join(sorted(r.modes))})")
        anchors = r.source.replace("docs/sources.md#", "").split(", ")
        sources = ", ".join(f"[{a}](sources.md#{a})" for a in anchors)
        description = r.description.replace("|", "/")
        lines.append(f"| {code} | {r.name} | {r.safety} | {r.kind} | {targets} | {description} | {sources} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except (UsageError, UnsafePath) as exc:
        print(f"bench migrate: error: {exc}", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.list_rules:
        sys.stdout.write(rules_table())
        return 0
    if not args.src:
        raise UsageError("no SRC given (files or directories to migrate)")
    known = list(all_rules())
    options = Options(
        target=args.target,
        mode=args.mode,
        safe_only=args.safe_only,
        select=_codes(args.select, known),
        ignore=_codes(args.ignore, known) or frozenset(),
    )
    roots = _source_roots(args.src)
    if args.jobs is not None and args.jobs < 1:
        raise UsageError("--jobs must be >= 1")
    out = _output_dir(args, roots, options.target)
    if args.report is not None:
        rep = args.report.resolve()
        for r in roots:
            if r.is_dir() and rep.is_relative_to(r.resolve()) and not args.in_place:
                raise UsageError(f"--report {args.report} lies inside SRC {r}")

    result = run(
        roots,
        options,
        out,
        in_place=args.in_place,
        backup=args.backup,
        diff=args.diff,
        jobs=args.jobs,
        progress=args.progress,
    )
    if args.diff:
        for r in result.files:
            if r.diff:
                sys.stdout.write(r.diff)
    if args.report is not None:
        link_root = out if out is not None else (roots[0] if len(roots) == 1 and roots[0].is_dir() else None)
        write_report(result, args.report, link_root)
    if not args.quiet:
        (sys.stderr if args.diff else sys.stdout).write(summary_text(result))
        if out is not None:
            (sys.stdout).write(f"output: {out}\n")
    if args.check:
        pending = any(r.status == "changed" for r in result.files) or any(not f.applied for f in result.findings)
        unread = [r for r in result.files if r.may_hold_cuda]
        for r in unread:  # named even with -q: a CI gate must say which file it could not check
            print(
                f"bench migrate: --check: {r.path} was not migrated ({r.reason}) and may hold CUDA code",
                file=sys.stderr,
            )
        return 1 if pending or unread else 0
    unread = [r for r in result.files if r.may_hold_cuda]
    for r in unread:  # named even with -q: the output tree is not the migrated project
        print(f"bench migrate: {r.path} was not migrated ({r.reason}) and may hold CUDA code", file=sys.stderr)
    return 1 if unread else 0


def _source_roots(src: list[str]) -> list[Path]:
    """The SRC arguments as paths: existing, no symlinks, distinct names, none inside another."""
    roots = []
    for s in src:
        p = Path(s)
        if not p.exists():
            raise UsageError(f"SRC not found: {s}")
        if p.is_symlink():
            raise UsageError(f"SRC is a symlink (not followed): {s}")
        roots.append(p)
    names = [r.name for r in roots]
    if len(set(names)) != len(names):
        raise UsageError("several SRC share a name; migrate them separately")
    for a in roots:
        for b in roots:
            if a is not b and a.resolve().is_relative_to(b.resolve()):
                raise UsageError(f"SRC {a} lies inside SRC {b}")
    return roots


def _output_dir(args, roots: list[Path], target: str) -> Path | None:
    """Where the migrated tree goes: None for --in-place, --diff and --check; --out, else a
    sibling of the source. Refuses an output inside a source (or the reverse) and a non-empty one."""
    write_nothing = args.diff or args.check
    if args.in_place:
        if args.out is not None:
            raise UsageError("--in-place and --out exclude each other")
        if write_nothing:
            raise UsageError("--in-place with --diff/--check makes no sense: those write nothing")
        if args.backup is None:
            for r in roots:
                ok, why = _git_clean(r)
                if not ok:
                    raise UsageError(f"--in-place needs --backup or a clean git tree ({r}: {why})")
        return None
    if args.backup is not None:
        raise UsageError("--backup only applies to --in-place")
    if write_nothing:
        return None
    out = args.out if args.out is not None else _default_out(roots, target)
    res_out = out.resolve()
    for r in roots:
        rr = r.resolve()
        if res_out == rr or (r.is_dir() and res_out.is_relative_to(rr)):
            raise UsageError(f"--out {out} lies inside SRC {r}: choose a directory outside the source tree")
        if rr.is_relative_to(res_out):
            raise UsageError(f"SRC {r} lies inside --out {out}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        raise UsageError(f"--out {out} exists and is not empty (use --force to write into it)")
    return out


def _default_out(roots: list[Path], target: str) -> Path:
    if len(roots) == 1:
        r = roots[0].resolve()
        stem = r.name if r.is_dir() else r.stem
        return r.parent / f"{stem}_{target}"
    return Path.cwd() / f"migrated_{target}"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
