"""The public tensor spec: one model input or output (name, shape, element type, DLA
layout), checked when built, and the validator of user arrays that the engine runs
before anything is queued.

The engine packs and unpacks through :class:`TensorSpec`, and so do the emulated
runtime's operations: there is no second copy of layout logic. Behind it,
:mod:`aiodla._descriptors` reads cuDLA descriptors and derives layouts,
:mod:`aiodla._convert` converts values and :mod:`aiodla._layout` cuts a buffer into
blocks and writes and reads them.

Which arrays are taken
----------------------
:meth:`TensorSpec.check_array` is the one validator of user arrays (``Engine.infer``
and ``Engine.check_inputs`` run it), and no value is lost silently through it:

- An array of the tensor's dtype, or of a dtype numpy casts safely to it
  (``np.can_cast(source, tensor, "safe")``: float16, bool, int8 or uint8 into
  float16; float16 or integers up to 16 bits into float32), is taken as it is.
- Into a float tensor, a wider array (float32, float64 or integers from int16 up into
  float16; float64 or 32- and 64-bit integers into float32) is taken only when every
  finite value's magnitude is at most the tensor type's largest finite value (65504
  for float16, about 3.4e38 for float32). NaN and infinity already in the array stay
  NaN and infinity. Rounding to the nearest stored value is not a loss in this sense:
  it is what every conversion does. Otherwise the first value beyond, in C order, is
  an :class:`~aiodla.InputValueError` that names the tensor, the array's dtype, the
  value and its index. ``check_array(..., casting="same_kind")`` takes numpy's rule
  instead (any real dtype; values beyond the range become infinity).
- Into an integer tensor, integer arrays must cast safely; float arrays of any width
  need the tensor's ``scale`` and are quantized as :mod:`aiodla._convert` says
  (rounded, saturated: ±inf saturate), and NaN is an input error.
- A masked array (``numpy.ma``) is an :class:`~aiodla.InputTypeError`: its mask would
  be ignored, so the caller passes ``.filled(...)`` instead.

``pack(..., validate=False)`` and :class:`~aiodla._layout.BoundTensor` skip these
checks and convert as :mod:`aiodla._convert` says (beyond float16's range: infinity).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ._convert import _quantizer, refuse_nan
from ._descriptors import (
    NAME_MAX_BYTES,
    DataCategory,
    TensorDescriptor,
    check_image_category,
    check_layout,
    dense_strides,
    describe_fields,
    descriptor_of,
    dtype_and_format,
    spec_fields,
)
from ._errors import ConfigurationError, InputTypeError, InputValueError, ModelError
from ._layout import BoundTensor, _chunks

__all__ = ["TensorSpec", "specs_by_name"]

_Array = np.ndarray[Any, Any]

#: What :meth:`TensorSpec.check_array` takes into a float tensor (its ``casting=``).
Casting = Literal["safe", "same_kind"]


@dataclasses.dataclass(frozen=True, eq=True)
class TensorSpec:
    """One model input or output: its name, logical shape, element type and DLA layout.

    ``TensorSpec("x", (1, 3, 224, 224), "float16", "chw16")`` describes a dense CHW16
    tensor; pass ``strides=(pixel, line, surface, batch)`` in bytes for padded rows or
    surfaces, and ``nbytes`` when the buffer is larger than the layout needs.
    ``scale`` is the quantization step of an integer tensor (``real = scale * stored``).
    ``category`` is the descriptor's ``dataCategory`` (IMAGE for hwc4, else FEATURE).

    :meth:`check_array` loses no value silently: an array whose dtype casts safely to
    the tensor's is taken as it is; a wider one into a float tensor (float64 into
    float16, say) only when every finite value fits the tensor type's range (at most
    65504 in magnitude for float16), else the first value beyond and its index are an
    InputValueError; floats into integer tensors are quantized with ``scale``; masked
    arrays are refused. The module docstring gives the rule in full.
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
        dtype, fmt = dtype_and_format(name, self.dtype, self.format, shape[1])
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "format", fmt)
        esize = np.dtype(dtype).itemsize
        if self.strides is None:
            strides = dense_strides(fmt, shape, esize)
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
        nbytes = check_layout(name, fmt, dtype, shape, strides, self.nbytes)
        object.__setattr__(self, "nbytes", nbytes)
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
        assert self.category is not None
        check_image_category(name, fmt, strides[0] == 4 * esize, self.category)

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

        :mod:`aiodla._descriptors` lists how each field is read and every rule checked.
        """
        fields = spec_fields(desc)
        try:
            return cls(**fields)
        except ModelError as exc:
            raise ModelError(f"{exc} ({describe_fields(desc)})") from None

    def to_descriptor(self) -> TensorDescriptor:
        """The descriptor fields a loadable would carry for this spec.

        ``TensorSpec.from_descriptor(spec.to_descriptor()) == spec`` for every spec
        without a scale (the descriptor carries no scale).
        """
        return descriptor_of(self)

    # -- layout views ----------------------------------------------------------------

    def bind(self, buffer: Any, *, zero: bool = True) -> BoundTensor[TensorSpec]:
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

    def check_array(self, value: Any, *, casting: Casting = "safe") -> _Array:
        """Validate a user array against this spec (shape, dtype, values); no copy made.

        Raises InputValueError / InputTypeError naming this tensor and what was
        expected: a wrong shape, a dtype that cannot be stored, a masked array, a float
        array for an integer tensor without a scale, NaN for an integer tensor, or a
        finite value beyond a float tensor's range (its first one and its index).

        ``casting="safe"`` (the default) takes what loses no value silently: a dtype
        numpy casts safely to the tensor's, or a wider one whose finite values all fit
        (see the class docstring). ``casting="same_kind"`` is numpy's rule: any real
        dtype goes into a float tensor, and values beyond its range become infinity.
        It changes nothing for integer tensors.
        """
        if type(value) is np.ndarray:
            array = value
        elif isinstance(value, np.ma.MaskedArray):
            raise InputTypeError(
                f"input {self.name!r}: a masked array's mask would be ignored (the DLA "
                "reads every element); pass value.filled(...) with the value masked "
                "elements should take"
            )
        elif isinstance(value, np.ndarray):
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
        if array.dtype == target:  # the common case: nothing to convert, nothing lost
            return array
        if casting != "safe" and casting != "same_kind":
            raise ConfigurationError(f"{casting=} must be 'safe' or 'same_kind'")
        if self.is_integer:
            if array.dtype.kind == "f":
                if self.scale is None:
                    raise InputTypeError(
                        f"input {self.name!r}: a {array.dtype} array for an {self.dtype} "
                        f"tensor needs a quantization scale (Engine(..., scales="
                        f"{{{self.name!r}: ...}})), or pass already-quantized {self.dtype}"
                    )
                refuse_nan(self.name, self.dtype, array)
            elif not np.can_cast(array.dtype, target, "safe"):
                raise InputTypeError(
                    f"input {self.name!r}: {array.dtype} cannot be cast safely to {self.dtype}"
                )
        elif not np.can_cast(array.dtype, target, "same_kind"):
            raise InputTypeError(
                f"input {self.name!r}: {array.dtype} cannot be cast to {self.dtype}"
            )
        elif casting == "safe" and not np.can_cast(array.dtype, target, "safe"):
            refuse_overflow(self.name, array, target)
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
        refuse_nan(self.name, self.dtype, source)
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


def refuse_overflow(name: str, array: _Array, target: np.dtype[Any]) -> None:
    """Refuse an array with a finite value beyond the float ``target``'s largest: the
    cast would store it as infinity. NaN and infinity already in it pass as they are."""
    largest = float(np.finfo(target).max)
    source = array.dtype
    if source.kind in "iu":
        info = np.iinfo(source)
        if -largest <= info.min and info.max <= largest:
            return  # int16 into float16, any integer into float32: nothing can overflow
    # Two reductions and no temporary settle the common case. NaN or infinity anywhere
    # fails this test, and the block-wise search below tells them from overflow.
    if -largest <= array.min() and array.max() <= largest:
        return
    for index in _chunks(array.shape):
        block = array[index]
        with np.errstate(invalid="ignore"):
            beyond = (block > largest) | (block < -largest)
            if source.kind == "f":
                beyond &= np.isfinite(block)
        if beyond.any():
            # _chunks fixes the leading indices and slices the next one
            *fixed, rows = index
            first = np.unravel_index(int(np.argmax(beyond)), beyond.shape)
            position = tuple(int(i) for i in (*fixed, rows.start + first[0], *first[1:]))
            raise InputValueError(
                f"input {name!r}: value {array[position].item()!r} at index {position} "
                f"does not fit {target} (largest {largest:.8g}); {source} arrays are "
                "taken only when every finite value is within that range, so that none "
                "becomes infinity: clip or rescale the values"
            )


def specs_by_name(specs: Sequence[TensorSpec]) -> dict[str, TensorSpec]:
    """Index specs by name; duplicate names are a model error."""
    result: dict[str, TensorSpec] = {}
    for spec in specs:
        if spec.name in result:
            raise ModelError(f"tensor name {spec.name!r} appears twice")
        result[spec.name] = spec
    return result


def inputs_in_order(specs: tuple[TensorSpec, ...], names: frozenset[str], inputs: Any) -> list[Any]:
    """The values of ``inputs`` in the model's input order (names checked)."""
    if isinstance(inputs, Mapping):
        given = set(inputs)
        if given != names:
            missing = sorted(names - given)
            extra = sorted(map(str, given - names))
            parts = []
            if missing:
                parts.append(f"missing {missing}")
            if extra:
                parts.append(f"unknown {extra}")
            raise InputValueError(
                f"inputs: {', '.join(parts)}; the model takes {[s.name for s in specs]}"
            )
        return [inputs[spec.name] for spec in specs]
    if len(specs) != 1:
        raise InputTypeError(
            f"the model has {len(specs)} inputs {[s.name for s in specs]}: pass a "
            "mapping of name to array"
        )
    return [inputs]
