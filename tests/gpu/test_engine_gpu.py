"""The engine end to end on the real CUDA path: CudaRuntime + the stand-in on a GPU.

Every result is checked against the emulator's own arithmetic (aiodla.emulator._ops),
so cross-talk between concurrent requests shows up as wrong numbers. States such as
"in flight on the DLA" are reached with the stand-in's gate, never by sleeping.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

try:
    from aiodla import (
        DeviceError,
        Engine,
        EngineClosedError,
        InputValueError,
        RequestTimeoutError,
        TaskError,
        TensorSpec,
    )
except ModuleNotFoundError as exc:  # only while the engine module does not exist yet
    if exc.name != "aiodla._engine":
        raise
    pytest.skip("aiodla.Engine is not available yet", allow_module_level=True)

from aiodla.emulator._format import EmulatorModel, make_loadable, parse_loadable
from aiodla.emulator._ops import compute_logical, to_storage
from aiodla.runtime._cuda import CudaRuntime

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio]

DLA_INVALID_INPUT = 0x40000001
ENGINE_TIMEOUT = 0x40000006
NO_HANDLES = {"devices": 0, "modules": 0, "registrations": 0}


def single_model(latency: float = 0.001, op: str = "affine") -> bytes:
    x = TensorSpec("x", (1, 24, 5, 7), "float16", "chw16")
    shape = (1, 24, 5, 7) if op == "affine" else (1, 24, 1, 1)
    y = TensorSpec("y", shape, "float16", "nchw")
    return make_loadable([x], [y], op, latency, scale=0.75, bias=-2.0)


def multi_model(latency: float = 0.001, op: str = "affine") -> bytes:
    def out(name: str, shape: tuple[int, int, int, int], dtype: str, fmt: str) -> TensorSpec:
        if op == "mean_hw":
            shape = (shape[0], shape[1], 1, 1)
        return TensorSpec(name, shape, dtype, fmt)

    inputs = [
        TensorSpec("image", (1, 3, 8, 8), "uint8", "hwc4"),
        TensorSpec("features", (2, 40, 3, 3), "int8", "chw32"),
        TensorSpec("dense", (1, 5, 4, 4), "float32", "nchw"),
    ]
    outputs = [
        out("image_out", (1, 3, 8, 8), "float16", "chw16"),
        out("features_out", (2, 40, 3, 3), "int8", "nchw"),
        out("dense_out", (1, 5, 4, 4), "float32", "nhwc"),
    ]
    return make_loadable(inputs, outputs, op, latency, scale=0.5, bias=3.0)


def random_inputs(model: EmulatorModel, seed: int) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    arrays = {}
    for spec in model.inputs:
        if spec.numpy_dtype.kind == "f":
            arrays[spec.name] = rng.uniform(-50, 50, spec.shape).astype(spec.numpy_dtype)
        else:
            info = np.iinfo(spec.numpy_dtype)
            arrays[spec.name] = rng.integers(
                info.min, info.max, spec.shape, endpoint=True, dtype=spec.numpy_dtype
            )
    return arrays


def expected(model: EmulatorModel, arrays: dict[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
    result = {}
    for index, (source, target) in enumerate(zip(model.inputs, model.outputs, strict=True)):
        with np.errstate(over="ignore", invalid="ignore"):
            values = compute_logical(model, index, arrays[source.name])
            result[target.name] = to_storage(values, target.numpy_dtype)
    return result


def assert_same(got: Any, want: dict[str, Any]) -> None:
    if not isinstance(got, dict):
        assert len(want) == 1
        got = {next(iter(want)): got}
    assert set(got) == set(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype, name
        np.testing.assert_array_equal(got[name], array, err_msg=name)


@pytest.fixture
def cuda_runtime(gpu_session: Any) -> Iterator[CudaRuntime]:
    runtime = CudaRuntime(0)
    yield runtime
    runtime.close()


@pytest.fixture
def released(standin: Any) -> Iterator[Any]:
    """The stand-in; after the test every handle the engine made is gone."""
    yield standin
    assert standin.live_handles() == NO_HANDLES


class TestResults:
    async def test_single_input(self, cuda_runtime: CudaRuntime, released: Any) -> None:
        data = single_model()
        model = parse_loadable(data)
        async with Engine(data, cores=(0, 1), streams_per_core=2, runtime=cuda_runtime) as engine:
            for seed in range(5):
                arrays = random_inputs(model, seed)
                assert_same(await engine.infer(arrays["x"]), expected(model, arrays))
            stats = engine.statistics()
            assert stats.completed == 5
            assert stats.failed == 0
            assert stats.in_flight == 0
            assert stats.queued == 0

    async def test_several_inputs_and_outputs(
        self, cuda_runtime: CudaRuntime, released: Any
    ) -> None:
        data = multi_model()
        model = parse_loadable(data)
        async with Engine(data, runtime=cuda_runtime) as engine:
            arrays = random_inputs(model, 1)
            result = await engine.infer(arrays)
            assert isinstance(result, dict)
            assert_same(result, expected(model, arrays))

    @pytest.mark.parametrize("build", [single_model, multi_model], ids=["single", "multi"])
    async def test_mean_hw(self, build: Any, cuda_runtime: CudaRuntime, released: Any) -> None:
        data = build(op="mean_hw")
        model = parse_loadable(data)
        async with Engine(data, runtime=cuda_runtime) as engine:
            arrays = random_inputs(model, 9)
            argument = arrays if len(arrays) > 1 else arrays["x"]
            assert_same(await engine.infer(argument), expected(model, arrays))

    async def test_hundreds_of_concurrent_requests(
        self, cuda_runtime: CudaRuntime, released: Any
    ) -> None:
        data = multi_model(latency=0.0005)
        model = parse_loadable(data)
        count = 400
        before = [released.core_tasks(core) for core in (0, 1)]
        inputs = [random_inputs(model, seed) for seed in range(count)]
        async with Engine(data, cores=(0, 1), streams_per_core=2, runtime=cuda_runtime) as engine:
            results = await asyncio.gather(*(engine.infer(x) for x in inputs))
            stats = engine.statistics()
        for arrays, result in zip(inputs, results, strict=True):
            assert_same(result, expected(model, arrays))
        assert stats.completed == count
        assert stats.failed == 0
        assert stats.in_flight == 0
        assert stats.queued == 0
        assert sum(core.completed for core in stats.cores) == count
        assert all(core.completed > 0 for core in stats.cores), stats.cores
        done = [released.core_tasks(core) - before[core] for core in (0, 1)]
        assert sum(done) == count
        assert min(done) > 0

    async def test_the_cuda_runtime_by_name(self, released: Any) -> None:
        data = single_model()
        model = parse_loadable(data)
        async with Engine(data, runtime="cuda") as engine:
            assert engine.runtime is not None
            assert engine.runtime.name == "cuda"
            arrays = random_inputs(model, 3)
            assert_same(await engine.infer(arrays["x"]), expected(model, arrays))

    async def test_bad_input_is_refused_before_queueing(
        self, cuda_runtime: CudaRuntime, released: Any
    ) -> None:
        async with Engine(single_model(), runtime=cuda_runtime) as engine:
            with pytest.raises(InputValueError):
                await engine.infer(np.zeros((1, 24, 5, 6), dtype=np.float16))
            assert engine.statistics().submitted == 0


class TestFaults:
    async def test_task_error(self, cuda_runtime: CudaRuntime, released: Any) -> None:
        data = single_model()
        model = parse_loadable(data)
        arrays = random_inputs(model, 2)
        async with Engine(data, cores=(0,), runtime=cuda_runtime) as engine:
            released.fail_next_task(0, DLA_INVALID_INPUT)
            with pytest.raises(TaskError) as caught:
                await engine.infer(arrays["x"])
            assert caught.value.status == DLA_INVALID_INPUT
            assert caught.value.core == 0
            assert_same(await engine.infer(arrays["x"]), expected(model, arrays))
            stats = engine.statistics()
            assert stats.failed == 1
            assert stats.completed == 1
            assert stats.cores[0].failed == 1

    async def test_fault_hits_the_core_it_was_set_on(
        self, cuda_runtime: CudaRuntime, released: Any
    ) -> None:
        data = single_model()
        model = parse_loadable(data)
        arrays = random_inputs(model, 4)
        async with Engine(data, cores=(0, 1), runtime=cuda_runtime) as engine:
            released.fail_next_task(1, 0x40000003)
            outcomes = await asyncio.gather(
                *(engine.infer(arrays["x"]) for _ in range(16)), return_exceptions=True
            )
            errors = [o for o in outcomes if isinstance(o, BaseException)]
            assert len(errors) == 1
            assert isinstance(errors[0], TaskError)
            assert errors[0].core == 1
            assert errors[0].status == 0x40000003
            stats = engine.statistics()
            assert stats.cores[1].failed == 1
            assert stats.cores[0].failed == 0

    async def test_hung_core_times_out(self, cuda_runtime: CudaRuntime, released: Any) -> None:
        data = single_model()
        model = parse_loadable(data)
        arrays = random_inputs(model, 5)
        async with Engine(data, cores=(0,), task_timeout=0.2, runtime=cuda_runtime) as engine:
            released.hang_core(0)
            with pytest.raises(TaskError) as caught:
                await engine.infer(arrays["x"])
            assert caught.value.status == ENGINE_TIMEOUT
            released.hang_core(0, False)
            assert_same(await engine.infer(arrays["x"]), expected(model, arrays))

    @pytest.mark.timing_bound("the core returns to rotation within 2 s of probes every 0.05 s")
    async def test_faulty_core_leaves_rotation_and_returns(
        self, cuda_runtime: CudaRuntime, released: Any, real_gpu: None
    ) -> None:
        data = single_model(latency=0.0005)
        model = parse_loadable(data)
        arrays = random_inputs(model, 6)
        want = expected(model, arrays)
        async with Engine(
            data,
            cores=(0, 1),
            streams_per_core=1,
            runtime=cuda_runtime,
            max_consecutive_faults=2,
            probe_interval=0.05,
        ) as engine:
            for _ in range(50):
                if not engine.statistics().cores[0].in_rotation:
                    break
                released.fail_next_task(0, DLA_INVALID_INPUT)
                try:
                    assert_same(await engine.infer(arrays["x"]), want)
                except TaskError as error:
                    assert error.core == 0
            health = engine.health()
            assert health.status == "degraded" and health.cores_out == (0,)
            served = engine.statistics().cores[1].completed
            for result in await asyncio.gather(*(engine.infer(arrays["x"]) for _ in range(20))):
                assert_same(result, want)
            assert engine.statistics().cores[1].completed - served == 20
            for _ in range(200):  # probes: the one armed fault at most, then success
                if engine.health().status == "ok":
                    break
                await asyncio.sleep(0.01)
            assert engine.health().status == "ok"

    @pytest.mark.timing_bound(
        "stage times against the 2 ms service time: copies under 2 ms, the DLA stage under 10 ms"
    )
    async def test_stage_times(
        self, cuda_runtime: CudaRuntime, released: Any, real_gpu: None
    ) -> None:
        data = single_model(latency=0.002)
        model = parse_loadable(data)
        arrays = random_inputs(model, 7)
        async with Engine(data, cores=(0,), runtime=cuda_runtime, stage_times=True) as engine:
            for _ in range(5):
                assert_same(await engine.infer(arrays["x"]), expected(model, arrays))
            stats = engine.statistics()
        assert stats.stages is not None
        assert stats.stages.dla.count == 5
        assert 0.002 * 0.98 <= stats.stages.dla.p50 < 0.01
        assert 0 <= stats.stages.copy_in.p50 < 0.002 and 0 <= stats.stages.copy_out.p50 < 0.002
        core = stats.cores[0]
        assert core.dla_histogram is not None and core.dla_histogram.count == 5

    async def test_poisoned_context_makes_the_engine_dead(
        self, real_gpu: None, gpu_session: Any
    ) -> None:
        pytest.importorskip("cupy", reason="the test traps a kernel through cupy")
        child = Path(__file__).with_name("_poison_child.py")
        env = {**os.environ, "AIODLA_STANDIN_LIB": str(gpu_session.library)}
        process = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, str(child)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert process.returncode == 0, process.stderr[-2000:]
        seen = json.loads(process.stdout.strip().splitlines()[-1])
        # Requests that never reached the DLA die with the engine; one whose task the
        # DLA had already ended may still report that task's own status first.
        assert set(seen["outcomes"]) <= {"EngineDeadError", "TaskError"}, seen
        assert seen["outcomes"].count("EngineDeadError") >= 4, seen
        assert seen["refused"], seen
        assert seen["health"] == "dead" and seen["state"] == "closed"
        assert "cudaError" in seen["cause"], seen
        assert seen["close_seconds"] < 15

    async def test_module_fails_to_load(self, cuda_runtime: CudaRuntime, released: Any) -> None:
        released.fail_next_call("cudlaModuleLoadFromMemory", 7)  # cudlaErrorUmd
        engine = Engine(single_model(), cores=(1,), runtime=cuda_runtime)
        with pytest.raises(DeviceError, match="core 1: load_module failed") as caught:
            await engine.open()
        assert caught.value.status == 7

    async def test_cancellation_storm(
        self, cuda_runtime: CudaRuntime, released: Any, real_gpu: None
    ) -> None:
        data = single_model(latency=0.0001)
        model = parse_loadable(data)
        arrays = random_inputs(model, 8)
        want = expected(model, arrays)
        rng = np.random.default_rng(3)
        async with Engine(
            data, runtime=cuda_runtime, streams_per_core=4, max_queue=10_000
        ) as engine:
            tasks = [
                asyncio.create_task(
                    engine.infer(arrays["x"], timeout=0.002 if i % 9 == 0 else None)
                )
                for i in range(3000)
            ]
            for _ in range(20):
                await asyncio.sleep(float(rng.uniform(0, 0.003)))
                for index in rng.choice(len(tasks), 40):
                    tasks[index].cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            for _ in range(500):
                if engine.statistics().in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            stats = engine.statistics()
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                assert isinstance(outcome, (asyncio.CancelledError, TimeoutError)), outcome
            else:
                assert_same(outcome, want)
        assert stats.in_flight == 0 and stats.queued == 0
        assert stats.completed + stats.failed + stats.cancelled + stats.timed_out == 3000


class TestCancellation:
    async def test_cancel_in_flight_and_queued(
        self, cuda_runtime: CudaRuntime, released: Any, real_gpu: None
    ) -> None:
        data = single_model()
        model = parse_loadable(data)
        arrays = random_inputs(model, 6)
        async with Engine(data, cores=(0,), streams_per_core=1, runtime=cuda_runtime) as engine:
            gate = released.hold(0)
            try:
                in_flight = asyncio.create_task(engine.infer(arrays["x"]))
                assert await asyncio.to_thread(gate.wait_for_held, 1, 10.0)
                queued = asyncio.create_task(engine.infer(arrays["x"]))
                await asyncio.sleep(0)  # let it reach the queue
                assert engine.statistics().queued == 1
                in_flight.cancel()
                queued.cancel()
                for task in (in_flight, queued):
                    with pytest.raises(asyncio.CancelledError):
                        await task
                assert engine.statistics().queued == 0
            finally:
                gate.release()
            # The slot comes back once the DLA is done with the cancelled task.
            assert_same(await engine.infer(arrays["x"]), expected(model, arrays))
            stats = engine.statistics()
            assert stats.cancelled == 2
            assert stats.completed == 1
            assert stats.in_flight == 0

    async def test_timeout_while_in_flight(
        self, cuda_runtime: CudaRuntime, released: Any, real_gpu: None
    ) -> None:
        data = single_model()
        model = parse_loadable(data)
        arrays = random_inputs(model, 7)
        async with Engine(data, cores=(0,), streams_per_core=1, runtime=cuda_runtime) as engine:
            gate = released.hold(0)
            try:
                with pytest.raises(RequestTimeoutError):
                    await engine.infer(arrays["x"], timeout=0.05)
            finally:
                gate.release()
            assert_same(await engine.infer(arrays["x"]), expected(model, arrays))
            assert engine.statistics().timed_out == 1

    @pytest.mark.timing_bound(
        "close must still be waiting 50 ms after it began, and the gate is bounded by 10 s"
    )
    async def test_close_with_work_in_flight(
        self, cuda_runtime: CudaRuntime, released: Any, real_gpu: None
    ) -> None:
        data = single_model()
        model = parse_loadable(data)
        arrays = random_inputs(model, 8)
        engine = Engine(data, cores=(0,), streams_per_core=2, runtime=cuda_runtime)
        await engine.open()
        gate = released.hold(0)
        try:
            tasks = [asyncio.create_task(engine.infer(arrays["x"])) for _ in range(5)]
            assert await asyncio.to_thread(gate.wait_for_held, 1, 10.0)
            await asyncio.sleep(0)
            closing = asyncio.create_task(engine.aclose())
            await asyncio.sleep(0.05)
            assert not closing.done()  # waiting for the in-flight tasks
        finally:
            gate.release()
        await closing
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        finished = [o for o in outcomes if not isinstance(o, BaseException)]
        refused = [o for o in outcomes if isinstance(o, EngineClosedError)]
        assert len(finished) == 2, outcomes  # the 2 slots' requests were in flight
        assert len(refused) == 3, outcomes  # the other 3 were queued
        for result in finished:
            assert_same(result, expected(model, arrays))
        with pytest.raises(EngineClosedError):
            await engine.infer(arrays["x"])

    async def test_health(self, cuda_runtime: CudaRuntime, released: Any) -> None:
        async with Engine(single_model(), runtime=cuda_runtime) as engine:
            health = engine.health()
            assert health.status == "ok" and health.ok
        assert engine.health().status == "closed"
