"""Element conversions: how values of the caller's type are stored as a tensor's
element type and read back (float16 rounding, quantization with a scale), as kernels
over one block of values at a time. :mod:`aiodla._layout` decides the blocks.

Values
------
- Into float16 and float32 tensors, values are rounded to nearest even in one step
  from the source value (float64 and integer sources included); beyond float16's
  range they become infinity, and NaN stays NaN. (``TensorSpec.check_array`` refuses
  finite values beyond the range first; the conversion here never refuses.)
- Into integer tensors, float values are quantized with the tensor's ``scale``:
  ``q = round_half_even(x / scale)`` with the quotient taken in binary64, then
  saturated to the type's range (so ±inf saturate too). NaN in a host array is an
  input error (:func:`refuse_nan`, before anything is stored); the conversion itself
  stores NaN as 0, the GPU kernels' rule for device arrays, whose values the host
  never reads. A float array for an integer tensor without a scale is an input error. Integer arrays
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

import functools
import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ._errors import InputValueError

__all__ = ["refuse_nan"]

_Array = np.ndarray[Any, Any]
_BOOL = np.dtype(np.bool_)


def refuse_nan(name: str, dtype: str, array: _Array) -> None:
    """NaN has no integer to be quantized to: an input error, before anything is stored."""
    # min() propagates NaN: one vectorized pass and no temporary of the array.
    if array.dtype.kind == "f" and array.size and np.isnan(np.min(array)):
        raise InputValueError(f"input {name!r}: NaN cannot be stored in an {dtype} tensor")


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


class _HalfRounding(NamedTuple):
    """The constants of the float16 rounding trick for one source float type."""

    float_dtype: np.dtype[Any]
    exponent_mask: Any  # the exponent field, as the type's unsigned integer
    overflow: int  # the exponent field of 65536.0: from there numpy's cast decides
    half_min_normal: Any  # float16's smallest normal, as the source type
    magic: Any  # 1.5 * 2**(p - 11), p the source type's significand bits
    scratch: str  # the scratch buffer's name


_F32_ROUNDING = _HalfRounding(
    _F32, _F32_EXPONENT, _F32_EXPONENT_65536, _F32_HALF_MIN_NORMAL, _F32_MAGIC, "f32 b"
)
_F64_ROUNDING = _HalfRounding(
    _F64, _F64_EXPONENT, _F64_EXPONENT_65536, _F64_HALF_MIN_NORMAL, _F64_MAGIC, "f64 b"
)


def _rounded_to_half_spacing(
    values: _Array, bits: _Array, work: _Array, constants: _HalfRounding
) -> _Array | None:
    """``values`` rounded to float16 precision (ties to even) in their own type, by the
    ``(x + M) - M`` of _half_from_float32; None when some ``|x| >= 65536`` (or inf,
    NaN), which numpy's cast must handle. ``work`` (unsigned, ``bits``' type) is used
    up."""
    shape = values.shape
    np.bitwise_and(bits, constants.exponent_mask, out=work)
    if int(work.max()) >= constants.overflow:
        return None
    magic = work.view(constants.float_dtype)  # 2**e, then M
    np.maximum(magic, _SCRATCH.constant(constants.half_min_normal, shape), out=magic)
    np.multiply(magic, constants.magic, out=magic)
    rounded = _SCRATCH.array(constants.scratch, constants.float_dtype, shape)
    np.add(values, magic, out=rounded)
    np.subtract(rounded, magic, out=rounded)
    return rounded


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
    bits = values.view(_U32)
    work = _SCRATCH.array("u32 a", _U32, values.shape)
    rounded = _rounded_to_half_spacing(values, bits, work, _F32_ROUNDING)
    if rounded is None:
        np.copyto(out, values, casting="same_kind")
        return
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
    rounded = _rounded_to_half_spacing(values, bits, work, _F64_ROUNDING)
    if rounded is None:
        np.copyto(out, values, casting="same_kind")
        return
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
    factor: Any  # a numpy scalar or None (numpy's stubs type them differently by version)
    divisor: Any
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
        # NaN stores 0, as the GPU kernels do: a host array with NaN is refused before
        # it gets here (refuse_nan); a device array's values are never looked at on
        # the host.
        nan = _SCRATCH.array("nan", _BOOL, values.shape)
        np.isnan(work, out=nan)
        np.copyto(work, 0, where=nan)
        np.clip(work, low, high, out=work)  # (±inf saturate here)
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
