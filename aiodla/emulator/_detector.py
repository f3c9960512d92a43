"""The emulator's detector op (``detect``) and its presets: raw YOLOv5-style heads with a
few dozen objects per frame, so that detector post-processing (:class:`~aiodla.Detect`)
has something to find where there is no DLA.

``aiodla emulate --preset yolov5s`` writes YOLOv5s' I/O (a 3x640x640 FP16 input; heads
255x80x80, 255x40x40 and 255x20x20, FP16) with this op. The arithmetic (the format's
definition, see :mod:`aiodla.emulator._format`): with ``K[o]`` and the draw ``r(i) =
F(K[o] + (i + 1) * G)`` of the op mix, output o (shape 1 x 3(5+k) x H x W: three anchors
of k classes) has cells i = (a*H + y)*W + x; cell i holds an object when ``r >> 48 <
floor(16 * 2**16 / (3*H*W))`` (16 objects an output, expected). Channels of anchor a at
(y, x), as logits: without an object 0, objectness -8; with one, x, y, w, h =
``((r >> s) & 255) / 128 - 1`` for s = 0, 8, 32, 40, objectness 4, class
``(r >> 16) % k`` 4 and the other classes -4. Values are exact in float16.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._tensors import TensorSpec
from ._detect_heads import ANCHORS
from ._detect_heads import check_detect_outputs as check_detect_outputs
from ._draws import _OUTPUT_STEP, _finalize, _finalize_int, _stream

__all__ = ["PRESETS", "PRESETS_HELP", "check_detect_outputs", "detect_heads", "preset_io"]

_MASK = (1 << 64) - 1
_OBJECTS = 16  # expected objects per output
_ANCHORS = ANCHORS

#: ``--preset`` name -> (inputs, outputs, seconds a task): the models' own I/O.
PRESETS: dict[str, tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...], float]] = {
    "yolov5s": (
        (TensorSpec("images", (1, 3, 640, 640), "float16", "chw16"),),
        tuple(
            TensorSpec(f"p{stride}", (1, 255, 640 // stride, 640 // stride), "float16", "chw16")
            for stride in (8, 16, 32)
        ),
        0.0038,  # YOLOv5s on one Orin DLA core, about
    ),
}


PRESETS_HELP = (
    "A known model's I/O with an op that imitates it: yolov5s (a 3x640x640 input, three "
    "raw heads with a few dozen objects a frame, 3.8 ms a task)."
)


def preset_io(name: str) -> tuple[list[TensorSpec], list[TensorSpec], dict[str, Any]]:
    """A preset's inputs, outputs and emulator settings (op, latency), as ``emulate``
    takes them from a model spec."""
    inputs, outputs, latency = PRESETS[name]
    return list(inputs), list(outputs), {"op": "detect", "latency": latency}


def detect_heads(outputs: Sequence[TensorSpec], digest: int) -> list[np.ndarray[Any, Any]]:
    """Every output of the op for the inputs' digest ``D`` (the op mix's, step 2), in its
    stored type and logical shape."""
    results = []
    for o, spec in enumerate(outputs):
        _, channels, height, width = spec.shape
        per, plane = channels // _ANCHORS, height * width
        key = _finalize_int((digest + (o + 1) * _OUTPUT_STEP) & _MASK)
        draws = _stream(key, _ANCHORS * plane)
        _finalize(draws, np.empty_like(draws))
        threshold = max(1, (_OBJECTS << 16) // (_ANCHORS * plane))
        heads = np.zeros((_ANCHORS, per, plane), np.float64)
        heads[:, 4, :] = -8.0
        anchor, cell = np.nonzero((draws >> np.uint64(48)).reshape(_ANCHORS, plane) < threshold)
        r = draws.reshape(_ANCHORS, plane)[anchor, cell]
        for channel, shift in enumerate((0, 8, 32, 40)):
            field = (r >> np.uint64(shift)) & np.uint64(255)
            heads[anchor, channel, cell] = field.astype(np.float64) / 128.0 - 1.0
        heads[anchor, 4, cell] = 4.0
        heads[anchor, 5:, cell] = -4.0
        best = ((r >> np.uint64(16)) % np.uint64(per - 5)).astype(np.int64)
        heads[anchor, 5 + best, cell] = 4.0
        results.append(heads.reshape(spec.shape).astype(spec.numpy_dtype))
    return results
