"""Reliability: survive what is survivable, fail clearly on what is not, leak nothing.

Every scenario runs on the emulated runtime; tests/gpu repeats the task-fault ones on
the GPU stand-in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import numpy as np
import pytest
from cuda.bindings import cudla

from aiodla import (
    DeviceError,
    EmulatedRuntime,
    Engine,
    EngineClosedError,
    EngineDeadError,
    EngineState,
    TaskError,
)
from aiodla.runtime import CudaCallError

from support import X, affine_model, all_idle, expected_affine, take_core_out, wait_until

# Every scenario ends with every request counted once, as what its caller saw.
pytestmark = pytest.mark.usefixtures("engines_add_up")

ONES = np.ones(X.shape, np.float32)
INVALID_INPUT = 0x40000001
ENGINE_TIMEOUT = 0x40000006


def handles_released(runtime: EmulatedRuntime) -> bool:
    return all(v == 0 for v in runtime.live_handles().values()) and runtime.invalid_releases == 0


class TestTaskFailure:
    @pytest.mark.loop_variants
    @pytest.mark.asyncio
    async def test_only_that_request_fails(
        self, engine: Engine, runtime: EmulatedRuntime, caplog: pytest.LogCaptureFixture
    ) -> None:
        gates = [runtime.hold(0), runtime.hold(1)]
        before = [asyncio.create_task(engine.infer(ONES * i)) for i in range(2)]
        await wait_until(lambda: engine.statistics().in_flight == 2)
        runtime.fail_next_task(0, INVALID_INPUT)
        doomed = asyncio.create_task(engine.infer(ONES * 7))
        await wait_until(lambda: engine.statistics().in_flight == 3)
        after = [asyncio.create_task(engine.infer(ONES * i)) for i in range(2, 12)]
        for gate in gates:
            gate.release()
        with pytest.raises(TaskError) as caught:
            await doomed
        assert caught.value.status == INVALID_INPUT and caught.value.core == 0
        assert caught.value.status_name == cudla.Status(INVALID_INPUT).name
        assert "core 0" in str(caught.value)
        for i, task in enumerate(before + after):
            np.testing.assert_array_equal(await task, expected_affine(ONES * i))
        stats = engine.statistics()
        assert stats.failed == 1 and stats.failures["task"] == 1
        assert stats.cores[0].failed == 1 and stats.cores[1].failed == 0
        assert stats.cores[0].consecutive_failures == 0  # later tasks succeeded
        np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))
        assert any(
            "DLA task failed on core 0" in r.message
            for r in caplog.records
            if r.levelno == logging.WARNING
        )

    @pytest.mark.asyncio
    async def test_hung_core_bounded_by_the_task_timeout(self, runtime: EmulatedRuntime) -> None:
        async with Engine(affine_model(), runtime=runtime, task_timeout=0.05) as engine:
            runtime.hang_core(0)
            results = await asyncio.gather(
                *(engine.infer(ONES * i) for i in range(6)), return_exceptions=True
            )
            runtime.hang_core(0, False)
            timeouts = [r for r in results if isinstance(r, TaskError)]
            assert timeouts and all(r.status == ENGINE_TIMEOUT and r.core == 0 for r in timeouts)
            for i, result in enumerate(results):
                if not isinstance(result, TaskError):
                    np.testing.assert_array_equal(result, expected_affine(ONES * i))
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))
        assert handles_released(runtime)


class TestFaultOnTheStream:
    """A DLA fault surfacing as on hardware in hybrid mode: a sticky CUDA error on the
    task's stream, the DLA status still in cudlaGetLastError."""

    # Process mode survives a lost context by replacing its worker (tests/test_isolation.py).
    @pytest.mark.in_process
    @pytest.mark.asyncio
    async def test_kills_the_engine_in_process(self, runtime: EmulatedRuntime) -> None:
        async with Engine(affine_model(), runtime=runtime, cores=[0]) as engine:
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))
            runtime.fail_next_task(0, ENGINE_TIMEOUT, on_stream=True)
            with pytest.raises(EngineDeadError) as caught:
                await engine.infer(ONES)
            cause = caught.value.__cause__
            assert isinstance(cause, CudaCallError) and cause.code == 911 and cause.sticky
            assert engine.health().status == "dead"
            assert engine.dead
            # cudaErrorExternalDevice says "a DLA broke"; cuDLA says how.
            core_handle = next(iter(runtime._timeline.devices))
            assert runtime.get_last_error(core_handle) == ENGINE_TIMEOUT

    # Process mode survives a lost context by replacing its worker (tests/test_isolation.py).
    @pytest.mark.in_process
    @pytest.mark.asyncio
    async def test_tasks_queued_behind_the_fault_leave_nothing_behind(
        self, runtime: EmulatedRuntime
    ) -> None:
        # The tasks behind the fault on the core never run: close must still release
        # every registration, module and device (the real context is gone anyway).
        async with Engine(
            affine_model(latency=0.01), runtime=runtime, cores=[0], streams_per_core=4
        ) as engine:
            runtime.fail_next_task(0, ENGINE_TIMEOUT, on_stream=True)
            outcomes = await asyncio.gather(
                *(engine.infer(ONES) for _ in range(6)), return_exceptions=True
            )
            assert all(isinstance(o, EngineDeadError) for o in outcomes)
        assert all(v == 0 for v in runtime.live_handles().values()), runtime.live_handles()

    @pytest.mark.asyncio
    async def test_the_default_fault_fails_only_its_request(self, runtime: EmulatedRuntime) -> None:
        async with Engine(affine_model(), runtime=runtime, cores=[0]) as engine:
            runtime.fail_next_task(0, ENGINE_TIMEOUT)
            with pytest.raises(TaskError):
                await engine.infer(ONES)
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))
            assert not engine.dead


class TestRotation:
    @pytest.mark.asyncio
    async def test_faulty_core_leaves_and_comes_back(self, runtime: EmulatedRuntime) -> None:
        async with Engine(
            affine_model(latency=0.0),
            runtime=runtime,
            max_consecutive_faults=3,
            probe_interval=0.02,
            streams_per_core=1,
        ) as engine:
            assert engine.health().status == "ok"
            for _ in range(50):
                runtime.fail_next_task(0, INVALID_INPUT)
            failures = 0
            while engine.statistics().cores[0].in_rotation:
                try:
                    await engine.infer(ONES)
                except TaskError as error:
                    assert error.core == 0
                    failures += 1
            assert failures == 3
            health = engine.health()
            assert health.status == "degraded" and health.cores_out == (0,)
            assert "core(s) [0] out of rotation" in health.reason
            # With core 0 out, core 1 serves everything, and correctly.
            served_before = engine.statistics().cores[1].completed
            results = await asyncio.gather(*(engine.infer(ONES * i) for i in range(30)))
            for i, y in enumerate(results):
                np.testing.assert_array_equal(y, expected_affine(ONES * i))
            assert engine.statistics().cores[1].completed - served_before == 30
            # Probes keep failing while faults are queued; then one succeeds.
            runtime._timeline.cores[0].failures.clear()
            await wait_until(lambda: engine.health().status == "ok", timeout=5)
            assert engine.statistics().cores[0].in_rotation
            await asyncio.gather(*(engine.infer(ONES) for _ in range(20)))
            assert engine.statistics().cores[0].completed > 0
        assert handles_released(runtime)

    @pytest.mark.asyncio
    async def test_last_core_stays_in_rotation(self, runtime: EmulatedRuntime) -> None:
        async with Engine(
            affine_model(latency=0.0), cores=[0], runtime=runtime, max_consecutive_faults=1
        ) as engine:
            for _ in range(3):
                runtime.fail_next_task(0)
                with pytest.raises(TaskError):
                    await engine.infer(ONES)
            assert engine.health().status == "ok"
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))

    @pytest.mark.asyncio
    async def test_hung_core_probe_waits_for_its_slots(self, runtime: EmulatedRuntime) -> None:
        async with Engine(
            affine_model(latency=0.0),
            runtime=runtime,
            task_timeout=0.05,
            max_consecutive_faults=1,
            probe_interval=0.01,
        ) as engine:
            runtime.hang_core(0)
            results = await asyncio.gather(
                *(engine.infer(ONES) for _ in range(4)), return_exceptions=True
            )
            assert any(isinstance(r, TaskError) for r in results)
            assert engine.health().status == "degraded"
            runtime.hang_core(0, False)
            await wait_until(lambda: engine.health().status == "ok")


class TestDeadEngine:
    # Process mode survives a lost context by replacing its worker (tests/test_isolation.py).
    @pytest.mark.in_process
    @pytest.mark.loop_variants
    @pytest.mark.asyncio
    async def test_poisoned_context(self, runtime: EmulatedRuntime) -> None:
        engine = Engine(affine_model(), runtime=runtime)
        await engine.open()
        gates = [runtime.hold(0), runtime.hold(1)]
        in_flight = [asyncio.create_task(engine.infer(ONES)) for _ in range(4)]
        queued = [asyncio.create_task(engine.infer(ONES)) for _ in range(5)]
        await wait_until(lambda: engine.statistics().queued == 5)
        runtime.poison()
        for task in in_flight + queued:
            with pytest.raises(EngineDeadError) as caught:
                await task
            assert isinstance(caught.value.__cause__, CudaCallError)
            assert "cudaErrorExternalDevice" in str(caught.value)
        with pytest.raises(EngineDeadError, match="dead"):
            await engine.infer(ONES)
        health = engine.health()
        assert health.status == "dead" and "cudaErrorExternalDevice" in health.reason
        stats = engine.statistics()
        assert stats.state == "dead" and stats.failures["dead"] == 9
        await asyncio.wait_for(engine.aclose(), 5)
        assert engine.state is EngineState.CLOSED
        assert handles_released(runtime)
        for gate in gates:
            gate.release()

    @pytest.mark.asyncio
    async def test_query_failure_while_the_loop_harvests(self, runtime: EmulatedRuntime) -> None:
        # Between batches the loop may sweep the events itself; a CUDA error there kills
        # the engine exactly as one in the poller thread does.
        async with Engine(affine_model(), runtime=runtime) as engine:
            assert engine._flow.poller is not None

            def harvest(at_least: int | None = None) -> list[object]:
                runtime.poison(719)  # the context is lost: the device drops its work
                raise CudaCallError("cudaEventQuery", 719)

            engine._flow.poller.harvest = harvest  # type: ignore[method-assign,assignment]
            results = await asyncio.gather(
                *(engine.infer(ONES) for _ in range(12)), return_exceptions=True
            )
            dead = [r for r in results if isinstance(r, EngineDeadError)]
            assert len(dead) >= 4  # at least those still queued behind the 8 slots
            assert all(isinstance(r.__cause__, CudaCallError) for r in dead)
            assert all(isinstance(r, (np.ndarray, EngineDeadError)) for r in results)
            assert engine.health().status == "dead"
            with pytest.raises(EngineDeadError):
                await engine.infer(ONES)
        assert handles_released(runtime)

    # Process mode survives a lost context by replacing its worker (tests/test_isolation.py).
    @pytest.mark.in_process
    @pytest.mark.asyncio
    async def test_sticky_error_while_submitting(self, runtime: EmulatedRuntime) -> None:
        async with Engine(affine_model(), runtime=runtime) as engine:
            runtime.fail_call("copy_to_device", CudaCallError("cudaMemcpyAsync", 911))
            with pytest.raises(EngineDeadError):
                await engine.infer(ONES)
            assert engine.dead

    @pytest.mark.asyncio
    async def test_non_sticky_submit_error_fails_one_request(
        self, runtime: EmulatedRuntime
    ) -> None:
        async with Engine(affine_model(), runtime=runtime) as engine:
            runtime.fail_call("submit_task", 2)  # cudlaErrorOutOfResources, once
            with pytest.raises(DeviceError, match="submitting the request failed") as caught:
                await engine.infer(ONES)
            assert caught.value.status == 2
            assert engine.statistics().failures["device"] == 1
            await wait_until(lambda: all_idle(engine))
            # The slot came back with no request: its stream's end is no task of the
            # core's (one that ran would count as completed or failed there).
            assert [(c.completed, c.failed) for c in engine.statistics().cores] == [(0, 0)] * 2
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))
            assert sum(c.completed for c in engine.statistics().cores) == 1
        assert handles_released(runtime)


class TestOpeningFailures:
    @pytest.mark.asyncio
    async def test_allocation_fails_on_the_fifth_slot(self, runtime: EmulatedRuntime) -> None:
        # Four slots of two tensors each allocate eight buffers; the ninth is slot 5's.
        runtime.fail_call("malloc", 2, after=8)
        engine = Engine(affine_model(), runtime=runtime, streams_per_core=3)
        with pytest.raises(DeviceError) as caught:
            await engine.open()
        assert "core 1 slot 1 tensor 'x': malloc failed" in str(caught.value)
        assert "cudaErrorMemoryAllocation" in str(caught.value)
        assert caught.value.cuda_error == 2
        assert engine.state is EngineState.CLOSED
        assert handles_released(runtime)

    @pytest.mark.asyncio
    async def test_module_fails_to_load_on_core_1(self, runtime: EmulatedRuntime) -> None:
        runtime.fail_call("load_module", 7, core=1)  # cudlaErrorUmd
        with pytest.raises(DeviceError, match="core 1: load_module failed") as caught:
            await Engine(affine_model(), runtime=runtime).open()
        assert caught.value.status == 7
        assert handles_released(runtime)

    @pytest.mark.parametrize(
        "call",
        [
            "create_device",
            "create_stream",
            "create_event",
            "mem_register",
            # The worker's staging is shared memory it maps itself, not host_alloc's.
            pytest.param("host_alloc", marks=pytest.mark.in_process),
            "make_current",
        ],
    )
    @pytest.mark.asyncio
    async def test_any_step_failing_releases_everything(
        self, runtime: EmulatedRuntime, call: str
    ) -> None:
        runtime.fail_call(call, 2, after=1 if call != "make_current" else 0)
        with pytest.raises(DeviceError):
            await Engine(affine_model(), runtime=runtime).open()
        assert handles_released(runtime)


class TestStorms:
    @pytest.mark.asyncio
    async def test_ten_thousand_requests_with_cancellations_and_timeouts(
        self, runtime: EmulatedRuntime
    ) -> None:
        rng = np.random.default_rng(11)
        async with Engine(affine_model(latency=0.0), runtime=runtime, max_queue=20_000) as engine:
            tasks = []
            for i in range(10_000):
                timeout = float(rng.uniform(0.0, 0.05)) if i % 7 == 0 else None
                tasks.append(asyncio.create_task(engine.infer(ONES * (i % 50), timeout=timeout)))
            for _ in range(40):
                await asyncio.sleep(float(rng.uniform(0, 0.005)))
                for index in rng.choice(len(tasks), 100):
                    tasks[index].cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            await wait_until(lambda: all_idle(engine))
            stats = engine.statistics()
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, np.ndarray):
                np.testing.assert_array_equal(outcome, expected_affine(ONES * (i % 50)))
            else:
                assert isinstance(outcome, (asyncio.CancelledError, TimeoutError)), outcome
        assert stats.submitted == 10_000 and stats.queued == 0 and stats.in_flight == 0
        assert stats.completed + stats.failed + stats.cancelled + stats.timed_out == 10_000
        assert all(core.busy_slots == 0 for core in stats.cores)
        assert handles_released(runtime)


class TestAfterClose:
    @pytest.mark.asyncio
    async def test_late_completion_after_close_is_harmless(self, runtime: EmulatedRuntime) -> None:
        engine = Engine(affine_model(), runtime=runtime)
        await engine.open()
        slot = engine._device.slots[0]
        await engine.aclose()
        engine._flow.on_completions([(slot, 0)])  # as a poller wake-up arriving late would
        assert engine.state is EngineState.CLOSED
        assert handles_released(runtime)

    @pytest.mark.asyncio
    async def test_closing_twice_releases_once(self, runtime: EmulatedRuntime) -> None:
        engine = Engine(affine_model(), runtime=runtime)
        await engine.open()
        await asyncio.gather(*(engine.infer(ONES) for _ in range(10)))
        await engine.aclose()
        await engine.aclose()
        assert handles_released(runtime)
        with pytest.raises(EngineClosedError):
            await engine.infer(ONES)


class KeptRecords(logging.Handler):
    """A handler that keeps every record of aiodla's logger, as a test's log capture or
    an application's buffer does."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def saying(self, text: str) -> list[logging.LogRecord]:
        return [r for r in self.records if text in r.getMessage()]


@pytest.fixture
def kept_records() -> Iterator[KeptRecords]:
    keeper = KeptRecords()
    logging.getLogger("aiodla").addHandler(keeper)
    yield keeper
    logging.getLogger("aiodla").removeHandler(keeper)


def assert_hold_no_error(records: list[logging.LogRecord]) -> None:
    """A kept record must not keep an error, whose traceback holds the frames that
    submitted a request, and so the request and its input."""
    assert records
    for record in records:
        held = [a for a in record.args or () if isinstance(a, BaseException)]
        assert not held, held
        assert record.exc_info is None


class TestLoggedFailuresKeepNothing:
    @pytest.mark.asyncio
    async def test_a_retired_slots_log_record_holds_no_error(
        self, leaky_runtime: EmulatedRuntime, kept_records: KeptRecords
    ) -> None:
        # A submission fails, then marking the end of what reached the stream fails too:
        # the slot is retired and logged.
        runtime = leaky_runtime
        async with Engine(
            affine_model(), runtime=runtime, streams_per_core=1, close_timeout=0.2
        ) as engine:
            runtime.fail_call("submit_task", 2)
            runtime.fail_call("record_event", 999)
            with pytest.raises(DeviceError, match="submitting the request failed"):
                await engine.infer(ONES)
            assert_hold_no_error(kept_records.saying("retired"))

    @pytest.mark.asyncio
    async def test_a_failed_probes_log_record_holds_no_error(
        self, kept_records: KeptRecords
    ) -> None:
        # A probe (a core out of rotation, tested again) whose submission fails has no
        # request to fail: it is logged, and must keep no error either.
        runtime = EmulatedRuntime()
        async with Engine(
            affine_model(),
            runtime=runtime,
            cores=[0, 1],
            max_consecutive_faults=1,
            probe_interval=0.1,
        ) as engine:
            await take_core_out(engine, lambda: runtime.fail_next_task(0, ENGINE_TIMEOUT), 0)
            runtime.fail_call("submit_task", 1)  # the probe's submission
            await wait_until(lambda: bool(kept_records.saying("submitting")))
            logged = kept_records.saying("submitting")
            assert "core 0: submitting the request" in logged[0].getMessage()
            assert_hold_no_error(logged)
