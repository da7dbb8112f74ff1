"""Bytes <-> text for the files being migrated, so that each is written back in its own encoding.

Python source follows PEP 263 (docs/sources.md#pep-263): a UTF-8 byte order mark, else a
``coding:`` comment in the first two lines, else UTF-8; ``tokenize.detect_encoding`` reads both
exactly as the interpreter does. Other text files (shell, YAML, JSON, requirements) are UTF-8 with
an optional byte order mark. The text handed to the rules never holds the BOM; the migrated text
is encoded back with the same codec and the BOM put back, so an unchanged file round-trips byte
for byte (checked on decoding: a codec that does not, or text it cannot encode, skips the file).
"""

from __future__ import annotations

import codecs
import dataclasses
import io
import tokenize

BOM = codecs.BOM_UTF8


@dataclasses.dataclass(frozen=True)
class Decoded:
    text: str  # without the BOM
    codec: str  # Python codec name, normalised ("utf-8", "iso8859-1", ...)
    bom: bool = False


def decode(data: bytes, kind: str) -> tuple[Decoded | None, str]:
    """-> (decoded, "") or (None, why the file cannot be read as text)."""
    if b"\x00" in data[:8192]:
        return None, "binary file"
    bom = data.startswith(BOM)
    body = data[len(BOM) :] if bom else data
    codec = "utf-8"
    if kind == "python":
        try:
            declared, _lines = tokenize.detect_encoding(io.BytesIO(data).readline)
        except SyntaxError as exc:  # an unknown codec, a BOM with a non-UTF-8 coding line, not UTF-8
            if "missing encoding declaration" not in str(exc):
                return None, str(exc) if str(exc).startswith("unknown encoding") else f"unknown encoding: {exc}"
            declared = "utf-8"  # no coding line and not UTF-8: decoding below says where
        codec = codecs.lookup("utf-8" if declared == "utf-8-sig" else declared).name
    try:
        text = body.decode(codec)
    except UnicodeDecodeError as exc:
        at = exc.start + len(data) - len(body)
        if codec == "utf-8":
            return None, f"not UTF-8 and no coding line ({exc.reason} at byte {at})"
        return None, f"not {codec} as its coding line says ({exc.reason} at byte {at})"
    if codec != "utf-8" and text.encode(codec, "strict") != body:
        return None, f"unknown encoding: {codec} does not round-trip this file"
    return Decoded(text, codec, bom), ""


def encode(text: str, source: Decoded) -> bytes | None:
    """The migrated text in the source's encoding (BOM kept); None when the codec cannot hold it."""
    try:
        body = text.encode(source.codec, "strict")
    except UnicodeEncodeError:
        return None
    return BOM + body if source.bom else body
