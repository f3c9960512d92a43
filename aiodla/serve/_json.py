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
"""

from __future__ import annotations

import json
from json.decoder import JSONArray  # type: ignore[attr-defined]
from json.scanner import py_make_scanner  # type: ignore[attr-defined]
from typing import Any

import numpy as np

__all__ = ["CHUNK", "PIECE", "dumps_values", "loads"]

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


class _Decoder(json.JSONDecoder):
    def __init__(self) -> None:
        super().__init__()
        self.parse_array = _array
        self.scan_once = py_make_scanner(self)


def loads(body: bytes | str) -> Any:
    """``json.loads`` (UTF-8), in bounded pieces; raises ``ValueError`` as it does."""
    text = body.decode() if isinstance(body, bytes) else body
    return _Decoder().decode(text)


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
