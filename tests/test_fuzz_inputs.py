"""Fuzzed bad inputs and wrong model files: always a clear aiodla error, never a crash,
a hang or an out-of-bounds read; the engine keeps serving."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from aiodla import (
    AiodlaError,
    EmulatedRuntime,
    Engine,
    InputError,
    ModelError,
    TensorSpec,
)
from aiodla.emulator import make_loadable

from support import X, affine_model, expected_affine

Q = TensorSpec("q", (1, 3, 4, 4), "int8", "chw32")
GOOD = np.ones(X.shape, np.float32)

shapes = st.one_of(
    hnp.array_shapes(min_dims=0, max_dims=5, max_side=9),
    st.just(X.shape),
    st.just((1, 3, 8, 9)),
)
dtypes = st.one_of(
    hnp.scalar_dtypes(),
    st.sampled_from([np.dtype(object), np.dtype("U3"), np.dtype("S2"), np.dtype("m8[s]")]),
)


def fuzz_settings() -> settings:
    return settings(
        max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )


class TestFuzzedArrays:
    @fuzz_settings()
    @given(data=st.data())
    @pytest.mark.asyncio
    async def test_any_array_is_served_or_refused_clearly(
        self, engine: Engine, data: st.DataObject
    ) -> None:
        dtype = data.draw(dtypes)
        shape = data.draw(shapes)
        try:
            array = np.zeros(shape, dtype=dtype)
        except (TypeError, ValueError):
            return
        try:
            y = await engine.infer(array)
        except InputError as error:
            assert "'x'" in str(error)
        else:
            assert y.shape == X.shape
        np.testing.assert_array_equal(await engine.infer(GOOD), expected_affine(GOOD))
        stats = engine.statistics()
        assert stats.queued == 0 and stats.failed == 0

    @fuzz_settings()
    @given(names=st.lists(st.text(max_size=5), max_size=3))
    @pytest.mark.asyncio
    async def test_any_mapping_of_names(self, engine: Engine, names: list[str]) -> None:
        inputs = {name: GOOD for name in names}
        if set(inputs) == {"x"}:
            np.testing.assert_array_equal(await engine.infer(inputs), expected_affine(GOOD))
        else:
            with pytest.raises(InputError, match="inputs:"):
                await engine.infer(inputs)

    @pytest.mark.asyncio
    async def test_non_contiguous_and_read_only_arrays_work(self, engine: Engine) -> None:
        big = np.arange(2 * 3 * 8 * 16, dtype=np.float32).reshape(2, 3, 8, 16)
        strided = big[:1, :, :, ::2]
        assert not strided.flags.c_contiguous
        np.testing.assert_array_equal(await engine.infer(strided), expected_affine(strided))
        frozen = np.full(X.shape, 3.0, np.float32)
        frozen.flags.writeable = False
        np.testing.assert_array_equal(await engine.infer(frozen), expected_affine(frozen))
        transposed = np.ascontiguousarray(GOOD.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
        np.testing.assert_array_equal(await engine.infer(transposed), expected_affine(transposed))

    @pytest.mark.asyncio
    async def test_gigabyte_array_is_refused_without_copying(self, engine: Engine) -> None:
        huge = np.broadcast_to(np.float32(0), (1, 3, 100_000, 100_000))  # 120 GB, not allocated
        with pytest.raises(InputError, match="expected shape"):
            await engine.infer(huge)

    @pytest.mark.asyncio
    async def test_lists_and_scalars(self, engine: Engine) -> None:
        np.testing.assert_array_equal(await engine.infer(GOOD.tolist()), expected_affine(GOOD))
        with pytest.raises(InputError):
            await engine.infer(3.0)
        with pytest.raises(InputError):
            await engine.infer([[1, 2], [3]])  # ragged
        with pytest.raises(InputError):
            await engine.infer(None)


class TestIntegerTensors:
    @pytest.fixture
    def int8_model(self) -> bytes:
        return make_loadable([Q], [TensorSpec("r", Q.shape, "int8", "chw32")], "affine", 0.0)

    @pytest.mark.parametrize("bad", [np.nan, -np.nan])
    @pytest.mark.asyncio
    async def test_nan_into_int8_is_refused(
        self, runtime: EmulatedRuntime, int8_model: bytes, bad: float
    ) -> None:
        async with Engine(int8_model, runtime=runtime, scales={"q": 0.1}) as engine:
            x = np.zeros(Q.shape, np.float32)
            x[0, 1, 2, 3] = bad
            with pytest.raises(InputError, match="NaN"):
                await engine.infer(x)
            assert engine.statistics().submitted == 0

    @pytest.mark.asyncio
    async def test_inf_into_int8_saturates(
        self, runtime: EmulatedRuntime, int8_model: bytes
    ) -> None:
        async with Engine(int8_model, runtime=runtime, scales={"q": 0.1, "r": 1.0}) as engine:
            x = np.zeros(Q.shape, np.float32)
            x[0, 0, 0, 0], x[0, 0, 0, 1] = np.inf, -np.inf
            y = await engine.infer(x)
            assert (y[0, 0, 0, 0], y[0, 0, 0, 1]) == (127.0, -128.0)

    @pytest.mark.asyncio
    async def test_float_without_a_scale_is_refused(
        self, runtime: EmulatedRuntime, int8_model: bytes
    ) -> None:
        async with Engine(int8_model, runtime=runtime) as engine:
            with pytest.raises(InputError, match="needs a quantization scale"):
                await engine.infer(np.zeros(Q.shape, np.float32))


class TestWrongModelFiles:
    @pytest.mark.parametrize(
        "data",
        [
            b"",
            affine_model()[:100],
            affine_model()[:-1],
            b"AIODLAEM" + bytes(56),
            b"AIODLAEM\x01\x00\x00\x00\x40\x00\x00\x00\xff\xff\xff\xff" + bytes(48),
        ],
        ids=["empty", "truncated-header", "truncated", "zero-header", "huge-counts"],
    )
    @pytest.mark.asyncio
    async def test_refused_with_a_model_error(self, data: bytes, tmp_path: object) -> None:
        runtime = EmulatedRuntime()
        with pytest.raises(AiodlaError) as caught:
            await Engine(data, runtime=runtime).open()
        assert isinstance(caught.value, (ModelError, AiodlaError))
        assert str(caught.value)
        assert all(v == 0 for v in runtime.live_handles().values())

    @settings(max_examples=60, deadline=None)
    @given(st.binary(min_size=1, max_size=400))
    @pytest.mark.asyncio
    async def test_random_bytes_never_crash_or_leak(self, data: bytes) -> None:
        runtime = EmulatedRuntime()
        for choice in ("emulated", runtime):
            try:
                await Engine(data, runtime=choice).open()  # type: ignore[arg-type]
            except AiodlaError:
                pass
            else:  # pragma: no cover - random bytes are never a valid loadable
                raise AssertionError("random bytes opened as a model")
        assert all(v == 0 for v in runtime.live_handles().values())
