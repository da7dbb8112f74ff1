"""Migrate the code cells of a Jupyter notebook (``.ipynb``, nbformat 4), keeping everything else.

The code cells, in order, form one Python module for the rules (an import in the first cell
resolves a name in the fifth, ``import torch_npu`` is added once), each cell opened by a marker
comment so that the result splits back into its cells. IPython syntax is masked before and put
back after: a line magic (``%matplotlib inline``), a shell line (``!pip install ...``,
``files = !ls``) or a help line (``?torch``) becomes ``pass`` plus a numbered comment at its
indentation; a cell magic (``%%bash``) makes its whole cell not Python, except the magics whose
body is Python (``%%time``, ``%%timeit``, ``%%capture``), whose first line alone is masked.

Only the ``source`` of a changed cell is rewritten in the file's own text: outputs, metadata,
cell ids, key order, indentation and escapes elsewhere stay byte for byte; unchanged lines keep
their JSON tokens, new lines are written as Jupyter writes them (docs/sources.md#jupyter-notebook-format).
Findings name their cell, ``file.ipynb#cell-N`` (N counts all cells from 1, as shown top to
bottom), with lines counted within the cell.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import re

from parabench.migrate.apply_rules import migrate_python
from parabench.migrate.core import Finding, Options
from parabench.migrate.rules._base import TextDoc
from parabench.migrate.rules._text import json_strings

PYTHON_CELL_MAGICS = frozenset({"time", "timeit", "capture"})  # %%magic whose body is Python
_MARKER = "# bench-migrate notebook cell "
_MARKER_RE = re.compile(r"^# bench-migrate notebook cell (\d+)\n", re.MULTILINE)
_MASK = "pass  # bench-migrate notebook ipython line "
# %magic, %%magic, !shell, ?help, obj?, x = !shell, x = %magic (never valid Python, so never masked
# by mistake; `% x` continuing an expression is not a magic)
_IPYTHON_LINE = re.compile(
    r"^\s*(?:%{1,2}[A-Za-z_]|!(?!=)|\?|[\w.]+\?{1,2}\s*$|[\w.,\s()\[\]]+=\s*(?:!(?!=)|%[A-Za-z_]))"
)


@dataclasses.dataclass
class _Cell:
    index: int  # position among all cells, 0-based
    text: str  # source as one string
    code: str = ""  # masked Python, ending with a newline
    masked: list[str] = dataclasses.field(default_factory=list)  # the original lines behind each mask


def cell_name(rel: str, index: int) -> str:
    return f"{rel}#cell-{index + 1}"


def migrate_notebook(text: str, rel: str, options: Options) -> tuple[str, list[Finding], str]:
    """-> (new notebook text, findings with ``file`` set per cell, skip reason)."""
    cells, reason = _python_cells(text, rel)
    if reason or not cells:
        return text, [], reason
    joined = "".join(f"{_MARKER}{c.index}\n{c.code}" for c in cells)
    new, findings, _full, reason = migrate_python(joined, rel, options)
    if reason:
        return text, [], reason
    if new == joined:
        return text, _per_cell(findings, cells, rel), ""
    pieces = _split(new, cells)
    if pieces is None:
        return text, [], "internal: the migrated cells could not be split back; left unchanged"
    return _splice(text, rel, options, cells, pieces), _per_cell(findings, cells, rel), ""


def _python_cells(text: str, rel: str) -> tuple[list[_Cell], str]:
    """The code cells holding Python (masked), or the reason the notebook cannot be migrated."""
    try:
        nb = json.loads(text)
    except ValueError as exc:
        return [], f"unparseable: invalid notebook JSON: {exc}"
    if not isinstance(nb, dict) or nb.get("nbformat") != 4 or not isinstance(nb.get("cells"), list):
        version = nb.get("nbformat") if isinstance(nb, dict) else "?"
        return [], f"not migrated: nbformat {version} (only nbformat 4 is read)"
    meta = nb.get("metadata") or {}
    language = (meta.get("kernelspec") or {}).get("language") or (meta.get("language_info") or {}).get("name")
    if language and str(language).lower() != "python":
        return [], ""  # not Python code: nothing to migrate
    cells: list[_Cell] = []
    for i, raw in enumerate(nb["cells"]):
        c = _cell(i, raw) if isinstance(raw, dict) and raw.get("cell_type") == "code" else None
        if c is None or not c.code.strip():
            continue
        try:
            ast.parse(c.code)
        except (SyntaxError, ValueError) as exc:
            where = f"{cell_name(rel, i)} line {getattr(exc, 'lineno', '?')}"
            return [], f"unparseable: {type(exc).__name__}: {getattr(exc, 'msg', exc)} ({where})"
        cells.append(c)
    return cells, ""


def _cell(index: int, cell: dict) -> _Cell | None:
    source = cell.get("source", "")
    if isinstance(source, list):
        source = "".join(s for s in source if isinstance(s, str))
    if not isinstance(source, str):
        return None
    c = _Cell(index, source)
    lines = source.split("\n")
    first = lines[0].lstrip()
    if first.startswith("%%"):
        name = first[2:].split(maxsplit=1)[0] if first[2:].strip() else ""
        if name not in PYTHON_CELL_MAGICS:
            return None  # %%bash, %%writefile, ...: not Python, left as it is
    out = []
    for k, line in enumerate(lines):
        if (k == 0 and first.startswith("%%")) or _IPYTHON_LINE.search(line):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}{_MASK}{len(c.masked)}")
            c.masked.append(line)
        else:
            out.append(line)
    c.code = "\n".join(out)
    if not c.code.endswith("\n"):
        c.code += "\n"
    return c


def _split(new: str, cells: list[_Cell]) -> list[str] | None:
    """The migrated module cut back into its cells (IPython lines restored); None when the markers
    did not survive in order."""
    marks = list(_MARKER_RE.finditer(new))
    if [int(m.group(1)) for m in marks] != [c.index for c in cells]:
        return None
    out = []
    for k, (m, c) in enumerate(zip(marks, cells)):
        end = marks[k + 1].start() if k + 1 < len(marks) else len(new)
        code = (new[: m.start()] if k == 0 else "") + new[m.end() : end]
        restored = _unmask(code, c.masked)
        if restored is None:
            return None
        if not c.text.endswith("\n") and restored.endswith("\n"):
            restored = restored[:-1]
        out.append(restored)
    return out


def _unmask(code: str, masked: list[str]) -> str | None:
    lines = code.split("\n")
    found = 0
    for i, line in enumerate(lines):
        at = line.find(_MASK)
        if at >= 0 and line[:at].strip() == "":
            k = int(line[at + len(_MASK) :])
            if k != found:
                return None
            lines[i] = masked[k]
            found += 1
    return "\n".join(lines) if found == len(masked) else None


def _per_cell(findings: list[Finding], cells: list[_Cell], rel: str) -> list[Finding]:
    """Findings of the joined module -> their cell and line within it."""
    starts, line = [], 1
    for c in cells:
        starts.append(line + 1)  # after the marker line
        line += 1 + c.code.count("\n")
    out = []
    for f in findings:
        k = max(0, next((i for i, s in enumerate(starts) if s > f.line), len(starts)) - 1)
        shift = starts[k] - 1
        out.append(
            dataclasses.replace(
                f, file=cell_name(rel, cells[k].index), line=max(1, f.line - shift), end_line=max(1, f.end_line - shift)
            )
        )
    return out


def _splice(text: str, rel: str, options: Options, cells: list[_Cell], pieces: list[str]) -> str:
    """``text`` with the ``source`` of each changed cell replaced, nothing else touched."""
    tokens = json_strings(TextDoc(text, rel, options))  # json.loads read it: the scanner does too
    by_cell: dict[int, list[tuple[int, int, str, tuple]]] = {}
    for start, end, value, is_key, path in tokens:
        if not is_key and len(path) >= 3 and path[0] == "cells" and path[2] == "source":
            by_cell.setdefault(path[1], []).append((start, end, value, path))
    edits = []
    for c, new in zip(cells, pieces):
        if new != c.text:
            edits.append(_source_edit(text, by_cell.get(c.index, []), new))
    out, pos = [], 0
    for start, end, repl in sorted(edits):
        out += [text[pos:start], repl]
        pos = end
    out.append(text[pos:])
    return "".join(out)


def _source_edit(text: str, tokens: list[tuple[int, int, str, tuple]], new: str) -> tuple[int, int, str]:
    """(start, end, replacement) for one cell's source: one string, or a list of lines whose
    unchanged lines keep their tokens and whose elements keep the list's separator."""
    dump = lambda s: json.dumps(s, ensure_ascii=False)  # noqa: E731 - as Jupyter writes strings
    if len(tokens) == 1 and len(tokens[0][3]) == 3:  # "source": "one string"
        start, end, _value, _path = tokens[0]
        return start, end, dump(new)
    old_lines = [t[2] for t in tokens]
    new_lines = new.splitlines(keepends=True)
    sep = text[tokens[0][1] : tokens[1][0]] if len(tokens) > 1 else _separator(text, tokens[0][0])
    parts = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False).get_opcodes():
        if tag == "equal":
            parts += [text[s:e] for s, e, _v, _p in tokens[i1:i2]]
        else:
            parts += [dump(line) for line in new_lines[j1:j2]]
    return tokens[0][0], tokens[-1][1], sep.join(parts)


def _separator(text: str, start: int) -> str:
    """Between list elements: a comma and the first element's own line break and indentation."""
    line_start = text.rfind("\n", 0, start) + 1
    indent = text[line_start:start]
    return ",\n" + indent if indent.strip() == "" and line_start > 0 else ", "
