"""compute=: the user's own computation in the emulated runtime.

What it sees (inputs after the DLA layout's round trip), where it runs (a compute
thread, never the thread that looks at an event), what the task still costs (the
loadable's service time), and how its failures end one request, not the engine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from aiodla import (
    ComputeError,
    EmulatedRuntime,
    Engine,
    EngineDeadError,
    LoadableFormatError,
    ModelError,
    TaskError,
    TensorSpec,
)
from aiodla.emulator import make_loadable, parse_loadable
from aiodla.testing import DLA_TASK_FAILURE

from support import X, Y, counts_add_up, doubled


def model(latency: float = 0.001, compute: str | None = None) -> bytes:
    return make_loadable([X], [Y], latency=latency, compute=compute)


def sample(value: float = 1.1) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(7)
    return (rng.standard_normal(X.shape) + value).astype(np.float32)


class Recorder:
    """A compute function that doubles x and notes the threads it ran on."""

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.calls = 0
        self.dtypes: set[str] = set()

    def __call__(self, inputs: Any) -> dict[str, Any]:
        self.threads.add(threading.current_thread().name)
        self.calls += 1
        self.dtypes.add(str(inputs["x"].dtype))
        return doubled(inputs)


@pytest.mark.asyncio
class TestComputeRuns:
    async def test_outputs_are_the_function_of_the_device_rounded_inputs(self) -> None:
        compute = Recorder()
        x = sample()
        async with Engine(model(), runtime=EmulatedRuntime(compute=compute)) as engine:
            y = await engine.infer(x)
        # The function saw FP16, as the DLA would: x rounded, not the float32 sent.
        assert compute.dtypes == {"float16"}
        np.testing.assert_array_equal(y, x.astype(np.float16).astype(np.float32) * 2)
        assert not np.array_equal(y, x * 2)

    async def test_it_runs_on_a_compute_thread_never_the_loop_or_poller(self) -> None:
        compute = Recorder()
        async with Engine(model(0.0005), runtime=EmulatedRuntime(compute=compute)) as engine:
            await asyncio.gather(*(engine.infer(sample()) for _ in range(200)))
        assert compute.calls == 200
        assert compute.threads <= {"aiodla-emulated-compute-0", "aiodla-emulated-compute-1"}

    async def test_the_service_time_is_the_loadables(self) -> None:
        runtime = EmulatedRuntime(compute=doubled)
        async with Engine(model(0.02), runtime=runtime, cores=[0]) as engine:
            began = time.monotonic()
            for _ in range(3):
                await engine.infer(sample())
            elapsed = time.monotonic() - began
        assert elapsed >= 3 * 0.02
        assert runtime.core_busy_time(0) == pytest.approx(3 * 0.02)

    async def test_a_slow_function_delays_the_completion(self) -> None:
        def slow(inputs: Any) -> dict[str, Any]:
            time.sleep(0.05)
            return doubled(inputs)

        async with Engine(model(0.001), runtime=EmulatedRuntime(compute=slow)) as engine:
            began = time.monotonic()
            y = await engine.infer(sample())
        assert time.monotonic() - began >= 0.05
        np.testing.assert_array_equal(y, sample().astype(np.float16).astype(np.float32) * 2)

    async def test_a_trusted_reference_in_the_loadable_is_imported(self) -> None:
        data = model(compute="support:doubled")
        assert parse_loadable(data).compute == "support:doubled"
        async with Engine(data, runtime="emulated", trust_compute=True) as engine:
            y = await engine.infer(sample())
        np.testing.assert_array_equal(y, sample().astype(np.float16).astype(np.float32) * 2)

    async def test_the_runtimes_compute_wins_over_the_loadables(self) -> None:
        def tripled(inputs: Any) -> dict[str, Any]:
            return {"y": inputs["x"].astype(np.float32) * 3}

        runtime = EmulatedRuntime(compute=tripled)
        async with Engine(model(compute="support:doubled"), runtime=runtime) as engine:
            y = await engine.infer(sample())
        np.testing.assert_array_equal(y, sample().astype(np.float16).astype(np.float32) * 3)

    async def test_an_injected_task_failure_skips_the_function(self) -> None:
        compute = Recorder()
        runtime = EmulatedRuntime(compute=compute)
        async with Engine(model(), runtime=runtime, cores=[0]) as engine:
            runtime.fail_next_task(0, DLA_TASK_FAILURE)
            with pytest.raises(TaskError):
                await engine.infer(sample())
            assert compute.calls == 0
            await engine.infer(sample())
        assert compute.calls == 1

    async def test_compute_threads_end_with_the_engine(self) -> None:
        runtime = EmulatedRuntime(compute=doubled)
        async with Engine(model(), runtime=runtime) as engine:
            await engine.infer(sample())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(
            t.name.startswith("aiodla-emulated-compute") for t in threading.enumerate()
        ):
            await asyncio.sleep(0.01)
        assert not [t for t in threading.enumerate() if t.name.startswith("aiodla-emulated")]


def _raises(inputs: Any) -> dict[str, Any]:
    raise ZeroDivisionError("the user's bug")


def _wrong_name(inputs: Any) -> dict[str, Any]:
    return {"z": inputs["x"]}


def _wrong_shape(inputs: Any) -> dict[str, Any]:
    return {"y": np.zeros((1, 3, 4, 4), np.float32)}


def _wrong_dtype(inputs: Any) -> dict[str, Any]:
    return {"y": np.zeros(Y.shape, np.complex64)}


def _not_a_mapping(inputs: Any) -> Any:
    return inputs["x"]


@pytest.mark.asyncio
class TestComputeFailures:
    @pytest.mark.parametrize(
        ("function", "words"),
        [
            (_raises, ["_raises raised ZeroDivisionError: the user's bug"]),
            (_wrong_name, ["_wrong_name returned outputs ['z']", "no 'y'", "unknown 'z'"]),
            (_wrong_shape, ["output 'y' of shape (1, 3, 4, 4)", "(1, 3, 8, 8)"]),
            (_wrong_dtype, ["output 'y' of dtype complex64", "float32"]),
            (_not_a_mapping, ["returned ndarray", "mapping of output name to array"]),
        ],
    )
    async def test_one_request_fails_and_the_engine_serves_on(
        self, function: Any, words: list[str]
    ) -> None:
        def sometimes(inputs: Any) -> Any:
            if inputs["x"].flat[0] < -50:
                return function(inputs)
            return doubled(inputs)

        sometimes.__qualname__ = function.__name__
        bad = np.full(X.shape, -100, np.float32)
        async with Engine(model(), runtime=EmulatedRuntime(compute=sometimes)) as engine:
            results = await asyncio.gather(
                *(engine.infer(bad if i % 3 == 0 else sample()) for i in range(30)),
                return_exceptions=True,
            )
            for i, result in enumerate(results):
                if i % 3 == 0:
                    assert isinstance(result, ComputeError), result
                    assert isinstance(result, ModelError)
                    for word in words:
                        assert word in str(result)
                else:
                    assert isinstance(result, np.ndarray), result
            stats = engine.statistics()
            assert stats.failed == 10
            assert stats.failures["compute"] == 10
            assert stats.failures["task"] == 0
            assert counts_add_up(stats)
            # Not the DLA's fault: no core left rotation, none counts a failure.
            assert engine.health().ok
            assert all(core.failed == 0 and core.in_rotation for core in stats.cores)
            np.testing.assert_array_equal(
                await engine.infer(sample()), sample().astype(np.float16).astype(np.float32) * 2
            )

    async def test_the_users_exception_is_the_cause(self) -> None:
        async with Engine(model(), runtime=EmulatedRuntime(compute=_raises)) as engine:
            with pytest.raises(ComputeError) as caught:
                await engine.infer(sample())
        assert isinstance(caught.value.__cause__, ZeroDivisionError)

    async def test_a_check_that_refuses_the_model_fails_the_open(self) -> None:
        class Picky:
            def __call__(self, inputs: Any) -> dict[str, Any]:
                return doubled(inputs)

            def check(self, inputs: Any, outputs: Any) -> None:
                raise ModelError(f"not for {[s.name for s in inputs]}")

        engine = Engine(model(), runtime=EmulatedRuntime(compute=Picky()))
        with pytest.raises(ModelError, match=r"not for \['x'\]"):
            await engine.open()

    async def test_a_reference_that_does_not_import_fails_the_open(self) -> None:
        engine = Engine(
            model(compute="support:no_such_function"), runtime="emulated", trust_compute=True
        )
        with pytest.raises(ModelError, match="'support' has no 'no_such_function'"):
            await engine.open()


class TestComputeReferenceFormat:
    def test_round_trip_and_default(self) -> None:
        assert parse_loadable(model()).compute is None
        assert parse_loadable(model(compute="a.b:c.d")).compute == "a.b:c.d"

    @pytest.mark.parametrize("bad", ["nocolon", "a:", ":b", "a b:c", "a:b:c", "é:f"])
    def test_a_bad_reference_is_refused(self, bad: str) -> None:
        with pytest.raises(ModelError, match="module:function"):
            model(compute=bad)

    def test_a_corrupt_reference_is_a_format_error(self) -> None:
        data = bytearray(model(compute="a:b"))
        data[-2] = ord(" ")
        with pytest.raises(LoadableFormatError, match="compute reference"):
            parse_loadable(bytes(data))
        data = bytearray(model(compute="a:b"))
        with pytest.raises(LoadableFormatError, match="truncated or padded"):
            parse_loadable(bytes(data[:-1]))

    def test_the_runtime_refuses_what_is_not_callable(self) -> None:
        with pytest.raises(ValueError, match="callable"):
            EmulatedRuntime(compute=42)  # type: ignore[arg-type]


@pytest.mark.asyncio
class TestPlugin:
    async def test_aiodla_engine_takes_compute(self, aiodla_engine: Any) -> None:
        compute = Recorder()
        engine = await aiodla_engine(inputs=[X], outputs=[Y], compute=compute)
        y = await engine.infer(sample())
        np.testing.assert_array_equal(y, sample().astype(np.float16).astype(np.float32) * 2)
        # Bound to that engine only: another of the same model computes the op.
        plain = await aiodla_engine(inputs=[X], outputs=[Y])
        await plain.infer(sample())
        assert compute.calls == 1

    async def test_a_failure_through_the_plugin(
        self, aiodla_engine: Any, aiodla_controls: Any
    ) -> None:
        engine = await aiodla_engine(inputs=[X], outputs=[Y], compute=_wrong_shape)
        with pytest.raises(ComputeError, match="shape"):
            await engine.infer(sample())
        aiodla_controls.fail_next()
        with pytest.raises(TaskError):
            await engine.infer(sample())
        assert counts_add_up(engine.statistics())

    async def test_a_reference_string(self, aiodla_engine: Any) -> None:
        engine = await aiodla_engine(
            inputs=[TensorSpec("x", (1, 3, 2, 2))],
            outputs=[TensorSpec("y", (1, 3, 2, 2))],
            compute="support:doubled",
        )
        x = np.full((1, 3, 2, 2), 0.1, np.float32)
        np.testing.assert_array_equal(await engine.infer(x), np.float16(0.1) * np.float16(2))


def test_onnx_compute_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiodla.emulator import onnx_compute

    monkeypatch.setitem(__import__("sys").modules, "onnxruntime", None)
    with pytest.raises(ValueError, match=r"pip install 'aiodla\[onnx\]'"):
        onnx_compute(b"any")


@pytest.mark.asyncio
async def test_a_poisoned_context_while_a_function_runs() -> None:
    started, finish = threading.Event(), threading.Event()

    def waits(inputs: Any) -> dict[str, Any]:
        started.set()
        finish.wait(5)
        return doubled(inputs)

    runtime = EmulatedRuntime(compute=waits)
    engine = Engine(model(), runtime=runtime, cores=[0])
    await engine.open()
    request = asyncio.ensure_future(engine.infer(sample()))
    assert await asyncio.to_thread(started.wait, 5)
    runtime.poison()
    finish.set()
    with pytest.raises(EngineDeadError):
        await request
    await engine.aclose()
    assert counts_add_up(engine.statistics())
