"""JSON for large tensors without stalling the event loop.

A JSON inference request for one float32 1x3x640x640 frame is 23 MiB of text. The
standard library parses and writes it in a single C call each (``json.loads`` about
0.3 s, ``json.dumps`` about 0.9 s), which holds the GIL throughout: moving that call to
a worker thread does not help, the event loop still waits for the GIL. So the HTTP
front hands large bodies to :func:`loads` and large JSON outputs to :func:`dumps_values`
in a worker thread, and both work in bounded pieces (a few thousand numbers per C call),
so the worker lets go of the GIL between pieces and the loop keeps answering.

:func:`loads` gives exactly what ``json.loads`` gives (the same values, ints as ints,
the same documents refused): it is the standard library's pure-Python scanner, whose
array parsing takes runs of plain numbers a chunk at a time through the C parser.

Nesting: a request's arrays nest once per dimension of a tensor, so a document nested
deeper than that is refused (:class:`NestingError`) before it is parsed deeper, rather
than running the parser into Python's recursion limit. :func:`loads` counts levels as
it enters them; :func:`nesting` measures a small document before the C parser reads it.
"""

from __future__ import annotations

import json
import re
from json.decoder import JSONArray, JSONObject  # type: ignore[attr-defined]
from json.scanner import py_make_scanner  # type: ignore[attr-defined]
from typing import Any

import numpy as np

__all__ = ["CHUNK", "PIECE", "NestingError", "dumps_values", "loads", "nesting"]

#: Numbers per C call when writing: a few milliseconds of work at most.
CHUNK = 4096
#: Characters per C call when parsing (about 3,000 numbers).
PIECE = 1 << 16

_load_piece = json.JSONDecoder().decode


def _array(s_and_end: tuple[str, int], scan_once: Any) -> tuple[list[Any], int]:
    """``JSONArray``, with a flat array of scalars parsed in pieces cut at commas."""
    s, end = s_and_end
    close = s.find("]", end)
    if close < 0 or any(s.find(c, end, close) >= 0 for c in '"[{'):
        # Strings or nested values inside: the general path (nested arrays come back here).
        return JSONArray((s, end), scan_once)  # type: ignore[no-any-return]
    # Only scalars and commas up to the bracket: cutting at a comma keeps every token
    # whole, so the pieces parse to the same values, and fail where the whole would.
    values: list[Any] = []
    start = end
    while (cut := s.find(",", start + PIECE, close) if start + PIECE < close else -1) >= 0:
        values.extend(_load_piece("[" + s[start:cut] + "]"))
        start = cut + 1
    last = s[start:close]
    if start > end and not last.strip(" \t\n\r"):
        raise json.JSONDecodeError("Expecting value", s, close)  # a trailing comma
    values.extend(_load_piece("[" + last + "]"))
    return values, close + 1


class NestingError(ValueError):
    """A document nested deeper than its reader takes."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request JSON nests deeper than {limit} levels")
        self.limit = limit


class _Decoder(json.JSONDecoder):
    def __init__(self, max_depth: int) -> None:
        super().__init__()
        self.depth = 0
        self.max_depth = max_depth
        self.parse_array = self._nested(_array)
        self.parse_object = self._nested(JSONObject)
        self.scan_once = py_make_scanner(self)

    def _nested(self, parse: Any) -> Any:
        def enter(s_and_end: tuple[str, int], *args: Any) -> Any:
            self.depth += 1
            if self.depth > self.max_depth:
                raise NestingError(self.max_depth)
            try:
                return parse(s_and_end, *args)
            finally:
                self.depth -= 1

        return enter


def loads(body: bytes | str, max_depth: int = 64) -> Any:
    """``json.loads`` (UTF-8), in bounded pieces; raises ``ValueError`` as it does, and
    :class:`NestingError` on entering level ``max_depth + 1`` of arrays and objects."""
    text = body.decode() if isinstance(body, bytes) else body
    return _Decoder(max_depth).decode(text)


_NOT_MARKS = bytes(b for b in range(256) if b not in b'[]{}"')
_STRING = re.compile(b'"[^"]*"')
_CLOSING = bytes.maketrans(b"[]{}", b"\x01\xff\x01\xff")


def nesting(body: bytes) -> int:
    """How deep a document's arrays and objects nest, brackets in strings not counted.

    Cheap (a few passes of C over the bytes), for a small document before the C parser
    reads it: that parser has no depth limit of its own but Python's recursion limit.
    """
    if b"\\" in body:  # escaped quotes and backslashes cannot end a string
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = body.translate(None, _NOT_MARKS)
    if b'"' in marks:
        marks = _STRING.sub(b"", marks).replace(b'"', b"")  # and an unclosed string's quote
    steps = np.frombuffer(marks.translate(_CLOSING), np.int8)
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def dumps_values(value: np.ndarray[Any, Any]) -> str:
    """A flat JSON list of an array's values, row-major: ``json.dumps(value.ravel().tolist())``
    with no spaces, a chunk at a time."""
    flat = value.ravel()
    dump = json.JSONEncoder(separators=(",", ":")).encode
    return (
        "["
        + ",".join(dump(flat[i : i + CHUNK].tolist())[1:-1] for i in range(0, flat.size, CHUNK))
        + "]"
    )
