"""Tensor specs and DLA memory layouts, derived from cuDLA tensor descriptors.

This is the one module that knows how a logical ``(n, c, h, w)`` array is laid out in
DLA memory. The engine packs and unpacks through it, and so do the emulated runtime's
operations: there is no second copy of layout logic.

How a ``cudlaModuleTensorDescriptor`` is read
--------------------------------------------
``n c h w``
    The logical shape, each >= 1.
``data_type``
    FLOAT 1 (float32), HALF 2 (float16), INT16 3, INT8 4, UINT8 5, UINT16 6 (values
    from ``cudla.h``). The element size ``E`` follows from it.
``data_format`` and ``stride[0]``
    ``stride[0]`` is the byte step from one pixel (one ``w``) to the next. The number
    of channel *lanes* stored at each pixel is ``L = stride[0] / E``:

    - NCHW 1: ``L`` must be 1 (``stride[0] == E``). Format name ``nchw``.
    - NHWC 2: all channels at one pixel, so ``L >= c``; ``L > c`` means padded
      channels. With ``data_category`` IMAGE 0 and ``L == 4`` this is the DLA image
      input ``hwc4`` (``c`` in {1, 3, 4}); otherwise ``nhwc``.
    - NCxHWx 3: channels in groups of ``L`` lanes: 16 lanes for HALF (``chw16``),
      32 lanes for INT8 (``chw32``).
``stride[1]``
    Line stride: bytes from one row (``h``) to the next, ``>= w * stride[0]``.
``stride[2]``
    Surface stride: bytes from one channel group to the next, ``>= h * stride[1]``.
    With one group (NHWC, hwc4) it is still checked, never used for addressing.
``stride[3]``
    Batch stride: bytes from one image (``n``) to the next, ``>= G * stride[2]`` where
    ``G = ceil(c / L)`` is the number of channel groups.
``stride[4:8]``
    Must be zero.
``size``
    Bytes of the whole tensor buffer, ``>= (n - 1) * stride[3] + (G - 1) * stride[2]
    + (h - 1) * stride[1] + w * stride[0]`` (the last byte any element's lanes touch).

Element ``(n, c, h, w)`` then lives at byte offset::

    n * stride[3] + (c // L) * stride[2] + h * stride[1] + w * stride[0] + (c % L) * E

One formula for every format; the formats differ only in ``L`` and the strides. This
reading is aiodla's: the stride semantics of NVIDIA's own loadables were not observed
on a Jetson by this project. ``aiodla inspect`` prints the fields so a user can check.

Packing writes every byte of the buffer: element lanes with the converted values,
padding lanes, row padding, surface padding and the tail with zeros.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Sequence
from typing import Any

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

_NUMPY_DTYPE = {
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
# Which element types the DLA accepts in which format (TensorRT's DLA I/O rules).
_ACCEPTED_DTYPES = {
    "nchw": frozenset({"float32", "float16", "int16", "int8", "uint8", "uint16"}),
    "nhwc": frozenset({"float32", "float16", "int16", "int8", "uint8", "uint16"}),
    "chw16": frozenset({"float16"}),
    "chw32": frozenset({"int8"}),
    "hwc4": frozenset({"int8", "uint8"}),
}
FORMATS = tuple(_ACCEPTED_DTYPES)
NAME_MAX_BYTES = 80


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
            name = bytes(np.asarray(raw_name, dtype=np.int8).view(np.uint8)).split(b"\0", 1)[0]
            name = name.decode("ascii", "replace")
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
    ``scale`` is the INT8/INT16 quantization step (``real = scale * stored``).
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
            raise ModelError(f"tensor {name!r}: shape must be (n, c, h, w), got {self.shape!r}")
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
                f"tensor {name!r}: the DLA does not accept {dtype} in format {fmt}; "
                f"{fmt} takes {sorted(_ACCEPTED_DTYPES[fmt])}"
            )
        n, c, h, w = shape
        if fmt == "hwc4" and c not in (1, 3, 4):
            raise ModelError(f"tensor {name!r}: hwc4 image input needs c in (1, 3, 4), got c={c}")
        esize = np.dtype(dtype).itemsize
        lanes = _FORMAT_LANES.get(fmt, c)
        if self.strides is None:
            pixel = lanes * esize
            line = w * pixel
            surface = h * line
            batch = math.ceil(c / lanes) * surface
            strides = (pixel, line, surface, batch)
        else:
            strides = tuple(int(s) for s in self.strides)  # type: ignore[assignment]
            if len(strides) != 4:
                raise ModelError(
                    f"tensor {name!r}: strides must be (pixel, line, surface, batch) in bytes"
                )
        object.__setattr__(self, "strides", strides)
        pixel, line, surface, batch = strides
        if pixel % esize or pixel < esize:
            raise _model_error(name, f"pixel stride {pixel} is not a multiple of {esize} bytes")
        lanes = pixel // esize
        if fmt == "nchw" and lanes != 1:
            raise _model_error(name, f"NCHW needs stride[0] == {esize} (one lane), got {pixel}")
        if fmt in ("chw16", "chw32", "hwc4") and lanes != _FORMAT_LANES[fmt]:
            raise _model_error(
                name, f"{fmt} needs {_FORMAT_LANES[fmt]} lanes per pixel, stride[0] gives {lanes}"
            )
        if fmt == "nhwc" and lanes < c:
            raise _model_error(name, f"NHWC needs stride[0] >= c * {esize} = {c * esize}, got {pixel}")
        groups = math.ceil(c / lanes)
        if line < w * pixel:
            raise _model_error(name, f"line stride {line} < w * pixel stride = {w * pixel}")
        if surface < h * line:
            raise _model_error(name, f"surface stride {surface} < h * line stride = {h * line}")
        if batch < groups * surface:
            raise _model_error(
                name, f"batch stride {batch} < {groups} channel groups * surface stride {surface}"
            )
        extent = (n - 1) * batch + (groups - 1) * surface + (h - 1) * line + w * pixel
        nbytes = extent if self.nbytes is None else int(self.nbytes)
        if nbytes < extent:
            raise _model_error(name, f"size {nbytes} bytes < the {extent} bytes the layout spans")
        object.__setattr__(self, "nbytes", nbytes)
        if self.scale is not None:
            scale = float(self.scale)
            if not (math.isfinite(scale) and scale > 0):
                raise ModelError(f"tensor {name!r}: scale must be a finite number > 0, got {self.scale!r}")
            object.__setattr__(self, "scale", scale)
        if self.category is None:
            object.__setattr__(
                self,
                "category",
                int(DataCategory.IMAGE if fmt == "hwc4" else DataCategory.FEATURE),
            )

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
        """Derive the spec from descriptor fields alone; inconsistent fields raise ModelError."""
        name = desc.name
        try:
            data_type = DataType(desc.data_type)
            dtype = _NUMPY_DTYPE[data_type]
        except (ValueError, KeyError):
            raise _model_error(name, f"dataType {desc.data_type} is not a DLA element type")
        try:
            data_format = DataFormat(desc.data_format)
        except ValueError:
            raise _model_error(name, f"dataFormat {desc.data_format} is unknown")
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
                    name, f"NCxHWx needs 16 or 32 lanes per pixel, stride[0]={pixel} gives {lanes}"
                )
            fmt = by_lanes[lanes]
        else:
            raise _model_error(name, "dataFormat UNKNOWN")
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
            raise ModelError(f"{exc} (from its cuDLA descriptor)") from None

    def to_descriptor(self) -> TensorDescriptor:
        """The descriptor fields a loadable would carry for this spec."""
        assert self.strides is not None and self.category is not None
        data_format = {
            "nchw": DataFormat.NCHW,
            "nhwc": DataFormat.NHWC,
            "hwc4": DataFormat.NHWC,
            "chw16": DataFormat.NCxHWx,
            "chw32": DataFormat.NCxHWx,
        }[self.format]
        if self.format == "hwc4":
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
            data_format=int(data_format),
            data_type=int(_DATA_TYPE[self.dtype]),
            data_category=int(self.category),
            pixel_format=pixel_format,
            pixel_mapping=PIXEL_MAPPING_PITCH_LINEAR,
            stride=(*self.strides, 0, 0, 0, 0),
        )

    # -- layout views ----------------------------------------------------------------

    def bind(self, buffer: Any, *, zero: bool = True) -> BoundTensor:
        """This tensor fixed to one buffer (a slot's pinned memory, say), with its views
        computed once: packing and unpacking are then one or two numpy copies."""
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

    def check_array(self, value: Any) -> np.ndarray[Any, Any]:
        """Validate a user array against this spec (name, shape, dtype); no copy made.

        Raises InputValueError / InputTypeError naming this tensor and what was expected.
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
                f"input {self.name!r}: expected shape {self.shape} (n, c, h, w), "
                f"got {array.shape}"
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
                if np.isnan(array).any():
                    raise InputValueError(
                        f"input {self.name!r}: NaN cannot be stored in an {self.dtype} tensor"
                    )
            elif not np.can_cast(array.dtype, target, "safe"):
                raise InputTypeError(
                    f"input {self.name!r}: {array.dtype} cannot be cast safely to {self.dtype}"
                )
        elif not np.can_cast(array.dtype, target, "same_kind"):
            raise InputTypeError(
                f"input {self.name!r}: {array.dtype} cannot be cast to {self.dtype}"
            )
        return array

    def pack(
        self, array: npt.ArrayLike, out: Any = None, *, validate: bool = True
    ) -> np.ndarray[Any, Any]:
        """Write ``array`` (logical NCHW) in this tensor's DLA layout.

        Writes straight into ``out`` (any writable buffer of at least ``size`` bytes,
        such as a slot's pinned host buffer) when given, else into a new uint8 array;
        every byte is written, padding as zeros. Float into integer tensors is
        quantized with ``scale``: round to nearest even, saturate. Returns the uint8
        view of the written bytes. ``validate=False`` skips :meth:`check_array` for an
        array that already passed it.
        """
        source = self.check_array(array) if validate else np.asarray(array)
        target = np.empty(self.size, dtype=np.uint8) if out is None else out
        bound = BoundTensor(self, target, zero=not self._is_dense())
        bound.write(source)
        return bound.raw

    def unpack(self, buffer: Any, *, dequantize: bool = True) -> np.ndarray[Any, Any]:
        """Read this tensor's DLA bytes into a fresh logical NCHW array.

        Integer tensors with a ``scale`` come back as float32 ``scale * stored`` unless
        ``dequantize`` is false.
        """
        return BoundTensor(self, buffer, zero=False).read(dequantize=dequantize)

    def quantize(self, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Float values to this integer type: ``round_half_even(x / scale)``, saturated."""
        if self.scale is None:
            raise InputTypeError(f"input {self.name!r}: quantizing needs a scale")
        if np.isnan(array).any():
            raise InputValueError(
                f"input {self.name!r}: NaN cannot be stored in an {self.dtype} tensor"
            )
        info = np.iinfo(self.numpy_dtype)
        scaled = np.divide(array, self.scale, dtype=np.float64)
        np.rint(scaled, out=scaled)
        np.clip(scaled, info.min, info.max, out=scaled)
        return scaled.astype(self.numpy_dtype)

    def describe(self) -> str:
        """A one-line human description: name, shape, dtype and format."""
        n, c, h, w = self.shape
        return f"{self.name}: {n}x{c}x{h}x{w} {self.dtype} {self.format}"


def _raw_bytes(buffer: Any, spec: TensorSpec) -> np.ndarray[Any, Any]:
    raw = buffer if isinstance(buffer, np.ndarray) else np.frombuffer(buffer, dtype=np.uint8)
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raw = raw.reshape(-1).view(np.uint8)
    if raw.nbytes < spec.size:
        raise ModelError(
            f"tensor {spec.name!r}: buffer of {raw.nbytes} bytes < the {spec.size} it needs"
        )
    return raw[: spec.size]


class BoundTensor:
    """A TensorSpec fixed to one buffer, its element views computed once.

    The views map logical ``(n, c, h, w)`` onto the lanes of the layout: one 4-D view
    when the channels have one stride (nchw, or all channels in one lane group), else
    a 5-D view of the full lane groups plus a 4-D view of the last, partial group.
    Padding bytes are zeroed once (``zero=True``) and never written again, since only
    element lanes are ever stored through the views.
    """

    __slots__ = ("_pieces", "raw", "spec")

    def __init__(self, spec: TensorSpec, buffer: Any, *, zero: bool = True) -> None:
        assert spec.strides is not None
        self.spec = spec
        self.raw = _raw_bytes(buffer, spec)
        if zero:
            self.raw[:] = 0
        pixel, line, surface, batch = spec.strides
        n, c, h, w = spec.shape
        lanes, groups, esize = spec.lanes, spec.groups, spec.numpy_dtype.itemsize
        view = np.ndarray(
            shape=(n, groups, h, w, lanes),
            dtype=spec.numpy_dtype,
            buffer=self.raw,
            strides=(batch, surface, line, pixel, esize),
        )
        # (view, first channel, channels, lane groups or 0 for a 4-D view)
        pieces: list[tuple[np.ndarray[Any, Any], int, int, int]] = []
        if lanes == 1:
            pieces.append((view[..., 0], 0, c, 0))
        elif groups == 1:
            pieces.append((view[:, 0, :, :, :c].transpose(0, 3, 1, 2), 0, c, 0))
        else:
            full = c // lanes
            pieces.append((view[:, :full].transpose(0, 1, 4, 2, 3), 0, full * lanes, full))
            if c > full * lanes:
                rest = view[:, full, :, :, : c - full * lanes].transpose(0, 3, 1, 2)
                pieces.append((rest, full * lanes, c - full * lanes, 0))
        self._pieces = tuple(pieces)

    def write(self, source: np.ndarray[Any, Any]) -> None:
        """Store a validated logical array (quantizing floats into integer tensors)."""
        spec = self.spec
        if spec.is_integer and source.dtype.kind == "f":
            source = spec.quantize(source)
        n, _, h, w = spec.shape
        for view, first, count, groups in self._pieces:
            part = source[:, first : first + count]
            if groups:
                part = part.reshape(n, groups, count // groups, h, w)
            np.copyto(view, part, casting="unsafe")

    def read(self, *, dequantize: bool = True) -> np.ndarray[Any, Any]:
        """A fresh logical array of the stored values (dequantized when a scale is set)."""
        spec = self.spec
        n, _, h, w = spec.shape
        dtype = spec.result_dtype if dequantize else spec.numpy_dtype
        result = np.empty(spec.shape, dtype=dtype)
        scale = np.float32(spec.scale) if dtype != spec.numpy_dtype else None
        for view, first, count, groups in self._pieces:
            part = result[:, first : first + count]
            if groups:
                part = part.reshape(n, groups, count // groups, h, w)
            if scale is None:
                np.copyto(part, view)
            else:
                np.multiply(view, scale, out=part, casting="unsafe")
        return result


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
