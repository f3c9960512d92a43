"""The emulator's detector op (``detect``) and its presets: raw YOLOv5-style heads with a
few dozen objects per frame, so that detector post-processing (:class:`~aiodla.Detect`)
has something to find where there is no DLA.

``aiodla emulate --preset yolov5s`` writes YOLOv5s' I/O (a 3x640x640 FP16 input; heads
255x80x80, 255x40x40 and 255x20x20, FP16) with this op. The arithmetic (the format's
definition, see :mod:`aiodla.emulator._format`): with the op mix's digest ``D`` taken
over the inputs' elements on an 8 x 8 grid of (h, w) (``_ops.DETECT_GRID``), and mix's
``K[o]`` and draw ``r(i) = F(K[o] + (i + 1) * G)``, output o (shape 1 x 3(5+k) x H x W:
three anchors of k classes) has cells i = (a*H + y)*W + x; cell i holds an object when
``r >> 48 < floor(16 * 2**16 / (3*H*W))`` (16 objects an output, expected) and the cell
lies in the picture. Channels of anchor a at (y, x), as logits: without an object 0, objectness -8;
with one, x, y, w, h = ``((r >> s) & 255) / 128 - 1`` for s = 0, 8, 32, 40, objectness
4, class ``(r >> 16) % k`` 4 and the other classes -4. Values are exact in float16.

*In the picture*: with input 0 of logical size h x w, cell (y, x) of an H x W output
covers its pixels from (``y*h // H``, ``x*w // W``) to (``((y+1)*h - 1) // H``,
``((x+1)*w - 1) // W``); it lies in the picture when each of these two pixels differs
from pixel (0, 0) in the stored bits of some channel (batch 0). A letterbox's padding is
uniform and includes pixel (0, 0), so no object sits in it: the decoded box's centre
lies in its cell, hence in the picture, as a real detector's would. A picture that
happens to match pixel (0, 0) at a cell's corners gets no object there, and the cell
holding pixel (0, 0) never holds one.

The work is sparse: a head is the background (zeros, objectness -8) with the object
cells written over it. The emulated runtime reads, from the input buffers as they lie,
only the digest's grid and the object cells' corner pixels, then fills each output's
bytes with zeros, its three objectness planes with -8, and writes the few object cells'
channels at their offsets (:func:`write_heads`): a task never passes over a whole
input, and over its outputs only to fill them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._tensors import TensorSpec
from ._detect_heads import ANCHORS
from ._detect_heads import check_detect_outputs as check_detect_outputs
from ._draws import _OUTPUT_STEP, _finalize, _finalize_int, _stream
from ._elements import element_offsets, laid_bits

__all__ = [
    "PRESETS",
    "PRESETS_HELP",
    "check_detect_outputs",
    "detect_heads",
    "laid_picture",
    "logical_picture",
    "objects",
    "preset_io",
    "write_heads",
]

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


class Objects(NamedTuple):
    """The object cells of one output, in cell order, and their channels' values."""

    anchor: np.ndarray[Any, Any]  # (n,) int64
    y: np.ndarray[Any, Any]
    x: np.ndarray[Any, Any]
    values: np.ndarray[Any, Any]  # (n, 5 + k) float64: the anchor's channels


class Picture(NamedTuple):
    """Input 0 as the in-the-picture test reads it: its height and width, and the stored
    bits of every channel of batch 0 at given rows and columns, ``(channels, n)``."""

    height: int
    width: int
    pixels: Callable[[np.ndarray[Any, Any], np.ndarray[Any, Any]], np.ndarray[Any, Any]]


def logical_picture(stored: np.ndarray[Any, Any]) -> Picture:
    """The picture of input 0's stored values in their logical shape."""
    flat = np.ascontiguousarray(stored[0])
    bits = flat.view(np.dtype(f"<u{flat.dtype.itemsize}"))  # (c, h, w)
    return Picture(bits.shape[1], bits.shape[2], lambda y, x: bits[:, y, x])


def laid_picture(spec: TensorSpec, raw: np.ndarray[Any, Any]) -> Picture:
    """The picture of input 0 as its buffer ``raw`` (uint8) holds it in ``spec``'s
    layout: only the pixels asked for are read."""
    _, channels, height, width = spec.shape
    planes = np.arange(channels)[:, None]

    def pixels(y: np.ndarray[Any, Any], x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        bits: np.ndarray[Any, Any] = laid_bits(raw, spec, element_offsets(spec, 0, planes, y, x))
        return bits

    return Picture(height, width, pixels)


def objects(spec: TensorSpec, o: int, digest: int, picture: Picture | None) -> Objects:
    """Output ``o``'s object cells for the digest ``D`` and input 0's ``picture`` (None:
    no input, every cell in the picture)."""
    _, channels, height, width = spec.shape
    per, plane = channels // _ANCHORS, height * width
    key = _finalize_int((digest + (o + 1) * _OUTPUT_STEP) & _MASK)
    draws = _stream(key, _ANCHORS * plane)
    _finalize(draws, np.empty_like(draws))
    threshold = max(1, (_OBJECTS << 16) // (_ANCHORS * plane))
    cell = np.flatnonzero((draws >> np.uint64(48)) < threshold)
    anchor, rest = np.divmod(cell, plane)
    y, x = np.divmod(rest, width)
    if picture is not None and len(cell):
        inside = _in_picture(picture, y, x, height, width)
        cell, anchor, y, x = cell[inside], anchor[inside], y[inside], x[inside]
    r = draws[cell]
    values = np.full((len(cell), per), -4.0)
    for channel, shift in enumerate((0, 8, 32, 40)):
        field = (r >> np.uint64(shift)) & np.uint64(255)
        values[:, channel] = field.astype(np.float64) / 128.0 - 1.0
    values[:, 4] = 4.0
    best = ((r >> np.uint64(16)) % np.uint64(per - 5)).astype(np.int64)
    values[np.arange(len(cell)), 5 + best] = 4.0
    return Objects(anchor, y, x, values)


def _in_picture(
    picture: Picture,
    y: np.ndarray[Any, Any],
    x: np.ndarray[Any, Any],
    height: int,
    width: int,
) -> np.ndarray[Any, Any]:
    """Whether cells (y, x) of a ``height`` x ``width`` output lie in the picture (the
    module's docstring): only the object cells' corners are read."""
    h, w, pixels = picture
    # one read: pixel (0, 0), then every cell's first pixel, then every cell's last
    zero = np.zeros(1, np.int64)
    rows = np.concatenate((zero, y * h // height, ((y + 1) * h - 1) // height))
    columns = np.concatenate((zero, x * w // width, ((x + 1) * w - 1) // width))
    bits = pixels(rows, columns)  # (c, 1 + 2n)
    differs = (bits[:, 1:] != bits[:, :1]).any(axis=0)
    inside: np.ndarray[Any, Any] = differs[: len(y)] & differs[len(y) :]
    return inside


@functools.lru_cache(maxsize=32)
def _background(spec: TensorSpec) -> np.ndarray[Any, Any]:
    """An output without objects, logical and read-only: zeros, objectness -8."""
    _, channels, height, width = spec.shape
    logical = np.zeros((_ANCHORS, channels // _ANCHORS, height * width), np.float64)
    logical[:, 4, :] = -8.0
    stored = logical.reshape(spec.shape).astype(spec.numpy_dtype)
    stored.flags.writeable = False
    return stored


def detect_heads(
    outputs: Sequence[TensorSpec], digest: int, image: np.ndarray[Any, Any] | None = None
) -> list[np.ndarray[Any, Any]]:
    """Every output of the op for the inputs' digest ``D`` (the op mix's, step 2) and
    input 0's stored values ``image`` (logical shape), in its stored type and logical
    shape."""
    picture = None if image is None else logical_picture(image)
    results = []
    for o, spec in enumerate(outputs):
        found = objects(spec, o, digest, picture)
        head = _background(spec).copy()
        per = spec.shape[1] // _ANCHORS
        channel = found.anchor[:, None] * per + np.arange(per)
        head[0, channel, found.y[:, None], found.x[:, None]] = found.values
        results.append(head)
    return results


def write_heads(
    raws: Sequence[np.ndarray[Any, Any]],
    outputs: Sequence[TensorSpec],
    digest: int,
    picture: Picture | None,
) -> None:
    """Write every output into its buffer's bytes ``raws`` (uint8, the DLA layout), as
    :func:`detect_heads` gives it and packing would lay it out: zeros, each anchor's
    objectness plane -8, then the object cells' channels at their offsets. Every byte is
    written."""
    for o, (raw, spec) in enumerate(zip(raws, outputs, strict=True)):
        # Zeros are the background but for three planes: filling is a store per byte
        # where copying a kept background would also load one.
        raw.fill(0)
        for plane in _objectness_planes(raw, spec):
            plane.fill(-8.0)
        found = objects(spec, o, digest, picture)
        if not len(found.y):
            continue
        esize = spec.numpy_dtype.itemsize
        per = spec.shape[1] // _ANCHORS
        channel = found.anchor[:, None] * per + np.arange(per)  # (n, per)
        at = element_offsets(spec, 0, channel, found.y[:, None], found.x[:, None])
        values = found.values.astype(spec.numpy_dtype).view(np.uint8).reshape(-1, esize)
        raw[at.reshape(-1, 1) + np.arange(esize)] = values


def _objectness_planes(raw: np.ndarray[Any, Any], spec: TensorSpec) -> list[np.ndarray[Any, Any]]:
    """Each anchor's objectness channel of ``raw`` as an (H, W) view in the layout."""
    assert spec.strides is not None
    pixel, line, _, _ = spec.strides
    _, channels, height, width = spec.shape
    per = channels // _ANCHORS
    return [
        np.ndarray(
            (height, width),
            spec.numpy_dtype,
            buffer=raw,
            offset=int(element_offsets(spec, 0, a * per + 4, 0, 0)),
            strides=(line, pixel),
        )
        for a in range(_ANCHORS)
    ]
