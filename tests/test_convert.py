"""Element conversions (aiodla._convert): float16 rounding, quantization and the
vectorized kernels, held to the slow reference and to numpy."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from aiodla import _convert
from aiodla._errors import InputTypeError
from aiodla._tensors import TensorSpec

from tensor_reference import (
    MODES,
    PAIRS,
    float_arrays,
    in_mode,
    reference_pack,
    reference_unpack,
    same_bits,
    specs,
)

# -- conversions on the way in and out ---------------------------------------------------

_BAND = [65504.0, 65519.99, 65520.0, 65535.99, 65536.0, 70000.0, 98304.0, 131071.9]
OVERFLOW_BAND = np.array([_BAND, [-v for v in _BAND]]).reshape(1, 2, 2, 4)
OVERFLOW_SPEC = TensorSpec("t", OVERFLOW_BAND.shape, "float16", "nchw")


@st.composite
def float_cases(draw: st.DrawFn) -> tuple[TensorSpec, np.ndarray[Any, Any]]:
    """A float16 or float32 spec and float values for it (``@example`` pins such pairs)."""
    spec = draw(specs([p for p in PAIRS if p[1] in ("float16", "float32")]))
    source = draw(st.sampled_from(["float16", "float32", "float64"]))
    return spec, draw(float_arrays(spec, source))


class TestConversions:
    @pytest.mark.parametrize("mode", MODES)
    @settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=float_cases())
    # float16's overflow band, both sides of 65520 (where rounding reaches infinity) and
    # of 65536 (where the vectorized kernels hand over to numpy's cast).
    @example(case=(OVERFLOW_SPEC, OVERFLOW_BAND.astype(np.float32)))
    @example(case=(OVERFLOW_SPEC, OVERFLOW_BAND))
    def test_float_sources_into_float_tensors(
        self, mode: str, case: tuple[TensorSpec, np.ndarray[Any, Any]]
    ) -> None:
        spec, array = case
        with in_mode(mode):
            # The conversion itself, overflow included: check_array refuses finite
            # values beyond the range before this (tests/test_tensors.py).
            packed = spec.pack(array, validate=False)
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
        with in_mode(mode):  # the conversion, overflow included, as above
            assert spec.pack(array, validate=False).tobytes() == reference_pack(spec, array)

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
            assert same_bits(
                spec.quantize(array),
                reference_unpack(spec, bytes(packed), dequantize=False).reshape(spec.shape),
            )
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
        spec = data.draw(
            specs([p for p in PAIRS if p[1] not in ("float16", "float32")], scale=True)
        )
        narrower = [
            t
            for t in ("bool", "int8", "uint8", "int16", "uint16")
            if np.can_cast(t, spec.dtype, "safe")
        ]
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
    def test_other_integer_saturation(
        self, dtype: str, values: list[float], stored: list[int]
    ) -> None:
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

    def test_nan_stays_nan_in_float_tensors(self) -> None:
        spec = TensorSpec("x", (1, 3, 64, 64), "float16", "chw16")
        array = np.zeros(spec.shape, np.float32)
        array[0, 1, 5, 5] = np.nan
        array[0, 2, 6, 6] = -np.inf
        array[0, 0, 7, 7] = 1e6  # check_array refuses it; the conversion makes it inf
        got = spec.unpack(spec.pack(array, validate=False))
        assert np.isnan(got[0, 1, 5, 5])
        assert got[0, 2, 6, 6] == -np.inf
        assert got[0, 0, 7, 7] == np.inf

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
    edges = [
        0,
        1,
        0xFFF,
        0x1000,
        0x1001,
        0x1FFF,
        0x2000,
        0x2FFF,
        0x3000,
        0x3001,
        0x7FE000,
        0x7FEFFF,
        0x7FF000,
        0x7FF001,
        0x7FFFFF,
    ]
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
        _convert._half_from_float32(values, out)  # 65520..65535 round to inf, silently
        with np.errstate(over="ignore"):
            assert same_bits(out, values.astype(np.float16))

    def test_half_from_float32_beyond_range_and_specials(self) -> None:
        bits = np.array(
            [
                0x477FEFFF,
                0x477FF000,
                0x47800000,
                0x7F7FFFFF,
                0x7F800000,
                0x7FC00000,
                0x7F800001,
                0x7FFFFFFF,
            ],
            np.uint32,
        )
        values = np.tile(np.concatenate([bits, bits | np.uint32(0x80000000)]), 1000).view(
            np.float32
        )
        out = np.empty(values.shape, np.float16)
        with np.errstate(all="ignore"):
            _convert._half_from_float32(values, out)
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
        _convert._half_from_float64(values, out)
        assert same_bits(out, values.astype(np.float16))
        beyond = np.tile([65520.0, 65536.0, 1e300, np.inf, -np.inf, np.nan, -1e10, 5e-324], 2000)
        out = np.empty(beyond.shape, np.float16)
        with np.errstate(all="ignore"):
            _convert._half_from_float64(beyond, out)
            assert same_bits(out, beyond.astype(np.float16))

    def test_half_from_integers_equals_numpy(self) -> None:
        for values in (
            np.arange(-65535, 65536, dtype=np.int32),  # the vectorized path
            np.concatenate(
                [np.arange(-70000, 70000, dtype=np.int64), [2**24 + 1, 2**40, -(2**62)]]
            ),
            np.arange(0, 1 << 16, dtype=np.uint16),
        ):
            out = np.empty(values.shape, np.float16)
            with np.errstate(all="ignore"):
                _convert._half_from_integers(values, out)
                assert same_bits(out, values.astype(np.float16))

    def test_float32_from_half_every_pattern(self) -> None:
        finite = np.array([b for b in range(1 << 16) if (b & 0x7C00) != 0x7C00], np.uint16).view(
            np.float16
        )
        out = np.empty(finite.shape, np.float32)
        _convert._float32_from_half(finite, out)
        assert same_bits(out, finite.astype(np.float32))
        everything = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
        out = np.empty(everything.shape, np.float32)
        _convert._float32_from_half(everything, out)  # inf and NaN present: numpy's cast
        assert same_bits(out, everything.astype(np.float32))

    def test_quantizer_paths_agree_with_python_round(self) -> None:
        rng = np.random.default_rng(9)
        values = np.concatenate(
            [np.arange(-300, 300, 0.25), rng.standard_normal(50_000) * 100]
        ).astype(np.float32)
        for scale in (1.0, 0.5, 0.25, 2.0**-9, 0.1, 0.0123, 3.0):
            out = np.empty(values.shape, np.int8)
            _convert._quantizer(np.dtype(np.float32), np.dtype(np.int8), scale)(values, out)
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
                _convert._half_from_float32(values, out)
                expected = values.astype(np.float16)
            differ = out.view(np.uint16) != expected.view(np.uint16)
            assert not differ.any(), hex(low + int(np.flatnonzero(differ)[0]))


@given(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6))
@settings(max_examples=200, deadline=None)
def test_quantize_one_value(value: float) -> None:
    spec = TensorSpec("q", (1, 1, 1, 1), "int16", "nchw", scale=0.37)
    assume(abs(value) < 1e5)
    got = int(spec.quantize(np.array(value).reshape(1, 1, 1, 1))[0, 0, 0, 0])
    assert got == min(max(round(value / 0.37), -32768), 32767)
