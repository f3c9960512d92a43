"""The poller: batching, back-off, failures, and harmlessness after close."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from aiodla import _poller as poller_module
from aiodla._local_device import CoreLane, Slot, completion_probe
from aiodla._poller import MAX_BACKOFF, Poller
from aiodla.runtime import CudaCallError


class FakeRuntime:
    """Events are flags the test sets; queries are counted."""

    def __init__(self) -> None:
        self.done: set[int] = set()
        self.queries = 0
        self.queried: list[int] = []
        self.fail_with: BaseException | None = None

    def make_current(self) -> None:
        pass

    def get_last_error(self, device: int) -> int:
        return 0

    def query_event(self, event: int) -> bool:
        self.queries += 1
        self.queried.append(event)
        if self.fail_with is not None:
            raise self.fail_with
        return event in self.done


class FakeLoop:
    """Records what the poller hands to the loop."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []
        self.closed = False
        self.posted = threading.Event()

    def call_soon_threadsafe(self, callback: Any, argument: Any) -> None:
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.calls.append((callback, argument))
        self.posted.set()


class Sink:
    def __init__(self) -> None:
        self.batches: list[list[tuple[Slot, int]]] = []
        self.failures: list[BaseException] = []

    def deliver(self, slots: list[tuple[Slot, int]]) -> None:
        self.batches.append(slots)

    def fail(self, error: BaseException) -> None:
        self.failures.append(error)


def slot(event: int, expected: float, core: CoreLane | None = None) -> Slot:
    s = Slot(core or CoreLane(0), event, 0, event, None, [], [])
    s.expected_done = expected
    return s


def start(runtime: FakeRuntime, loop: FakeLoop, sink: Sink, pause: float = 0.0) -> Poller:
    poller = Poller(completion_probe(runtime), loop, sink.deliver, sink.fail, pause=pause)  # type: ignore[arg-type]
    poller.start()
    return poller


def test_one_wakeup_for_all_completions_of_a_sweep() -> None:
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    core = CoreLane(0, service_time=0.2)
    due = time.monotonic() + 0.2
    slots = [slot(i, due, core) for i in range(3)]
    poller = start(runtime, loop, sink)
    try:
        for s in slots:
            poller.watch(s)
        runtime.done.update({0, 1, 2})  # all done before the poller's first look
        assert loop.posted.wait(5)
        time.sleep(0.05)
    finally:
        poller.stop()
        poller.join(5)
    delivered = [s.event for _, batch in loop.calls for s, _ in batch]
    assert sorted(delivered) == [0, 1, 2]
    assert len(loop.calls) == 1  # one call_soon_threadsafe for the whole sweep
    assert not poller.alive


def test_a_loaded_core_is_collected_in_batches_that_leave_it_a_reserve() -> None:
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    service = 0.05
    core = CoreLane(0, service_time=service)
    began = time.monotonic()
    # Eight tasks queued on one core, all already done: a poller that swept at the
    # first expected completion would deliver them one by one.
    slots = [slot(i, began + service * (i + 1), core) for i in range(8)]
    runtime.done.update(range(8))
    poller = start(runtime, loop, sink)
    try:
        for s in slots:
            poller.watch(s)
        assert loop.posted.wait(5)
        first_delivery = time.monotonic() - began
    finally:
        poller.stop()
        poller.join(5)
    reserve = max(poller_module.RESERVE, 2 * service)
    # Not before the core has only its reserve of queued work left...
    assert first_delivery >= 8 * service - reserve - poller_module.SPIN_WINDOW
    first = [s.event for s, _ in loop.calls[0][1]]
    # ...and then every task expected by then arrives in one batch, and the two done
    # ahead of their estimates with them (each queried once a task before it was done).
    assert first == list(range(8))


def planned_wakeups(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, float]]:
    """(when, until) of every sleep the poller starts from now: what it planned, which
    a loaded machine cannot stretch (the wake-up itself may come late there)."""
    sleeps: list[tuple[float, float]] = []
    original = Poller._sleep

    def sleep(self: Poller, seconds: float) -> None:
        now = time.monotonic()
        sleeps.append((now, now + seconds))
        original(self, seconds)

    monkeypatch.setattr(Poller, "_sleep", sleep)
    return sleeps


def test_light_load_is_collected_at_its_expected_completion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    core = CoreLane(0, service_time=0.05)
    runtime.done.add(1)
    poller = start(runtime, loop, sink)
    began = time.monotonic()
    sleeps = planned_wakeups(monkeypatch)
    try:
        poller.watch(slot(1, began + 0.05, core))
        assert loop.posted.wait(5)
        delivered_after = time.monotonic() - began
    finally:
        poller.stop()
        poller.join(5)
    assert delivered_after >= 0.05 - 0.025  # half a service time early at most
    # ...and never planned to sleep past the completion (a late wake-up of a loaded
    # machine is not the poller's choice; a sleep planned too long would be).
    due = began + 0.05
    assert all(until < due + 0.03 for when, until in sleeps if began <= when < due)


class TimedRuntime(FakeRuntime):
    """Also records when each event was first queried."""

    def __init__(self) -> None:
        super().__init__()
        self.first_query: dict[int, float] = {}

    def query_event(self, event: int) -> bool:
        self.first_query.setdefault(event, time.monotonic())
        return super().query_event(event)


def test_a_core_with_work_queued_behind_its_task_is_not_polled_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A wide spin window makes polling early unmistakable; the core's second task
    # (0.2 s of work behind the first) means a late wake-up costs it nothing.
    monkeypatch.setattr(poller_module, "SPIN_WINDOW", 0.05)
    runtime, loop, sink = TimedRuntime(), FakeLoop(), Sink()
    core = CoreLane(0, service_time=0.2)
    began = time.monotonic()
    first, second = slot(1, began + 0.2, core), slot(2, began + 0.4, core)
    runtime.done.add(1)
    poller = start(runtime, loop, sink)
    try:
        poller.watch(first)
        poller.watch(second)
        assert loop.posted.wait(5)
    finally:
        poller.stop()
        poller.join(5)
    assert runtime.first_query[1] >= first.expected_done


def test_a_lone_task_is_still_polled_from_its_spin_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(poller_module, "SPIN_WINDOW", 0.05)
    runtime, loop, sink = TimedRuntime(), FakeLoop(), Sink()
    core = CoreLane(0, service_time=0.2)
    alone = slot(1, time.monotonic() + 0.2, core)
    poller = start(runtime, loop, sink)
    try:
        poller.watch(alone)
        time.sleep(0.2)
        runtime.done.add(1)
        assert loop.posted.wait(5)
    finally:
        poller.stop()
        poller.join(5)
    assert runtime.first_query[1] <= alone.expected_done - 0.04  # light load: early


def test_a_loaded_cores_next_task_is_waited_for_without_the_loop_consuming(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # After a batch from a loaded core, the next sweep is planned for the core's next
    # task: the poller sleeps until then, not until the loop says it consumed the batch
    # (which would cost a wake-up per batch), and the loop's ``consumed`` does not wake it.
    monkeypatch.setattr(poller_module, "CONSUME_WAIT", 30.0)
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    service = 0.1
    core = CoreLane(0, service_time=service)
    began = time.monotonic()
    first, second = slot(1, began, core), slot(2, began + service, core)
    runtime.done.add(1)
    poller = start(runtime, loop, sink)
    try:
        poller.watch(first)
        poller.watch(second)
        assert loop.posted.wait(5)
        runtime.done.add(2)  # (done before, it would have come with the first)
        loop.posted.clear()
        sweeps = poller.sweeps
        poller.consumed()  # the loop handled the first batch
        time.sleep(0.01)
        assert poller.sweeps == sweeps  # not woken by it
        # Never waited on the loop: the second task comes, well before CONSUME_WAIT.
        assert loop.posted.wait(5)
        delivered_after = time.monotonic() - began
    finally:
        poller.stop()
        poller.join(5)
    assert [[s.event for s, _ in batch] for _, batch in loop.calls] == [[1], [2]]
    assert service <= delivered_after


def test_sleeps_until_close_to_the_expected_completion() -> None:
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    poller = start(runtime, loop, sink)
    try:
        # Due in a minute: however late this thread wakes, the slot cannot be due yet.
        poller.watch(slot(1, time.monotonic() + 60))
        time.sleep(0.1)
        early = runtime.queries
    finally:
        poller.stop()
        poller.join(5)
    assert not poller.alive
    assert early <= 2  # it slept instead of polling a slot that could not be done yet


def test_backs_off_from_an_overdue_slot() -> None:
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    poller = start(runtime, loop, sink)
    try:
        began = time.monotonic()
        poller.watch(slot(1, began))  # due now, never completes (a hung core)
        # It goes on polling (as often as this machine lets it)...
        while runtime.queries <= 10 and time.monotonic() < began + 5:
            time.sleep(0.01)
        time.sleep(0.3)
        queries, elapsed = runtime.queries, time.monotonic() - began
    finally:
        poller.stop()
        poller.join(5)
    # ...and a busy spin would query tens of thousands of times a second; back-off
    # keeps it near one query per MAX_BACKOFF after the first overdue stretch.
    assert 10 < queries < 4 * elapsed / MAX_BACKOFF + 100


def test_query_failure_is_reported_once_and_the_thread_ends() -> None:
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    runtime.fail_with = CudaCallError("cudaEventQuery", 911)
    poller = start(runtime, loop, sink)
    poller.watch(slot(1, time.monotonic()))
    poller.join(5)
    assert not poller.alive
    assert [call[1] for call in loop.calls] == [runtime.fail_with]


def test_closed_loop_stops_the_poller_quietly() -> None:
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    loop.closed = True
    runtime.done.add(1)
    poller = start(runtime, loop, sink)
    poller.watch(slot(1, time.monotonic()))
    poller.join(5)
    assert not poller.alive and loop.calls == []


def test_dropped_engine_stops_the_poller() -> None:
    runtime, loop = FakeRuntime(), FakeLoop()
    sink = Sink()
    poller = start(runtime, loop, sink)
    del sink  # the poller holds its callbacks weakly
    runtime.done.add(1)
    poller.watch(slot(1, time.monotonic()))
    poller.join(5)
    assert not poller.alive and loop.calls == []


@pytest.mark.parametrize("pause", [0.0, 0.0002])
def test_watch_wakes_an_idle_poller(pause: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # An idle sleep of a minute: the slot arriving within the wait below is the proof.
    monkeypatch.setattr(poller_module, "IDLE_WAIT", 60.0)
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    poller = start(runtime, loop, sink, pause=pause)
    try:
        time.sleep(0.05)  # idle: sleeping long
        runtime.done.add(7)
        began = time.monotonic()
        poller.watch(slot(7, began))
        assert loop.posted.wait(5)  # not the idle sleep of a minute
    finally:
        poller.stop()
        poller.join(5)


def post_one_then_watch_another(poller: Poller, runtime: FakeRuntime, loop: FakeLoop) -> float:
    """Slot 1 finishes and is posted; slot 2, done at once, is watched while the loop has
    not consumed that batch. Returns when slot 2 was watched."""
    runtime.done.add(1)
    poller.watch(slot(1, time.monotonic()))
    assert loop.posted.wait(5)
    loop.posted.clear()
    runtime.done.add(2)
    began = time.monotonic()
    poller.watch(slot(2, began))
    return began


def test_waits_for_the_loop_to_consume_a_batch_before_polling_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(poller_module, "CONSUME_WAIT", 30.0)
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    poller = start(runtime, loop, sink)
    try:
        post_one_then_watch_another(poller, runtime, loop)
        queries = runtime.queries
        time.sleep(0.1)
        assert runtime.queries == queries and len(loop.calls) == 1  # no sweep meanwhile
        poller.consumed()
        assert loop.posted.wait(5)
    finally:
        poller.stop()
        poller.join(5)
    assert [[s.event for s, _ in batch] for _, batch in loop.calls] == [[1], [2]]


def test_a_loop_that_never_consumes_does_not_stall_the_poller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(poller_module, "CONSUME_WAIT", 0.05)
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    poller = start(runtime, loop, sink)
    try:
        post_one_then_watch_another(poller, runtime, loop)
        assert loop.posted.wait(5)  # never consumed: swept again after CONSUME_WAIT
    finally:
        poller.stop()
        poller.join(5)
    assert len(loop.calls) == 2


def test_stop_ends_a_wait_for_consumption(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(poller_module, "CONSUME_WAIT", 30.0)
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    runtime.done.add(1)
    poller = start(runtime, loop, sink)
    poller.watch(slot(1, time.monotonic()))
    assert loop.posted.wait(5)
    poller.stop()
    poller.join(5)  # well before CONSUME_WAIT's 30 s
    assert not poller.alive


def test_a_core_is_queried_from_its_first_slot_and_no_further_than_the_first_not_done() -> None:
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    core = CoreLane(0, service_time=0.001)
    now = time.monotonic()
    runtime.done.update({2, 3, 4})  # the core's first task (1) is still running
    poller = start(runtime, loop, sink)
    try:
        for event in (1, 2, 3, 4):
            poller.watch(slot(event, now, core))
        time.sleep(0.05)
        assert loop.calls == []
        assert runtime.queried and set(runtime.queried) == {1}
        runtime.done.add(1)
        assert loop.posted.wait(5)
    finally:
        poller.stop()
        poller.join(5)
    assert [[s.event for s, _ in batch] for _, batch in loop.calls] == [[1, 2, 3, 4]]


def test_harvest_takes_what_is_done_once_enough_should_be(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(poller_module, "CONSUME_WAIT", 30.0)
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    core = CoreLane(0, service_time=0.001)
    now = time.monotonic()
    poller = start(runtime, loop, sink)
    try:
        post_one_then_watch_another(poller, runtime, loop)  # 1 posted; 2 done, watched
        runtime.done.add(3)
        poller.watch(slot(3, now, core))
        poller.watch(slot(4, now, core))  # due, not done
        runtime.done.add(5)
        poller.watch(slot(5, now + 60, core))  # done, but not due for a minute
        assert poller.harvest(at_least=4) == []  # only 2, 3 and 4 should be done
        harvested = poller.harvest(at_least=3)
        assert [s.event for s, _ in harvested] == [2, 3]  # stops at 4, not done
        assert poller.harvest(at_least=1) == []  # 4: queried, still running
        runtime.done.add(4)
        loop.posted.clear()
        poller.consumed()
        assert loop.posted.wait(5)
    finally:
        poller.stop()
        poller.join(5)
    posted = [[s.event for s, _ in batch] for _, batch in loop.calls]
    # 2 and 3 reached the loop once, through harvest; 5, done ahead of its estimate,
    # came with 4.
    assert posted == [[1], [4, 5]]


def test_harvest_yields_to_a_sweep_in_progress() -> None:
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    poller = Poller(completion_probe(runtime), loop, sink.deliver, sink.fail, pause=0.0)  # type: ignore[arg-type]
    runtime.done.add(1)
    poller.watch(slot(1, time.monotonic()))
    with poller._sweeping:  # the poller thread is sweeping at this moment
        assert poller.harvest(at_least=1) == []
    assert [s.event for s, _ in poller.harvest(at_least=1)] == [1]
