"""Helpers for non-Python rules: shell code/comment split, a position-keeping JSON scanner, YAML nodes.

Edits are spans on the original text, so formatting and comments outside the edited token survive.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from parabench.migrate.rules._base import TextDoc


class TextParseError(Exception):
    pass


# --- shell --------------------------------------------------------------------------------------


def shell_code_lines(doc: TextDoc) -> list[tuple[int, int, str]]:
    """[(lineno, start offset, code part)] with comments removed (a `#` that starts a word, outside quotes)."""
    cached = doc.cache.get("shell_lines")
    if cached is not None:
        return cached  # type: ignore[return-value]
    out = []
    offset = 0
    for lineno, line in enumerate(doc.text.split("\n"), 1):
        out.append((lineno, offset, line[: _comment_start(line)]))
        offset += len(line) + 1
    doc.cache["shell_lines"] = out
    return out


def _comment_start(line: str) -> int:
    quote = None
    i = 0
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 2
                continue
            if c == quote:
                quote = None
        elif c == "\\":
            i += 2
            continue
        elif c in ("'", '"'):
            quote = c
        elif c == "#" and (i == 0 or line[i - 1] in " \t;&|("):
            return i
        i += 1
    return len(line)


def word_re(word: str) -> re.Pattern[str]:
    return re.compile(r"(?<![A-Za-z0-9_])" + re.escape(word) + r"(?![A-Za-z0-9_])")


# --- JSON ---------------------------------------------------------------------------------------


def json_strings(doc: TextDoc) -> list[tuple[int, int, str, bool, tuple]]:
    """[(start, end, value, is_key, path)] for every JSON string token; path = keys/indexes above it."""
    cached = doc.cache.get("json_strings")
    if cached is not None:
        return cached  # type: ignore[return-value]
    text = doc.text
    try:
        doc.cache["json_data"] = json.loads(text)
    except ValueError as exc:
        raise TextParseError(f"invalid JSON: {exc}") from exc
    out = []
    stack: list[list] = []  # ["obj", key, expecting_key] | ["arr", index]
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while True:
                j = text.index('"', j)
                k = j - 1
                while text[k] == "\\":
                    k -= 1
                if (j - k - 1) % 2 == 0:
                    break
                j += 1
            value = json.loads(text[i : j + 1])
            is_key = bool(stack) and stack[-1][0] == "obj" and stack[-1][2]
            path = tuple(f[1] for f in stack)
            if is_key:
                stack[-1][1] = value
                stack[-1][2] = False
                path = path[:-1]
            out.append((i, j + 1, value, is_key, path))
            i = j + 1
            continue
        if c == "{":
            stack.append(["obj", None, True])
        elif c == "[":
            stack.append(["arr", 0])
        elif c in "}]":
            stack.pop()
        elif c == "," and stack:
            if stack[-1][0] == "obj":
                stack[-1][2] = True
            else:
                stack[-1][1] += 1
        i += 1
    doc.cache["json_strings"] = out
    return out


def json_get(data, path: tuple):
    for p in path:
        try:
            data = data[p]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def truthy(value) -> bool:
    if isinstance(value, dict):
        return truthy(value.get("enabled", True)) if "enabled" in value else bool(value)
    if isinstance(value, str):
        return value.strip().lower() not in ("", "false", "no", "none", "null", "0", "off")
    return bool(value)


# --- YAML ---------------------------------------------------------------------------------------


def yaml_pairs(doc: TextDoc) -> list[tuple[object, object, tuple]]:
    """[(key node, value node, parent key path)] for every mapping entry of every document."""
    cached = doc.cache.get("yaml_pairs")
    if cached is not None:
        return cached  # type: ignore[return-value]
    import yaml

    try:
        roots = list(yaml.compose_all(doc.text, Loader=yaml.SafeLoader))
    except yaml.YAMLError as exc:
        raise TextParseError(f"invalid YAML: {str(exc).splitlines()[0]}") from exc
    out: list = []

    def walk(node, path):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                out.append((k, v, path))
                walk(v, path + (getattr(k, "value", None),))
        elif isinstance(node, yaml.SequenceNode):
            for v in node.value:
                walk(v, path)

    for root in roots:
        if root is not None:
            walk(root, ())
    doc.cache["yaml_pairs"] = out
    return out


def yaml_scalar(node) -> str | None:
    import yaml

    return node.value if isinstance(node, yaml.ScalarNode) else None


def yaml_replace(doc: TextDoc, node, old: str, new: str) -> tuple[int, int, str] | None:
    """Span edit replacing ``old`` inside a scalar's source text (quotes kept), or None if not verbatim."""
    start, end = node.start_mark.index, node.end_mark.index
    src = doc.text[start:end]
    pos = src.find(old)
    if pos < 0:
        return None
    return start + pos, start + pos + len(old), new


def iter_requirements(doc: TextDoc) -> Iterator[tuple[int, int, str, str]]:
    """(lineno, offset, line, code part) for requirements lines."""
    offset = 0
    for lineno, line in enumerate(doc.text.split("\n"), 1):
        code = re.split(r"(?:^|\s)#", line, maxsplit=1)[0]
        yield lineno, offset, line, code
        offset += len(line) + 1
