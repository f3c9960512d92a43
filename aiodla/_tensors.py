"""Tensor specs and DLA memory layouts, derived from cuDLA tensor descriptors.

This is the one module that knows how a logical ``(n, c, h, w)`` array is laid out in
DLA memory and how its values are converted to the stored element type. The engine
packs and unpacks through it, and so do the emulated runtime's operations: there is
no second copy of layout logic.

How a ``cudlaModuleTensorDescriptor`` is read
--------------------------------------------
Every field is read as below, and a descriptor that breaks any rule is refused with a
:class:`~aiodla.ModelError` naming the tensor and the fields; nothing is guessed or
silently corrected.

``name``
    The tensor's name: 1 to 80 ASCII bytes.
``n c h w``
    The logical shape, each >= 1.
``dataType``
    FLOAT 1 (float32), HALF 2 (float16), INT16 3, INT8 4, UINT8 5, UINT16 6 (values
    from ``cudla.h``). The element size ``E`` follows from it. Any other value is
    refused.
``dataFormat`` with ``stride[0]`` (and ``dataCategory`` for NHWC)
    ``stride[0]`` is the byte step from one pixel (one ``w``) to the next. It must be
    a positive multiple of ``E``; the number of channel *lanes* stored at each pixel is
    ``L = stride[0] / E``:

    - NCHW 1: ``L`` must be 1 (``stride[0] == E``). Format name ``nchw``.
    - NHWC 2: all channels at one pixel, so ``L >= c``; ``L > c`` means padded
      channels. With ``dataCategory`` IMAGE 0 and ``L == 4`` this is the DLA image
      input ``hwc4`` (``c`` in {1, 3, 4}); otherwise ``nhwc``.
    - NCxHWx 3: channels in groups of ``L`` lanes, ``L`` 16 (``chw16``) or 32
      (``chw32``); any other lane count is refused.
    - UNKNOWN 0 or any other value is refused.
``stride[1]``
    Line stride: bytes from one row (``h``) to the next, ``>= w * stride[0]``.
``stride[2]``
    Surface stride: bytes from one channel group to the next, ``>= h * stride[1]``.
    With one group (NHWC, hwc4) it is still checked, never used for addressing.
``stride[3]``
    Batch stride: bytes from one image (``n``) to the next, ``>= G * stride[2]`` where
    ``G = ceil(c / L)`` is the number of channel groups. Checked even when ``n == 1``.
``stride[4:8]``
    Must be zero.
``size``
    Bytes of the whole tensor buffer, cross-checked against the layout:
    ``size >= (n - 1) * stride[3] + (G - 1) * stride[2] + (h - 1) * stride[1]
    + w * stride[0]`` (the end of the last pixel). Bytes beyond are tail padding.
``pixelMapping``
    Must be 0 (pitch linear); block-linear surfaces are refused.
``dataCategory``
    Only tells hwc4 from nhwc (above); any other value is carried, not checked.
``pixelFormat``
    Not used: the layout follows from the fields above. ``to_descriptor`` writes R8
    (c == 1) or A8B8G8R8 for 8-bit hwc4 and FEATURE otherwise.

Which element types each format takes is a table (``_ACCEPTED_DTYPES``): chw16 holds
float16 only and chw32 int8 only (TensorRT's kCHW16/kCHW32), hwc4 int8, uint8 and
float16 (TensorRT's kDLA_HWC4 is FP16 or INT8; uint8 is the DLA's R8/A8B8G8R8 image
input), nchw and nhwc any of the six types. TensorRT itself emits only FP16 and INT8
for kDLA_LINEAR; the wider set is what the cuDLA descriptor can say and what emulator
loadables use. A pair outside the table is refused.

Element ``(n, c, h, w)`` then lives at byte offset::

    n * stride[3] + (c // L) * stride[2] + h * stride[1] + w * stride[0] + (c % L) * E

One formula for every format; the formats differ only in ``L`` and the strides. This
reading is aiodla's: the stride semantics of NVIDIA's own loadables were not observed
on a Jetson by this project. ``aiodla inspect`` prints the fields so a user can check.
TensorRT's alignment rules (64-byte rows for kDLA_LINEAR, 32-byte rows for
kDLA_HWC4) are the producer's business and are not enforced here.

Values
------
Packing writes every byte of a fresh buffer: element lanes with the converted values;
padding lanes, row, surface and batch padding and the tail with zeros. A
:class:`BoundTensor` zeroes its buffer once and from then on stores element lanes
only, so padding stays zero however often it is reused.

- Into float16 and float32 tensors, values are rounded to nearest even in one step
  from the source value (float64 and integer sources included); beyond float16's
  range they become infinity, and NaN stays NaN.
- Into integer tensors, float values are quantized with the tensor's ``scale``:
  ``q = round_half_even(x / scale)`` with the quotient taken in binary64, then
  saturated to the type's range (so ±inf saturate too). NaN is an input error, and
  a float array for an integer tensor without a scale is one too. Integer arrays
  are stored as they are (already quantized); only safe integer casts are taken.
- Out of integer tensors with a scale, values come back as float32
  ``float32(scale * q)``, the product taken in binary64 and rounded once.
  ``unpack(..., dtype=)`` asks for another type (float32 out of a float16 tensor,
  say, widened exactly).

Conversions run in blocks of about ``_BLOCK`` elements through per-thread scratch
arrays, so no temporary of the whole tensor is ever made; blocks under ``_SMALL``
elements go through numpy's own casts straight into the buffer. numpy's float16
conversion is scalar code on builds whose baseline lacks F16C (about 2.5 ns an
element here), so larger blocks of float32, float64 or integers into float16, and
float16 out to float32, use exact vectorized arithmetic instead (see
:func:`_half_from_float32`): the results equal numpy's, bit for bit. Quantizing with
a power-of-two scale, and dequantizing with a scale that is a float32 number, run in
float32 because that gives the same values as binary64 (see :func:`_quantizer`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ._errors import InputTypeError, InputValueError, ModelError

__all__ = [
    "BoundTensor",
    "DataCategory",
    "DataFormat",
    "DataType",
    "TensorDescriptor",
    "TensorSpec",
]

_Array = np.ndarray[Any, Any]


class DataFormat(enum.IntEnum):
    """``cudlaModuleTensorDescriptor.dataFormat`` values (``cudla.h``)."""

    UNKNOWN = 0
    NCHW = 1
    NHWC = 2
    NCxHWx = 3


class DataType(enum.IntEnum):
    """``cudlaModuleTensorDescriptor.dataType`` values (``cudla.h``)."""

    UNKNOWN = 0
    FLOAT = 1
    HALF = 2
    INT16 = 3
    INT8 = 4
    UINT8 = 5
    UINT16 = 6


class DataCategory(enum.IntEnum):
    """``cudlaModuleTensorDescriptor.dataCategory`` values (``cudla.h``)."""

    IMAGE = 0
    WEIGHT = 1
    FEATURE = 2
    PLANAR = 3
    BIAS = 4


PIXEL_FORMAT_FEATURE = 36
PIXEL_FORMAT_R8 = 0
PIXEL_FORMAT_A8B8G8R8 = 12
PIXEL_MAPPING_PITCH_LINEAR = 0

_NUMPY_DTYPE: dict[DataType, np.dtype[Any]] = {
    DataType.FLOAT: np.dtype(np.float32),
    DataType.HALF: np.dtype(np.float16),
    DataType.INT16: np.dtype(np.int16),
    DataType.INT8: np.dtype(np.int8),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.UINT16: np.dtype(np.uint16),
}
_DATA_TYPE = {dtype.name: data_type for data_type, dtype in _NUMPY_DTYPE.items()}

# Lanes per pixel of the channel-interleaved formats; nhwc's lanes are its padded C.
_FORMAT_LANES = {"nchw": 1, "chw16": 16, "chw32": 32, "hwc4": 4}
# Which element types the DLA accepts in which format. chw16, chw32 and hwc4 follow
# TensorRT's DLA I/O rules (kCHW16 FP16, kCHW32 INT8, kDLA_HWC4 FP16 or INT8), plus
# uint8 for hwc4, the DLA's 8-bit unsigned image input. nchw and nhwc take every type
# a cuDLA descriptor can name: TensorRT emits only FP16 and INT8 there, but emulator
# loadables and the shared test vectors use the rest, and the GPU stand-in's parser
# (emulator/standin/loadable.h, format_accepts) must accept exactly this table.
_ACCEPTED_DTYPES = {
    "nchw": frozenset({"float32", "float16", "int16", "int8", "uint8", "uint16"}),
    "nhwc": frozenset({"float32", "float16", "int16", "int8", "uint8", "uint16"}),
    "chw16": frozenset({"float16"}),
    "chw32": frozenset({"int8"}),
    "hwc4": frozenset({"int8", "uint8", "float16"}),
}
FORMATS = tuple(_ACCEPTED_DTYPES)
NAME_MAX_BYTES = 80
_DATA_FORMAT = {
    "nchw": DataFormat.NCHW,
    "nhwc": DataFormat.NHWC,
    "hwc4": DataFormat.NHWC,
    "chw16": DataFormat.NCxHWx,
    "chw32": DataFormat.NCxHWx,
}


@dataclasses.dataclass(frozen=True)
class TensorDescriptor:
    """A plain copy of ``cudlaModuleTensorDescriptor``, independent of any runtime."""

    name: str
    size: int
    n: int
    c: int
    h: int
    w: int
    data_format: int
    data_type: int
    data_category: int
    pixel_format: int
    pixel_mapping: int
    stride: tuple[int, ...]

    @classmethod
    def from_cudla(cls, desc: Any) -> TensorDescriptor:
        """Copy the fields of a ``cuda.bindings.cudla.ModuleTensorDescriptor``."""
        raw_name = desc.name
        if isinstance(raw_name, (bytes, bytearray)):
            name = bytes(raw_name).split(b"\0", 1)[0].decode("ascii", "replace")
        elif isinstance(raw_name, str):
            name = raw_name.split("\0", 1)[0]
        else:  # an int8 array, as numpy-backed records give it
            encoded = bytes(np.asarray(raw_name, dtype=np.int8).view(np.uint8))
            name = encoded.split(b"\0", 1)[0].decode("ascii", "replace")
        return cls(
            name=name,
            size=int(desc.size_),
            n=int(desc.n),
            c=int(desc.c),
            h=int(desc.h),
            w=int(desc.w),
            data_format=int(desc.data_format),
            data_type=int(desc.data_type),
            data_category=int(desc.data_category),
            pixel_format=int(desc.pixel_format),
            pixel_mapping=int(desc.pixel_mapping),
            stride=tuple(int(s) for s in desc.stride),
        )


def _model_error(name: str, problem: str) -> ModelError:
    return ModelError(f"tensor {name!r}: inconsistent descriptor: {problem}")


@dataclasses.dataclass(frozen=True, eq=True)
class TensorSpec:
    """One model input or output: its name, logical shape, element type and DLA layout.

    ``TensorSpec("x", (1, 3, 224, 224), "float16", "chw16")`` describes a dense CHW16
    tensor; pass ``strides=(pixel, line, surface, batch)`` in bytes for padded rows or
    surfaces, and ``nbytes`` when the buffer is larger than the layout needs.
    ``scale`` is the quantization step of an integer tensor (``real = scale * stored``).
    ``category`` is the descriptor's ``dataCategory`` (IMAGE for hwc4, else FEATURE).
    """

    name: str
    shape: tuple[int, int, int, int]
    dtype: str = "float16"
    format: str = "nchw"
    strides: tuple[int, int, int, int] | None = None
    nbytes: int | None = None
    scale: float | None = None
    category: int | None = None

    def __post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not name:
            raise ModelError(f"tensor name must be a non-empty string, got {name!r}")
        if len(name.encode("utf-8")) > NAME_MAX_BYTES or not name.isascii():
            raise ModelError(f"tensor name {name!r} must be ASCII of at most 80 bytes")
        try:
            shape = tuple(int(d) for d in self.shape)
        except (TypeError, ValueError):
            raise ModelError(
                f"tensor {name!r}: shape must be (n, c, h, w), got {self.shape!r}"
            ) from None
        if len(shape) != 4 or min(shape) < 1:
            raise ModelError(
                f"tensor {name!r}: shape must be four dimensions >= 1 (n, c, h, w), "
                f"got {self.shape!r}"
            )
        object.__setattr__(self, "shape", shape)
        dtype = np.dtype(self.dtype).name if _is_dtype_like(self.dtype) else str(self.dtype)
        if dtype not in _DATA_TYPE:
            raise ModelError(
                f"tensor {name!r}: dtype {self.dtype!r} is not a DLA element type; "
                f"expected one of {sorted(_DATA_TYPE)}"
            )
        object.__setattr__(self, "dtype", dtype)
        fmt = str(self.format).lower()
        if fmt not in _ACCEPTED_DTYPES:
            raise ModelError(
                f"tensor {name!r}: format {self.format!r} is unknown; expected one of {FORMATS}"
            )
        object.__setattr__(self, "format", fmt)
        if dtype not in _ACCEPTED_DTYPES[fmt]:
            raise ModelError(
                f"tensor {name!r}: the DLA does not accept {dtype} (dataType "
                f"{int(_DATA_TYPE[dtype])}) in format {fmt} (dataFormat "
                f"{int(_DATA_FORMAT[fmt])}); {fmt} takes {sorted(_ACCEPTED_DTYPES[fmt])}"
            )
        _, c, h, w = shape
        if fmt == "hwc4" and c not in (1, 3, 4):
            raise ModelError(f"tensor {name!r}: hwc4 image input needs c in (1, 3, 4), got c={c}")
        esize = np.dtype(dtype).itemsize
        if self.strides is None:
            lanes = _FORMAT_LANES.get(fmt, c)
            pixel = lanes * esize
            line = w * pixel
            surface = h * line
            strides = (pixel, line, surface, math.ceil(c / lanes) * surface)
        else:
            try:
                strides = tuple(int(s) for s in self.strides)  # type: ignore[assignment]
            except (TypeError, ValueError):
                strides = ()  # type: ignore[assignment]
            if len(strides) != 4:
                raise ModelError(
                    f"tensor {name!r}: strides must be four byte counts (stride[0] pixel, "
                    f"stride[1] line, stride[2] surface, stride[3] batch), got {self.strides!r}"
                )
        object.__setattr__(self, "strides", strides)
        self._check_layout(esize)
        if self.scale is not None:
            if np.dtype(dtype).kind == "f":
                raise ModelError(
                    f"tensor {name!r}: a quantization scale applies to integer tensors "
                    f"only; this one is {dtype}"
                )
            try:
                scale = float(self.scale)
            except (TypeError, ValueError):
                scale = math.nan
            if not (math.isfinite(scale) and scale > 0):
                raise ModelError(
                    f"tensor {name!r}: scale must be a finite number > 0, got {self.scale!r}"
                )
            object.__setattr__(self, "scale", scale)
        if self.category is None:
            default = DataCategory.IMAGE if fmt == "hwc4" else DataCategory.FEATURE
            object.__setattr__(self, "category", int(default))
        else:
            object.__setattr__(self, "category", int(self.category))
        # hwc4 *is* NHWC with four lanes in the IMAGE category: any other combination of
        # those three would read back from its descriptor as a different format.
        four_lane_image = strides[0] == 4 * esize and self.category == DataCategory.IMAGE
        if fmt == "hwc4" and self.category != DataCategory.IMAGE:
            raise ModelError(
                f"tensor {name!r}: hwc4 is the IMAGE category (dataCategory 0), "
                f"got category {self.category}"
            )
        if fmt == "nhwc" and four_lane_image:
            raise ModelError(
                f"tensor {name!r}: NHWC with 4 lanes in the IMAGE category is the hwc4 "
                "image input; give format='hwc4' (or another category)"
            )

    def _check_layout(self, esize: int) -> None:
        """The stride and size rules of the module docstring, each error naming fields."""
        name, fmt = self.name, self.format
        n, c, h, w = self.shape
        assert self.strides is not None
        pixel, line, surface, batch = self.strides
        if pixel < esize or pixel % esize:
            raise _model_error(
                name,
                f"stride[0] (pixel stride) {pixel} must be a positive multiple of the "
                f"{esize}-byte {self.dtype} element",
            )
        lanes = pixel // esize
        if fmt == "nchw" and lanes != 1:
            raise _model_error(
                name, f"NCHW needs stride[0] == {esize} (one lane per pixel), got {pixel}"
            )
        if fmt in ("chw16", "chw32", "hwc4") and lanes != _FORMAT_LANES[fmt]:
            wanted = _FORMAT_LANES[fmt]
            raise _model_error(
                name,
                f"{fmt} needs {wanted} lanes per pixel (stride[0] == {wanted * esize}), "
                f"stride[0] {pixel} gives {lanes}",
            )
        if fmt == "nhwc" and lanes < c:
            raise _model_error(
                name,
                f"NHWC needs stride[0] >= c * {esize} = {c * esize} (all {c} channels at "
                f"one pixel), got {pixel}",
            )
        groups = math.ceil(c / lanes)
        if line < w * pixel:
            raise _model_error(
                name,
                f"stride[1] (line stride) {line} < w * stride[0] = {w} * {pixel} = {w * pixel}",
            )
        if surface < h * line:
            raise _model_error(
                name,
                f"stride[2] (surface stride) {surface} < h * stride[1] = {h} * {line} = {h * line}",
            )
        if batch < groups * surface:
            raise _model_error(
                name,
                f"stride[3] (batch stride) {batch} < {groups} channel group(s) * "
                f"stride[2] = {groups * surface}",
            )
        extent = (n - 1) * batch + (groups - 1) * surface + (h - 1) * line + w * pixel
        try:
            nbytes = extent if self.nbytes is None else int(self.nbytes)
        except (TypeError, ValueError):
            raise ModelError(
                f"tensor {name!r}: nbytes must be a byte count, got {self.nbytes!r}"
            ) from None
        if nbytes < extent:
            raise _model_error(
                name,
                f"size {nbytes} bytes < the {extent} bytes the layout spans "
                f"(n c h w {n} {c} {h} {w}, stride[0:4] {list(self.strides)})",
            )
        object.__setattr__(self, "nbytes", nbytes)

    # -- derived facts (cached: the engine reads them per request) ----------------------

    @functools.cached_property
    def numpy_dtype(self) -> np.dtype[Any]:
        """The element type stored in DLA memory."""
        return np.dtype(self.dtype)

    @functools.cached_property
    def lanes(self) -> int:
        """Channel lanes stored at each pixel (1 for nchw, 16 for chw16, ...)."""
        assert self.strides is not None
        return self.strides[0] // self.numpy_dtype.itemsize

    @functools.cached_property
    def groups(self) -> int:
        """Channel groups of ``lanes`` channels each: ``ceil(c / lanes)``."""
        return math.ceil(self.shape[1] / self.lanes)

    @property
    def size(self) -> int:
        """Bytes of the DLA buffer (the descriptor's ``size``)."""
        assert self.nbytes is not None
        return self.nbytes

    @functools.cached_property
    def is_integer(self) -> bool:
        return self.numpy_dtype.kind in "iu"

    @functools.cached_property
    def result_dtype(self) -> np.dtype[Any]:
        """The dtype ``unpack`` returns: float32 for quantized tensors with a scale."""
        if self.is_integer and self.scale is not None:
            return np.dtype(np.float32)
        return self.numpy_dtype

    def with_scale(self, scale: float | None) -> TensorSpec:
        """A copy with the quantization scale set (or cleared)."""
        return dataclasses.replace(self, scale=scale)

    # -- descriptors -----------------------------------------------------------------

    @classmethod
    def from_descriptor(cls, desc: TensorDescriptor) -> TensorSpec:
        """Derive the spec from descriptor fields alone; inconsistent fields raise ModelError.

        The module docstring lists how each field is read and every rule checked.
        """
        name = desc.name
        try:
            data_type = DataType(desc.data_type)
            dtype = _NUMPY_DTYPE[data_type]
        except (ValueError, KeyError):
            raise _model_error(
                name, f"dataType {desc.data_type} is not a DLA element type"
            ) from None
        try:
            data_format = DataFormat(desc.data_format)
        except ValueError:
            raise _model_error(name, f"dataFormat {desc.data_format} is unknown") from None
        if len(desc.stride) != 8 or any(desc.stride[4:]):
            raise _model_error(name, f"stride[4:8] must be zero, got {list(desc.stride)}")
        if desc.pixel_mapping != PIXEL_MAPPING_PITCH_LINEAR:
            raise _model_error(
                name, f"pixelMapping {desc.pixel_mapping} (block linear) is not supported"
            )
        pixel = desc.stride[0]
        lanes = pixel // dtype.itemsize if pixel % dtype.itemsize == 0 else 0
        if data_format is DataFormat.NCHW:
            fmt = "nchw"
        elif data_format is DataFormat.NHWC:
            is_image = desc.data_category == DataCategory.IMAGE and lanes == 4
            fmt = "hwc4" if is_image else "nhwc"
        elif data_format is DataFormat.NCxHWx:
            by_lanes = {16: "chw16", 32: "chw32"}
            if lanes not in by_lanes:
                raise _model_error(
                    name,
                    f"dataFormat NCxHWx needs 16 or 32 lanes per pixel, stride[0]={pixel} "
                    f"with {dtype.itemsize}-byte {dtype.name} elements gives "
                    f"{pixel / dtype.itemsize:g}",
                )
            fmt = by_lanes[lanes]
        else:
            raise _model_error(name, "dataFormat UNKNOWN (0)")
        try:
            return cls(
                name=name,
                shape=(desc.n, desc.c, desc.h, desc.w),
                dtype=dtype.name,
                format=fmt,
                strides=(desc.stride[0], desc.stride[1], desc.stride[2], desc.stride[3]),
                nbytes=desc.size,
                category=desc.data_category,
            )
        except ModelError as exc:
            raise ModelError(
                f"{exc} (from its cuDLA descriptor: n c h w {desc.n} {desc.c} {desc.h} "
                f"{desc.w}, dataFormat {desc.data_format}, dataType {desc.data_type}, "
                f"dataCategory {desc.data_category}, stride {list(desc.stride)}, "
                f"size {desc.size})"
            ) from None

    def to_descriptor(self) -> TensorDescriptor:
        """The descriptor fields a loadable would carry for this spec.

        ``TensorSpec.from_descriptor(spec.to_descriptor()) == spec`` for every spec
        without a scale (the descriptor carries no scale).
        """
        assert self.strides is not None
        assert self.category is not None
        if self.format == "hwc4" and self.numpy_dtype.itemsize == 1:
            pixel_format = PIXEL_FORMAT_R8 if self.shape[1] == 1 else PIXEL_FORMAT_A8B8G8R8
        else:
            pixel_format = PIXEL_FORMAT_FEATURE
        n, c, h, w = self.shape
        return TensorDescriptor(
            name=self.name,
            size=self.size,
            n=n,
            c=c,
            h=h,
            w=w,
            data_format=int(_DATA_FORMAT[self.format]),
            data_type=int(_DATA_TYPE[self.dtype]),
            data_category=int(self.category),
            pixel_format=pixel_format,
            pixel_mapping=PIXEL_MAPPING_PITCH_LINEAR,
            stride=(*self.strides, 0, 0, 0, 0),
        )

    # -- layout views ----------------------------------------------------------------

    def bind(self, buffer: Any, *, zero: bool = True) -> BoundTensor:
        """This tensor fixed to one buffer (a slot's pinned memory, say), with its views
        computed once. ``zero`` zeroes the whole buffer now; writes never touch padding
        afterwards."""
        return BoundTensor(self, buffer, zero=zero)

    def _is_dense(self) -> bool:
        """True when every byte of the buffer holds a real element (no padding at all)."""
        assert self.strides is not None
        pixel, line, surface, batch = self.strides
        n, c, h, w = self.shape
        return (
            c == self.groups * self.lanes
            and line == w * pixel
            and surface == h * line
            and batch == self.groups * surface
            and self.size == n * batch
        )

    # -- pack / unpack ---------------------------------------------------------------

    def check_array(self, value: Any) -> _Array:
        """Validate a user array against this spec (shape, dtype, NaN); no copy made.

        Raises InputValueError / InputTypeError naming this tensor and what was
        expected: a wrong shape, a dtype that cannot be stored, a float array for an
        integer tensor without a scale, NaN for an integer tensor.
        """
        if isinstance(value, np.ndarray):
            array = value
        else:
            try:
                array = np.asarray(value)
            except Exception as exc:
                raise InputTypeError(
                    f"input {self.name!r}: expected an array of shape {self.shape}, "
                    f"got {type(value).__name__} ({exc})"
                ) from None
        if array.dtype.kind not in "biuf":
            raise InputTypeError(
                f"input {self.name!r}: dtype {array.dtype} cannot be converted to "
                f"{self.dtype}; pass a numeric array"
            )
        if array.shape != self.shape:
            raise InputValueError(
                f"input {self.name!r}: expected shape {self.shape} (n, c, h, w), got {array.shape}"
            )
        target = self.numpy_dtype
        if self.is_integer:
            if array.dtype.kind == "f":
                if self.scale is None:
                    raise InputTypeError(
                        f"input {self.name!r}: a {array.dtype} array for an {self.dtype} "
                        f"tensor needs a quantization scale (Engine(..., scales="
                        f"{{{self.name!r}: ...}})), or pass already-quantized {self.dtype}"
                    )
                _refuse_nan(self, array)
            elif not np.can_cast(array.dtype, target, "safe"):
                raise InputTypeError(
                    f"input {self.name!r}: {array.dtype} cannot be cast safely to {self.dtype}"
                )
        elif not np.can_cast(array.dtype, target, "same_kind"):
            raise InputTypeError(
                f"input {self.name!r}: {array.dtype} cannot be cast to {self.dtype}"
            )
        return array

    def pack(self, array: npt.ArrayLike, out: Any = None, *, validate: bool = True) -> _Array:
        """Write ``array`` (logical NCHW) in this tensor's DLA layout.

        Writes straight into ``out`` (any writable contiguous buffer of at least
        ``size`` bytes, such as a slot's pinned host buffer) when given, else into a
        new uint8 array; every byte of the tensor is written, padding as zeros, and
        no temporary of the whole tensor is made. Float into integer tensors is
        quantized with ``scale`` (round half to even, saturate). Returns the uint8
        view of the written bytes. ``validate=False`` skips :meth:`check_array` for
        an array that already passed it.
        """
        source = self.check_array(array) if validate else np.asarray(array)
        if out is None:
            target: Any = np.zeros(self.size, dtype=np.uint8)
            zero = False
        else:
            target, zero = out, not self._is_dense()
        bound = BoundTensor(self, target, zero=zero)
        bound.write(source, checked=validate)
        return bound.raw

    def unpack(
        self, buffer: Any, *, dequantize: bool = True, dtype: npt.DTypeLike | None = None
    ) -> _Array:
        """Read this tensor's DLA bytes into a fresh logical NCHW array.

        Integer tensors with a ``scale`` come back as float32 ``scale * stored``
        unless ``dequantize`` is false. ``dtype`` asks for another result type: any
        float type for dequantized values, else a type the stored values cast to
        safely (float32 for a float16 tensor, say, widened exactly).
        """
        return BoundTensor(self, buffer, zero=False).read(dequantize=dequantize, dtype=dtype)

    def quantize(self, array: npt.ArrayLike) -> _Array:
        """Float values to this integer type: ``round_half_even(x / scale)``, saturated.

        The quotient is taken in binary64; ±inf saturate; NaN raises InputValueError.
        Works in blocks, so no float64 copy of the whole array is made.
        """
        if not self.is_integer or self.scale is None:
            raise InputTypeError(
                f"input {self.name!r}: quantizing needs an integer tensor with a scale"
            )
        source = np.asarray(array)
        if source.dtype.kind not in "biuf":
            raise InputTypeError(f"input {self.name!r}: cannot quantize {source.dtype} values")
        _refuse_nan(self, source)
        out = np.empty(source.shape, self.numpy_dtype)
        convert = _quantizer(source.dtype, self.numpy_dtype, self.scale)
        with np.errstate(all="ignore"):
            for index in _chunks(source.shape):
                convert(source[index], out[index])
        return out

    def describe(self) -> str:
        """A one-line human description: name, shape, dtype and format."""
        n, c, h, w = self.shape
        return f"{self.name}: {n}x{c}x{h}x{w} {self.dtype} {self.format}"


def _refuse_nan(spec: TensorSpec, array: _Array) -> None:
    # min() propagates NaN: one vectorized pass and no temporary of the array.
    if array.dtype.kind == "f" and array.size and np.isnan(np.min(array)):
        raise InputValueError(
            f"input {spec.name!r}: NaN cannot be stored in an {spec.dtype} tensor"
        )


# -- element conversions ------------------------------------------------------------------
#
# A conversion stores one block of values (any strides) into ``out`` (same shape).
# Blocks are about _BLOCK elements: a kernel's dozen numpy calls cost about 12 us
# whatever the size, so blocks must be large for that to vanish (0.1 ns an element at
# 2**17), yet small beside the tensor so the temporaries stay a few hundred kB and
# mostly in cache (measured on benchmarks/bench_layouts.py: 2**15 was a third slower).

_BLOCK = 1 << 17
# Below this many elements numpy's own casts win: the kernels' dozen calls cost more
# (measured break-even about 7000 float32 -> float16 elements).
_SMALL = 1 << 13

_Convert = Callable[[_Array, _Array], None]


class _Scratch(threading.local):
    """Per-thread temporaries for the kernels and staging, reshaped views cached.

    Thread-local because the engine may pack on the loop thread and in a worker at the
    same time; per thread, conversions run one at a time.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, np.dtype[Any]], _Array] = {}
        self.views: dict[tuple[str, np.dtype[Any], tuple[int, ...]], _Array] = {}

    def array(self, role: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> _Array:
        key = (role, dtype, shape)
        view = self.views.get(key)
        if view is None:
            view = self._make(role, dtype, shape, None)
        return view

    def constant(self, value: Any, shape: tuple[int, ...]) -> _Array:
        """A read-only-by-convention array of ``shape`` filled with ``value``."""
        dtype = np.asarray(value).dtype
        role = f"const {value!r}"
        key = (role, dtype, shape)
        view = self.views.get(key)
        if view is None:
            view = self._make(role, dtype, shape, value)
        return view

    def _make(self, role: str, dtype: np.dtype[Any], shape: tuple[int, ...], fill: Any) -> _Array:
        count = math.prod(shape)
        buffer = self.buffers.get((role, dtype))
        if buffer is None or buffer.size < count:
            buffer = np.empty(max(count, _BLOCK), dtype)
            if fill is not None:
                buffer.fill(fill)
            self.buffers[(role, dtype)] = buffer
            # views of a replaced buffer must not be handed out again
            self.views = {k: v for k, v in self.views.items() if k[:2] != (role, dtype)}
        if len(self.views) > 1024:  # many tensor shapes over a long life: start again
            self.views.clear()
        view = buffer[:count].reshape(shape)
        self.views[(role, dtype, shape)] = view
        return view


_SCRATCH = _Scratch()

_U16 = np.dtype(np.uint16)
_U32 = np.dtype(np.uint32)
_U64 = np.dtype(np.uint64)
_I32 = np.dtype(np.int32)
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)

# float32 -> float16, see _half_from_float32.
_F32_EXPONENT = np.uint32(0x7F800000)
_F32_EXPONENT_65536 = 0x47800000  # exponent field of 65536.0, float16's overflow
_F32_HALF_MIN_NORMAL = np.float32(2.0**-14)
_F32_MAGIC = np.float32(1.5 * 2.0**13)
_F32_TO_HALF_EXPONENT = np.float32(2.0**-112)
_F64_EXPONENT = np.uint64(0x7FF0000000000000)
_F64_EXPONENT_65536 = 0x40F0000000000000
_F64_HALF_MIN_NORMAL = np.float64(2.0**-14)
_F64_MAGIC = np.float64(1.5 * 2.0**42)
_SHIFT_13 = np.uint32(13)
_SHIFT_16 = np.uint32(16)
_SHIFT_48 = np.uint64(48)
_HALF_SIGN = np.uint32(0x8000)
_HALF_SIGN64 = np.uint64(0x8000)
_HALF_MAGNITUDE = np.uint32(0x7FFF)
_HALF_INFINITY = 0x7C00
_F32_FROM_HALF_EXPONENT = np.float32(2.0**112)
_I32_SIGN = np.int32(-(2**31))


def _cast(values: _Array, out: _Array) -> None:
    np.copyto(out, values, casting="unsafe")


def _half_from_float32(values: _Array, out: _Array) -> None:
    """float32 ``values`` to float16 ``out``, rounded to nearest even: numpy's result.

    For ``|x|`` in ``[2**e, 2**(e+1))`` let ``M = 1.5 * 2**(e+13)``, with ``e`` raised
    to -14 below float16's smallest normal. ``x + M`` lies in ``[2**(e+13),
    2**(e+14))``, whose float32 spacing is ``2**(e-10)``: exactly float16's spacing
    for ``x`` (``2**-24`` for its subnormals). So the float32 addition rounds ``x`` to
    float16 precision, ties to even (``M`` is an even multiple of that spacing), and
    ``(x + M) - M`` is exact (Sterbenz). Scaling that by ``2**-112`` is exact too and
    moves float16's exponent bias into float32's, subnormals included: bits 13..27
    of the product are the float16 bit pattern. A rounding up to 65536 gives the
    pattern of infinity. Only ``|x| >= 65536``, inf and NaN (rare) take numpy's cast.
    Checked against numpy for all 2**32 float32 bit patterns.
    """
    if values.size < _SMALL:
        np.copyto(out, values, casting="same_kind")
        return
    shape = values.shape
    bits = values.view(_U32)
    work = _SCRATCH.array("u32 a", _U32, shape)
    np.bitwise_and(bits, _F32_EXPONENT, out=work)
    if int(work.max()) >= _F32_EXPONENT_65536:
        np.copyto(out, values, casting="same_kind")
        return
    magic = work.view(_F32)  # 2**e, then M
    np.maximum(magic, _SCRATCH.constant(_F32_HALF_MIN_NORMAL, shape), out=magic)
    np.multiply(magic, _F32_MAGIC, out=magic)
    rounded = _SCRATCH.array("f32 b", _F32, shape)
    np.add(values, magic, out=rounded)
    np.subtract(rounded, magic, out=rounded)
    np.multiply(rounded, _F32_TO_HALF_EXPONENT, out=rounded)
    pattern = rounded.view(_U32)
    np.right_shift(pattern, _SHIFT_13, out=pattern)
    # The sign comes from x itself: (x + M) - M is +0 for negative x that round to 0.
    np.right_shift(bits, _SHIFT_16, out=work)
    np.bitwise_and(work, _HALF_SIGN, out=work)
    np.bitwise_or(pattern, work, out=pattern)
    np.copyto(out.view(_U16), pattern, casting="unsafe")


def _half_from_float64(values: _Array, out: _Array) -> None:
    """float64 ``values`` to float16 ``out`` in one rounding; as _half_from_float32
    with float64's spacing (``M = 1.5 * 2**(e+42)``). Going through float32 would
    round twice."""
    if values.size < _SMALL:
        np.copyto(out, values, casting="same_kind")
        return
    shape = values.shape
    bits = values.view(_U64)
    work = _SCRATCH.array("u64 a", _U64, shape)
    np.bitwise_and(bits, _F64_EXPONENT, out=work)
    if int(work.max()) >= _F64_EXPONENT_65536:
        np.copyto(out, values, casting="same_kind")
        return
    magic = work.view(_F64)
    np.maximum(magic, _SCRATCH.constant(_F64_HALF_MIN_NORMAL, shape), out=magic)
    np.multiply(magic, _F64_MAGIC, out=magic)
    rounded = _SCRATCH.array("f64 b", _F64, shape)
    np.add(values, magic, out=rounded)
    np.subtract(rounded, magic, out=rounded)
    narrow = _SCRATCH.array("f32 b", _F32, shape)
    np.copyto(narrow, rounded, casting="same_kind")  # exact: a float16 value
    np.multiply(narrow, _F32_TO_HALF_EXPONENT, out=narrow)
    pattern = narrow.view(_U32)
    np.right_shift(pattern, _SHIFT_13, out=pattern)
    np.right_shift(bits, _SHIFT_48, out=work)
    np.bitwise_and(work, _HALF_SIGN64, out=work)
    halves = out.view(_U16)
    np.copyto(halves, pattern, casting="unsafe")
    np.bitwise_or(halves, work, out=halves, casting="unsafe")


def _half_from_integers(values: _Array, out: _Array) -> None:
    """Integers (or booleans) to float16 through float32: exact below 2**24, and
    anything larger is beyond float16 (infinity) either way."""
    if values.size < _SMALL:
        np.copyto(out, values, casting="unsafe")
        return
    wide = _SCRATCH.array("f32 c", _F32, values.shape)
    np.copyto(wide, values, casting="unsafe")
    _half_from_float32(wide, out)


def _float32_from_half(values: _Array, out: _Array) -> None:
    """float16 ``values`` to float32 ``out``, exactly. The float16 magnitude bits
    shifted left by 13 are a float32 pattern with float16's exponent bias (its
    subnormals become float32 subnormals); times ``2**112`` rebiases it exactly.
    Infinity and NaN (rare) take numpy's cast."""
    if values.size < _SMALL:
        np.copyto(out, values, casting="same_kind")
        return
    shape = values.shape
    signed = _SCRATCH.array("i32 a", _I32, shape)
    np.copyto(signed, values.view(np.int16), casting="safe")  # sign-extends into bit 31
    magnitude = _SCRATCH.array("u32 b", _U32, shape)
    np.bitwise_and(signed.view(_U32), _HALF_MAGNITUDE, out=magnitude)
    if int(magnitude.max()) >= _HALF_INFINITY:
        np.copyto(out, values, casting="same_kind")
        return
    np.left_shift(magnitude, _SHIFT_13, out=magnitude)
    np.multiply(magnitude.view(_F32), _F32_FROM_HALF_EXPONENT, out=out)
    np.bitwise_and(signed, _I32_SIGN, out=signed)
    result_bits = out.view(_U32)
    np.bitwise_or(result_bits, signed.view(_U32), out=result_bits)


def _is_power_of_two(value: float) -> bool:
    return math.frexp(value)[0] == 0.5


@functools.lru_cache(maxsize=256)
def _quantizer(source: np.dtype[Any], target: np.dtype[Any], scale: float) -> _Convert:
    """``round_half_even(x / scale)`` saturated to ``target``, the quotient in binary64.

    A float32 source with a power-of-two scale (2**-100..2**100) is done in float32:
    ``x * (1 / scale)`` is then exact in both precisions (or overflows to a saturating
    infinity, or underflows far below 0.5), so the result is the same.
    """
    info = np.iinfo(target)
    work_dtype: np.dtype[Any]
    if source == _F32 and _is_power_of_two(scale) and 2.0**-100 <= scale <= 2.0**100:
        work_dtype, factor, divisor = _F32, np.float32(1.0 / scale), None
    else:
        work_dtype, factor, divisor = _F64, None, np.float64(scale)
    low, high = work_dtype.type(info.min), work_dtype.type(info.max)

    def quantize(values: _Array, out: _Array) -> None:
        work = _SCRATCH.array("q", work_dtype, values.shape)
        if divisor is None:
            np.multiply(values, factor, out=work)
        else:
            np.copyto(work, values, casting="same_kind")  # exact widening
            np.divide(work, divisor, out=work)
        np.rint(work, out=work)  # half to even
        np.clip(work, low, high, out=work)
        np.copyto(out, work, casting="unsafe")

    return quantize


@functools.lru_cache(maxsize=256)
def _dequantizer(result: np.dtype[Any], scale: float) -> _Convert:
    """``scale * q`` as a binary64 product rounded once to ``result``.

    When the result is float32 and the scale is a float32 number, the float32 product
    is that same value: ``q`` (at most 16 bits) times a 24-bit scale is exact in
    binary64, so both round the exact product once.
    """
    if result == _F32 and float(np.float32(scale)) == scale:
        factor32 = np.float32(scale)

        def dequantize32(values: _Array, out: _Array) -> None:
            np.multiply(values, factor32, out=out)

        return dequantize32

    def dequantize(values: _Array, out: _Array) -> None:
        product = _SCRATCH.array("q", _F64, values.shape)
        np.copyto(product, values, casting="safe")
        np.multiply(product, scale, out=product)
        np.copyto(out, product, casting="same_kind")

    return dequantize


@functools.lru_cache(maxsize=256)
def _write_conversion(
    source: np.dtype[Any], target: np.dtype[Any], scale: float | None
) -> _Convert | None:
    """How values of ``source`` type are stored as ``target``; None: copied as they are."""
    if source == target:
        return None
    if target.kind in "iu":
        if source.kind == "f":
            assert scale is not None  # BoundTensor._write_conversion checks it
            return _quantizer(source, target, scale)
        return _cast
    if target == _F16 and source.isnative:
        if source == _F32:
            return _half_from_float32
        if source == _F64:
            return _half_from_float64
        if source.kind in "biu":
            return _half_from_integers
    if target == _F32 and source == _F16:
        return _float32_from_half
    return _cast


@functools.lru_cache(maxsize=256)
def _read_conversion(
    stored: np.dtype[Any], result: np.dtype[Any], scale: float | None
) -> _Convert | None:
    """How stored values become ``result`` values; None: copied as they are."""
    if scale is not None:
        return _dequantizer(result, scale)
    if stored == result:
        return None
    if stored == _F16 and result == _F32:
        return _float32_from_half
    return _cast


def _chunks(shape: tuple[int, ...]) -> Iterator[tuple[Any, ...]]:
    """Index tuples that cover an array of ``shape`` in pieces of about _BLOCK elements."""
    if not shape:
        yield ()
        return
    inner = math.prod(shape[1:])
    if inner <= _BLOCK:
        step = max(1, _BLOCK // max(inner, 1))
        for start in range(0, shape[0], step):
            yield (slice(start, start + step),)
        return
    for index in range(shape[0]):
        for rest in _chunks(shape[1:]):
            yield (index, *rest)


# -- buffers and bound tensors ------------------------------------------------------------

# Channel groups of at most this many channels are copied one channel plane at a time:
# numpy would otherwise run its innermost loop over the few lanes of each pixel.
_PER_CHANNEL_MAX = 4


class _Block(NamedTuple):
    """A piece of the tensor converted and copied in one go."""

    # (n, channels, rows) of the logical array; () for a block that is the whole tensor
    where: tuple[int, slice, slice] | tuple[()]
    lanes: _Array  # its elements in the buffer, shape (channels, rows, w), or the tensor's
    per_channel: bool  # copy channel by channel (few lanes per pixel)


def _raw_bytes(buffer: Any, spec: TensorSpec) -> _Array:
    if isinstance(buffer, np.ndarray):
        if not (buffer.flags.c_contiguous or buffer.flags.f_contiguous):
            raise InputValueError(
                f"tensor {spec.name!r}: the buffer must be contiguous, got an array with "
                f"strides {buffer.strides}"
            )
        raw: _Array = np.ravel(buffer, order="K").view(np.uint8)
    else:
        try:
            raw = np.frombuffer(buffer, dtype=np.uint8)
        except (TypeError, ValueError) as exc:
            raise InputValueError(
                f"tensor {spec.name!r}: expected a contiguous buffer of at least "
                f"{spec.size} bytes, got {type(buffer).__name__} ({exc})"
            ) from None
    if raw.nbytes < spec.size:
        raise InputValueError(
            f"tensor {spec.name!r}: buffer of {raw.nbytes} bytes < the {spec.size} it needs"
        )
    return raw[: spec.size]


def _plan(spec: TensorSpec, raw: _Array) -> tuple[_Block, ...]:
    """Cut the tensor into blocks of about _BLOCK elements, each with its buffer view.

    nchw tensors are cut into whole channel planes (or row bands of one plane); the
    lane formats into row bands of one channel group, so each block fills whole
    pixels and every cache line of the buffer is fetched once per write.
    """
    assert spec.strides is not None
    pixel, line, surface, batch = spec.strides
    n, c, h, w = spec.shape
    lanes, esize = spec.lanes, spec.numpy_dtype.itemsize
    view = np.ndarray(
        shape=(n, spec.groups, h, w, lanes),
        dtype=spec.numpy_dtype,
        buffer=raw,
        strides=(batch, surface, line, pixel, esize),
    )
    # (first channel, channels, view of shape (n, channels, h, w), rows and channels per block)
    segments: list[tuple[int, int, _Array, int, int]] = []
    if lanes == 1:
        plane = h * w
        if plane <= _BLOCK:
            chans, rows = max(1, min(c, _BLOCK // plane)), h
        else:
            chans, rows = 1, max(1, _BLOCK // w)
        segments.append((0, c, view[..., 0], chans, rows))
    else:
        for group in range(spec.groups):
            first = group * lanes
            count = min(lanes, c - first)
            rows = max(1, min(h, _BLOCK // (count * w)))
            lane_view = view[:, group, :, :, :count].transpose(0, 3, 1, 2)
            segments.append((first, count, lane_view, count, rows))
    blocks: list[_Block] = []
    for image in range(n):
        for first, count, lane_view, chans, rows in segments:
            few_lanes = lanes > 1 and count <= _PER_CHANNEL_MAX
            for c0 in range(0, count, chans):
                c1 = min(count, c0 + chans)
                for h0 in range(0, h, rows):
                    h1 = min(h, h0 + rows)
                    where = (image, slice(first + c0, first + c1), slice(h0, h1))
                    # one numpy call beats several for a small block, whatever its order
                    per_channel = few_lanes and (c1 - c0) * (h1 - h0) * w >= _SMALL
                    blocks.append(_Block(where, lane_view[image, c0:c1, h0:h1], per_channel))
    if len(blocks) == 1 and not blocks[0].per_channel and n == 1:
        # One block is the whole tensor (small tensors, the common case on the request
        # path): shaped as the tensor, a write or read is one numpy call, no indexing.
        whole = blocks[0].lanes[np.newaxis]
        if whole.shape == spec.shape:
            return (_Block((), whole, False),)
    return tuple(blocks)


def _store(lanes: _Array, values: _Array, per_channel: bool) -> None:
    if per_channel:
        for channel in range(values.shape[0]):
            np.copyto(lanes[channel], values[channel])
    else:
        np.copyto(lanes, values)


def _load(lanes: _Array, into: _Array, per_channel: bool) -> None:
    if per_channel:
        for channel in range(into.shape[0]):
            np.copyto(into[channel], lanes[channel])
    else:
        np.copyto(into, lanes)


class BoundTensor:
    """A TensorSpec fixed to one buffer, its element views computed once.

    The tensor is cut into blocks (see ``_plan``); each block knows its view of the
    element lanes in the buffer, so a write or read is a short loop of numpy copies
    and, where the types differ, conversions: straight into the lanes for small
    blocks, through per-thread scratch arrays for large ones.
    Padding bytes are zeroed once (``zero=True``) and never written again, since only
    element lanes are ever stored through the views.
    """

    __slots__ = ("_blocks", "_reads", "_writes", "raw", "spec")

    def __init__(self, spec: TensorSpec, buffer: Any, *, zero: bool = True) -> None:
        self.spec = spec
        self.raw = _raw_bytes(buffer, spec)
        if zero:
            if not self.raw.flags.writeable:
                raise InputValueError(f"tensor {spec.name!r}: the buffer is read-only")
            self.raw[:] = 0
        self._blocks = _plan(spec, self.raw)
        # The conversion for the last source dtype written / result dtype read: the
        # engine writes and reads the same types request after request.
        self._writes: tuple[np.dtype[Any], _Convert | None] | None = None
        self._reads: dict[
            tuple[bool, np.dtype[Any] | None], tuple[np.dtype[Any], _Convert | None]
        ] = {}

    def write(self, source: _Array, *, checked: bool = False) -> None:
        """Store a validated logical array (see :meth:`TensorSpec.check_array`).

        Floats into integer tensors are quantized; other types are converted as the
        module docstring says. Only element lanes are written. ``checked=True`` says
        :meth:`TensorSpec.check_array` already passed it, so the NaN scan it made is
        not made twice.
        """
        spec = self.spec
        if source.shape != spec.shape:
            raise InputValueError(
                f"input {spec.name!r}: expected shape {spec.shape} (n, c, h, w), got {source.shape}"
            )
        cached = self._writes
        if cached is not None and cached[0] == source.dtype:
            convert = cached[1]
        else:
            convert = self._write_conversion(source.dtype)
            self._writes = (source.dtype, convert)
        if convert is None:
            for where, lanes, per_channel in self._blocks:
                _store(lanes, source[where], per_channel)
            return
        target = spec.numpy_dtype
        if target.kind in "iu" and not checked:
            _refuse_nan(spec, source)
        small = _SMALL
        with np.errstate(all="ignore"):  # overflow to float16 infinity is by design
            for where, lanes, per_channel in self._blocks:
                if lanes.size < small:  # numpy's casts, straight into the lanes
                    convert(source[where], lanes)
                    continue
                staged = _SCRATCH.array("stage", target, lanes.shape)
                convert(source[where], staged)
                _store(lanes, staged, per_channel)

    def _write_conversion(self, source: np.dtype[Any]) -> _Convert | None:
        spec = self.spec
        if not self.raw.flags.writeable:
            raise InputValueError(f"tensor {spec.name!r}: the buffer is read-only")
        target = spec.numpy_dtype
        if source.kind in "iub" and target.kind in "iu" and not np.can_cast(source, target, "safe"):
            raise InputTypeError(f"input {spec.name!r}: {source} cannot be cast safely to {target}")
        if source.kind == "f" and target.kind in "iu" and spec.scale is None:
            raise InputTypeError(
                f"input {spec.name!r}: a {source} array for an {target} tensor needs a "
                "quantization scale"
            )
        return _write_conversion(source, target, spec.scale)

    def read(self, *, dequantize: bool = True, dtype: npt.DTypeLike | None = None) -> _Array:
        """A fresh logical array of the stored values (dequantized when a scale is set).

        ``dtype`` as in :meth:`TensorSpec.unpack`.
        """
        key = (dequantize, None if dtype is None else np.dtype(dtype))
        decided = self._reads.get(key)
        if decided is None:
            decided = self._reads[key] = self._read_conversion(*key)
        result_dtype, convert = decided
        spec = self.spec
        result = np.empty(spec.shape, result_dtype)
        if convert is None:
            for where, lanes, per_channel in self._blocks:
                _load(lanes, result[where], per_channel)
            return result
        stored, small = spec.numpy_dtype, _SMALL
        with np.errstate(all="ignore"):
            for where, lanes, per_channel in self._blocks:
                if lanes.size < small:
                    convert(lanes, result[where])
                    continue
                staged = _SCRATCH.array("stage", stored, lanes.shape)
                _load(lanes, staged, per_channel)
                convert(staged, result[where])
        return result

    def _read_conversion(
        self, dequantize: bool, dtype: np.dtype[Any] | None
    ) -> tuple[np.dtype[Any], _Convert | None]:
        spec = self.spec
        stored = spec.numpy_dtype
        scale = spec.scale if dequantize and spec.is_integer else None
        if dtype is None:
            dtype = np.dtype(np.float32) if scale is not None else stored
        elif scale is not None and dtype.kind != "f":
            raise InputTypeError(
                f"tensor {spec.name!r}: dequantized values need a float dtype, got {dtype}"
            )
        elif scale is None and not np.can_cast(stored, dtype, "safe"):
            raise InputTypeError(
                f"tensor {spec.name!r}: stored {stored} values do not cast safely to {dtype}"
            )
        return dtype, _read_conversion(stored, dtype, scale)


def _is_dtype_like(value: object) -> bool:
    if isinstance(value, str):
        return value in np.sctypeDict
    try:
        np.dtype(value)  # type: ignore[call-overload]
    except TypeError:
        return False
    return True


def specs_by_name(specs: Sequence[TensorSpec]) -> dict[str, TensorSpec]:
    """Index specs by name; duplicate names are a model error."""
    result: dict[str, TensorSpec] = {}
    for spec in specs:
        if spec.name in result:
            raise ModelError(f"tensor name {spec.name!r} appears twice")
        result[spec.name] = spec
    return result
