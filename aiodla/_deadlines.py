"""Timers on the event loop that meet a deadline rather than overshoot it.

``loop.call_at(when, ...)`` never runs its callback before ``when``, and mostly runs it
well after: the selector's wait is in whole milliseconds rounded up (epoll), the kernel
adds its timer slack, a virtual machine its thread wake-up, and a wait that other events
cut short is re-armed rounded up again. On this project's 2-CPU virtual machine a 2 ms
``call_later`` ran 0.2 to 0.3 ms late at the median. A :class:`DeadlineTimers` arms each
timer early by the lateness its own timers showed (a high recent value: about the 90th
percentile of the last :data:`WINDOW`), so the callback runs by its deadline, and at
most ``cap`` seconds before it.

Only the event loop's thread uses it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

__all__ = ["WINDOW", "DeadlineTimers"]

# Latenesses kept: enough for a high quantile, few enough to follow a change of load.
WINDOW = 16


class DeadlineTimers:
    """``call_at(deadline, callback)`` on ``loop``, armed ``lead`` seconds early.

    ``lead`` is about the 90th percentile of the latenesses (how long after its armed
    time a timer's callback ran) seen in the last :data:`WINDOW` firings, and at most
    ``cap``; 0 until a timer has fired. ``clock``: the loop's (``loop.time``) unless
    told otherwise.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        cap: float,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._loop = loop
        self._clock = loop.time if clock is None else clock
        self._cap = cap
        self._late: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.lead = 0.0

    def call_at(self, deadline: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        """Run ``callback`` by ``deadline`` (the loop's time) as far as the loop's own
        lateness allows."""
        armed = deadline - self.lead
        return self._loop.call_at(armed, self._fire, armed, callback)

    def _fire(self, armed: float, callback: Callable[[], None]) -> None:
        self.observe(self._clock() - armed)
        callback()

    def observe(self, late: float) -> None:
        """A timer armed for a time ran ``late`` seconds after it."""
        seen = self._late
        seen.append(max(0.0, late))
        ordered = sorted(seen)
        self.lead = min(self._cap, ordered[(len(ordered) * 9) // 10])
