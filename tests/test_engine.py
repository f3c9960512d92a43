"""The engine end to end on the emulated runtime: results, inputs, lifecycle."""

from __future__ import annotations

import asyncio
import gc
import os
import pathlib
import warnings

import numpy as np
import pytest

import aiodla
from aiodla import (
    AiodlaError,
    ConfigurationError,
    EmulatedRuntime,
    Engine,
    EngineClosedError,
    EngineState,
    InputTypeError,
    InputValueError,
    ModelError,
    RuntimeUnavailableError,
    TensorSpec,
)
from aiodla import _poller as poller_module
from aiodla.emulator import make_loadable

from support import X, affine_model, expected_affine, two_pair_model


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


class TestResults:
    @pytest.mark.loop_variants
    @pytest.mark.asyncio
    async def test_single_input_returns_array(self, engine: Engine) -> None:
        x = rng().standard_normal(X.shape).astype(np.float32)
        y = await engine.infer(x)
        assert isinstance(y, np.ndarray)
        assert y.dtype == np.float32 and y.shape == X.shape
        np.testing.assert_array_equal(y, expected_affine(x))

    @pytest.mark.asyncio
    async def test_results_are_fresh_arrays(self, engine: Engine) -> None:
        x = np.ones(X.shape, np.float32)
        first = await engine.infer(x)
        second = await engine.infer(x * 3)
        assert first.base is None or not np.shares_memory(first, second)
        first[...] = 0  # writing a result harms nothing else
        np.testing.assert_array_equal(second, expected_affine(x * 3))
        np.testing.assert_array_equal(await engine.infer(x), expected_affine(x))

    @pytest.mark.asyncio
    async def test_several_inputs_and_outputs(self, runtime: EmulatedRuntime) -> None:
        async with Engine(two_pair_model(), runtime=runtime) as engine:
            assert [s.name for s in engine.inputs] == ["a", "b"]
            assert [s.name for s in engine.outputs] == ["mean_a", "mean_b"]
            a = rng(1).standard_normal((1, 4, 6, 6)).astype(np.float16)
            b = rng(2).standard_normal((2, 3, 5, 7)).astype(np.float32)
            out = await engine.infer({"a": a, "b": b})
        assert set(out) == {"mean_a", "mean_b"}
        assert out["mean_a"].dtype == np.float32 and out["mean_b"].dtype == np.float16
        expect_a = a.astype(np.float64).mean(axis=(2, 3), keepdims=True) * 3.0 - 1.0
        expect_b = b.astype(np.float64).mean(axis=(2, 3), keepdims=True) * 3.0 - 1.0
        np.testing.assert_allclose(out["mean_a"], expect_a, rtol=1e-6)
        np.testing.assert_allclose(out["mean_b"], expect_b, rtol=1e-3, atol=1e-3)

    @pytest.mark.loop_variants
    @pytest.mark.asyncio
    async def test_no_cross_talk_between_concurrent_requests(
        self, runtime: EmulatedRuntime
    ) -> None:
        async with Engine(
            affine_model(latency=0.0005), runtime=runtime, max_queue=10_000
        ) as engine:
            inputs = [rng(i).standard_normal(X.shape).astype(np.float32) * i for i in range(400)]
            outputs = await asyncio.gather(*(engine.infer(x) for x in inputs))
            stats = engine.statistics()
        for x, y in zip(inputs, outputs):
            np.testing.assert_array_equal(y, expected_affine(x))
        assert stats.completed == 400 and stats.failed == 0
        assert all(core.completed > 100 for core in stats.cores)  # both cores served

    @pytest.mark.asyncio
    async def test_model_from_a_path(
        self, runtime: EmulatedRuntime, tmp_path: pathlib.Path
    ) -> None:
        path = tmp_path / "model.bin"
        await asyncio.to_thread(path.write_bytes, affine_model())
        async with Engine(path, runtime=runtime) as engine:
            x = np.ones(X.shape, np.float16)
            np.testing.assert_array_equal(await engine.infer(x), expected_affine(x))

    @pytest.mark.asyncio
    async def test_the_poller_is_told_when_each_batch_was_handled(
        self, runtime: EmulatedRuntime, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The poller stays quiet after a batch until the loop says it handled it; an
        # engine that never said so would leave each next request waiting 30 s here.
        monkeypatch.setattr(poller_module, "CONSUME_WAIT", 30.0)
        x = rng().standard_normal(X.shape).astype(np.float32)
        async with Engine(affine_model(0.0005), runtime=runtime) as engine:

            async def serve() -> list[np.ndarray]:
                for _ in range(20):
                    np.testing.assert_array_equal(await engine.infer(x), expected_affine(x))
                return await asyncio.gather(*(engine.infer(x) for _ in range(64)))

            results = await asyncio.wait_for(serve(), 10)
        for y in results:
            np.testing.assert_array_equal(y, expected_affine(x))

    # The application's loop sweeps no events in process mode: the worker's poller does.
    @pytest.mark.in_process
    @pytest.mark.asyncio
    async def test_under_load_the_loop_takes_what_finished_during_a_batch(
        self, runtime: EmulatedRuntime, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(poller_module, "HARVEST_AT_LEAST", 1)
        x = rng().standard_normal(X.shape).astype(np.float32)
        async with Engine(affine_model(0.0002), runtime=runtime, streams_per_core=4) as engine:
            poller = engine._flow.poller
            assert poller is not None
            harvested: list[int] = []
            harvest = poller.harvest

            def spy(at_least: int | None = None) -> list[tuple[object, int]]:
                found = harvest(at_least)
                harvested.append(len(found))
                return found  # type: ignore[return-value]

            poller.harvest = spy  # type: ignore[method-assign,assignment]
            results = await asyncio.gather(*(engine.infer(x) for _ in range(400)))
            stats = engine.statistics()
        for y in results:
            np.testing.assert_array_equal(y, expected_affine(x))
        assert sum(harvested) > 0  # some completions never needed the poller thread
        assert stats.completed == 400 and stats.in_flight == 0


class TestBadInputs:
    """Each bad input raises before anything is queued, and the engine keeps serving."""

    @pytest.mark.parametrize(
        ("value", "error", "words"),
        [
            (np.ones((1, 3, 8, 9), np.float32), InputValueError, "expected shape (1, 3, 8, 8)"),
            (np.ones((3, 8, 8), np.float32), InputValueError, "expected shape"),
            (np.ones(X.shape, np.complex64), InputTypeError, "complex64"),
            (np.array([["a"]]), InputTypeError, "numeric"),
            (np.ones(X.shape, dtype=object), InputTypeError, "object"),
            ("not an array", InputTypeError, "numeric"),
            ({"x": np.ones(X.shape), "z": np.ones(X.shape)}, InputValueError, "unknown ['z']"),
            ({"q": np.ones(X.shape)}, InputValueError, "missing ['x']"),
        ],
    )
    @pytest.mark.asyncio
    async def test_rejected_with_a_clear_error(
        self, engine: Engine, value: object, error: type, words: str
    ) -> None:
        with pytest.raises(error) as caught:
            await engine.infer(value)
        assert isinstance(caught.value, AiodlaError)
        assert words in str(caught.value)
        stats = engine.statistics()
        assert stats.submitted == 0 and stats.queued == 0 and stats.in_flight == 0
        x = np.ones(X.shape, np.float32)
        np.testing.assert_array_equal(await engine.infer(x), expected_affine(x))

    @pytest.mark.asyncio
    async def test_errors_are_value_or_type_errors(self, engine: Engine) -> None:
        with pytest.raises(ValueError, match="'x'"):
            await engine.infer(np.ones((1, 1, 1, 1)))
        with pytest.raises(TypeError, match="'x'"):
            await engine.infer(np.ones(X.shape, np.complex128))

    @pytest.mark.asyncio
    async def test_multi_input_model_needs_a_mapping(self, runtime: EmulatedRuntime) -> None:
        async with Engine(two_pair_model(), runtime=runtime) as engine:
            with pytest.raises(InputTypeError, match=r"2 inputs \['a', 'b'\]"):
                await engine.infer(np.ones((1, 4, 6, 6)))

    @pytest.mark.parametrize("timeout", [-1.0, float("nan"), "soon", True])
    @pytest.mark.asyncio
    async def test_bad_timeout(self, engine: Engine, timeout: object) -> None:
        with pytest.raises(ConfigurationError, match="timeout"):
            await engine.infer(np.ones(X.shape), timeout=timeout)  # type: ignore[arg-type]
        assert engine.statistics().submitted == 0


class TestLifecycle:
    @pytest.mark.asyncio
    async def test_states_and_idempotent_close(self, runtime: EmulatedRuntime) -> None:
        engine = Engine(affine_model(), runtime=runtime)
        assert engine.state is EngineState.NEW
        with pytest.raises(EngineClosedError, match="not open"):
            await engine.infer(np.ones(X.shape))
        async with engine:
            assert engine.state is EngineState.OPEN
        assert engine.state is EngineState.CLOSED
        await engine.aclose()
        await engine.aclose()
        with pytest.raises(EngineClosedError, match="closed"):
            await engine.infer(np.ones(X.shape))
        with pytest.raises(EngineClosedError, match="Cannot reopen"):
            await engine.open()
        assert all(v == 0 for v in runtime.live_handles().values())

    @pytest.mark.asyncio
    async def test_open_twice_is_refused(self, engine: Engine) -> None:
        with pytest.raises(AiodlaError, match="open it once"):
            await engine.open()

    @pytest.mark.asyncio
    async def test_close_never_opened(self) -> None:
        engine = Engine(affine_model(), runtime="emulated")
        await engine.aclose()
        assert engine.state is EngineState.CLOSED

    @pytest.mark.asyncio
    async def test_concurrent_closes(self, runtime: EmulatedRuntime) -> None:
        engine = Engine(affine_model(), runtime=runtime)
        await engine.open()
        await asyncio.gather(engine.aclose(), engine.aclose(), engine.aclose())
        assert engine.state is EngineState.CLOSED
        assert all(v == 0 for v in runtime.live_handles().values())

    def test_dropped_unclosed_engine_warns(self, leaky_runtime: EmulatedRuntime) -> None:
        async def leak() -> None:
            engine = Engine(affine_model(), runtime=leaky_runtime)
            await engine.open()

        def drop_and_collect() -> None:
            asyncio.run(leak())
            gc.collect()

        # With isolation="process" the engine's channel socket is in the same garbage
        # as the engine, and the collector may finalize the socket first (it did on
        # Python 3.10): a ResourceWarning of its own, next to the engine's.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            drop_and_collect()
        messages = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert [m for m in messages if m.startswith("unclosed engine")], messages
        others = [m for m in messages if not m.startswith("unclosed engine")]
        assert all(m.startswith("unclosed <socket.socket") for m in others), others

    def test_dropped_new_engine_is_silent(self) -> None:
        Engine(affine_model())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            gc.collect()

    # A process-mode engine's runtime is in its worker (engine.runtime says so).
    @pytest.mark.in_process
    @pytest.mark.asyncio
    async def test_owned_runtime_is_closed(self) -> None:
        async with Engine(affine_model(), runtime="emulated") as engine:
            runtime = engine.runtime
            assert isinstance(runtime, EmulatedRuntime)
        assert all(v == 0 for v in runtime.live_handles().values())

    @pytest.mark.asyncio
    async def test_engine_bound_to_its_loop(self, engine: Engine) -> None:
        def other_loop() -> None:
            asyncio.run(engine.infer(np.ones(X.shape)))

        with pytest.raises(AiodlaError, match="another event loop"):
            await asyncio.to_thread(other_loop)


class TestOpening:
    @pytest.mark.asyncio
    async def test_missing_model_file(self, tmp_path: os.PathLike[str]) -> None:
        engine = Engine(os.path.join(tmp_path, "nope.bin"), runtime="emulated")
        with pytest.raises(ModelError, match=r"cannot read model .*nope\.bin"):
            await engine.open()
        assert engine.state is EngineState.CLOSED

    @pytest.mark.asyncio
    async def test_empty_model(self) -> None:
        with pytest.raises(ModelError, match="empty"):
            await Engine(b"", runtime="emulated").open()

    def test_model_of_wrong_type(self) -> None:
        with pytest.raises(ConfigurationError, match="path or the loadable's bytes"):
            Engine(42)  # type: ignore[arg-type]

    @pytest.mark.asyncio
    async def test_dla_loadable_without_cudla(self) -> None:
        with pytest.raises(RuntimeUnavailableError) as caught:
            await Engine(b"\x01\x02NVDLA-loadable", runtime="auto").open()
        # Nothing but cuDLA can tell a DLA loadable from random bytes: say only what is known.
        assert str(caught.value).startswith(
            "the model is not an emulator loadable; if it is a DLA loadable, it needs cuDLA "
            "(libcudla.so.1, on a Jetson), which is not usable here: "
        )

    @pytest.mark.asyncio
    async def test_dla_loadable_on_the_emulated_runtime(self) -> None:
        with pytest.raises(RuntimeUnavailableError, match="emulator loadables only"):
            await Engine(b"\x01\x02NVDLA-loadable", runtime="emulated").open()

    # A process-mode engine's runtime is in its worker (engine.runtime says so).
    @pytest.mark.in_process
    @pytest.mark.asyncio
    async def test_auto_picks_the_emulator_for_emulator_loadables(self) -> None:
        async with Engine(affine_model(), runtime="auto") as engine:
            assert isinstance(engine.runtime, EmulatedRuntime)

    @pytest.mark.parametrize("choice", ["gpu", 3])
    @pytest.mark.asyncio
    async def test_unknown_runtime_choice(self, choice: object) -> None:
        with pytest.raises(ConfigurationError, match="runtime="):
            await Engine(affine_model(), runtime=choice).open()  # type: ignore[arg-type]

    @pytest.mark.asyncio
    async def test_core_that_does_not_exist(self, runtime: EmulatedRuntime) -> None:
        with pytest.raises(ConfigurationError, match="DLA core 2 does not exist"):
            await Engine(affine_model(), cores=[0, 2], runtime=runtime).open()
        assert all(v == 0 for v in runtime.live_handles().values())

    @pytest.mark.asyncio
    async def test_scale_for_unknown_tensor(self, runtime: EmulatedRuntime) -> None:
        with pytest.raises(ConfigurationError, match="'nope'"):
            await Engine(affine_model(), runtime=runtime, scales={"nope": 0.1}).open()
        assert all(v == 0 for v in runtime.live_handles().values())

    @pytest.mark.asyncio
    async def test_scale_for_float_tensor(self, runtime: EmulatedRuntime) -> None:
        with pytest.raises(ConfigurationError, match="only integer"):
            await Engine(affine_model(), runtime=runtime, scales={"x": 0.1}).open()

    @pytest.mark.asyncio
    async def test_single_core_engine(self, runtime: EmulatedRuntime) -> None:
        async with Engine(affine_model(), cores=[1], streams_per_core=3, runtime=runtime) as engine:
            await asyncio.gather(*(engine.infer(np.ones(X.shape)) for _ in range(10)))
            stats = engine.statistics()
        assert [c.core for c in stats.cores] == [1]
        assert stats.cores[0].completed == 10
        assert runtime.core_tasks(0) == 0 and runtime.core_tasks(1) == 10


class TestQuantized:
    @pytest.mark.asyncio
    async def test_int8_with_scales(self, runtime: EmulatedRuntime) -> None:
        q_in = TensorSpec("q", (1, 40, 2, 3), "int8", "chw32")
        q_out = TensorSpec("r", (1, 40, 2, 3), "int8", "chw32")
        model = make_loadable([q_in], [q_out], "affine", 0.0, scale=1.0, bias=1.0)
        async with Engine(model, runtime=runtime, scales={"q": 0.5, "r": 0.25}) as engine:
            x = np.linspace(-10, 10, 240, dtype=np.float32).reshape(1, 40, 2, 3)
            y = await engine.infer(x)
            assert y.dtype == np.float32
            stored = np.clip(np.rint(x / 0.5), -128, 127) + 1
            np.testing.assert_array_equal(y, (np.clip(stored, -128, 127) * 0.25).astype(np.float32))
            raw = np.arange(-120, 120, dtype=np.int8).reshape(1, 40, 2, 3)
            np.testing.assert_array_equal(
                await engine.infer(raw), ((raw.astype(np.int16) + 1) * 0.25).astype(np.float32)
            )
            with pytest.raises(InputValueError, match="NaN"):
                await engine.infer(np.full(q_in.shape, np.nan, np.float32))
            with pytest.raises(InputTypeError, match="cannot be cast safely"):
                await engine.infer(np.ones(q_in.shape, np.int32))


def test_public_names() -> None:
    assert isinstance(aiodla.__all__, tuple)
    for name in aiodla.__all__:
        assert getattr(aiodla, name) is not None
    subpackages = {"emulator", "runtime", "testing", "metrics", "serve", "ray", "compile"}
    # pytest rewrites asserts in the package of its aiodla.testing plugin, adding "@"
    # names; they are not public API.
    public = {n for n in dir(aiodla) if not n.startswith(("_", "@"))} - subpackages
    assert public == set(aiodla.__all__)


class TestChecksAndWaits:
    @pytest.mark.asyncio
    async def test_check_inputs_refuses_as_infer_does(self, engine: Engine) -> None:
        engine.check_inputs(np.ones(X.shape, np.float32))
        engine.check_inputs({"x": np.ones(X.shape, np.float16)})
        with pytest.raises(InputValueError, match="expected shape"):
            engine.check_inputs(np.ones((1, 1, 1, 1)))
        with pytest.raises(InputTypeError):
            engine.check_inputs(np.ones(X.shape, np.complex64))
        assert engine.statistics().submitted == 0

    @pytest.mark.asyncio
    async def test_check_inputs_before_open(self) -> None:
        with pytest.raises(EngineClosedError, match="not open"):
            Engine(affine_model()).check_inputs(np.ones(X.shape))

    @pytest.mark.asyncio
    async def test_wait_closed(self, runtime: EmulatedRuntime) -> None:
        engine = Engine(affine_model(), runtime=runtime)
        await engine.open()
        waiter = asyncio.create_task(engine.wait_closed())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await engine.aclose()
        await asyncio.wait_for(waiter, 1)

    # No CUDA in the application's process: its loop thread makes nothing current.
    @pytest.mark.in_process
    @pytest.mark.asyncio
    async def test_device_not_current_on_the_loop_thread(self, runtime: EmulatedRuntime) -> None:
        # The opening thread makes the device current once; the loop thread's call fails.
        runtime.fail_call("make_current", 3, after=1)
        engine = Engine(affine_model(), runtime=runtime)
        with pytest.raises(aiodla.DeviceError, match="make_current failed"):
            await engine.open()
        assert engine.state is EngineState.CLOSED
        assert all(v == 0 for v in runtime.live_handles().values())
