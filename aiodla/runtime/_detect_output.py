"""The detector's output buffer: what the post-processing on a slot's stream leaves for
the host to copy back, and how either side reads and writes it.

``count`` (int32), the candidates dropped ``outside`` the frame and ``not_finite``
(int32 each, :class:`~aiodla.Detections`' counts; padded to 16 bytes so that what
follows stays aligned), then
``max_det`` boxes (4 float32 each: x1 y1 x2 y2), ``max_det`` scores (float32) and
``max_det`` classes (int32); only the first ``count`` of each are meaningful. The CUDA
kernels' select step writes it (:mod:`._detect_source` prints these offsets into the
source), the emulated runtime's stream operation writes it with numpy, and the host
reads it back. A count outside 0..max_det means the device's post-processing failed
(the emulated runtime writes -1 then); the reader refuses it, so that request fails
alone.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .._detect import Detections

__all__ = [
    "FAILED",
    "OutputLayout",
    "OutputReader",
    "output_layout",
    "read_count",
    "read_dropped",
    "read_output",
    "write_output",
]

HEADER = 16
FAILED = -1  # the count a failed post-processing leaves


class OutputLayout(NamedTuple):
    """Where the output buffer holds what (bytes from its start)."""

    max_det: int
    boxes: int
    scores: int
    classes: int
    size: int


def output_layout(max_det: int) -> OutputLayout:
    boxes = HEADER
    scores = boxes + 16 * max_det
    classes = scores + 4 * max_det
    return OutputLayout(max_det, boxes, scores, classes, classes + 4 * max_det)


def read_count(raw: Any, layout: OutputLayout) -> int:
    """The count at the start of an output buffer's bytes; a ValueError for a count
    outside 0..max_det (a failed post-processing, or a corrupt buffer)."""
    count = int(np.asarray(raw, np.uint8).reshape(-1)[:4].view(np.int32)[0])
    _check_count(count, layout)
    return count


def _check_count(count: int, layout: OutputLayout) -> None:
    if count == FAILED:
        raise ValueError("the device's post-processing of this request failed")
    if not 0 <= count <= layout.max_det:
        raise ValueError(f"detector output holds a count of {count}, not 0..{layout.max_det}")


def read_dropped(raw: Any) -> tuple[int, int]:
    """The candidates dropped ``outside`` the frame and ``not_finite``, after the count."""
    outside, not_finite = np.asarray(raw, np.uint8).reshape(-1)[4:12].view(np.int32).tolist()
    return int(outside), int(not_finite)


def read_output(raw: Any, layout: OutputLayout) -> Detections:
    """The Detections in an output buffer's bytes (a uint8 array of ``layout.size``),
    copied out of it; ValueError as :func:`read_count`."""
    return OutputReader(raw, layout).read()


class OutputReader:
    """Views of one output buffer's bytes, made once (a slot's, when it opens), so that
    reading a request's Detections out of it takes a slice and a copy of each array:
    this runs once a request, on the event loop."""

    __slots__ = ("boxes", "classes", "header", "layout", "scores")

    def __init__(self, raw: Any, layout: OutputLayout) -> None:
        data = np.asarray(raw, np.uint8).reshape(-1)
        self.layout = layout
        self.header = data[:12].view(np.int32)
        max_det = layout.max_det
        self.boxes = data[layout.boxes : layout.scores].view(np.float32).reshape(max_det, 4)
        self.scores = data[layout.scores : layout.classes].view(np.float32)
        self.classes = data[layout.classes : layout.classes + 4 * max_det].view(np.int32)

    def read(self) -> Detections:
        """The Detections the buffer holds now, copied out of it; ValueError as
        :func:`read_count`."""
        count, outside, not_finite = self.header.tolist()  # the header in one read
        _check_count(count, self.layout)
        return Detections(
            self.boxes[:count].copy(),
            self.scores[:count].copy(),
            self.classes[:count].copy(),
            outside=outside,
            not_finite=not_finite,
        )


def write_output(detections: Detections | None, layout: OutputLayout, raw: Any) -> None:
    """Write ``detections`` (at most ``max_det``) into an output buffer's bytes, as the
    kernels do; None writes the failed count."""
    data = np.asarray(raw, np.uint8).reshape(-1)
    header = data[:12].view(np.int32)
    if detections is None:
        header[0] = FAILED
        return
    count = len(detections)
    if count > layout.max_det:
        raise ValueError(f"{count} detections do not fit an output of max_det={layout.max_det}")
    boxes = np.asarray(detections.boxes, np.float32).reshape(count, 4)
    data[layout.boxes : layout.boxes + 16 * count] = boxes.view(np.uint8).reshape(-1)
    scores = np.asarray(detections.scores, np.float32)
    data[layout.scores : layout.scores + 4 * count] = scores.view(np.uint8)
    classes = np.asarray(detections.classes, np.int32)
    data[layout.classes : layout.classes + 4 * count] = classes.view(np.uint8)
    header[1:3] = detections.outside, detections.not_finite
    header[0] = count
