"""Scheduling policy: FIFO among waiters, least outstanding work first, fairness (a
lone engine's: the dispatcher's fast path, over the engine's scheduler)."""

from __future__ import annotations

import asyncio
import collections
import itertools

import numpy as np
import pytest

from aiodla import EmulatedRuntime, Engine, QueueFullError
from aiodla._core_record import CoreRecord
from aiodla._dispatch import Client, Dispatcher
from aiodla._life import EngineState, Life
from aiodla._local_device import CoreLane, Slot
from aiodla._scheduler import Outcome, Request, Scheduler

from support import X, affine_model, expected_affine, wait_until

ONES = np.ones(X.shape, np.float32)


class Lone:
    """A lone engine as its cores' dispatcher sees it: its lanes, its scheduler, and
    the requests it was told to start (with their slots)."""

    def __init__(self, slots_per_core: dict[int, int]) -> None:
        self.life = Life()
        self.life.state = EngineState.OPEN
        self.scheduler = Scheduler()
        self.lanes: list[CoreLane] = []
        for number, count in slots_per_core.items():
            core = CoreLane(number, CoreRecord(number))
            for index in range(count):
                slot = Slot(core, index, 0, 0, None, [], [])
                core.slots.append(slot)
                core.idle.append(slot)
            self.lanes.append(core)
        self.dispatcher = Dispatcher({core.core: core.record for core in self.lanes})
        self.client: Client = self.dispatcher.join(self, 0, 1.0)
        self.started: list[tuple[Request, Slot]] = []

    def start(self, request: Request, slot: Slot) -> None:
        self.started.append((request, slot))

    def probe(self, slot: Slot) -> None:
        raise AssertionError("no core is out of rotation here")

    def assign(self) -> list[tuple[Request, Slot]]:
        """What one assignment started."""
        before = len(self.started)
        self.dispatcher.assign()
        return self.started[before:]


def request(loop: asyncio.AbstractEventLoop, tag: int) -> Request:
    return Request((tag,), loop.create_future(), 0.0)


class TestPolicy:
    @pytest.mark.asyncio
    async def test_fifo_and_least_outstanding(self) -> None:
        loop = asyncio.get_running_loop()
        lone = Lone({0: 2, 1: 2})
        waiting = [request(loop, i) for i in range(5)]
        for r in waiting:
            lone.scheduler.admit(r)
        assigned = [(r.arrays[0], s.core.core) for r, s in lone.assign()]
        # Requests in arrival order; cores alternate as each gains outstanding work.
        assert assigned == [(0, 0), (1, 1), (2, 0), (3, 1)]
        assert lone.scheduler.queued == 1 and lone.client.idle_slots == 0

    @pytest.mark.asyncio
    async def test_released_slot_goes_to_the_least_loaded_core(self) -> None:
        loop = asyncio.get_running_loop()
        lone = Lone({0: 2, 1: 2})
        for i in range(4):
            lone.scheduler.admit(request(loop, i))
        slots = [slot for _, slot in lone.assign()]
        core1 = [s for s in slots if s.core.core == 1]
        release = lone.dispatcher.release
        release(lone.client, core1[0])
        release(lone.client, core1[1])
        release(lone.client, next(s for s in slots if s.core.core == 0))
        lone.scheduler.admit(request(loop, 9))
        (pair,) = lone.assign()
        assert pair[1].core.core == 1  # 0 outstanding beats 1

    @pytest.mark.asyncio
    async def test_cancelled_waiters_are_skipped_and_not_counted(self) -> None:
        loop = asyncio.get_running_loop()
        lone = Lone({0: 1})
        scheduler = lone.scheduler
        waiting = [request(loop, i) for i in range(3)]
        for r in waiting:
            scheduler.admit(r)
        scheduler.finish(waiting[0], Outcome.CANCELLED)
        assert scheduler.queued == 2
        (pair,) = lone.assign()
        assert pair[0] is waiting[1] and pair[0].slot is pair[1]
        assert scheduler.queued == 1

    @pytest.mark.asyncio
    async def test_drain_returns_live_waiters(self) -> None:
        loop = asyncio.get_running_loop()
        scheduler = Lone({0: 1}).scheduler
        waiting = [request(loop, i) for i in range(3)]
        for r in waiting:
            scheduler.admit(r)
        scheduler.finish(waiting[1], Outcome.CANCELLED)
        assert scheduler.drain("closed") == [waiting[0], waiting[2]]
        assert scheduler.queued == 0


class TestEngineScheduling:
    @pytest.mark.asyncio
    async def test_fifo_completion_order_on_one_slot(self, runtime: EmulatedRuntime) -> None:
        async with Engine(
            affine_model(latency=0.0), cores=[0], streams_per_core=1, runtime=runtime
        ) as engine:
            order: list[int] = []

            async def one(i: int) -> None:
                await engine.infer(ONES * i)
                order.append(i)

            gate = runtime.hold(0)
            tasks = [asyncio.create_task(one(i)) for i in range(8)]
            await wait_until(lambda: engine.statistics().queued == 7)
            gate.release()
            await asyncio.gather(*tasks)
        assert order == list(range(8))

    @pytest.mark.asyncio
    async def test_both_cores_share_the_load(self, engine: Engine) -> None:
        await asyncio.gather(*(engine.infer(ONES) for _ in range(200)))
        counts = [core.completed for core in engine.statistics().cores]
        assert sum(counts) == 200 and min(counts) >= 80

    @pytest.mark.asyncio
    async def test_a_held_core_does_not_stall_the_other(
        self, engine: Engine, runtime: EmulatedRuntime
    ) -> None:
        gate = runtime.hold(0)
        # Fill core 0's slots (held), then everything else flows through core 1.
        first = [asyncio.create_task(engine.infer(ONES)) for _ in range(4)]
        await wait_until(lambda: gate.held == 2 and engine.statistics().completed == 2)
        held = [task for task in first if not task.done()]
        assert len(held) == 2
        results = await asyncio.gather(*(engine.infer(ONES * i) for i in range(20)))
        for i, y in enumerate(results):
            np.testing.assert_array_equal(y, expected_affine(ONES * i))
        assert engine.statistics().cores[1].completed == 22
        gate.release()
        await asyncio.gather(*held)

    @pytest.mark.asyncio
    async def test_fairness_between_callers(self, engine: Engine, runtime: EmulatedRuntime) -> None:
        """Two producers flooding the queue are served in arrival order, interleaved."""
        gates = [runtime.hold(0), runtime.hold(1)]
        served: list[str] = []

        async def producer(name: str) -> None:
            for _ in range(20):
                await engine.infer(ONES)
                served.append(name)

        tasks = [asyncio.create_task(producer("a")), asyncio.create_task(producer("b"))]
        await wait_until(lambda: engine.statistics().in_flight == 2)
        for gate in gates:
            gate.release()
        await asyncio.gather(*tasks)
        runs = collections.Counter(itertools.pairwise(served))
        assert served.count("a") == served.count("b") == 20
        assert runs[("a", "b")] + runs[("b", "a")] >= 30  # interleaved, not one after the other


class TestBackpressure:
    @pytest.mark.asyncio
    async def test_nowait_fails_fast_when_full(self, runtime: EmulatedRuntime) -> None:
        async with Engine(affine_model(), runtime=runtime, max_queue=3) as engine:
            gates = [runtime.hold(0), runtime.hold(1)]
            busy = [asyncio.create_task(engine.infer(ONES)) for _ in range(4 + 3)]
            await wait_until(lambda: engine.statistics().queued == 3)
            with pytest.raises(QueueFullError, match=r"max_queue=3"):
                engine.infer_nowait(ONES)
            with pytest.raises(QueueFullError):
                await engine.infer(ONES, wait=False)
            assert engine.statistics().rejected == 2
            # infer() waits its turn instead.
            waiter = asyncio.create_task(engine.infer(ONES * 9))
            await wait_until(lambda: engine.statistics().queued == 4)
            for gate in gates:
                gate.release()
            await asyncio.gather(*busy)
            np.testing.assert_array_equal(await waiter, expected_affine(ONES * 9))
            stats = engine.statistics()
            assert stats.submitted == 8 and stats.completed == 8 and stats.rejected == 2

    @pytest.mark.asyncio
    async def test_nowait_succeeds_with_room(self, engine: Engine) -> None:
        np.testing.assert_array_equal(await engine.infer_nowait(ONES), expected_affine(ONES))

    @pytest.mark.asyncio
    async def test_zero_queue_admits_only_to_idle_slots(self, runtime: EmulatedRuntime) -> None:
        async with Engine(
            affine_model(), runtime=runtime, max_queue=0, cores=[0], streams_per_core=1
        ) as engine:
            gate = runtime.hold(0)
            first = engine.infer_nowait(ONES)
            await wait_until(lambda: gate.held == 1)
            with pytest.raises(QueueFullError):
                engine.infer_nowait(ONES)  # refused at once, with no await
            gate.release()
            await first
