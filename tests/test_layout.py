"""Block planning and bound tensors (aiodla._layout): every pack and unpack against the
slow reference, padding untouched, no temporary of the whole tensor."""

from __future__ import annotations

import math
import tracemalloc
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aiodla import _layout
from aiodla._descriptors import DataCategory
from aiodla._errors import InputValueError
from aiodla._layout import BoundTensor
from aiodla._tensors import TensorSpec

from tensor_reference import (
    MODES,
    ODD_CHANNELS,
    element_bytes,
    float_arrays,
    in_mode,
    reference_pack,
    reference_unpack,
    same_bits,
    small_blocks,
    specs,
    stored_arrays,
)

# -- layouts: pack and unpack against the reference --------------------------------------


@st.composite
def specs_with_values(draw: st.DrawFn) -> tuple[TensorSpec, np.ndarray[Any, Any]]:
    """A spec and values of its own type (``@example`` can pin such a pair)."""
    spec = draw(specs())
    return spec, draw(stored_arrays(spec))


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
    @given(case=specs_with_values())
    # Dense strides but three of sixteen lanes used: only the lanes are padding, so a
    # density check that ignored them would leave 0xA5 there.
    @example(
        case=(
            TensorSpec("t", (1, 3, 2, 2), "float16", "chw16"),
            np.arange(1, 13, dtype=np.float16).reshape(1, 3, 2, 2),
        )
    )
    def test_pack_into_a_dirty_buffer_rewrites_every_byte(
        self, case: tuple[TensorSpec, np.ndarray[Any, Any]]
    ) -> None:
        spec, array = case
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


# -- bound tensors -----------------------------------------------------------------------


class TestBoundTensor:
    @pytest.mark.parametrize("mode", MODES)
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_reuse_leaves_padding_zero(self, mode: str, data: st.DataObject) -> None:
        spec = data.draw(specs(scale=True))
        source = (
            "float32" if spec.scale is not None or spec.dtype.startswith("float") else spec.dtype
        )
        with in_mode(mode):
            bound = spec.bind(np.full(spec.size, 0xEE, np.uint8))
            for _ in range(5):
                array = data.draw(
                    float_arrays(spec, source, allow_nan=False)
                    if source == "float32"
                    else stored_arrays(spec)
                )
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
        spec = TensorSpec(
            "x",
            (2, 40, 33, 47),
            "float16",
            "chw16",
            strides=(32, line, surface, 3 * surface + 96),
            nbytes=2 * (3 * surface + 96) + 40,
        )
        owned = np.zeros(spec.size, bool)
        bound = spec.bind(np.zeros(spec.size, np.uint8))
        rng = np.random.default_rng(3)
        for round_ in range(4):
            array = (
                rng.standard_normal(spec.shape).astype(np.float32 if round_ % 2 else np.float16)
                * 1000
            )
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
            for index in _layout._chunks(shape):
                seen[index] += 1
            assert (seen == 1).all()


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
    slow._blocks = (_layout._Block(general, slow._blocks[0].lanes[0], False),)
    rng = np.random.default_rng(7)
    values = (
        rng.uniform(-4, 4, shape) if np.dtype(source).kind == "f" else rng.integers(0, 200, shape)
    )
    array = values.astype(source)
    fast.write(array)
    slow.write(array)
    np.testing.assert_array_equal(fast.raw, slow.raw)
    for kwargs in ({}, {"dtype": np.float64}):
        np.testing.assert_array_equal(fast.read(**kwargs), slow.read(**kwargs))
