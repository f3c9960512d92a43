"""The arithmetic of camera-frame pre-processing that the host path
(:mod:`aiodla._preprocess`) and the GPU kernels' generator (``runtime/_preprocess_*``)
both follow: pixel layouts, channel orders, where a frame lands in the model input
(:class:`Geometry`) and the resize's sample tables (:func:`_plan`); and what a kernel
reads of a pre-processing (:class:`Preprocessing`). The steps themselves are defined in
``_preprocess``'s docstring.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ._errors import InputValueError
from ._tensors import TensorSpec

__all__ = ["Geometry", "Preprocessing"]

_Array = np.ndarray[Any, Any]

#: Bytes per pixel of the packed sources.
_PACKED = {"bgr": 3, "rgb": 3, "bgra": 4, "rgba": 4}
#: The planar YUV 4:2:0 sources, each one (H*3/2) x W uint8 array: the Y plane, then
#: the chroma (nv12: U and V interleaved in H/2 rows; i420: the U plane then the V plane,
#: each H/2 x W/2, packed row after row into the same H/2 rows).
_PLANAR = ("nv12", "i420")
#: Where R, G and B sit in a packed pixel (planar sources are converted to R, G, B first).
_RGB_AT = {"bgr": (2, 1, 0), "rgb": (0, 1, 2), "bgra": (2, 1, 0), "rgba": (0, 1, 2)}
_ORDERS = {"rgb": (0, 1, 2), "bgr": (2, 1, 0)}
#: Each YUV ``color_range``'s coefficients (``_preprocess``'s docstring, step 1): the
#: black level Y starts from, Y's gain, then the gains of V in R, V in G, U in G and U
#: in B, in units of 2**-20.
_YUV_COEFFICIENTS = {
    "limited": (16, 1220542, 1673527, -852492, -409993, 2116026),
    # OpenCV's YCrCb coefficients (22987, -11698, -5636, 29049 in units of 2**-14) x 64
    "full": (0, 1 << 20, 1471168, -748672, -360704, 1859136),
}


class Preprocessing(Protocol):
    """What the runtimes read of an :class:`~aiodla.ImagePreprocess`."""

    @property
    def source(self) -> str: ...
    @property
    def order(self) -> str: ...
    @property
    def resize(self) -> str | None: ...
    @property
    def pad_value(self) -> int: ...
    @property
    def scale(self) -> float: ...
    @property
    def mean(self) -> float | Sequence[float]: ...
    @property
    def std(self) -> float | Sequence[float]: ...
    @property
    def max_frame(self) -> tuple[int, int]: ...
    @property
    def color_range(self) -> str: ...
    def check_target(self, spec: TensorSpec) -> None: ...
    def apply(
        self, frame: Any, spec: TensorSpec, out: _Array | None = None, *, validate: bool = True
    ) -> _Array: ...


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Where the frame lands in the model input (:meth:`ImagePreprocess.geometry`).

    It unpacks as ``scale, top, left = preprocess.geometry(...)``.

    Frame pixel edges map linearly: ``x_model = left + x_frame * scale_x`` and
    ``y_model = top + y_frame * scale_y`` (so pixel centres map as the resize samples
    them). ``scale`` is the one factor of both axes: letterbox's s = min(H/Hf, W/Wf)
    (Ultralytics' *gain*), 1.0 for resize=None, and NaN for stretch, whose axes scale
    apart, so that a mapping that ignores ``scale_y``/``scale_x`` shows up as NaN.
    ``scale_y``/``scale_x`` are the exact factors of the resampling (h/Hf, w/Wf, with
    h x w the resized frame's size); map boxes with them, or with :meth:`to_frame`.
    """

    scale: float
    top: int
    left: int
    scale_y: float
    scale_x: float

    def __iter__(self) -> Iterator[Any]:
        return iter((self.scale, self.top, self.left))

    def to_frame(self, boxes: npt.ArrayLike) -> _Array:
        """Boxes ``(..., 4)`` as x1, y1, x2, y2 in model input pixels, mapped into frame
        pixels (float64; not clipped to the frame: a box may reach into the padding)."""
        result = np.array(boxes, dtype=np.float64)
        if result.ndim < 1 or result.shape[-1] != 4:
            raise InputValueError(f"boxes must have shape (..., 4), got {result.shape}")
        result[..., 0::2] = (result[..., 0::2] - self.left) / self.scale_x
        result[..., 1::2] = (result[..., 1::2] - self.top) / self.scale_y
        return result


@functools.lru_cache(maxsize=64)
def _geometry(
    resize: str | None, frame_height: int, frame_width: int, height: int, width: int
) -> Geometry:
    if resize == "letterbox":
        s = min(height / frame_height, width / frame_width)
        rows = min(height, max(1, round(frame_height * s)))
        columns = min(width, max(1, round(frame_width * s)))
        return Geometry(
            s, (height - rows) // 2, (width - columns) // 2, rows / frame_height,
            columns / frame_width,
        )  # fmt: skip
    if resize == "stretch":
        return Geometry(math.nan, 0, 0, height / frame_height, width / frame_width)
    return Geometry(1.0, 0, 0, 1.0, 1.0)


def _axis(source: int, target: int) -> tuple[_Array, _Array, _Array]:
    """One axis's sample table (module docstring, step 2): i0, i1 and f float32."""
    inverse = source / target
    position = (np.arange(target, dtype=np.float64) + 0.5) * inverse - 0.5
    first = np.floor(position)
    fraction = position - first
    below, beyond = first < 0, first >= source - 1
    first[below], fraction[below] = 0, 0
    first[beyond], fraction[beyond] = source - 1, 0
    i0 = first.astype(np.intp)
    return i0, np.minimum(i0 + 1, source - 1), fraction.astype(np.float32)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The tables for one (source, order, resize, frame size, model size)."""

    geometry: Geometry
    planar: str | None  # "nv12" or "i420"; None for the packed sources
    y0: _Array
    y1: _Array
    fy: _Array  # (rows, 1, 1), to broadcast over (rows, channel, column) blocks
    x0: _Array
    x1: _Array
    fx: _Array
    # False when an axis's fractions are all zero: interpolating along it would give its
    # first operand exactly, so it is skipped (1080 -> 360 takes every third row, say)
    blend_y: bool
    blend_x: bool
    # packed sources: the byte within a frame row of each (channel, column) in the
    # model's order, for x0 and x1; nv12: the byte of U within a UV row; i420: the
    # column of U (and of V) within its plane, for x0 and x1
    columns0: _Array
    columns1: _Array
    # planar sources: which of R, G, B (0, 1, 2) each model channel takes
    lanes: tuple[int, ...]


@functools.lru_cache(maxsize=32)
def _plan(
    source: str, order: str, resize: str | None, frame_height: int, frame_width: int,
    height: int, width: int,
) -> _Plan:  # fmt: skip
    geometry = _geometry(resize, frame_height, frame_width, height, width)
    if resize == "letterbox":
        rows = round(geometry.scale_y * frame_height)
        columns = round(geometry.scale_x * frame_width)
    else:
        rows, columns = height, width
    y0, y1, fy = _axis(frame_height, rows)
    x0, x1, fx = _axis(frame_width, columns)
    lanes = _ORDERS[order]
    if source == "nv12":
        columns0, columns1 = x0 // 2 * 2, x1 // 2 * 2
    elif source == "i420":
        columns0, columns1 = x0 // 2, x1 // 2
    else:
        at = np.array([_RGB_AT[source][k] for k in lanes], np.intp)[:, None]
        columns0 = (x0 * _PACKED[source] + at).ravel()
        columns1 = (x1 * _PACKED[source] + at).ravel()
    planar = source if source in _PLANAR else None
    plan = _Plan(
        geometry, planar, y0, y1, fy.reshape(-1, 1, 1), x0, x1, fx,
        bool(fy.any()), bool(fx.any()), columns0, columns1, lanes,
    )  # fmt: skip
    for table in (y0, y1, fy, x0, x1, fx, columns0, columns1):
        table.flags.writeable = False  # shared between threads through the cache
    return plan
