"""The poller: batching, back-off, failures, and harmlessness after close."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from aiodla._poller import MAX_BACKOFF, Poller
from aiodla._scheduler import CoreState, Slot
from aiodla.runtime import CudaCallError


class FakeRuntime:
    """Events are flags the test sets; queries are counted."""

    def __init__(self) -> None:
        self.done: set[int] = set()
        self.queries = 0
        self.fail_with: BaseException | None = None

    def make_current(self) -> None:
        pass

    def get_last_error(self, device: int) -> int:
        return 0

    def query_event(self, event: int) -> bool:
        self.queries += 1
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


def slot(event: int, expected: float) -> Slot:
    s = Slot(CoreState(0), event, 0, event, None, [], [])
    s.expected_done = expected
    return s


def start(runtime: FakeRuntime, loop: FakeLoop, sink: Sink, pause: float = 0.0) -> Poller:
    poller = Poller(runtime, loop, sink.deliver, sink.fail, pause=pause)  # type: ignore[arg-type]
    poller.start()
    return poller


def test_one_wakeup_for_all_completions_of_a_sweep() -> None:
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    far = time.monotonic() + 60
    slots = [slot(i, far) for i in range(3)]
    poller = start(runtime, loop, sink)
    try:
        for s in slots:
            poller.watch(s)
        runtime.done.update({0, 1, 2})
        poller.watch(slot(99, time.monotonic()))  # wakes the poller for a sweep now
        assert loop.posted.wait(5)
        time.sleep(0.05)
    finally:
        poller.stop()
        poller.join(5)
    delivered = [s.event for _, batch in loop.calls for s, _ in batch]
    assert sorted(delivered) == [0, 1, 2]
    assert len(loop.calls) == 1  # one call_soon_threadsafe for the whole sweep
    assert not poller.alive


def test_sleeps_until_close_to_the_expected_completion() -> None:
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    poller = start(runtime, loop, sink)
    try:
        poller.watch(slot(1, time.monotonic() + 0.2))
        time.sleep(0.1)
        early = runtime.queries
        runtime.done.add(1)
        assert loop.posted.wait(5)
    finally:
        poller.stop()
        poller.join(5)
    assert early <= 2  # it slept instead of polling a slot that could not be done yet


def test_backs_off_from_an_overdue_slot() -> None:
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    poller = start(runtime, loop, sink)
    try:
        poller.watch(slot(1, time.monotonic()))  # due now, never completes (a hung core)
        time.sleep(0.3)
    finally:
        poller.stop()
        poller.join(5)
    # A busy spin would query tens of thousands of times; back-off keeps it near
    # 0.3 s / MAX_BACKOFF after the first overdue stretch.
    assert 10 < runtime.queries < 4 * 0.3 / MAX_BACKOFF + 100


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
def test_watch_wakes_an_idle_poller(pause: float) -> None:
    runtime, loop, sink = FakeRuntime(), FakeLoop(), Sink()
    poller = start(runtime, loop, sink, pause=pause)
    try:
        time.sleep(0.05)  # idle: sleeping long
        runtime.done.add(7)
        began = time.monotonic()
        poller.watch(slot(7, began))
        assert loop.posted.wait(5)
        assert time.monotonic() - began < 0.1  # not the idle sleep of 0.5 s
    finally:
        poller.stop()
        poller.join(5)
