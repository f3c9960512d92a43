"""Timers that meet a deadline: armed early by the lateness their own firings showed.

The lateness a firing reports comes from the clock given to the timers, so these tests
set it; nothing here depends on how late the machine's loop really is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from aiodla._deadlines import WINDOW, DeadlineTimers


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def timers_with(
    loop: asyncio.AbstractEventLoop, latenesses: list[float], cap: float = 1.0
) -> DeadlineTimers:
    timers = DeadlineTimers(loop, cap=cap)
    for late in latenesses:
        timers.observe(late)
    return timers


def test_before_any_firing_a_timer_is_armed_at_its_deadline(
    loop: asyncio.AbstractEventLoop,
) -> None:
    timers = timers_with(loop, [])
    handle = timers.call_at(100.0, lambda: None)
    assert timers.lead == 0.0 and handle.when() == 100.0
    handle.cancel()


def test_timers_are_armed_early_by_a_high_recent_lateness(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # 16 firings 0.1 .. 1.6 ms late: about the 90th percentile is the second latest.
    timers = timers_with(loop, [k * 1e-4 for k in range(1, WINDOW + 1)])
    assert timers.lead == pytest.approx(1.5e-3)
    handle = timers.call_at(100.0, lambda: None)
    assert handle.when() == pytest.approx(100.0 - 1.5e-3)
    handle.cancel()


def test_the_lead_never_exceeds_the_cap(loop: asyncio.AbstractEventLoop) -> None:
    timers = timers_with(loop, [0.5] * 4, cap=1e-3)
    assert timers.lead == 1e-3


def test_old_latenesses_leave_the_window(loop: asyncio.AbstractEventLoop) -> None:
    timers = timers_with(loop, [5e-3] * WINDOW + [2e-4] * WINDOW)
    assert timers.lead == pytest.approx(2e-4)


def test_a_firing_before_its_time_counts_as_on_time(loop: asyncio.AbstractEventLoop) -> None:
    assert timers_with(loop, [-1e-3]).lead == 0.0


@pytest.mark.asyncio
async def test_a_firing_reports_its_lateness_and_runs_the_callback() -> None:
    loop = asyncio.get_running_loop()
    now = [0.0]
    timers = DeadlineTimers(loop, cap=1.0, clock=lambda: now[0])
    fired = asyncio.Event()
    deadline = loop.time()  # due at once: the loop runs it on its next iteration
    now[0] = deadline + 4e-4  # what the clock will say when it runs
    timers.call_at(deadline, fired.set)
    await fired.wait()
    assert timers.lead == pytest.approx(4e-4)
    # The next timer is armed that much before its deadline.
    handle = timers.call_at(deadline + 10.0, lambda: None)
    assert handle.when() == pytest.approx(deadline + 10.0 - 4e-4)
    handle.cancel()
