"""Tensor specs, layouts and conversions, held to a slow reference written with loops.

The reference below walks every element with explicit Python loops over n, c, h, w,
places it at the offset the module docstring gives, and converts each value on its
own (numpy scalar casts for floats, Python's ``round`` on the binary64 quotient for
quantization). Every pack and unpack is compared with it byte for byte, on tiny
shapes, for every accepted (format, dtype) pair, with padded lanes, rows, surfaces,
batches and tails. ``small_blocks`` shrinks the block size so the same tiny tensors
also run through the multi-block plans and the vectorized kernels.
"""

from __future__ import annotations

import contextlib
import math
import os
import tracemalloc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from aiodla import _tensors
from aiodla._errors import InputTypeError, InputValueError, ModelError
from aiodla._tensors import (
    FORMATS,
    BoundTensor,
    DataCategory,
    DataFormat,
    DataType,
    TensorDescriptor,
    TensorSpec,
)

DTYPES = ("float32", "float16", "int16", "int8", "uint8", "uint16")
ACCEPTED = {fmt: sorted(_tensors._ACCEPTED_DTYPES[fmt]) for fmt in FORMATS}
PAIRS = [(fmt, dtype) for fmt in FORMATS for dtype in ACCEPTED[fmt]]
REFUSED = [(fmt, dtype) for fmt in FORMATS for dtype in DTYPES if dtype not in ACCEPTED[fmt]]
ODD_CHANNELS = (1, 3, 15, 16, 17, 31, 33)
FIXED_LANES = {"nchw": 1, "chw16": 16, "chw32": 32, "hwc4": 4}

# -- the slow reference ------------------------------------------------------------------


def offset(spec: TensorSpec, n: int, c: int, h: int, w: int) -> int:
    """Byte offset of element (n, c, h, w): the module docstring's formula, from the
    strides alone."""
    assert spec.strides is not None
    pixel, line, surface, batch = spec.strides
    esize = np.dtype(spec.dtype).itemsize
    lanes = pixel // esize
    return n * batch + (c // lanes) * surface + h * line + w * pixel + (c % lanes) * esize


def element_bytes(spec: TensorSpec) -> set[int]:
    """Every byte of the buffer that belongs to some element."""
    esize = np.dtype(spec.dtype).itemsize
    n_, c_, h_, w_ = spec.shape
    owned: set[int] = set()
    for n in range(n_):
        for c in range(c_):
            for h in range(h_):
                for w in range(w_):
                    start = offset(spec, n, c, h, w)
                    owned.update(range(start, start + esize))
    return owned


def store_value(spec: TensorSpec, value: Any) -> Any:
    """One value as the tensor stores it (a numpy scalar of the tensor's type)."""
    target = np.dtype(spec.dtype)
    if target.kind in "iu" and np.asarray(value).dtype.kind == "f":
        assert spec.scale is not None
        quotient = float(value) / spec.scale  # binary64, rounded once
        info = np.iinfo(target)
        if math.isnan(quotient):
            raise AssertionError("NaN reached the reference quantizer")
        if math.isinf(quotient):
            stored = info.max if quotient > 0 else info.min
        else:
            stored = min(max(round(quotient), info.min), info.max)  # half to even
        return target.type(stored)
    with np.errstate(all="ignore"):
        return np.asarray(value).astype(target)[()]


def reference_pack(spec: TensorSpec, array: np.ndarray[Any, Any]) -> bytes:
    buffer = bytearray(spec.size)
    esize = np.dtype(spec.dtype).itemsize
    n_, c_, h_, w_ = spec.shape
    for n in range(n_):
        for c in range(c_):
            for h in range(h_):
                for w in range(w_):
                    start = offset(spec, n, c, h, w)
                    stored = store_value(spec, array[n, c, h, w])
                    buffer[start : start + esize] = np.asarray(stored).tobytes()
    return bytes(buffer)


def reference_unpack(
    spec: TensorSpec, buffer: bytes, *, dequantize: bool = True, dtype: Any = None
) -> np.ndarray[Any, Any]:
    stored_type = np.dtype(spec.dtype)
    scale = spec.scale if dequantize and stored_type.kind in "iu" else None
    if dtype is None:
        dtype = np.float32 if scale is not None else stored_type
    result = np.empty(spec.shape, dtype)
    esize = stored_type.itemsize
    n_, c_, h_, w_ = spec.shape
    for n in range(n_):
        for c in range(c_):
            for h in range(h_):
                for w in range(w_):
                    start = offset(spec, n, c, h, w)
                    stored = np.frombuffer(buffer[start : start + esize], stored_type)[0]
                    if scale is not None:
                        result[n, c, h, w] = np.dtype(dtype).type(float(stored) * scale)
                    else:
                        result[n, c, h, w] = stored
    return result


def same_bits(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    """Equal dtype, shape and bytes (so NaN payloads and signed zeros count)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@contextlib.contextmanager
def small_blocks(block: int = 24) -> Iterator[None]:
    """Tiny blocks, and the vectorized kernels even for a handful of elements."""
    saved = _tensors._BLOCK, _tensors._SMALL
    _tensors._BLOCK, _tensors._SMALL = block, 1
    try:
        yield
    finally:
        _tensors._BLOCK, _tensors._SMALL = saved


MODES = ("default", "small blocks")


def in_mode(mode: str) -> contextlib.AbstractContextManager[None]:
    return small_blocks() if mode == "small blocks" else contextlib.nullcontext()


# -- strategies --------------------------------------------------------------------------


@st.composite
def specs(
    draw: st.DrawFn,
    pairs: list[tuple[str, str]] = PAIRS,
    padded: bool = True,
    scale: bool = False,
) -> TensorSpec:
    """Tiny specs of any accepted pair, with padding anywhere the layout allows."""
    fmt, dtype = draw(st.sampled_from(pairs))
    esize = np.dtype(dtype).itemsize
    n = draw(st.integers(1, 2))
    c = draw(st.sampled_from((1, 3, 4) if fmt == "hwc4" else (*ODD_CHANNELS, 2, 4)))
    h = draw(st.integers(1, 4))
    w = draw(st.integers(1, 5))
    pad = (lambda most: draw(st.integers(0, most))) if padded else (lambda most: 0)
    lanes = FIXED_LANES.get(fmt) or c + pad(3)
    if fmt == "nhwc" and lanes == 4:
        lanes += 1  # four lanes in the IMAGE category would be hwc4; keep it plain
    pixel = lanes * esize
    line = w * pixel + pad(5)
    surface = h * line + pad(7)
    groups = math.ceil(c / lanes)
    batch = groups * surface + pad(9)
    extent = (n - 1) * batch + (groups - 1) * surface + (h - 1) * line + w * pixel
    chosen_scale = None
    if scale and np.dtype(dtype).kind in "iu":
        chosen_scale = draw(st.sampled_from((1.0, 0.5, 0.1, 0.0123, 3.0, 2.0**-7)))
    return TensorSpec(
        "t",
        (n, c, h, w),
        dtype,
        fmt,
        strides=(pixel, line, surface, batch),
        nbytes=extent + pad(11),
        scale=chosen_scale,
    )


def stored_arrays(spec: TensorSpec) -> st.SearchStrategy[np.ndarray[Any, Any]]:
    """Any values of the tensor's own type, NaN, inf and subnormals included."""
    return hnp.arrays(np.dtype(spec.dtype), spec.shape)


def float_arrays(spec: TensorSpec, dtype: Any, **kwargs: Any) -> st.SearchStrategy[Any]:
    return hnp.arrays(np.dtype(dtype), spec.shape, elements=hnp.from_dtype(np.dtype(dtype), **kwargs))


# -- layouts: pack and unpack against the reference --------------------------------------


class TestLayouts:
    @pytest.mark.parametrize("mode", MODES)
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_pack_and_unpack_equal_the_reference(self, mode: str, data: st.DataObject) -> None:
        spec = data.draw(specs())
        array = data.draw(stored_arrays(spec))
        with in_mode(mode):
            packed = spec.pack(array)
            expected = reference_pack(spec, array)
            assert packed.tobytes() == expected
            assert same_bits(spec.unpack(packed), array)
            assert same_bits(spec.unpack(expected), reference_unpack(spec, expected))

    @settings(max_examples=60, deadline=None)
    @given(data=st.data())
    def test_padding_is_zero(self, data: st.DataObject) -> None:
        spec = data.draw(specs())
        array = data.draw(stored_arrays(spec))
        raw = bytes(spec.pack(array))
        owned = element_bytes(spec)
        assert all(raw[i] == 0 for i in range(spec.size) if i not in owned)

    @settings(max_examples=40, deadline=None)
    @given(data=st.data())
    def test_pack_into_a_dirty_buffer_rewrites_every_byte(self, data: st.DataObject) -> None:
        spec = data.draw(specs())
        array = data.draw(stored_arrays(spec))
        out = np.full(spec.size + 7, 0xA5, np.uint8)
        spec.pack(array, out=out)
        assert out[: spec.size].tobytes() == reference_pack(spec, array)
        assert (out[spec.size :] == 0xA5).all()  # beyond the tensor: not ours

    @pytest.mark.parametrize("c", ODD_CHANNELS)
    @pytest.mark.parametrize("fmt", ["nchw", "nhwc", "chw16", "chw32"])
    def test_odd_channel_counts(self, fmt: str, c: int) -> None:
        dtype = "int8" if fmt == "chw32" else "float16"
        spec = TensorSpec("x", (2, c, 3, 5), dtype, fmt)
        array = np.arange(math.prod(spec.shape)).reshape(spec.shape).astype(dtype)
        for mode in MODES:
            with in_mode(mode):
                packed = spec.pack(array)
                assert packed.tobytes() == reference_pack(spec, array)
                assert same_bits(spec.unpack(packed), array)

    def test_chw16_pads_channels_to_sixteen_lanes(self) -> None:
        spec = TensorSpec("x", (1, 17, 2, 3), "float16", "chw16")
        assert spec.strides == (32, 96, 192, 384)
        assert (spec.lanes, spec.groups, spec.size) == (16, 2, 384)
        array = np.arange(1, 103).reshape(spec.shape).astype(np.float16)
        lanes = spec.pack(array).view(np.float16).reshape(2, 2, 3, 16)  # [group][h][w][lane]
        assert lanes[1, 1, 2, 0] == array[0, 16, 1, 2]
        assert (lanes[1, :, :, 1:] == 0).all()

    def test_hwc4_image_pads_three_channels_to_four(self) -> None:
        spec = TensorSpec("img", (1, 3, 2, 2), "uint8", "hwc4")
        assert (spec.strides, spec.category) == ((4, 8, 16, 16), DataCategory.IMAGE)
        array = np.arange(1, 13, dtype=np.uint8).reshape(spec.shape)
        assert list(spec.pack(array)[:8]) == [1, 5, 9, 0, 2, 6, 10, 0]


# -- every accepted pair, every refused pair ---------------------------------------------


class TestPairs:
    @pytest.mark.parametrize(("fmt", "dtype"), PAIRS)
    def test_accepted_pair_round_trips(self, fmt: str, dtype: str) -> None:
        c = 3 if fmt == "hwc4" else 5
        spec = TensorSpec("x", (1, c, 2, 3), dtype, fmt)
        info = np.finfo(dtype) if np.dtype(dtype).kind == "f" else np.iinfo(dtype)
        values = np.linspace(float(info.min) / 2, float(info.max) / 2, math.prod(spec.shape))
        array = values.reshape(spec.shape).astype(dtype)
        for mode in MODES:
            with in_mode(mode):
                packed = spec.pack(array)
                assert packed.tobytes() == reference_pack(spec, array)
                assert same_bits(spec.unpack(packed), array)
        assert TensorSpec.from_descriptor(spec.to_descriptor()) == spec

    @pytest.mark.parametrize(("fmt", "dtype"), REFUSED)
    def test_refused_pair_raises(self, fmt: str, dtype: str) -> None:
        with pytest.raises(ModelError, match=f"does not accept {dtype}.*in format {fmt}"):
            TensorSpec("x", (1, 3, 2, 2), dtype, fmt)

    def test_the_table(self) -> None:
        # TensorRT's DLA rules for the vectorized formats; nchw/nhwc take all six.
        assert ACCEPTED["chw16"] == ["float16"]
        assert ACCEPTED["chw32"] == ["int8"]
        assert ACCEPTED["hwc4"] == ["float16", "int8", "uint8"]
        assert ACCEPTED["nchw"] == ACCEPTED["nhwc"] == sorted(DTYPES)


# -- conversions on the way in and out ---------------------------------------------------


class TestConversions:
    @pytest.mark.parametrize("mode", MODES)
    @settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_float_sources_into_float_tensors(self, mode: str, data: st.DataObject) -> None:
        spec = data.draw(specs([p for p in PAIRS if p[1] in ("float16", "float32")]))
        source = data.draw(st.sampled_from(["float16", "float32", "float64"]))
        array = data.draw(float_arrays(spec, source))
        with in_mode(mode):
            packed = spec.pack(array)
            assert packed.tobytes() == reference_pack(spec, array)
            # within rounding: exactly what one numpy cast gives
            with np.errstate(all="ignore"):
                expected = array.astype(spec.dtype)
            assert same_bits(spec.unpack(packed), expected)

    @pytest.mark.parametrize("mode", MODES)
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_integer_sources_into_float_tensors(self, mode: str, data: st.DataObject) -> None:
        spec = data.draw(specs([p for p in PAIRS if p[1] in ("float16", "float32")]))
        source = data.draw(st.sampled_from(["bool", "int8", "uint8", "int16", "int32", "int64"]))
        array = data.draw(hnp.arrays(np.dtype(source), spec.shape))
        with in_mode(mode):
            assert spec.pack(array).tobytes() == reference_pack(spec, array)

    @pytest.mark.parametrize("mode", MODES)
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_quantization(self, mode: str, data: st.DataObject) -> None:
        pairs = [p for p in PAIRS if p[1] not in ("float16", "float32")]
        spec = data.draw(specs(pairs, scale=True))
        assert spec.scale is not None
        source = data.draw(st.sampled_from(["float16", "float32", "float64"]))
        array = data.draw(float_arrays(spec, source, allow_nan=False))
        with in_mode(mode):
            packed = spec.pack(array)
            assert packed.tobytes() == reference_pack(spec, array)
            assert same_bits(spec.quantize(array), reference_unpack(spec, bytes(packed), dequantize=False).reshape(spec.shape))
            got = spec.unpack(packed)
            assert same_bits(got, reference_unpack(spec, bytes(packed)))
        # within rounding: half a step of the scale, except where it saturated
        info = np.iinfo(spec.dtype)
        real = array.astype(np.float64)
        with np.errstate(all="ignore"):
            steps = real / spec.scale
            inside = np.isfinite(steps) & (steps > info.min) & (steps < info.max)
        error = np.abs(got.astype(np.float64) - real)[inside]
        assert (error <= spec.scale * 0.5 * (1 + 1e-6) + np.abs(real[inside]) * 1e-6).all()

    @pytest.mark.parametrize("mode", MODES)
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_already_quantized_integers_pass_through(self, mode: str, data: st.DataObject) -> None:
        spec = data.draw(specs([p for p in PAIRS if p[1] not in ("float16", "float32")], scale=True))
        narrower = [t for t in ("bool", "int8", "uint8", "int16", "uint16") if np.can_cast(t, spec.dtype, "safe")]
        source = data.draw(st.sampled_from(narrower))
        array = data.draw(hnp.arrays(np.dtype(source), spec.shape))
        with in_mode(mode):
            packed = spec.pack(array)
            assert same_bits(spec.unpack(packed, dequantize=False), array.astype(spec.dtype))

    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize(
        ("value", "stored"),
        [
            (127.5, 127),  # rounds to 128 (even), saturates
            (-127.5, -128),  # rounds to -128 (even)
            (128.5, 127),
            (-128.5, -128),
            (126.5, 126),
            (-126.5, -126),
            (math.inf, 127),
            (-math.inf, -128),
            (-0.5, 0),
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-1.5, -2),
            (-2.5, -2),
            (0.49999997, 0),
            (1e30, 127),
            (-1e30, -128),
        ],
    )
    def test_int8_rounding_and_saturation(self, mode: str, value: float, stored: int) -> None:
        for fmt in ("chw32", "nchw"):
            spec = TensorSpec("q", (1, 33, 1, 1), "int8", fmt, scale=1.0)
            for source in (np.float32, np.float64):
                array = np.full(spec.shape, value, source)
                with in_mode(mode):
                    got = spec.unpack(spec.pack(array), dequantize=False)
                assert (got == stored).all(), (fmt, source, value, got.ravel()[:3])

    @pytest.mark.parametrize(
        ("dtype", "values", "stored"),
        [
            ("uint8", [-0.5, -1.0, 255.5, 256.5, 254.5, math.inf], [0, 0, 255, 255, 254, 255]),
            ("int16", [32767.5, -32768.5, 32766.5, -math.inf], [32767, -32768, 32766, -32768]),
            ("uint16", [65535.5, -3.0, 65534.5, 0.5], [65535, 0, 65534, 0]),
        ],
    )
    def test_other_integer_saturation(self, dtype: str, values: list[float], stored: list[int]) -> None:
        spec = TensorSpec("q", (1, len(values), 1, 1), dtype, "nchw", scale=1.0)
        array = np.array(values, np.float64).reshape(spec.shape)
        assert spec.unpack(spec.pack(array), dequantize=False).ravel().tolist() == stored

    def test_scale_divides_in_binary64(self) -> None:
        # 0.3 / 0.1 is 2.9999999999999996 in binary64: it rounds to 3, not to 2.
        spec = TensorSpec("q", (1, 1, 1, 2), "int8", "nchw", scale=0.1)
        got = spec.quantize(np.array([0.3, 0.25]).reshape(spec.shape))
        assert got.ravel().tolist() == [3, 2]

    def test_dequantize_rounds_the_binary64_product_once(self) -> None:
        for scale in (0.1, 0.0123, 2.0**-7, float(np.float32(0.0123))):
            spec = TensorSpec("q", (1, 3, 4, 5), "int16", "nhwc", scale=scale)
            stored = np.arange(-30000, 30000, 1000, dtype=np.int16).reshape(spec.shape)
            got = spec.unpack(spec.pack(stored))
            assert got.dtype == np.float32
            assert same_bits(got, (stored.astype(np.float64) * scale).astype(np.float32))
            wide = spec.unpack(spec.pack(stored), dtype=np.float64)
            assert same_bits(wide, stored.astype(np.float64) * scale)

    def test_nan_into_integer_tensors_is_an_input_error(self) -> None:
        spec = TensorSpec("q", (1, 3, 2, 2), "int8", "chw32", scale=0.5)
        array = np.zeros(spec.shape, np.float32)
        array[0, 2, 1, 1] = np.nan
        with pytest.raises(InputValueError, match="NaN"):
            spec.check_array(array)
        with pytest.raises(InputValueError, match="NaN"):
            spec.pack(array)
        with pytest.raises(InputValueError, match="NaN"):
            spec.pack(array, validate=False)
        with pytest.raises(InputValueError, match="NaN"):
            spec.quantize(array)
        bound = spec.bind(np.zeros(spec.size, np.uint8))
        with pytest.raises(InputValueError, match="NaN"):
            bound.write(array)
        assert not bound.raw.any()  # refused before anything was stored

    def test_nan_stays_nan_in_float_tensors(self) -> None:
        spec = TensorSpec("x", (1, 3, 64, 64), "float16", "chw16")
        array = np.zeros(spec.shape, np.float32)
        array[0, 1, 5, 5] = np.nan
        array[0, 2, 6, 6] = -np.inf
        array[0, 0, 7, 7] = 1e6
        got = spec.unpack(spec.pack(array))
        assert np.isnan(got[0, 1, 5, 5])
        assert got[0, 2, 6, 6] == -np.inf
        assert got[0, 0, 7, 7] == np.inf

    def test_float_array_without_a_scale_is_an_input_error(self) -> None:
        spec = TensorSpec("q", (1, 3, 2, 2), "int8", "nchw")
        with pytest.raises(InputTypeError, match="needs a quantization scale"):
            spec.check_array(np.zeros(spec.shape, np.float32))
        with pytest.raises(InputTypeError, match="needs a quantization scale"):
            spec.bind(np.zeros(spec.size, np.uint8)).write(np.zeros(spec.shape, np.float32))
        with pytest.raises(InputTypeError, match="integer tensor with a scale"):
            spec.quantize(np.zeros(spec.shape))

    def test_unsafe_integer_casts_are_refused(self) -> None:
        spec = TensorSpec("q", (1, 3, 2, 2), "int8", "nchw", scale=1.0)
        for dtype in (np.uint8, np.int16, np.int64):
            with pytest.raises(InputTypeError, match="cannot be cast safely"):
                spec.check_array(np.zeros(spec.shape, dtype))
            with pytest.raises(InputTypeError, match="cannot be cast safely"):
                spec.bind(np.zeros(spec.size, np.uint8)).write(np.zeros(spec.shape, dtype))

    def test_check_array_errors(self) -> None:
        spec = TensorSpec("x", (1, 3, 2, 2), "float16", "chw16")
        with pytest.raises(InputValueError, match="expected shape"):
            spec.check_array(np.zeros((1, 3, 2, 3), np.float32))
        with pytest.raises(InputTypeError, match="numeric"):
            spec.check_array(np.zeros(spec.shape, np.complex64))
        with pytest.raises(InputTypeError, match="cannot be converted"):
            spec.check_array("not an array")
        assert spec.check_array([[[[0.0, 1.0]] * 2] * 3]).shape == spec.shape
        with pytest.raises(InputValueError, match="expected shape"):
            spec.bind(np.zeros(spec.size, np.uint8)).write(np.zeros((1, 3, 2, 1), np.float16))

    def test_read_dtypes(self) -> None:
        spec = TensorSpec("x", (1, 3, 4, 4), "float16", "chw16")
        array = np.linspace(-3, 3, 48).reshape(spec.shape).astype(np.float16)
        packed = spec.pack(array)
        assert same_bits(spec.unpack(packed, dtype=np.float32), array.astype(np.float32))
        assert same_bits(spec.unpack(packed, dtype=np.float64), array.astype(np.float64))
        with pytest.raises(InputTypeError, match="cast safely"):
            spec.unpack(packed, dtype=np.int8)
        q = TensorSpec("q", (1, 3, 4, 4), "int8", "chw32", scale=0.5)
        with pytest.raises(InputTypeError, match="float dtype"):
            q.unpack(q.pack(np.zeros(q.shape, np.int8)), dtype=np.int32)
        assert q.unpack(q.pack(np.ones(q.shape, np.int8)), dtype=np.float16).dtype == np.float16
        assert q.result_dtype == np.float32
        assert q.with_scale(None).result_dtype == np.int8


# -- the vectorized kernels against numpy, on many bit patterns -------------------------


def _float32_patterns() -> np.ndarray[Any, Any]:
    """Every float32 exponent below float16's overflow, with the mantissas that sit on
    and around each float16 rounding boundary, both signs; plus random patterns."""
    exponents = np.arange(0, 0x8F, dtype=np.uint32) << 23
    edges = [0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x2FFF, 0x3000, 0x3001, 0x7FE000, 0x7FEFFF, 0x7FF000, 0x7FF001, 0x7FFFFF]
    mantissas = np.array(edges, dtype=np.uint32)
    grid = (exponents[:, None] | mantissas[None, :]).ravel()
    rng = np.random.default_rng(7)
    random = rng.integers(0, 0x47800000, 200_000, dtype=np.uint32)
    magnitudes = np.concatenate([grid, random])
    return np.concatenate([magnitudes, magnitudes | np.uint32(0x80000000)]).view(np.float32)


class TestKernels:
    def test_half_from_float32_equals_numpy(self) -> None:
        values = _float32_patterns()
        out = np.empty(values.shape, np.float16)
        _tensors._half_from_float32(values, out)  # 65520..65535 round to inf, silently
        with np.errstate(over="ignore"):
            assert same_bits(out, values.astype(np.float16))

    def test_half_from_float32_beyond_range_and_specials(self) -> None:
        bits = np.array([0x477FEFFF, 0x477FF000, 0x47800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF], np.uint32)
        values = np.tile(np.concatenate([bits, bits | np.uint32(0x80000000)]), 1000).view(np.float32)
        out = np.empty(values.shape, np.float16)
        with np.errstate(all="ignore"):
            _tensors._half_from_float32(values, out)
            assert same_bits(out, values.astype(np.float16))

    def test_half_from_float64_equals_numpy(self) -> None:
        rng = np.random.default_rng(8)
        halves = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
        ties = (halves[:-1] + halves[1:]) / 2  # exact binary64 midpoints
        near = np.concatenate([np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf), ties])
        random = rng.uniform(-1, 1, 100_000) * np.exp2(rng.integers(-30, 16, 100_000))
        values = np.concatenate([halves, near, random, [65519.999999, 65520.0 - 2**-37]])
        values = np.concatenate([values, -values])
        assert np.abs(values).max() < 65536  # all on the vectorized path
        out = np.empty(values.shape, np.float16)
        _tensors._half_from_float64(values, out)
        assert same_bits(out, values.astype(np.float16))
        beyond = np.tile([65520.0, 65536.0, 1e300, np.inf, -np.inf, np.nan, -1e10, 5e-324], 2000)
        out = np.empty(beyond.shape, np.float16)
        with np.errstate(all="ignore"):
            _tensors._half_from_float64(beyond, out)
            assert same_bits(out, beyond.astype(np.float16))

    def test_half_from_integers_equals_numpy(self) -> None:
        for values in (
            np.arange(-65535, 65536, dtype=np.int32),  # the vectorized path
            np.concatenate([np.arange(-70000, 70000, dtype=np.int64), [2**24 + 1, 2**40, -(2**62)]]),
            np.arange(0, 1 << 16, dtype=np.uint16),
        ):
            out = np.empty(values.shape, np.float16)
            with np.errstate(all="ignore"):
                _tensors._half_from_integers(values, out)
                assert same_bits(out, values.astype(np.float16))

    def test_float32_from_half_every_pattern(self) -> None:
        finite = np.array([b for b in range(1 << 16) if (b & 0x7C00) != 0x7C00], np.uint16).view(np.float16)
        out = np.empty(finite.shape, np.float32)
        _tensors._float32_from_half(finite, out)
        assert same_bits(out, finite.astype(np.float32))
        everything = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
        out = np.empty(everything.shape, np.float32)
        _tensors._float32_from_half(everything, out)  # inf and NaN present: numpy's cast
        assert same_bits(out, everything.astype(np.float32))

    def test_quantizer_paths_agree_with_python_round(self) -> None:
        rng = np.random.default_rng(9)
        values = np.concatenate([np.arange(-300, 300, 0.25), rng.standard_normal(50_000) * 100]).astype(np.float32)
        for scale in (1.0, 0.5, 0.25, 2.0**-9, 0.1, 0.0123, 3.0):
            out = np.empty(values.shape, np.int8)
            _tensors._quantizer(np.dtype(np.float32), np.dtype(np.int8), scale)(values, out)
            expected = [min(max(round(float(v) / scale), -128), 127) for v in values[:2000]]
            assert out[:2000].tolist() == expected
            wide = np.clip(np.rint(values.astype(np.float64) / scale), -128, 127)
            assert (out == wide).all()

    @pytest.mark.skipif(not os.environ.get("AIODLA_EXHAUSTIVE"), reason="set AIODLA_EXHAUSTIVE=1")
    def test_half_from_float32_all_bit_patterns(self) -> None:  # pragma: no cover - minutes
        """AIODLA_EXHAUSTIVE=1: all 2**32 float32 bit patterns against numpy (~10 min)."""
        step = 1 << 24
        out = np.empty(step, np.float16)
        for low in range(0, 1 << 32, step):
            values = np.arange(low, low + step, dtype=np.uint64).astype(np.uint32).view(np.float32)
            with np.errstate(all="ignore"):
                _tensors._half_from_float32(values, out)
                expected = values.astype(np.float16)
            differ = out.view(np.uint16) != expected.view(np.uint16)
            assert not differ.any(), hex(low + int(np.flatnonzero(differ)[0]))


# -- bound tensors -----------------------------------------------------------------------


class TestBoundTensor:
    @pytest.mark.parametrize("mode", MODES)
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_reuse_leaves_padding_zero(self, mode: str, data: st.DataObject) -> None:
        spec = data.draw(specs(scale=True))
        source = "float32" if spec.scale is not None or spec.dtype.startswith("float") else spec.dtype
        with in_mode(mode):
            bound = spec.bind(np.full(spec.size, 0xEE, np.uint8))
            for _ in range(5):
                array = data.draw(float_arrays(spec, source, allow_nan=False) if source == "float32" else stored_arrays(spec))
                bound.write(array)
                assert bound.raw.tobytes() == reference_pack(spec, array)
                assert same_bits(bound.read(), reference_unpack(spec, bound.raw.tobytes()))

    @settings(max_examples=30, deadline=None)
    @given(data=st.data())
    def test_writes_touch_element_lanes_only(self, data: st.DataObject) -> None:
        spec = data.draw(specs())
        garbage = np.frombuffer(np.random.default_rng(1).bytes(spec.size), np.uint8).copy()
        bound = spec.bind(garbage.copy(), zero=False)
        array = data.draw(stored_arrays(spec))
        bound.write(array)
        owned = element_bytes(spec)
        packed = reference_pack(spec, array)
        for i in range(spec.size):
            assert bound.raw[i] == (packed[i] if i in owned else garbage[i])

    def test_many_blocks_and_many_writes(self) -> None:
        line = 32 * 47 + 64
        surface = line * 33 + 32
        spec = TensorSpec("x", (2, 40, 33, 47), "float16", "chw16", strides=(32, line, surface, 3 * surface + 96), nbytes=2 * (3 * surface + 96) + 40)
        owned = np.zeros(spec.size, bool)
        bound = spec.bind(np.zeros(spec.size, np.uint8))
        rng = np.random.default_rng(3)
        for round_ in range(4):
            array = rng.standard_normal(spec.shape).astype(np.float32 if round_ % 2 else np.float16) * 1000
            bound.write(array)
            assert same_bits(bound.read(), array.astype(np.float16))
            assert bound.raw.tobytes() == spec.pack(array).tobytes()
            owned |= bound.raw != 0
        mask = np.zeros(spec.size, bool)
        mask[sorted(element_bytes(spec))] = True
        assert not (owned & ~mask).any()

    def test_buffer_errors(self) -> None:
        spec = TensorSpec("x", (1, 3, 2, 2), "float16", "chw16")
        with pytest.raises(InputValueError, match="buffer of 10 bytes"):
            spec.bind(np.zeros(10, np.uint8))
        with pytest.raises(InputValueError, match="contiguous"):
            spec.bind(np.zeros(2 * spec.size, np.uint8)[::2])
        with pytest.raises(InputValueError, match="read-only"):
            spec.bind(bytes(spec.size))
        with pytest.raises(InputValueError, match="read-only"):
            spec.bind(bytes(spec.size), zero=False).write(np.zeros(spec.shape, np.float16))
        with pytest.raises(InputValueError, match="contiguous buffer"):
            spec.unpack(12345)
        assert spec.unpack(bytes(spec.size)).shape == spec.shape  # read-only is fine to read
        words = np.zeros(spec.size // 4, np.uint32)  # any contiguous dtype
        spec.pack(np.ones(spec.shape, np.float16), out=words)
        assert same_bits(spec.unpack(words), np.ones(spec.shape, np.float16))
        fortran = np.zeros((spec.size // 8, 8), np.uint8, order="F")
        spec.pack(np.ones(spec.shape, np.float16), out=fortran)
        assert same_bits(spec.unpack(fortran), np.ones(spec.shape, np.float16))

    def test_non_native_and_noncontiguous_sources(self) -> None:
        spec = TensorSpec("x", (1, 3, 40, 50), "float16", "chw16")
        rng = np.random.default_rng(4)
        base = rng.standard_normal((1, 40, 50, 3)).astype(np.float32)
        transposed = base.transpose(0, 3, 1, 2)  # an NHWC image seen as NCHW
        swapped = transposed.astype(">f4")
        expected = transposed.astype(np.float16)
        for array in (transposed, swapped, transposed.astype(np.float64)):
            assert same_bits(spec.unpack(spec.pack(array)), expected)

    def test_no_full_size_temporary(self) -> None:
        """pack into a bound buffer allocates nothing of the tensor's size."""
        cases = [
            (TensorSpec("x", (1, 3, 256, 256), "float16", "chw16"), np.float32),
            (TensorSpec("q", (1, 64, 64, 64), "int8", "chw32", scale=0.05), np.float32),
            (TensorSpec("q", (1, 64, 64, 64), "int8", "chw32", scale=0.125), np.float32),
            (TensorSpec("y", (1, 20, 128, 128), "float32", "nhwc"), np.float16),
            (TensorSpec("y", (1, 16, 128, 128), "float16", "nchw"), np.float64),
        ]
        for spec, source in cases:
            array = (np.random.default_rng(5).standard_normal(spec.shape) * 10).astype(source)
            bound = spec.bind(np.zeros(spec.size, np.uint8))
            bound.write(array)  # scratch arrays exist from here on
            bound.read()
            tracemalloc.start()
            try:
                bound.write(array)
                spec.pack(array, out=bound.raw)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert peak < array.nbytes / 8, (spec.describe(), peak, array.nbytes)
            tracemalloc.start()
            try:
                result = bound.read()
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert peak < result.nbytes * 1.15, (spec.describe(), peak, result.nbytes)


# -- specs and descriptors ---------------------------------------------------------------


def descriptor(**changes: Any) -> TensorDescriptor:
    """A valid float16 chw16 descriptor, with some fields changed."""
    fields: dict[str, Any] = dict(
        name="input_0", size=1536, n=2, c=20, h=3, w=4,
        data_format=int(DataFormat.NCxHWx), data_type=int(DataType.HALF),
        data_category=int(DataCategory.FEATURE), pixel_format=36, pixel_mapping=0,
        stride=(32, 128, 384, 768, 0, 0, 0, 0),
    )
    fields.update(changes)
    return TensorDescriptor(**fields)


class TestDescriptors:
    def test_valid_descriptor(self) -> None:
        spec = TensorSpec.from_descriptor(descriptor())
        assert spec == TensorSpec("input_0", (2, 20, 3, 4), "float16", "chw16")
        assert spec.to_descriptor() == descriptor()

    @settings(max_examples=200, deadline=None)
    @given(spec=specs())
    def test_round_trip(self, spec: TensorSpec) -> None:
        assert TensorSpec.from_descriptor(spec.to_descriptor()) == spec

    def test_round_trip_drops_only_the_scale(self) -> None:
        spec = TensorSpec("q", (1, 3, 2, 2), "int8", "hwc4", scale=0.5)
        assert TensorSpec.from_descriptor(spec.to_descriptor()) == spec.with_scale(None)

    @pytest.mark.parametrize(
        ("changes", "words"),
        [
            (dict(data_type=0), r"dataType 0 is not a DLA element type"),
            (dict(data_type=9), r"dataType 9 is not a DLA element type"),
            (dict(data_format=0), r"dataFormat UNKNOWN"),
            (dict(data_format=7), r"dataFormat 7 is unknown"),
            (dict(stride=(32, 128, 384, 768, 0, 0, 1, 0)), r"stride\[4:8\] must be zero"),
            (dict(stride=(32, 128, 384, 768)), r"stride\[4:8\] must be zero"),
            (dict(pixel_mapping=1), r"pixelMapping 1 \(block linear\)"),
            (dict(stride=(48, 192, 576, 1152, 0, 0, 0, 0)), r"NCxHWx needs 16 or 32 lanes.*stride\[0\]=48"),
            (dict(stride=(31, 124, 372, 744, 0, 0, 0, 0)), r"NCxHWx needs 16 or 32 lanes.*stride\[0\]=31"),
            (dict(data_type=int(DataType.INT16)), r"does not accept int16 \(dataType 3\) in format chw16"),
            (dict(data_type=int(DataType.FLOAT), stride=(64, 256, 768, 1536, 0, 0, 0, 0), size=3072), r"does not accept float32 \(dataType 1\) in format chw16"),
            (dict(stride=(32, 127, 384, 768, 0, 0, 0, 0)), r"stride\[1\] \(line stride\) 127 < w \* stride\[0\] = 4 \* 32 = 128"),
            (dict(stride=(32, 128, 383, 768, 0, 0, 0, 0)), r"stride\[2\] \(surface stride\) 383 < h \* stride\[1\]"),
            (dict(stride=(32, 128, 384, 767, 0, 0, 0, 0)), r"stride\[3\] \(batch stride\) 767 < 2 channel group\(s\) \* stride\[2\] = 768"),
            (dict(size=2 * 768 - 1), r"size 1535 bytes < the 1536 bytes the layout spans"),
            (dict(size=0), r"size 0 bytes <"),
            (dict(n=0), r"shape must be four dimensions >= 1"),
            (dict(c=0), r"shape must be four dimensions >= 1"),
            (dict(h=0), r"shape must be four dimensions >= 1"),
            (dict(w=0), r"shape must be four dimensions >= 1"),
            (dict(name=""), r"name must be a non-empty string"),
            (dict(name="x" * 81), r"must be ASCII of at most 80 bytes"),
            (dict(name="é"), r"must be ASCII"),
            (dict(data_format=int(DataFormat.NCHW)), r"NCHW needs stride\[0\] == 2 \(one lane per pixel\), got 32"),
            (dict(data_format=int(DataFormat.NCHW), stride=(0, 8, 24, 480, 0, 0, 0, 0)), r"stride\[0\] \(pixel stride\) 0 must be a positive multiple"),
            (dict(data_format=int(DataFormat.NCHW), stride=(3, 12, 36, 720, 0, 0, 0, 0)), r"stride\[0\] \(pixel stride\) 3 must be a positive multiple of the 2-byte"),
            (dict(data_format=int(DataFormat.NHWC), stride=(38, 152, 456, 912, 0, 0, 0, 0)), r"NHWC needs stride\[0\] >= c \* 2 = 40"),
            (dict(data_format=int(DataFormat.NHWC), data_category=0, data_type=int(DataType.UINT8), c=20, stride=(4, 16, 48, 96, 0, 0, 0, 0)), r"hwc4 image input needs c in \(1, 3, 4\), got c=20"),
            (dict(data_format=int(DataFormat.NHWC), data_category=0, data_type=int(DataType.INT16), c=3, stride=(8, 32, 96, 192, 0, 0, 0, 0), size=384), r"does not accept int16 \(dataType 3\) in format hwc4"),
        ],
    )
    def test_inconsistent_descriptors(self, changes: dict[str, Any], words: str) -> None:
        desc = descriptor(**changes)
        with pytest.raises(ModelError, match=words) as caught:
            TensorSpec.from_descriptor(desc)
        message = str(caught.value)
        if desc.name and len(desc.name) <= 80 and desc.name.isascii():
            assert "'input_0'" in message
        if "from its cuDLA descriptor" in message:
            assert "stride [" in message
            assert f"size {desc.size}" in message

    def test_every_field_is_named_when_layout_fails(self) -> None:
        with pytest.raises(ModelError) as caught:
            TensorSpec.from_descriptor(descriptor(size=5))
        message = str(caught.value)
        for words in ("tensor 'input_0'", "size 5 bytes", "n c h w 2 20 3 4", "dataFormat 3", "dataType 2", "stride [32, 128, 384, 768, 0, 0, 0, 0]"):
            assert words in message

    def test_hwc4_and_nhwc_by_category(self) -> None:
        image = descriptor(data_format=int(DataFormat.NHWC), data_category=0, data_type=int(DataType.UINT8), c=3, stride=(4, 16, 48, 96, 0, 0, 0, 0), size=192)
        assert TensorSpec.from_descriptor(image).format == "hwc4"
        feature = descriptor(data_format=int(DataFormat.NHWC), data_category=2, data_type=int(DataType.UINT8), c=3, stride=(4, 16, 48, 96, 0, 0, 0, 0), size=192)
        assert TensorSpec.from_descriptor(feature).format == "nhwc"
        gray = descriptor(data_format=int(DataFormat.NHWC), data_category=0, data_type=int(DataType.HALF), c=1, stride=(2, 8, 24, 48, 0, 0, 0, 0), size=96)
        spec = TensorSpec.from_descriptor(gray)  # TensorRT's C == 1 image: one lane
        assert (spec.format, spec.lanes, spec.category) == ("nhwc", 1, 0)
        half_image = descriptor(data_format=int(DataFormat.NHWC), data_category=0, c=4, stride=(8, 32, 96, 192, 0, 0, 0, 0), size=384)
        assert TensorSpec.from_descriptor(half_image).format == "hwc4"
        odd = descriptor(data_category=7)  # carried, not checked
        assert TensorSpec.from_descriptor(odd).category == 7

    def test_spec_errors(self) -> None:
        with pytest.raises(ModelError, match="hwc4 is the IMAGE category"):
            TensorSpec("x", (1, 3, 2, 2), "uint8", "hwc4", category=int(DataCategory.FEATURE))
        with pytest.raises(ModelError, match="is the hwc4 image input"):
            TensorSpec("x", (1, 3, 2, 2), "uint8", "nhwc", strides=(4, 8, 16, 16), category=0)
        with pytest.raises(ModelError, match="integer tensors only"):
            TensorSpec("x", (1, 3, 2, 2), "float16", "chw16", scale=0.5)
        for bad in (0.0, -1.0, math.inf, math.nan, "x"):
            with pytest.raises(ModelError, match="scale must be a finite number > 0"):
                TensorSpec("x", (1, 3, 2, 2), "int8", "chw32", scale=bad)  # type: ignore[arg-type]
        with pytest.raises(ModelError, match="strides must be four byte counts"):
            TensorSpec("x", (1, 3, 2, 2), "int8", "chw32", strides=(32, 64, 128))  # type: ignore[arg-type]
        with pytest.raises(ModelError, match="dtype 'float64' is not a DLA element type"):
            TensorSpec("x", (1, 3, 2, 2), "float64", "nchw")
        with pytest.raises(ModelError, match="format 'chw8' is unknown"):
            TensorSpec("x", (1, 3, 2, 2), "float16", "chw8")
        with pytest.raises(ModelError, match=r"shape must be \(n, c, h, w\)"):
            TensorSpec("x", "abc", "float16", "nchw")  # type: ignore[arg-type]
        with pytest.raises(ModelError, match="nbytes must be a byte count"):
            TensorSpec("x", (1, 3, 2, 2), "float16", "nchw", nbytes="many")  # type: ignore[arg-type]
        spec = TensorSpec("x", (1, 3, 2, 2), np.float16, "CHW16")
        assert (spec.dtype, spec.format, spec.describe()) == ("float16", "chw16", "x: 1x3x2x2 float16 chw16")

    def test_from_cudla_copies_every_field(self) -> None:
        class Record:
            name = np.frombuffer(b"abc\0" + bytes(77), np.int8)
            size_, n, c, h, w = 96, 1, 3, 2, 2
            data_format, data_type, data_category, pixel_format, pixel_mapping = 3, 2, 2, 36, 0
            stride = (32, 64, 128, 128, 0, 0, 0, 0)

        desc = TensorDescriptor.from_cudla(Record())
        assert desc.name == "abc"
        assert desc.stride == (32, 64, 128, 128, 0, 0, 0, 0)
        Record.name = b"xyz\0\0"  # type: ignore[assignment]
        assert TensorDescriptor.from_cudla(Record()).name == "xyz"
        Record.name = "uvw\0"  # type: ignore[assignment]
        assert TensorDescriptor.from_cudla(Record()).name == "uvw"


def test_one_copy_of_layout_logic() -> None:
    """The emulated ops and the engine go through this module's bound tensors."""
    import inspect

    from aiodla.emulator import _ops

    source = inspect.getsource(_ops)
    assert ".bind(" in source
    assert "strides" not in source and "stride[" not in source
    assert isinstance(TensorSpec("x", (1, 1, 1, 1)).bind(bytearray(2)), BoundTensor)


def test_chunks_cover_everything() -> None:
    with small_blocks(7):
        for shape in [(), (5,), (3, 4), (2, 3, 5), (1, 9, 2, 2)]:
            seen = np.zeros(shape, int)
            for index in _tensors._chunks(shape):
                seen[index] += 1
            assert (seen == 1).all()


@given(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6))
@settings(max_examples=200, deadline=None)
def test_quantize_one_value(value: float) -> None:
    spec = TensorSpec("q", (1, 1, 1, 1), "int16", "nchw", scale=0.37)
    assume(abs(value) < 1e5)
    got = int(spec.quantize(np.array(value).reshape(1, 1, 1, 1))[0, 0, 0, 0])
    assert got == min(max(round(value / 0.37), -32768), 32767)


@pytest.mark.parametrize(
    ("shape", "dtype", "layout", "scale", "source"),
    [
        ((1, 16, 8, 8), "float16", "chw16", None, np.float16),
        ((1, 5, 3, 7), "float16", "chw16", None, np.float32),
        ((1, 3, 4, 4), "float16", "nchw", None, np.float16),
        ((1, 20, 2, 3), "int8", "chw32", 0.05, np.float32),
        ((1, 3, 5, 5), "uint8", "hwc4", None, np.uint8),
        ((1, 3, 5, 5), "float16", "nhwc", None, np.float64),
    ],
)
def test_a_whole_tensor_block_agrees_with_the_block_loop(
    shape: tuple[int, int, int, int], dtype: str, layout: str, scale: float | None, source: Any
) -> None:
    spec = TensorSpec("t", shape, dtype, layout, scale=scale)
    fast = BoundTensor(spec, np.zeros(spec.size, np.uint8))
    slow = BoundTensor(spec, np.zeros(spec.size, np.uint8))
    ((where, lanes, per_channel),) = fast._blocks
    # Small: one block is the whole tensor, shaped as it.
    assert where == () and lanes.shape == shape and not per_channel
    _, c, h, _ = shape
    # The same block as the general path indexes it: (n, channels, rows).
    general = (0, slice(0, c), slice(0, h))
    slow._blocks = (_tensors._Block(general, slow._blocks[0].lanes[0], False),)
    rng = np.random.default_rng(7)
    values = rng.uniform(-4, 4, shape) if np.dtype(source).kind == "f" else rng.integers(0, 200, shape)
    array = values.astype(source)
    fast.write(array)
    slow.write(array)
    np.testing.assert_array_equal(fast.raw, slow.raw)
    for kwargs in ({}, {"dtype": np.float64}):
        np.testing.assert_array_equal(fast.read(**kwargs), slow.read(**kwargs))
