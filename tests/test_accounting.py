"""Every request is counted once, as what its caller saw, through close and death;
``infer_nowait`` admits at once; a hung core keeps exactly its own handles at close."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from aiodla import (
    AiodlaError,
    EmulatedRuntime,
    Engine,
    EngineClosedError,
    QueueFullError,
    RequestTimeoutError,
)
from aiodla import _flow as flow_module

from support import (
    X,
    affine_model,
    all_idle,
    busy_slots,
    counts_add_up,
    expected_affine,
    wait_until,
)

ONES = np.ones(X.shape, np.float32)

pytestmark = pytest.mark.usefixtures("engines_add_up")


def assert_settled_after_close(engine: Engine) -> None:
    stats = engine.statistics()
    assert counts_add_up(stats), stats
    assert stats.queued == 0 and stats.in_flight == 0
    assert all(core.busy_slots == 0 and core.in_flight == 0 for core in stats.cores)


class TestInferNowait:
    @pytest.mark.asyncio
    async def test_admits_at_once_and_runs_without_being_awaited(self, engine: Engine) -> None:
        future = engine.infer_nowait(ONES * 3)  # no await: the request is in already
        assert isinstance(future, asyncio.Future)
        assert engine.statistics().submitted == 1
        await wait_until(future.done)
        np.testing.assert_array_equal(future.result(), expected_affine(ONES * 3))
        assert engine.statistics().completed == 1

    @pytest.mark.asyncio
    async def test_full_queue_raises_at_the_call(self, runtime: EmulatedRuntime) -> None:
        async with Engine(
            affine_model(), runtime=runtime, max_queue=1, cores=[0], streams_per_core=1
        ) as engine:
            gate = runtime.hold(0)
            running = engine.infer_nowait(ONES)
            waiting = engine.infer_nowait(ONES)
            with pytest.raises(QueueFullError, match="max_queue=1"):
                engine.infer_nowait(ONES)
            stats = engine.statistics()
            assert (stats.submitted, stats.rejected, stats.queued) == (2, 1, 1)
            gate.release()
            await asyncio.gather(running, waiting)
            assert engine.statistics().completed == 2

    @pytest.mark.asyncio
    async def test_cancelling_the_future_cancels_the_request(
        self, engine: Engine, runtime: EmulatedRuntime
    ) -> None:
        gates = [runtime.hold(0), runtime.hold(1)]
        busy = [engine.infer_nowait(ONES) for _ in range(4)]
        queued = engine.infer_nowait(ONES)
        await wait_until(lambda: engine.statistics().queued == 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        stats = engine.statistics()
        assert stats.cancelled == 1 and stats.queued == 0 and counts_add_up(stats)
        for gate in gates:
            gate.release()
        await asyncio.gather(*busy)
        assert runtime.core_tasks(0) + runtime.core_tasks(1) == 4  # never reached the DLA


class TestCountsThroughClose:
    @pytest.mark.asyncio
    async def test_cancelling_waiters_while_close_starts_leaves_no_negative_count(
        self, runtime: EmulatedRuntime
    ) -> None:
        engine = Engine(affine_model(), runtime=runtime)
        await engine.open()
        gates = [runtime.hold(0), runtime.hold(1)]
        tasks = [asyncio.create_task(engine.infer(ONES)) for _ in range(14)]
        await wait_until(lambda: engine.statistics().queued == 10)
        closing = asyncio.create_task(engine.aclose())
        await asyncio.sleep(0)  # the close has failed the waiters; their tasks have not run
        for task in tasks[4:9]:
            task.cancel()
        assert counts_add_up(engine.statistics())
        for gate in gates:
            gate.release()
        await closing
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        stats = engine.statistics()
        assert stats.queued == 0 and counts_add_up(stats), stats
        cancelled = sum(isinstance(o, asyncio.CancelledError) for o in outcomes)
        closed = sum(isinstance(o, EngineClosedError) for o in outcomes)
        assert (stats.cancelled, stats.failures["closed"]) == (cancelled, closed)
        assert stats.completed == 4 and cancelled + closed == 10

    @pytest.mark.asyncio
    async def test_load_with_cancels_and_timeouts_then_close_with_a_held_core(
        self, leaky_runtime: EmulatedRuntime
    ) -> None:
        runtime = leaky_runtime
        engine = Engine(
            affine_model(latency=0.0002), runtime=runtime, max_queue=2000, close_timeout=0.05
        )
        await engine.open()
        rng = np.random.default_rng(11)
        tasks = []
        for i in range(1000):
            timeout = 0.002 if rng.random() < 0.05 else None
            tasks.append(asyncio.create_task(engine.infer(ONES, timeout=timeout)))
            if i % 100 == 99:
                await asyncio.sleep(0)
        for index in rng.choice(len(tasks), 50, replace=False):
            tasks[index].cancel()
        await asyncio.sleep(0.01)
        assert counts_add_up(engine.statistics())
        runtime.hold(0)  # a core that never finishes what it has
        await asyncio.sleep(0.005)
        await engine.aclose()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        stats = engine.statistics()
        assert_settled_after_close(engine)
        assert stats.submitted == 1000
        seen = {
            "cancelled": sum(isinstance(o, asyncio.CancelledError) for o in outcomes),
            "timed_out": sum(isinstance(o, RequestTimeoutError) for o in outcomes),
            "completed": sum(isinstance(o, np.ndarray) for o in outcomes),
        }
        assert seen == {
            "cancelled": stats.cancelled,
            "timed_out": stats.timed_out,
            "completed": stats.completed,
        }
        assert stats.failed == 1000 - sum(seen.values())

    @pytest.mark.asyncio
    async def test_after_close_with_a_hung_core_nothing_counts_as_in_flight(
        self, leaky_runtime: EmulatedRuntime
    ) -> None:
        runtime = leaky_runtime
        engine = Engine(affine_model(), runtime=runtime, close_timeout=0.02)
        await engine.open()
        runtime.hang_core(0)
        tasks = [asyncio.create_task(engine.infer(ONES)) for _ in range(4)]
        await wait_until(lambda: engine.statistics().completed == 2)  # core 1's two
        assert busy_slots(engine) == 2
        await engine.aclose()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert sum(isinstance(o, EngineClosedError) for o in outcomes) == 2
        assert_settled_after_close(engine)
        assert engine.statistics().failures["closed"] == 2


class TestCountedAsTheCallerSawIt:
    @pytest.mark.asyncio
    async def test_a_cancel_racing_the_deadline_counts_as_cancelled(
        self, engine: Engine, runtime: EmulatedRuntime, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        gates = [runtime.hold(0), runtime.hold(1)]
        task = asyncio.create_task(engine.infer(ONES, timeout=0.01))

        class CancelledAsItTimesOut(RequestTimeoutError):
            def __init__(self, *args: object) -> None:
                super().__init__(*args)
                task.cancel()  # the caller is cancelled in the same step as its deadline

        monkeypatch.setattr(flow_module, "RequestTimeoutError", CancelledAsItTimesOut)
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = engine.statistics()
        assert (stats.cancelled, stats.timed_out) == (1, 0) and counts_add_up(stats)
        for gate in gates:
            gate.release()
        await wait_until(lambda: all_idle(engine))

    @pytest.mark.asyncio
    async def test_a_cancel_racing_the_result_counts_as_cancelled(
        self, engine: Engine, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        task = asyncio.create_task(engine.infer(ONES))
        read_outputs = engine._device.read_outputs

        def read_then_cancel(slot: object) -> object:
            outputs = read_outputs(slot)  # type: ignore[arg-type]
            task.cancel()  # the caller is cancelled in the step its result arrives
            return outputs

        monkeypatch.setattr(engine._device, "read_outputs", read_then_cancel)
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = engine.statistics()
        assert (stats.cancelled, stats.completed) == (1, 0) and counts_add_up(stats)


class TestHungCoreAtClose:
    # The handles a timed-out close leaves are the worker's; it exits (status 5) with them.
    @pytest.mark.in_process
    @pytest.mark.asyncio
    async def test_keeps_every_handle_of_the_hung_core_and_none_of_the_other(
        self, leaky_runtime: EmulatedRuntime
    ) -> None:
        runtime = leaky_runtime
        before = runtime.live_handles()
        engine = Engine(affine_model(), runtime=runtime, streams_per_core=2, close_timeout=0.02)
        await engine.open()
        runtime.hang_core(0)
        tasks = [asyncio.create_task(engine.infer(ONES)) for _ in range(4)]
        await wait_until(lambda: engine.statistics().completed == 2)
        await engine.aclose()
        await asyncio.gather(*tasks, return_exceptions=True)
        kept = {kind: runtime.live_handles()[kind] - before[kind] for kind in before}
        # One core's share: its device and module, and per slot (2) one stream, one
        # event, and per tensor (x and y) a device buffer, its registration and a
        # pinned host buffer; and each slot's two graphs (the work before and after
        # the task), captured by its first request.
        assert kept == {
            "devices": 1,
            "modules": 1,
            "registrations": 4,
            "streams": 2,
            "events": 2,
            "device_memory": 4,
            "host_memory": 4,
            "graphs": 4,
        }

    @pytest.mark.in_process
    @pytest.mark.asyncio
    async def test_a_task_that_ends_after_close_gives_its_core_s_handles_back(
        self, leaky_runtime: EmulatedRuntime
    ) -> None:
        # close_timeout=0: the close does not wait for the task in flight on core 0, so it
        # keeps core 0's handles; the core is healthy, and once the task ends they go.
        runtime = leaky_runtime
        before = runtime.live_handles()
        engine = Engine(affine_model(), runtime=runtime, cores=[0], close_timeout=0)
        await engine.open()
        gate = runtime.hold(0)
        task = asyncio.create_task(engine.infer(ONES))
        await asyncio.get_running_loop().run_in_executor(None, gate.wait_for_held)
        await engine.aclose()
        with pytest.raises(EngineClosedError):
            await task
        assert runtime.live_handles()["devices"] == before["devices"] + 1  # kept meanwhile
        gate.release()  # the task runs and ends
        await wait_until(lambda: runtime.live_handles() == before)


class TestAnotherLoop:
    @pytest.mark.asyncio
    async def test_says_how_to_call_from_another_loop(self, engine: Engine) -> None:
        caught: list[BaseException] = []

        def other_thread() -> None:
            try:
                asyncio.run(engine.infer(ONES))
            except BaseException as exc:
                caught.append(exc)

        thread = threading.Thread(target=other_thread)
        thread.start()
        await asyncio.get_running_loop().run_in_executor(None, thread.join)
        assert len(caught) == 1 and isinstance(caught[0], AiodlaError)
        assert "run_coroutine_threadsafe(engine.infer(x), engine_loop)" in str(caught[0])
        # And the way it names works.
        loop = asyncio.get_running_loop()
        done = await loop.run_in_executor(
            None,
            lambda: asyncio.run_coroutine_threadsafe(engine.infer(ONES), loop).result(5),
        )
        np.testing.assert_array_equal(done, expected_affine(ONES))
