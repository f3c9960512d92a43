"""Values on the edges of the element conversions' fast paths, in blocks the vectorized
kernels take: float16 infinity read back, and float32 quantized with a scale that is not
a power of two (which must divide in binary64)."""

from __future__ import annotations

import numpy as np
import pytest

from aiodla import _convert
from aiodla._tensors import TensorSpec

# 16,384 elements: one block for the kernels (numpy's casts take blocks under 8,192).
SHAPE = (1, 1, 128, 128)


@pytest.fixture(autouse=True)
def built_here() -> None:
    """Each test's conversions are built in it, not taken from an earlier test's cache:
    the choice of path (float32 or binary64) is then made, and checked, here."""
    for cached in (
        _convert._write_conversion,
        _convert._read_conversion,
        _convert._quantizer,
        _convert._dequantizer,
    ):
        cached.cache_clear()


@pytest.mark.parametrize("value", [np.inf, -np.inf])
def test_float16_infinity_reads_back_as_infinity(value: float) -> None:
    spec = TensorSpec("y", SHAPE, "float16", "nchw")
    stored = np.full(SHAPE, 1.5, np.float16)
    stored[0, 0, 64, 7] = value  # one infinity among finite values, no NaN
    got = spec.unpack(spec.pack(stored), dtype=np.float32)
    assert got[0, 0, 64, 7] == value
    np.testing.assert_array_equal(got, stored.astype(np.float32))


def test_float32_quantized_with_a_tenth_divides_in_binary64() -> None:
    # float32(0.35) / 0.1 is 3.49999994... in binary64 (rounds to 3); multiplied by
    # float32(10) in float32 it rounds up to 3.5, then to 4.
    spec = TensorSpec("q", SHAPE, "int8", "nchw", scale=0.1)
    x = np.full(SHAPE, 0.35, np.float32)
    packed = spec.pack(x).view(np.int8)
    expected = np.rint(x.astype(np.float64) / 0.1)
    assert expected[0, 0, 0, 0] == 3
    np.testing.assert_array_equal(packed.reshape(SHAPE), expected.astype(np.int8))
