"""Cancellation and timeouts: queued, assigned, in flight, during close; asyncio and anyio.

States are reached through the emulated runtime's gates (a held core keeps its tasks
in flight), never by sleeping and hoping. After each scenario the engine must be
consistent: no busy slot, nothing queued, and the counts add up.
"""

from __future__ import annotations

import asyncio
import sys

import anyio
import numpy as np
import pytest

from aiodla import (
    EmulatedRuntime,
    Engine,
    EngineClosedError,
    EngineStatistics,
    RequestTimeoutError,
)

from support import X, affine_model, all_idle, busy_slots, expected_affine, wait_until

# Every scenario ends with every request counted once, as what its caller saw.
pytestmark = pytest.mark.usefixtures("engines_add_up")

ONES = np.ones(X.shape, np.float32)


def settled(stats: EngineStatistics) -> bool:
    return (
        stats.in_flight == 0
        and stats.queued == 0
        and all(core.busy_slots == 0 for core in stats.cores)
    )


def accounted(stats: EngineStatistics) -> bool:
    ended = stats.completed + stats.failed + stats.cancelled + stats.timed_out
    return ended + stats.queued + stats.in_flight == stats.submitted


async def fill_slots(
    engine: Engine, runtime: EmulatedRuntime
) -> tuple[list[asyncio.Task[object]], list[object]]:
    """Hold both cores and put one request in flight on every slot."""
    gates = [runtime.hold(0), runtime.hold(1)]
    slots = sum(c.idle_slots for c in engine.statistics().cores)
    tasks = [asyncio.create_task(engine.infer(ONES * i)) for i in range(slots)]
    await wait_until(lambda: engine.statistics().in_flight == slots)
    assert sum(g.held for g in gates) == slots
    return tasks, gates


class TestCancelQueued:
    @pytest.mark.loop_variants
    @pytest.mark.asyncio
    async def test_never_reaches_the_dla(self, engine: Engine, runtime: EmulatedRuntime) -> None:
        busy, gates = await fill_slots(engine, runtime)
        queued = asyncio.create_task(engine.infer(ONES * 100))
        await wait_until(lambda: engine.statistics().queued == 1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert engine.statistics().queued == 0
        for gate in gates:
            gate.release()
        results = await asyncio.gather(*busy)
        for i, y in enumerate(results):
            np.testing.assert_array_equal(y, expected_affine(ONES * i))
        stats = engine.statistics()
        assert stats.cancelled == 1 and stats.completed == len(busy)
        assert runtime.core_tasks(0) + runtime.core_tasks(1) == len(busy)  # not one more
        assert settled(stats) and accounted(stats)

    @pytest.mark.asyncio
    async def test_fifo_skips_the_cancelled(self, engine: Engine, runtime: EmulatedRuntime) -> None:
        busy, gates = await fill_slots(engine, runtime)
        waiting = [asyncio.create_task(engine.infer(ONES * (10 + i))) for i in range(6)]
        await wait_until(lambda: engine.statistics().queued == 6)
        for task in waiting[::2]:
            task.cancel()
        await asyncio.sleep(0)
        assert engine.statistics().queued == 3
        for gate in gates:
            gate.release()
        await asyncio.gather(*busy)
        for i, task in enumerate(waiting):
            if i % 2:
                np.testing.assert_array_equal(await task, expected_affine(ONES * (10 + i)))
            else:
                with pytest.raises(asyncio.CancelledError):
                    await task
        stats = engine.statistics()
        assert stats.cancelled == 3 and settled(stats) and accounted(stats)


class TestCancelInFlight:
    @pytest.mark.loop_variants
    @pytest.mark.asyncio
    async def test_result_dropped_slot_returns_when_done(
        self, engine: Engine, runtime: EmulatedRuntime
    ) -> None:
        gate = runtime.hold(0)
        runtime.hold(1)
        task = asyncio.create_task(engine.infer(ONES))
        await wait_until(lambda: engine.statistics().in_flight == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = engine.statistics()
        assert stats.cancelled == 1
        assert stats.in_flight == 0 and accounted(stats)  # the request ended for its caller
        assert busy_slots(engine) == 1  # the DLA still has its task: the slot is not free yet
        gate.release()
        runtime.hold(1).release()
        await wait_until(lambda: all_idle(engine))
        stats = engine.statistics()
        assert settled(stats) and accounted(stats) and stats.completed == 0
        np.testing.assert_array_equal(await engine.infer(ONES * 5), expected_affine(ONES * 5))

    @pytest.mark.asyncio
    async def test_cancel_storm(self, runtime: EmulatedRuntime) -> None:
        async with Engine(affine_model(latency=0.0002), runtime=runtime, max_queue=5000) as engine:
            rng = np.random.default_rng(7)
            tasks = [asyncio.create_task(engine.infer(ONES * i)) for i in range(600)]
            for _ in range(30):
                await asyncio.sleep(float(rng.uniform(0, 0.002)))
                for index in rng.choice(len(tasks), 15):
                    tasks[index].cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            await wait_until(lambda: all_idle(engine))
            stats = engine.statistics()
        done = [(i, y) for i, y in enumerate(outcomes) if isinstance(y, np.ndarray)]
        for i, y in done:
            np.testing.assert_array_equal(y, expected_affine(ONES * i))
        cancelled = sum(isinstance(y, asyncio.CancelledError) for y in outcomes)
        assert len(done) + cancelled == 600
        # A caller cancelled just after its result was set sees CancelledError, while
        # the engine counts the request completed: the counts add up either way.
        assert stats.completed >= len(done) and stats.cancelled <= cancelled
        assert stats.completed + stats.cancelled == 600
        assert settled(stats) and accounted(stats)


class TestCancelAssigned:
    """Large inputs are packed in a worker thread after a slot is granted."""

    @pytest.mark.asyncio
    async def test_cancel_while_packing_passes_the_slot_on(self, runtime: EmulatedRuntime) -> None:
        async with Engine(
            affine_model(), cores=[0], streams_per_core=1, runtime=runtime, offload_bytes=0
        ) as engine:
            gate = runtime.hold(0)
            first = asyncio.create_task(engine.infer(ONES))
            await wait_until(lambda: gate.held == 1)
            second = asyncio.create_task(engine.infer(ONES * 2))
            third = asyncio.create_task(engine.infer(ONES * 3))
            await wait_until(lambda: engine.statistics().queued == 2)
            # When the first finishes, the slot goes to the second, which starts
            # packing in a thread; cancel it as it is granted.
            first.add_done_callback(lambda _: second.cancel())
            gate.release()
            np.testing.assert_array_equal(await first, expected_affine(ONES))
            with pytest.raises(asyncio.CancelledError):
                await second
            np.testing.assert_array_equal(await third, expected_affine(ONES * 3))
            stats = engine.statistics()
            assert stats.cancelled == 1 and stats.completed == 2
            assert settled(stats) and accounted(stats)

    @pytest.mark.asyncio
    async def test_offloaded_requests_give_right_results(self, runtime: EmulatedRuntime) -> None:
        async with Engine(affine_model(), runtime=runtime, offload_bytes=0) as engine:
            xs = [np.full(X.shape, i, np.float32) for i in range(40)]
            ys = await asyncio.gather(*(engine.infer(x) for x in xs))
            for x, y in zip(xs, ys):
                np.testing.assert_array_equal(y, expected_affine(x))
            assert settled(engine.statistics())


class TestTimeouts:
    @pytest.mark.loop_variants
    @pytest.mark.asyncio
    async def test_timeout_while_queued(self, engine: Engine, runtime: EmulatedRuntime) -> None:
        busy, gates = await fill_slots(engine, runtime)
        with pytest.raises(RequestTimeoutError, match="timeout passed"):
            await engine.infer(ONES, timeout=0.01)
        assert engine.statistics().queued == 0
        for gate in gates:
            gate.release()
        await asyncio.gather(*busy)
        stats = engine.statistics()
        assert stats.timed_out == 1
        assert runtime.core_tasks(0) + runtime.core_tasks(1) == len(busy)
        assert settled(stats) and accounted(stats)

    @pytest.mark.asyncio
    async def test_timeout_while_in_flight(self, engine: Engine, runtime: EmulatedRuntime) -> None:
        gate = runtime.hold(0)
        runtime.hold(1)
        with pytest.raises(RequestTimeoutError):
            await engine.infer(ONES, timeout=0.01)
        assert engine.statistics().in_flight == 0 and accounted(engine.statistics())
        assert busy_slots(engine) == 1  # the DLA still has its task
        gate.release()
        runtime.hold(1).release()
        await wait_until(lambda: all_idle(engine))
        stats = engine.statistics()
        assert stats.timed_out == 1 and settled(stats) and accounted(stats)

    @pytest.mark.asyncio
    async def test_timeout_is_a_timeout_error(
        self, engine: Engine, runtime: EmulatedRuntime
    ) -> None:
        runtime.hold(0)
        runtime.hold(1)
        with pytest.raises(TimeoutError):
            await engine.infer(ONES, timeout=0)
        runtime.hold(0).release()
        runtime.hold(1).release()

    @pytest.mark.asyncio
    async def test_timeout_not_reached(self, engine: Engine) -> None:
        y = await engine.infer(ONES, timeout=5.0)
        np.testing.assert_array_equal(y, expected_affine(ONES))
        assert engine.statistics().timed_out == 0

    @pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.timeout needs 3.11")
    @pytest.mark.asyncio
    async def test_asyncio_timeout_behaves_alike(
        self, engine: Engine, runtime: EmulatedRuntime
    ) -> None:
        busy, gates = await fill_slots(engine, runtime)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):  # type: ignore[attr-defined]
                await engine.infer(ONES)
        assert engine.statistics().queued == 0
        for gate in gates:
            gate.release()
        await asyncio.gather(*busy)
        assert runtime.core_tasks(0) + runtime.core_tasks(1) == len(busy)
        stats = engine.statistics()
        assert stats.cancelled == 1 and settled(stats) and accounted(stats)

    @pytest.mark.asyncio
    async def test_wait_for(self, engine: Engine, runtime: EmulatedRuntime) -> None:
        gate = runtime.hold(0)
        runtime.hold(1)
        # wait_for raises asyncio's own TimeoutError (not the builtin on 3.10).
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.infer(ONES), 0.01)
        gate.release()
        runtime.hold(1).release()
        await wait_until(lambda: all_idle(engine))
        assert accounted(engine.statistics())


class TestAnyio:
    """anyio re-delivers cancellation until the scope exits: nothing may swallow it."""

    @pytest.mark.loop_variants
    @pytest.mark.asyncio
    async def test_fail_after_while_queued(self, engine: Engine, runtime: EmulatedRuntime) -> None:
        busy, gates = await fill_slots(engine, runtime)
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.01):
                await engine.infer(ONES)
        assert engine.statistics().queued == 0
        for gate in gates:
            gate.release()
        await asyncio.gather(*busy)
        assert runtime.core_tasks(0) + runtime.core_tasks(1) == len(busy)
        assert settled(engine.statistics())

    @pytest.mark.asyncio
    async def test_move_on_after_while_in_flight(
        self, engine: Engine, runtime: EmulatedRuntime
    ) -> None:
        gate = runtime.hold(0)
        runtime.hold(1)
        result = "untouched"
        with anyio.move_on_after(0.01) as scope:
            result = await engine.infer(ONES)
        assert scope.cancelled_caught and result == "untouched"
        gate.release()
        runtime.hold(1).release()
        await wait_until(lambda: all_idle(engine))
        stats = engine.statistics()
        assert stats.cancelled == 1 and settled(stats) and accounted(stats)

    @pytest.mark.asyncio
    async def test_task_group_cancel(self, engine: Engine, runtime: EmulatedRuntime) -> None:
        gates = [runtime.hold(0), runtime.hold(1)]
        results: list[object] = []

        async def one(i: int) -> None:
            results.append(await engine.infer(ONES * i))

        async with anyio.create_task_group() as group:
            for i in range(10):
                group.start_soon(one, i)
            await wait_until(lambda: engine.statistics().submitted == 10)
            group.cancel_scope.cancel()
        assert results == []
        for gate in gates:
            gate.release()
        await wait_until(lambda: all_idle(engine))
        stats = engine.statistics()
        assert stats.cancelled == 10 and settled(stats) and accounted(stats)

    @pytest.mark.asyncio
    async def test_inside_an_anyio_task_group(self, engine: Engine) -> None:
        results: dict[int, object] = {}

        async def one(i: int) -> None:
            results[i] = await engine.infer(ONES * i)

        async with anyio.create_task_group() as group:
            for i in range(20):
                group.start_soon(one, i)
        for i in range(20):
            np.testing.assert_array_equal(results[i], expected_affine(ONES * i))


class TestCloseWithWork:
    @pytest.mark.asyncio
    async def test_queued_fail_closed_in_flight_drain(self, runtime: EmulatedRuntime) -> None:
        engine = Engine(affine_model(), runtime=runtime)
        await engine.open()
        busy, gates = await fill_slots(engine, runtime)
        queued = [asyncio.create_task(engine.infer(ONES)) for _ in range(3)]
        await wait_until(lambda: engine.statistics().queued == 3)
        closing = asyncio.create_task(engine.aclose())
        for task in queued:
            with pytest.raises(EngineClosedError, match="while the request waited"):
                await task
        assert not closing.done()  # draining the in-flight work
        for gate in gates:
            gate.release()
        await closing
        for i, task in enumerate(busy):
            np.testing.assert_array_equal(await task, expected_affine(ONES * i))
        assert all(v == 0 for v in runtime.live_handles().values())

    # The handles a timed-out close leaves are the worker's; it exits (status 5) with them.
    @pytest.mark.in_process
    @pytest.mark.asyncio
    async def test_drain_bound_then_closed_error(self, leaky_runtime: EmulatedRuntime) -> None:
        engine = Engine(affine_model(), runtime=leaky_runtime, close_timeout=0.05)
        await engine.open()
        busy, gates = await fill_slots(engine, leaky_runtime)
        await engine.aclose()
        for task in busy:
            with pytest.raises(EngineClosedError, match="before the DLA finished"):
                await task
        # The held tasks may still write their buffers: their cores keep them.
        assert leaky_runtime.live_handles()["devices"] == 2
        for gate in gates:
            gate.release()

    @pytest.mark.asyncio
    async def test_cancel_a_request_during_close(self, runtime: EmulatedRuntime) -> None:
        engine = Engine(affine_model(), runtime=runtime)
        await engine.open()
        busy, gates = await fill_slots(engine, runtime)
        closing = asyncio.create_task(engine.aclose())
        await asyncio.sleep(0)
        busy[0].cancel()
        with pytest.raises(asyncio.CancelledError):
            await busy[0]
        for gate in gates:
            gate.release()
        await closing
        for i, task in enumerate(busy[1:], start=1):
            np.testing.assert_array_equal(await task, expected_affine(ONES * i))
        assert all(v == 0 for v in runtime.live_handles().values())

    @pytest.mark.asyncio
    async def test_cancelling_close_still_closes(self, runtime: EmulatedRuntime) -> None:
        engine = Engine(affine_model(), runtime=runtime)
        await engine.open()
        busy, gates = await fill_slots(engine, runtime)
        closing = asyncio.create_task(engine.aclose())
        await asyncio.sleep(0.01)
        closing.cancel()
        for gate in gates:
            gate.release()
        with pytest.raises(asyncio.CancelledError):
            await closing
        await engine.aclose()  # waits for the shielded close to finish
        assert all(v == 0 for v in runtime.live_handles().values())
        await asyncio.gather(*busy)
