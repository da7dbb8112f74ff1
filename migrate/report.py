"""Render a migration run: terminal summary, report.json, Ascend-style CSVs, Markdown checklist.

report.json schema ("parabench.migrate/report-v1"), all paths relative to the source root(s):
  schema, tool{name, version}, target, mode, safe_only, select, ignore,
  api_map{torch_npu_version, source}, sources[], output,
  summary{files_total, files_scanned, files_changed, files_unchanged, files_skipped, files_copied,
          changes, changes_by_rule{code: n}, changes_by_safety{safe, review}, manual_items,
          manual_by_rule{code: n}, review_not_applied},
  files[{path, kind, status, reason, changes, manual}]   (every non-plain file and every skip),
  changes[{file, line, end_line, rule, safety, op, message, before, after, tip}],
  manual[{file, line, end_line, rule, op, message, tip}]  (manual items + review items not applied),
  rules{code: {name, safety, description}}                (the rules that produced an entry).
Everything is sorted and free of timestamps and absolute paths, so reports diff cleanly.
"""

from __future__ import annotations

import collections
import csv
import io
import json
import os
from pathlib import Path

from parabench.migrate import api_map
from parabench.migrate.core import MANUAL, REVIEW, SAFE, FileResult, Finding
from parabench.migrate.engine import RunResult
from parabench.migrate.rules._base import all_rules

SCHEMA = "parabench.migrate/report-v1"
TOOL_VERSION = "0.1.0"
INSERT_RULES = frozenset({"PY100", "MS001", "RT001", "RQ003", "SH008"})
DELETE_RULES = frozenset({"SH003", "RQ001"})


def _split(result: RunResult) -> tuple[list[Finding], list[Finding]]:
    changes = [f for f in result.findings if f.applied]
    manual = [f for f in result.findings if not f.applied]
    key = lambda f: (f.file, f.line, f.rule, f.end_line, f.message)  # noqa: E731
    return sorted(changes, key=key), sorted(manual, key=key)


def _counts(result: RunResult) -> dict[str, int]:
    c = collections.Counter(r.status for r in result.files)
    scanned = sum(1 for r in result.files if r.kind not in ("file", "symlink", "ci") and r.status != "skipped")
    return {
        "files_total": len(result.files),
        "files_scanned": scanned,
        "files_changed": c["changed"],
        "files_unchanged": c["unchanged"],
        "files_skipped": c["skipped"],
        "files_copied": c["copied"],
    }


def to_dict(result: RunResult) -> dict:
    changes, manual = _split(result)
    rules = all_rules()
    fired = sorted({f.rule for f in changes + manual})
    per_file = collections.defaultdict(lambda: [0, 0])
    for f in changes:
        per_file[file_of(f)][0] += 1
    for f in manual:
        per_file[file_of(f)][1] += 1
    opts = result.options
    summary = dict(_counts(result))
    summary.update(
        changes=len(changes),
        changes_by_rule=dict(sorted(collections.Counter(f.rule for f in changes).items())),
        changes_by_safety={s: sum(1 for f in changes if f.safety == s) for s in (SAFE, REVIEW)},
        manual_items=sum(1 for f in manual if f.safety == MANUAL),
        manual_by_rule=dict(sorted(collections.Counter(f.rule for f in manual if f.safety == MANUAL).items())),
        review_not_applied=sum(1 for f in manual if f.safety == REVIEW),
    )
    return {
        "schema": SCHEMA,
        "tool": {"name": "bench migrate", "version": TOOL_VERSION},
        "target": opts.target,
        "mode": opts.mode,
        "safe_only": opts.safe_only,
        "select": sorted(opts.select) if opts.select is not None else None,
        "ignore": sorted(opts.ignore),
        "api_map": {"torch_npu_version": api_map.TORCH_NPU_VERSION, "source": api_map.TORCH_NPU_SOURCE},
        "sources": [Path(r).name for r in result.roots],
        "output": Path(result.out).name if result.out else None,
        "summary": summary,
        "files": [
            {
                "path": r.path,
                "kind": r.kind,
                "status": r.status,
                "reason": r.reason,
                "changes": per_file[r.path][0],
                "manual": per_file[r.path][1],
            }
            for r in result.files
            if r.kind != "file" or r.status == "skipped"
        ],
        "changes": [
            {
                "file": f.file,
                "line": f.line,
                "end_line": f.end_line,
                "rule": f.rule,
                "safety": f.safety,
                "op": f.op,
                "message": f.message,
                "before": f.before,
                "after": f.after,
                "tip": f.tip,
            }
            for f in changes
        ],
        "manual": [
            {
                "file": f.file,
                "line": f.line,
                "end_line": f.end_line,
                "rule": f.rule,
                "op": f.op,
                "message": f.message,
                "tip": f.tip,
            }
            for f in manual
        ],
        "rules": {
            c: {"name": rules[c].name, "safety": rules[c].safety, "description": rules[c].description}
            for c in fired
            if c in rules
        },
    }


def summary_text(result: RunResult, *, limit: int = 20) -> str:
    rules = all_rules()
    changes, manual = _split(result)
    c = _counts(result)
    o = result.options
    lines = [
        f"bench migrate --to {o.target} ({o.mode}{', safe only' if o.safe_only else ''}): "
        f"{c['files_scanned']} files scanned, {c['files_changed']} changed, {c['files_unchanged']} unchanged, "
        f"{c['files_skipped']} not migrated, {c['files_copied']} copied as-is",
    ]
    by_safety = collections.Counter(f.safety for f in changes)
    lines.append(f"changes: {len(changes)} (safe {by_safety[SAFE]}, review {by_safety[REVIEW]})")
    for code, n in sorted(collections.Counter(f.rule for f in changes).items()):
        r = rules.get(code)
        lines.append(f"  {code} {r.name if r else '':<26} {r.safety if r else '':<7} {n}")
    n_manual = sum(1 for f in manual if f.safety == MANUAL)
    n_skipped_review = len(manual) - n_manual
    lines.append(
        f"manual items: {n_manual}"
        + (f" (+{n_skipped_review} review rewrites not applied)" if n_skipped_review else "")
    )
    for code, n in sorted(collections.Counter(f.rule for f in manual).items()):
        r = rules.get(code)
        lines.append(f"  {code} {r.name if r else '':<26} {n}")
    for title, files in (
        ("not migrated (copied unchanged)", [r for r in result.files if r.status == "skipped"]),
        ("left as is on purpose (review by hand)", [r for r in result.files if r.kind == "ci"]),
    ):
        if files:
            lines.append(f"{title}: {len(files)}")
            lines += [f"  {r.path}: {r.reason}" for r in files[:limit]]
            if len(files) > limit:
                lines.append(f"  ... {len(files) - limit} more (see --report)")
    if manual:
        lines.append("manual work:")
        for f in manual[:limit]:
            lines.append(f"  {f.file}:{f.line} {f.rule} {f.message}" + (f" -- {f.tip}" if f.tip else ""))
        if len(manual) > limit:
            lines.append(f"  ... {len(manual) - limit} more (see --report)")
    return "\n".join(lines) + "\n"


def _csv(rows: list[list[object]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for row in rows:
        w.writerow(row)
    return buf.getvalue()


def _op_type(f: Finding) -> str:
    return "insert" if f.rule in INSERT_RULES else "delete" if f.rule in DELETE_RULES else "modify"


def write_report(result: RunResult, report_dir: Path, link_root: Path | None) -> list[Path]:
    """Write report.json, change_list.csv, unsupported_api.csv, unknown_api.csv, manual.md.

    ``link_root``: the tree the Markdown links point into (the output tree, or the source when
    nothing was written)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    changes, manual = _split(result)
    written = []

    def put(name: str, text: str) -> None:
        p = report_dir / name
        p.write_text(text, encoding="utf-8", newline="")
        written.append(p)

    put("report.json", json.dumps(to_dict(result), indent=2, ensure_ascii=False) + "\n")
    put(
        "change_list.csv",
        _csv(
            [["File", "Start Line", "End Line", "Operation Type", "Message", "Rule", "Safety"]]
            + [[f.file, f.line, f.end_line, _op_type(f), f.message, f.rule, f.safety] for f in changes]
        ),
    )
    unknown = [f for f in manual if f.tip == api_map.UNKNOWN_TIP]
    supported_rows = [f for f in manual if f.tip != api_map.UNKNOWN_TIP]
    header = ["File", "Start Line", "End Line", "OP", "Tips", "Rule", "Message"]
    put(
        "unsupported_api.csv",
        _csv([header] + [[f.file, f.line, f.end_line, f.op, f.tip, f.rule, f.message] for f in supported_rows]),
    )
    put(
        "unknown_api.csv",
        _csv([header] + [[f.file, f.line, f.end_line, f.op, f.tip, f.rule, f.message] for f in unknown]),
    )
    put("manual.md", checklist(result, report_dir, link_root))
    return written


def file_of(f: Finding) -> str:
    """The file a finding lies in: a notebook's findings name their cell (``x.ipynb#cell-3``)."""
    return f.file.rpartition("#cell-")[0] if ".ipynb#cell-" in f.file else f.file


def _link(f: Finding, report_dir: Path, link_root: Path | None, moved: dict[str, FileResult]) -> str:
    """``file:line`` linked to that line. Findings carry source lines; where the file was written
    with lines added or removed (``moved``), the link and its label give the output file's line
    and say which source line it was."""
    label = f"{f.file}:{f.line}"
    if link_root is None:
        return label
    line = moved[f.file].output_line(f.line) if f.file in moved else f.line
    if line != f.line:
        label = f"{f.file}:{line} (source line {f.line})"
    target = Path(os.path.relpath(Path(link_root) / file_of(f), report_dir)).as_posix()
    if file_of(f) != f.file:  # a notebook cell: its lines are not the file's, link the notebook
        return f"[{label}]({target})"
    return f"[{label}]({target}#L{line})"


def checklist(result: RunResult, report_dir: Path, link_root: Path | None) -> str:
    changes, manual = _split(result)
    written = result.out is not None or result.in_place
    moved = {r.path: r for r in result.files if r.line_shifts} if written else {}
    o = result.options
    out = [
        "# Manual migration checklist",
        "",
        f"Target `{o.target}` ({o.mode}), API map checked against torch_npu {api_map.TORCH_NPU_VERSION}. "
        f"{sum(1 for f in manual if f.safety == MANUAL)} manual items, "
        f"{sum(1 for f in changes if f.safety == REVIEW)} applied rewrites to review.",
        "",
        "## Manual work (not rewritten)",
        "",
    ]
    if not manual:
        out.append("Nothing left.")
    for f in manual:
        tip = f" -- {f.tip}" if f.tip else ""
        out.append(f"- [ ] {_link(f, report_dir, link_root, moved)} `{f.rule}` {f.message}{tip}")
    out += ["", "## Applied rewrites to review", ""]
    reviews = [f for f in changes if f.safety == REVIEW]
    if not reviews:
        out.append("None.")
    for f in reviews:
        tip = f" -- {f.tip}" if f.tip else ""
        out.append(f"- [ ] {_link(f, report_dir, link_root, moved)} `{f.rule}` {f.message}{tip}")
    skipped = [r for r in result.files if r.status == "skipped"]
    if skipped:
        out += ["", "## Files not migrated", ""]
        out += [f"- [ ] `{r.path}`: {r.reason}" for r in skipped]
    ci = [r for r in result.files if r.kind == "ci"]
    if ci:
        out += ["", "## Left as is on purpose", ""]
        out += [f"- [ ] `{r.path}`: {r.reason}" for r in ci]
    return "\n".join(out) + "\n"
