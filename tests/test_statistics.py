"""statistics() and repr(): what an operator reads, backed by the requests made."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from aiodla import EmulatedRuntime, Engine
from aiodla._core_record import CoreRecord
from aiodla._local_device import CoreLane, Slot
from aiodla._slots import account
from aiodla._statistics import LatencyWindow

from support import X, affine_model, wait_until

ONES = np.ones(X.shape, np.float32)


@pytest.mark.asyncio
async def test_counts_follow_the_requests(engine: Engine, runtime: EmulatedRuntime) -> None:
    before = engine.statistics()
    assert before.state == "open" and before.submitted == before.completed == 0
    assert [c.idle_slots for c in before.cores] == [2, 2]
    await asyncio.gather(*(engine.infer(ONES) for _ in range(50)))
    stats = engine.statistics()
    assert stats.submitted == stats.completed == 50
    assert sum(c.completed for c in stats.cores) == 50
    assert runtime.core_tasks(0) + runtime.core_tasks(1) == 50
    assert stats.latency.count == 50
    assert 0 < stats.latency.p50 <= stats.latency.p90 <= stats.latency.p99 <= stats.latency.max
    assert all(core.busy_time > 0 for core in stats.cores)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.completed = 0  # type: ignore[misc]


@pytest.mark.asyncio
async def test_repr_shows_slots_and_queue(engine: Engine, runtime: EmulatedRuntime) -> None:
    assert repr(engine) == "<Engine open [cores 2: 0 busy slots, 4 idle | 0 in flight, 0 queued]>"
    gates = [runtime.hold(0), runtime.hold(1)]
    tasks = [asyncio.create_task(engine.infer(ONES)) for _ in range(7)]
    await wait_until(lambda: engine.statistics().queued == 3)
    assert repr(engine) == "<Engine open [cores 2: 4 busy slots, 0 idle | 4 in flight, 3 queued]>"
    stats = engine.statistics()
    assert [c.busy_slots for c in stats.cores] == [2, 2] and stats.in_flight == 4
    for gate in gates:
        gate.release()
    await asyncio.gather(*tasks)


@pytest.mark.asyncio
async def test_repr_before_and_after() -> None:
    engine = Engine(affine_model(), runtime="emulated")
    assert repr(engine) == "<Engine new>"
    async with engine:
        pass
    assert repr(engine).startswith("<Engine closed [cores 2:")
    assert engine.statistics().state == "closed"


def test_latency_window_keeps_the_most_recent() -> None:
    window = LatencyWindow(4)
    assert window.summary().count == 0
    for value in (10.0, 1.0, 2.0, 3.0, 4.0):
        window.add(value)
    summary = window.summary()
    assert summary.count == 4 and summary.max == 4.0 and summary.mean == 2.5
    assert summary.p50 == pytest.approx(2.5)


def test_busy_window_covers_the_last_ten_seconds() -> None:
    from aiodla._statistics import BusyWindow

    window = BusyWindow(opened=90.0)  # opened well before: a full window from 100 on
    assert window.fraction(100.0) == 0.0
    for second in range(100, 110):
        window.add(second + 0.5, 0.5)  # busy half of every second
    assert window.fraction(109.9) == pytest.approx(0.5)
    assert window.fraction(115.0) == pytest.approx(0.2)  # buckets 106..115: four busy ones
    assert window.fraction(200.0) == 0.0
    window.add(200.1, 50.0)
    assert window.fraction(200.2) == 1.0  # capped


def test_a_task_seen_done_just_after_its_predecessor_was_seen_late_counts_its_stated_time() -> None:
    # Both queued at t0 on a core of a 1 ms stated time; the first seen done 2 ms late
    # (the poller batches, or the host is loaded), the second 0.1 ms after that. The
    # core ran 2 ms of tasks: the second ran from t0 + 1 ms, not from when the first was
    # seen.
    core = CoreLane(0, service_time=0.001, learn_service_time=False)
    t0 = 100.0
    first, second = (Slot(core, i, 0, i, None, [], []) for i in range(2))
    first.submitted_at = second.submitted_at = t0
    account(first, 0, t0 + 0.003)
    account(second, 0, t0 + 0.0031)
    assert core.busy_time == pytest.approx(0.002)


def test_a_time_stated_long_counts_the_core_no_busier_than_the_clock() -> None:
    # Stated 1.1 ms, each task seen done 1 ms after the one before: 3 ms of tasks in
    # 3 ms, not 3.3.
    core = CoreLane(0, service_time=0.0011, learn_service_time=False)
    t0 = 100.0
    slots = [Slot(core, i, 0, i, None, [], []) for i in range(3)]
    for number, slot in enumerate(slots, 1):
        slot.submitted_at = t0
        account(slot, 0, t0 + number * 0.001)
    assert core.busy_time == pytest.approx(0.003)


@pytest.mark.parametrize("learn", [True, False])
def test_tasks_of_one_core_seen_done_together_are_accounted_one_service_time_each(
    learn: bool,
) -> None:
    # Two tasks queued on one core at t0, both seen done in one batch at t0 + 2 ms:
    # the second has no span of its own. It must neither teach the engine a service
    # time of 0 (the poller would then poll every slot at once) nor count as idle.
    core = CoreLane(0, service_time=0.001, learn_service_time=learn)
    t0 = 100.0
    first, second = (Slot(core, i, 0, i, None, [], []) for i in range(2))
    first.submitted_at = second.submitted_at = t0
    account(first, 0, t0 + 0.002)
    account(second, 0, t0 + 0.002)
    if learn:
        assert core.service_time == pytest.approx(0.002)
        assert list(core.observed) == [pytest.approx(0.002)]
        assert core.busy_time == pytest.approx(0.004)
    else:
        assert core.service_time == 0.001
        assert core.busy_time == pytest.approx(0.002)
    assert core.completed == 2


@pytest.mark.parametrize(("learn", "second_seen"), [(True, 0.002), (False, 0.0015)])
def test_two_engines_tasks_on_one_physical_core_count_no_more_than_the_clock(
    learn: bool, second_seen: float
) -> None:
    # Two engines' lanes on one physical core (one record), a task of each queued at t0
    # with a 1 ms service time, the first seen done at t0 + 1 ms, the second later: the
    # core was busy no longer than the clock ran. Bounded by each engine's own last
    # completion, the second engine's task would count from t0, as if the core ran both
    # at once, and a learned service time would take in the other engine's task.
    record = CoreRecord(0)
    lanes = [CoreLane(0, record, service_time=0.001, learn_service_time=learn) for _ in range(2)]
    t0 = 100.0
    first, second = (Slot(lane, 0, 0, 0, None, [], []) for lane in lanes)
    first.submitted_at = second.submitted_at = t0
    account(first, 0, t0 + 0.001)
    account(second, 0, t0 + second_seen)
    assert lanes[0].busy_time + lanes[1].busy_time == pytest.approx(second_seen)
    assert lanes[1].service_time == pytest.approx(0.001)
