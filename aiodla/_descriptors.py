"""cuDLA tensor descriptors: what each field of ``cudlaModuleTensorDescriptor`` means,
and the DLA layout derived from the fields, cross-checked against the buffer ``size``.
:class:`~aiodla.TensorSpec` is built from descriptors, and written back into them, here.

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

How :class:`~aiodla.TensorSpec` derives a descriptor's fields when it is built from
its own arguments (format, dtype, optional strides and ``nbytes``) follows the same
rules: a spec is exactly what some valid descriptor says.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Protocol

import numpy as np

from ._errors import ModelError
from ._spec_facts import SpecFacts

__all__ = [
    "DataCategory",
    "DataFormat",
    "DataType",
    "TensorDescriptor",
]


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


def _is_dtype_like(value: object) -> bool:
    if isinstance(value, str):
        return value in np.sctypeDict
    try:
        np.dtype(value)  # type: ignore[call-overload]
    except TypeError:
        return False
    return True


def dtype_and_format(name: str, dtype: object, fmt: object, channels: int) -> tuple[str, str]:
    """The element type's name and the lower-case format, checked against the table of
    what the DLA accepts (``_ACCEPTED_DTYPES``) and hwc4's channel counts."""
    dtype_name = np.dtype(dtype).name if _is_dtype_like(dtype) else str(dtype)  # type: ignore[call-overload]
    if dtype_name not in _DATA_TYPE:
        raise ModelError(
            f"tensor {name!r}: dtype {dtype!r} is not a DLA element type; "
            f"expected one of {sorted(_DATA_TYPE)}"
        )
    format_name = str(fmt).lower()
    if format_name not in _ACCEPTED_DTYPES:
        raise ModelError(f"tensor {name!r}: format {fmt!r} is unknown; expected one of {FORMATS}")
    if dtype_name not in _ACCEPTED_DTYPES[format_name]:
        raise ModelError(
            f"tensor {name!r}: the DLA does not accept {dtype_name} (dataType "
            f"{int(_DATA_TYPE[dtype_name])}) in format {format_name} (dataFormat "
            f"{int(_DATA_FORMAT[format_name])}); {format_name} takes "
            f"{sorted(_ACCEPTED_DTYPES[format_name])}"
        )
    if format_name == "hwc4" and channels not in (1, 3, 4):
        raise ModelError(
            f"tensor {name!r}: hwc4 image input needs c in (1, 3, 4), got c={channels}"
        )
    return dtype_name, format_name


def dense_strides(
    fmt: str, shape: tuple[int, int, int, int], esize: int
) -> tuple[int, int, int, int]:
    """(pixel, line, surface, batch) byte strides of the layout with no padding beyond
    the format's own lanes."""
    _, c, h, w = shape
    lanes = _FORMAT_LANES.get(fmt, c)
    pixel = lanes * esize
    line = w * pixel
    surface = h * line
    return (pixel, line, surface, math.ceil(c / lanes) * surface)


def check_layout(
    name: str,
    fmt: str,
    dtype: str,
    shape: tuple[int, int, int, int],
    strides: tuple[int, int, int, int],
    nbytes: int | None,
) -> int:
    """The stride and size rules of the module docstring, each error naming fields.

    Returns the buffer's size in bytes: ``nbytes``, or the extent of the layout when
    ``nbytes`` is None.
    """
    esize = np.dtype(dtype).itemsize
    n, c, h, w = shape
    pixel, line, surface, batch = strides
    if pixel < esize or pixel % esize:
        raise _model_error(
            name,
            f"stride[0] (pixel stride) {pixel} must be a positive multiple of the "
            f"{esize}-byte {dtype} element",
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
        size = extent if nbytes is None else int(nbytes)
    except (TypeError, ValueError):
        raise ModelError(f"tensor {name!r}: nbytes must be a byte count, got {nbytes!r}") from None
    if size < extent:
        raise _model_error(
            name,
            f"size {size} bytes < the {extent} bytes the layout spans "
            f"(n c h w {n} {c} {h} {w}, stride[0:4] {list(strides)})",
        )
    return size


def check_image_category(name: str, fmt: str, four_lanes: bool, category: int) -> None:
    """hwc4 *is* NHWC with four lanes in the IMAGE category: any other combination of
    those three would read back from its descriptor as a different format."""
    if fmt == "hwc4" and category != DataCategory.IMAGE:
        raise ModelError(
            f"tensor {name!r}: hwc4 is the IMAGE category (dataCategory 0), got category {category}"
        )
    if fmt == "nhwc" and four_lanes and category == DataCategory.IMAGE:
        raise ModelError(
            f"tensor {name!r}: NHWC with 4 lanes in the IMAGE category is the hwc4 "
            "image input; give format='hwc4' (or another category)"
        )


def spec_fields(desc: TensorDescriptor) -> dict[str, Any]:
    """The :class:`~aiodla.TensorSpec` arguments a descriptor's fields say, its format
    derived as the module docstring reads it; fields that name no layout raise
    ModelError (the spec itself checks the rest)."""
    name = desc.name
    try:
        data_type = DataType(desc.data_type)
        dtype = _NUMPY_DTYPE[data_type]
    except (ValueError, KeyError):
        raise _model_error(name, f"dataType {desc.data_type} is not a DLA element type") from None
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
    return dict(
        name=name,
        shape=(desc.n, desc.c, desc.h, desc.w),
        dtype=dtype.name,
        format=fmt,
        strides=(desc.stride[0], desc.stride[1], desc.stride[2], desc.stride[3]),
        nbytes=desc.size,
        category=desc.data_category,
    )


def describe_fields(desc: TensorDescriptor) -> str:
    """The layout fields of a descriptor, for an error that must name them all."""
    return (
        f"from its cuDLA descriptor: n c h w {desc.n} {desc.c} {desc.h} "
        f"{desc.w}, dataFormat {desc.data_format}, dataType {desc.data_type}, "
        f"dataCategory {desc.data_category}, stride {list(desc.stride)}, "
        f"size {desc.size}"
    )


class Described(SpecFacts, Protocol):
    """What a descriptor is written from (a :class:`~aiodla.TensorSpec`)."""

    @property
    def format(self) -> str: ...
    @property
    def category(self) -> int | None: ...


def descriptor_of(spec: Described) -> TensorDescriptor:
    """The descriptor fields a loadable would carry for ``spec`` (no scale: the
    descriptor has no field for one)."""
    assert spec.strides is not None
    assert spec.category is not None
    if spec.format == "hwc4" and spec.numpy_dtype.itemsize == 1:
        pixel_format = PIXEL_FORMAT_R8 if spec.shape[1] == 1 else PIXEL_FORMAT_A8B8G8R8
    else:
        pixel_format = PIXEL_FORMAT_FEATURE
    n, c, h, w = spec.shape
    return TensorDescriptor(
        name=spec.name,
        size=spec.size,
        n=n,
        c=c,
        h=h,
        w=w,
        data_format=int(_DATA_FORMAT[spec.format]),
        data_type=int(_DATA_TYPE[spec.dtype]),
        data_category=int(spec.category),
        pixel_format=pixel_format,
        pixel_mapping=PIXEL_MAPPING_PITCH_LINEAR,
        stride=(*spec.strides, 0, 0, 0, 0),
    )
