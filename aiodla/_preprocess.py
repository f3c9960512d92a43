"""Camera frames into a model input: colour conversion, resize, letterbox and
normalization, defined to the bit, and its numpy implementation.

:class:`ImagePreprocess` is set per input tensor. The engine validates each frame with
:meth:`~ImagePreprocess.check_frame` before anything is queued; :meth:`~ImagePreprocess.apply`
writes the logical float32 ``(1, 3, H, W)`` array that :meth:`TensorSpec.pack
<aiodla.TensorSpec.pack>` then converts into the tensor's dtype and DLA layout (FP16
round to nearest even, INT8 quantization): that step is not repeated here. This numpy
code is the emulated runtime's implementation and the reference a GPU kernel reproduces
bit for bit; OpenCV is the tests' reference, which it matches within one pixel level.

Arithmetic
----------
Hf x Wf is the frame, H x W the model input, and the frame is resized to h x w and
placed at (top, left) as :meth:`ImagePreprocess.geometry` says (letterbox: s = min(H/Hf,
W/Wf), w = round(Wf*s), h = round(Hf*s), half to even and at least 1, left = (W - w) // 2,
top = (H - h) // 2; stretch: h x w = H x W at (0, 0); None: the frame is the input).
``f32(x)`` is x rounded to the nearest float32, ties to even. Each float32 operation
below is one IEEE-754 operation rounded to nearest even, in the order written, never
fused into an FMA (on CUDA: ``__fadd_rn``, ``__fsub_rn``, ``__fmul_rn``, ``__fdiv_rn``,
or ``-fmad=false``).

1. **Pixels**, uint8 R, G, B at frame pixel (y, x).
   bgr, rgb, bgra, rgba: the bytes at (y, x); alpha is ignored.
   nv12 (BT.601, nearest chroma; limited range exactly OpenCV's ``COLOR_YUV2RGB_NV12``):
   Y = a[y, x], U = a[Hf + y//2, 2*(x//2)], V = a[Hf + y//2, 2*(x//2) + 1].
   i420 (the same; limited range exactly OpenCV's ``COLOR_YUV2RGB_I420``): Y = a[y, x],
   and U, V at chroma row r = y//2 (U) or r = Hf/2 + y//2 (V), column c = x//2, which lies at
   a[Hf + r//2, (r % 2)*(Wf/2) + c] (two chroma rows of Wf/2 bytes to an array row).
   Then, for both, in int32 (no intermediate overflows), with ``>>`` an arithmetic
   shift, for ``color_range="limited"`` (BT.601 limited range, 16..235: what H.264 and
   H.265 cameras send)::

       l = max(Y - 16, 0) * 1220542 + 2**19
       R = clamp((l + 1673527 * (V - 128)) >> 20, 0, 255)
       G = clamp((l - 852492 * (V - 128) - 409993 * (U - 128)) >> 20, 0, 255)
       B = clamp((l + 2116026 * (U - 128)) >> 20, 0, 255)

   and for ``color_range="full"`` (BT.601 full range, 0..255, as JPEG codes it: an MJPEG
   camera's ``yuvj420p``), exactly OpenCV's ``COLOR_YCrCb2RGB`` of Y and the U, V taken
   above (its 14-bit coefficients, times 64)::

       l = Y * 2**20 + 2**19
       R = clamp((l + 1471168 * (V - 128)) >> 20, 0, 255)
       G = clamp((l - 748672 * (V - 128) - 360704 * (U - 128)) >> 20, 0, 255)
       B = clamp((l + 1859136 * (U - 128)) >> 20, 0, 255)

   Model channel k reads R, G or B as ``order`` says.
2. **Sample tables**, per axis, in float64 (each operation rounded to double; OpenCV
   INTER_LINEAR's half-pixel centres and border clamp), for output index d in [0, n) of
   an axis resized from m pixels to n::

       src = (d + 0.5) * (m / n) - 0.5;   i = floor(src);   t = src - i
       if i < 0:      i, t = 0, 0
       if i >= m - 1: i, t = m - 1, 0
       i0 = i;   i1 = min(i + 1, m - 1);   f = f32(t)

3. **Interpolation**, float32: with y0, y1, fy the vertical and x0, x1, fx the horizontal
   table entries, and p(y, x) a pixel converted exactly to float32::

       a = p(y0, x0);  b = p(y0, x1);  c = p(y1, x0);  d = p(y1, x1)
       upper = a + fx * (b - a);   lower = c + fx * (d - c)
       v = upper + fy * (lower - upper)

   v is not rounded to an integer. With f == 0 a step gives its first operand exactly,
   so resize=None (and any axis whose size does not change) gives the pixels themselves,
   and v always lies between the smallest and largest of a, b, c, d.
4. **Letterbox**: outside rows [top, top + h) and columns [left, left + w), v = pad_value.
5. **Normalization**, float32, model channel k:
   ``y = (v * f32(scale) - f32(mean[k])) / f32(std[k])``.

v matches OpenCV's float32 ``cv2.resize`` (INTER_LINEAR) to float32 rounding. Its uint8
resize rounds the result and weighs with 11-bit fixed-point coefficients: v differs from
it by less than one level (0.82 at most in the tests, on random pixels).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from ._errors import ConfigurationError, InputTypeError, InputValueError
from ._frame_plan import (
    _ORDERS,
    _PACKED,
    _PLANAR,
    _YUV_COEFFICIENTS,
    Geometry,
    _geometry,
    _Plan,
    _plan,
)
from ._frame_plan import _axis as _axis  # (the kernels' tests compare with it here)
from ._tensors import TensorSpec
from ._video_frame import VideoFrame

__all__ = ["Geometry", "ImagePreprocess", "preprocessing_for", "video_frame_pixels"]

_Array = np.ndarray[Any, Any]

Source = Literal["bgr", "rgb", "bgra", "rgba", "nv12", "i420"]
Order = Literal["rgb", "bgr"]
Resize = Literal["letterbox", "stretch"]

_RESIZES = ("letterbox", "stretch", None)

#: Frames are limited so that every offset into a frame, and into the staging buffer
#: sized from ``max_frame``, fits a signed 32-bit int in the GPU kernel
#: (16384 * 16384 * 4 bytes < 2**31).
_MAX_SIDE = 16384

#: Rows of the output interpolated at once: the temporaries of one block (rows x C x w
#: float32) stay within L2 cache, which more than pays for the extra numpy calls.
_BLOCK_ELEMENTS = 1 << 15

# nv12 and i420 in OpenCV's fixed point (modules/imgproc/src/color_yuv.simd.hpp, ITUR_BT_601_*),
# split into 256-entry tables per operand; the rounding term 2**19 rides on the Y table.
_LEVELS = np.arange(256, dtype=np.int32)


def _terms(black: int, gain: int, rv: int, gv: int, gu: int, bu: int) -> tuple[_Array, ...]:
    """The tables of one YUV range (module docstring, step 1): Y's, then R's of V, G's
    of V, G's of U and B's of U."""
    chroma = _LEVELS - 128
    tables = (
        np.maximum(_LEVELS - black, 0) * gain + (1 << 19),
        chroma * rv,
        chroma * gv,
        chroma * gu,
        chroma * bu,
    )
    for table in tables:
        table.flags.writeable = False
    return tables


_TERMS = {name: _terms(*values) for name, values in _YUV_COEFFICIENTS.items()}
ColorRange = Literal["limited", "full"]
_RANGE_LEVELS = {"limited": "16..235, as H.264 and H.265 send", "full": "0..255, as JPEG codes"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImagePreprocess:
    """Pre-processing of camera frames for one model input tensor.

    ``ImagePreprocess(source="bgr", order="rgb", resize="letterbox", mean=(0.485, 0.456,
    0.406), std=(0.229, 0.224, 0.225))``:

    - ``source``: the frames' pixel format, ``"bgr"``, ``"rgb"``, ``"bgra"``, ``"rgba"``
      (H x W x C uint8; alpha is ignored), ``"nv12"`` or ``"i420"`` (YUV 4:2:0, BT.601
      in ``color_range``'s levels, one (H*3/2) x W uint8 array, H and W even: the Y
      plane H x W, then nv12: U, V interleaved at half resolution in H/2 rows; i420:
      the U plane, then the V plane, each (H/2) x (W/2), packed row after row into
      those H/2 rows, as FFmpeg's decoders give them);
    - ``color_range``: for ``"nv12"`` and ``"i420"``, the YUV levels the frames use:
      ``"limited"`` (16..235, what H.264 and H.265 cameras send) or ``"full"`` (0..255,
      as JPEG codes them: a USB camera's MJPEG). A :class:`~aiodla.VideoFrame` says its
      own (``frame.color_range``), and must match;
    - ``order``: the model's channel order, ``"rgb"`` or ``"bgr"``;
    - ``resize``: ``"letterbox"`` (keep the aspect ratio, centre on a canvas of
      ``pad_value``), ``"stretch"`` (each axis to the model's size) or ``None`` (frames
      must already have the model's height and width);
    - ``pad_value``: the letterbox canvas, an integer level 0..255 before normalization;
    - ``scale``, ``mean``, ``std``: ``y = (x * scale - mean[k]) / std[k]``; ``mean`` and
      ``std`` are a number or one per channel in the model's ``order``, each finite
      (``std`` > 0) as the float32 the normalization computes in, and such that no
      level 0..255 normalizes to inf (``std=1e-300`` is refused: it is 0 in float32);
    - ``max_frame``: the largest frame (height, width) accepted, in either orientation,
      each side at most 16384 (for nv12 and i420, the image's size, not the array's);
      the engine sizes staging buffers from it when it opens.

    An input with pre-processing takes frames of any size up to ``max_frame``: an
    array, or an :class:`~aiodla.VideoFrame` whose ``format`` is ``source``, on the host
    (read in place from the engine's frame buffers) or, with device conversion, in
    device memory (NVDEC's, say: DLPack or the CUDA array interface, read where it lies
    by the pre-processing kernel on the slot's stream; rows may be pitched).

    The module docstring defines the arithmetic to the bit.
    """

    source: Source
    order: Order
    resize: Resize | None
    pad_value: int = 114
    scale: float = 1 / 255
    mean: float | Sequence[float] = 0.0
    std: float | Sequence[float] = 1.0
    max_frame: tuple[int, int] = (1080, 1920)
    color_range: ColorRange = "limited"
    # float32 scale, mean and std (3, 1), and the normalized canvas per channel (3, 1, 1)
    _constants: tuple[_Array, _Array, _Array, _Array] = dataclasses.field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.source not in _PACKED and self.source not in _PLANAR:
            raise ConfigurationError(
                f"source={self.source!r} must be 'bgr', 'rgb', 'bgra', 'rgba', 'nv12' or 'i420'"
            )
        if self.order not in _ORDERS:
            raise ConfigurationError(f"order={self.order!r} must be 'rgb' or 'bgr'")
        if self.resize not in _RESIZES:
            raise ConfigurationError(
                f"resize={self.resize!r} must be 'letterbox', 'stretch' or None"
            )
        if self.color_range not in _TERMS:
            raise ConfigurationError(
                f"color_range={self.color_range!r} must be 'limited' or 'full'"
            )
        if self.color_range != "limited" and self.source not in _PLANAR:
            raise ConfigurationError(
                f"color_range={self.color_range!r} is for YUV frames (source 'nv12' or "
                f"'i420'); {self.source} frames are RGB levels already"
            )
        pad = self.pad_value
        if not _is_real(pad) or not (0 <= pad <= 255 and int(pad) == pad):
            raise ConfigurationError(f"pad_value={pad!r} must be an integer level 0..255")
        object.__setattr__(self, "pad_value", int(pad))
        scale = self.scale
        if not _is_real(scale) or not (math.isfinite(scale) and scale > 0):
            raise ConfigurationError(f"scale={scale!r} must be a finite number > 0")
        object.__setattr__(self, "scale", float(scale))
        mean = _per_channel("mean", self.mean, positive=False)
        std = _per_channel("std", self.std, positive=True)
        _check_float32(scale, mean, std)
        object.__setattr__(self, "mean", mean)
        object.__setattr__(self, "std", std)
        object.__setattr__(self, "max_frame", _max_frame(self.max_frame))
        # (3, 1) broadcasts over the (rows, channel, column) blocks of apply
        column = (3, 1)
        f32 = np.float32
        constants = (
            np.full(column, self.scale, f32),
            np.array(mean, f32).reshape(column),
            np.array(std, f32).reshape(column),
        )
        canvas = ((f32(self.pad_value) * constants[0] - constants[1]) / constants[2])[:, None]
        for array in (*constants, canvas):
            array.flags.writeable = False
        object.__setattr__(self, "_constants", (*constants, canvas))

    # -- sizes -----------------------------------------------------------------------

    @property
    def max_frame_nbytes(self) -> int:
        """Bytes of the largest frame accepted: what a staging buffer must hold."""
        height, width = self.max_frame
        if self.source in _PLANAR:
            return (height // 2) * (width // 2) * 6
        return height * width * _PACKED[self.source]

    def geometry(self, frame_height: int, frame_width: int, height: int, width: int) -> Geometry:
        """Where a frame of ``frame_height`` x ``frame_width`` lands in a model input of
        ``height`` x ``width``: a pure function of the sizes (see :class:`Geometry`).

        letterbox: s = min(height/frame_height, width/frame_width), the frame resized to
        round(frame_width*s) x round(frame_height*s) (Python's round, half to even; at
        least 1) at left = (width - new_width) // 2, top = (height - new_height) // 2.
        stretch: scale NaN, top = left = 0, scale_y = height/frame_height, scale_x =
        width/frame_width. None: the sizes must be equal; scale 1, top = left = 0.
        """
        sizes: list[int] = []
        for given in (frame_height, frame_width, height, width):
            size = _integer(given)
            if size is None:
                raise InputTypeError(f"geometry takes integer sizes, got {given!r}")
            if not 1 <= size <= _MAX_SIDE:
                raise InputValueError(f"geometry: size {given!r} is not within 1..{_MAX_SIDE}")
            sizes.append(size)
        if self.resize is None and (frame_height, frame_width) != (height, width):
            raise InputValueError(
                f"resize=None takes frames of the model's size {height}x{width} only, "
                f"got {frame_height}x{frame_width}"
            )
        return _geometry(self.resize, *sizes)

    # -- validation ------------------------------------------------------------------

    def check_target(self, spec: TensorSpec) -> None:
        """Refuse a model tensor these frames cannot feed (the engine calls it at open):
        not one image of 3 channels, an integer tensor with no quantization scale, or,
        with resize=None, a model input larger than ``max_frame``."""
        n, channels, height, width = spec.shape
        where = f"input {spec.name!r} ({n}x{channels}x{height}x{width} {spec.dtype})"
        if channels != 3:
            raise ConfigurationError(
                f"{where}: ImagePreprocess feeds 3 channels ({self.order}), the tensor has "
                f"{channels}"
            )
        if n != 1:
            raise ConfigurationError(f"{where}: ImagePreprocess feeds one image, n is {n}")
        if spec.is_integer and spec.scale is None:
            raise ConfigurationError(
                f"{where}: an integer tensor fed by ImagePreprocess needs its quantization "
                f"scale (Engine(..., scales={{{spec.name!r}: ...}}))"
            )
        if self.resize is None and (height > self.max_frame[0] or width > self.max_frame[1]):
            raise ConfigurationError(
                f"{where}: resize=None takes frames of {height}x{width}, larger than "
                f"max_frame={self.max_frame}"
            )

    def check_frame(self, value: Any, spec: TensorSpec) -> _Array:
        """``value`` validated as a frame for ``spec``, and returned as an ndarray (no copy).

        InputTypeError: not an array, or not uint8. InputValueError: not H x W x C with C
        matching ``source`` (nv12, i420: not (H*3/2) x W with W even), empty, larger than
        ``max_frame``, or, with resize=None, not the model's height and width. Messages
        name the tensor.
        """
        name = spec.name
        if isinstance(value, np.ma.MaskedArray):
            raise InputTypeError(
                f"input {name!r}: a masked array's mask would be ignored; pass value.filled(...)"
            )
        try:
            array = np.asarray(value)
        except Exception as exc:
            raise InputTypeError(
                f"input {name!r}: expected a uint8 {self.source} frame, got "
                f"{type(value).__name__} ({exc})"
            ) from None
        if array.dtype != np.uint8:
            raise InputTypeError(
                f"input {name!r}: a {self.source} frame must be uint8, got {array.dtype}"
            )
        self.check_frame_shape(array.shape, spec)
        return array

    def check_frame_shape(self, shape: tuple[int, ...], spec: TensorSpec) -> tuple[int, int]:
        """The (height, width) of a frame array of ``shape`` (the image's size for nv12
        and i420), raising the InputValueError :meth:`check_frame` raises for a shape
        that is not a frame for ``spec``: what a device frame is checked against."""
        name = spec.name
        frame_height, frame_width = self._frame_size(name, shape)
        # Either orientation: a camera turned to portrait fits the same staging buffer.
        # (The larger side within the larger limit and the smaller within the smaller,
        # written without min and max: this runs once a request.)
        limit_a, limit_b = self.max_frame
        if not (
            (frame_height <= limit_a and frame_width <= limit_b)
            or (frame_height <= limit_b and frame_width <= limit_a)
        ):
            raise InputValueError(
                f"input {name!r}: a {frame_height}x{frame_width} frame is larger than "
                f"max_frame={self.max_frame} (height, width; or turned by 90 degrees)"
            )
        height, width = spec.shape[2:]
        if self.resize is None and (frame_height, frame_width) != (height, width):
            raise InputValueError(
                f"input {name!r}: with resize=None a frame must be the model's "
                f"{height}x{width}, got {frame_height}x{frame_width}"
            )
        return frame_height, frame_width

    def _frame_size(self, name: str, shape: tuple[int, ...]) -> tuple[int, int]:
        """The frame's (height, width) from its array shape, which must fit ``source``."""
        if self.source in _PLANAR:
            if len(shape) != 2 or shape[0] % 3 or min(shape) < 1:
                chroma = "interleaved UV" if self.source == "nv12" else "U plane, V plane"
                raise InputValueError(
                    f"input {name!r}: an {self.source} frame is one (H*3/2) x W uint8 array "
                    f"(Y plane, then {chroma}), got shape {shape}"
                )
            # rows = 3m makes the height 2m: only the width can be odd
            height, width = shape[0] * 2 // 3, shape[1]
            if width % 2:
                raise InputValueError(
                    f"input {name!r}: an {self.source} frame has an even width, got {width} "
                    f"(array shape {shape})"
                )
            return height, width
        channels = _PACKED[self.source]
        if len(shape) != 3 or shape[2] != channels or min(shape) < 1:
            raise InputValueError(
                f"input {name!r}: a {self.source} frame is H x W x {channels} uint8, "
                f"got shape {shape}"
            )
        return shape[0], shape[1]

    # -- the numpy implementation ------------------------------------------------------

    def apply(
        self, frame: Any, spec: TensorSpec, out: _Array | None = None, *, validate: bool = True
    ) -> _Array:
        """The model input for ``frame``: float32 logical ``(1, 3, H, W)``, as the module
        docstring defines it, written into ``out`` when given (a float32 array of that
        shape). ``validate=False`` skips :meth:`check_frame` for a frame that passed it.
        """
        array = self.check_frame(frame, spec) if validate else np.asarray(frame)
        height, width = spec.shape[2:]
        if out is None:
            out = np.empty((1, 3, height, width), np.float32)
        elif out.shape != (1, 3, height, width) or out.dtype != np.float32:
            raise InputValueError(
                f"input {spec.name!r}: out must be float32 of shape (1, 3, {height}, "
                f"{width}), got {out.dtype} {out.shape}"
            )
        frame_size = self._frame_size(spec.name, array.shape)
        plan = _plan(self.source, self.order, self.resize, *frame_size, height, width)
        top, left = plan.geometry.top, plan.geometry.left
        rows, columns = len(plan.y0), len(plan.x0)
        scale, mean, std, canvas = self._constants
        if rows < height or columns < width:
            # the canvas, only where the frame does not cover it
            planes = out[0]
            for region in (
                planes[:, :top],
                planes[:, top + rows :],
                planes[:, top : top + rows, :left],
                planes[:, top : top + rows, left + columns :],
            ):
                region[...] = canvas
        # (rows, channel, column) views: the row blocks below are contiguous per row
        target = out[0, :, top : top + rows, left : left + columns].transpose(1, 0, 2)
        array = np.ascontiguousarray(array)
        step = max(1, _BLOCK_ELEMENTS // (3 * columns))
        terms = _TERMS[self.color_range]
        for start in range(0, rows, step):
            block = slice(start, min(start + step, rows))
            value = _interpolate(array, plan, block, terms)
            view = target[block]
            np.multiply(value, scale, out=view)
            np.subtract(view, mean, out=view)
            np.divide(view, std, out=view)
        return out


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _check_float32(
    scale: float, mean: tuple[float, float, float], std: tuple[float, float, float]
) -> None:
    """ConfigurationError naming the value unless normalization, which computes in float32
    (step 5), stays finite and tells pixels apart: a finite float64 such as ``std=1e-300``
    or ``scale=1e300`` is 0 or inf as a float32, and would turn every input into inf
    (or every pixel into one value)."""
    f32 = np.float32
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        if not 0 < f32(scale) < np.inf:
            raise ConfigurationError(
                f"scale={scale!r} is {float(f32(scale))} as a float32 (normalization computes "
                "in float32): it must be a finite number > 0 there"
            )
        for name, values in (("mean", mean), ("std", std)):
            for value in values:
                as_f32 = f32(value)
                if not (np.isfinite(as_f32) and (name == "mean" or as_f32 > 0)):
                    raise ConfigurationError(
                        f"{name}={value!r} is {float(as_f32)} as a float32 (normalization "
                        f"computes in float32): it must be finite{' and > 0' * (name == 'std')} "
                        "there"
                    )
        for k in range(3):
            for level in (0, 255):  # v lies within the levels (steps 3, 4): y at the ends
                y = (f32(level) * f32(scale) - f32(mean[k])) / f32(std[k])
                if not np.isfinite(y):
                    raise ConfigurationError(
                        f"scale={scale!r}, mean={mean[k]!r} and std={std[k]!r} normalize level "
                        f"{level} to {float(y)} in float32: every input would hold inf"
                    )


def _per_channel(name: str, value: object, *, positive: bool) -> tuple[float, float, float]:
    """A number or three, finite (and > 0 when ``positive``), as three floats."""
    if _is_real(value):
        values: list[object] = [value] * 3
    elif isinstance(value, (Sequence, np.ndarray)) and not isinstance(value, (str, bytes)):
        values = list(value)
    else:
        values = []
    if len(values) != 3 or not all(_is_real(v) for v in values):
        raise ConfigurationError(
            f"{name}={value!r} must be a number or 3 numbers (one per channel, in the "
            "model's order)"
        )
    floats = [float(v) for v in values]  # type: ignore[arg-type]
    if not all(math.isfinite(v) and (v > 0 or not positive) for v in floats):
        bound = "finite and > 0" if positive else "finite"
        raise ConfigurationError(f"{name}={value!r} must be {bound}")
    return floats[0], floats[1], floats[2]


def _integer(value: object) -> int | None:
    """``value`` as an int when it is an integer (bool excluded), else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _max_frame(value: object) -> tuple[int, int]:
    sides = [_integer(s) for s in value] if isinstance(value, (tuple, list)) else []
    if len(sides) != 2 or not all(s is not None and 1 <= s <= _MAX_SIDE for s in sides):
        raise ConfigurationError(
            f"max_frame={value!r} must be (height, width), integers 1..{_MAX_SIDE}"
        )
    return sides[0], sides[1]  # type: ignore[return-value]


def _rows(frame: _Array, plan: _Plan, which: _Array) -> tuple[_Array, ...]:
    """The frame rows ``which`` (packed: one array of bytes per row; nv12: the Y rows
    and the UV rows that go with them; i420: the Y rows, the U rows and the V rows)."""
    if plan.planar is None:
        return (frame.reshape(frame.shape[0], -1).take(which, axis=0),)
    height = frame.shape[0] * 2 // 3
    luma, chroma = frame[:height].take(which, axis=0), frame[height:]
    if plan.planar == "nv12":
        return luma, chroma.take(which // 2, axis=0)
    # A C-contiguous frame (apply made it one): the chroma bytes are the U plane then
    # the V plane, each (height/2) x (width/2), exactly as the docstring's indices say.
    planes = chroma.reshape(2, height // 2, frame.shape[1] // 2)
    return luma, planes[0].take(which // 2, axis=0), planes[1].take(which // 2, axis=0)


def _pixels(
    rows: tuple[_Array, ...], plan: _Plan, second: bool, terms: tuple[_Array, ...]
) -> _Array:
    """float32 (rows, channel, column) pixels at columns x0 (x1 when ``second``);
    ``terms``: the YUV range's tables (planar sources)."""
    columns = plan.columns1 if second else plan.columns0
    if plan.planar is None:
        (packed,) = rows
        return packed.take(columns, axis=1).reshape(len(packed), 3, -1).astype(np.float32)
    luma = rows[0]
    y = luma.take(plan.x1 if second else plan.x0, axis=1)
    u = rows[1].take(columns, axis=1)
    if plan.planar == "nv12":  # V follows U in the UV row
        v = rows[1].take(columns + 1, axis=1)
    else:  # i420: V at the same column of its own plane
        v = rows[2].take(columns, axis=1)
    y_term, rv_term, gv_term, gu_term, bu_term = terms
    base = y_term.take(y)
    result = np.empty((len(luma), 3, y.shape[1]), np.float32)
    for channel, lane in enumerate(plan.lanes):
        if lane == 0:
            level = base + rv_term.take(v)
        elif lane == 1:
            level = base + gv_term.take(v)
            level += gu_term.take(u)
        else:
            level = base + bu_term.take(u)
        level >>= 20
        np.clip(level, 0, 255, out=level)
        result[:, channel] = level
    return result


def _interpolate(frame: _Array, plan: _Plan, block: slice, terms: tuple[_Array, ...]) -> _Array:
    """float32 v (module docstring, step 3) for output rows ``block`` of the resized
    frame, as (rows, channel, column)."""
    fx = plan.fx
    rows = _rows(frame, plan, plan.y0[block])
    upper = _pixels(rows, plan, False, terms)
    if plan.blend_x:
        step = _pixels(rows, plan, True, terms)
        step -= upper
        step *= fx
        upper += step
    if not plan.blend_y:
        return upper
    rows = _rows(frame, plan, plan.y1[block])
    lower = _pixels(rows, plan, False, terms)
    if plan.blend_x:
        step = _pixels(rows, plan, True, terms)
        step -= lower
        step *= fx
        lower += step
    lower -= upper
    lower *= plan.fy[block]
    upper += lower
    return upper


def video_frame_pixels(
    frame: VideoFrame, spec: TensorSpec, pre: ImagePreprocess | None
) -> tuple[Any, tuple[int, int]]:
    """The array of a :class:`~aiodla.VideoFrame` given for input ``spec``, and the
    shape its array must have, once the frame is checked against the input's
    pre-processing ``pre``: an InputError when the input takes no frames, when the
    frame's format is not the one ``pre`` reads, or when its array does not hold the
    planes its width and height say (the array itself is then checked as any frame)."""
    name = spec.name
    if pre is None:
        raise InputTypeError(
            f"input {name!r}: a VideoFrame goes to an input with an ImagePreprocess; this "
            f"input takes tensors of shape {spec.shape} ({spec.dtype})"
        )
    if frame.format != pre.source:
        raise InputValueError(
            f"input {name!r}: the frame is {frame.format}, and this engine pre-processes "
            f"{pre.source} frames (ImagePreprocess(source={pre.source!r})); open the engine "
            f"with ImagePreprocess(source={frame.format!r}) for this source's frames"
        )
    if frame.color_range != pre.color_range:
        raise InputValueError(
            f"input {name!r}: the frame's YUV levels are {frame.color_range} range "
            f"({_RANGE_LEVELS[frame.color_range]}), and this engine reads "
            f"{pre.color_range} range (ImagePreprocess(color_range={pre.color_range!r})); "
            f"open the engine with ImagePreprocess(source={pre.source!r}, "
            f"color_range={frame.color_range!r}) for this source's frames"
        )
    array = frame.array
    expected = (frame.height * 3 // 2, frame.width)
    is_host = isinstance(array, np.ndarray)
    if is_host == frame.on_device:
        where = "a host numpy array" if is_host else f"a {type(array).__name__}"
        raise InputValueError(
            f"input {name!r}: the VideoFrame says on_device={frame.on_device}, and its "
            f"array is {where}"
        )
    if is_host and (array.shape != expected or array.dtype != np.uint8):
        raise InputValueError(
            f"input {name!r}: the {frame.format} VideoFrame of {frame.width}x{frame.height} "
            f"holds planes of uint8 shape {expected}, its array is {array.dtype} "
            f"{array.shape}"
        )
    return array, expected


def preprocessing_for(
    inputs: Sequence[TensorSpec], preprocess: Mapping[str, ImagePreprocess]
) -> tuple[ImagePreprocess | None, ...]:
    """Each model input's pre-processing (None where it takes tensors); the names and
    the tensors they feed are checked (ConfigurationError)."""
    names = [spec.name for spec in inputs]
    unknown = sorted(set(preprocess) - set(names))
    if unknown:
        raise ConfigurationError(
            f"preprocess names {unknown}, not inputs of the model; its inputs are {names}"
        )
    frames = tuple(preprocess.get(name) for name in names)
    for spec, pre in zip(inputs, frames, strict=True):
        if pre is not None:
            pre.check_target(spec)
    return frames
