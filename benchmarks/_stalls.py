"""What stalls a process's threads during a stream benchmark, told apart by cause.

A stream's coroutine that wakes a whole frame interval late drops a frame, yet the
loop's 1 ms ticker can show a small p99: a few long stalls a second are a fraction of
a percent of its ticks. Two witnesses tell where long stalls come from:

- ``LockProbe``: a thread of its own that sleeps 1 ms at a time and records how late it
  wakes. It needs the interpreter lock to record, so a stall it shares with the loop is
  the whole process's (a thread holding the lock, or the lock's hand-over among many
  waiting threads), and one it misses is the loop thread's own: its work, or a wait
  that lets the lock go (on the emulated runtime, its one lock).
- ``CollectorPauses``: each run of the cyclic garbage collector, by generation and
  length (``gc.callbacks``), which stops every thread of the process.

And ``SlowCallbacks`` names the loop's own long callbacks.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any

import numpy as np


def tail(values_s: list[float], interval_s: float) -> dict[str, Any]:
    """p50, p99, p99.9 and the largest of ``values_s`` in milliseconds, and how many
    reached ``interval_s`` (a frame interval: each such stall drops a frame)."""
    if not values_s:
        return {"count": 0}
    values = np.asarray(values_s)
    return {
        "count": int(values.size),
        "p50_ms": 1e3 * float(np.percentile(values, 50)),
        "p99_ms": 1e3 * float(np.percentile(values, 99)),
        "p999_ms": 1e3 * float(np.percentile(values, 99.9)),
        "max_ms": 1e3 * float(values.max()),
        "over_interval": int((values >= interval_s).sum()),
    }


class LockProbe:
    """A thread that sleeps ``period`` at a time while running, recording how late each
    wake-up was (seconds) once ``begin`` (``time.perf_counter()``) has passed."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.late: list[float] = []
        self.begin = float("inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lock probe", daemon=True)

    def __enter__(self) -> LockProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            due = time.perf_counter() + self.period
            time.sleep(self.period)
            now = time.perf_counter()
            if now >= self.begin:
                self.late.append(max(0.0, now - due))


class CollectorPauses:
    """Each collection's generation and length while installed (``gc.callbacks``), once
    ``begin`` (``time.perf_counter()``) has passed."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self.begin = float("inf")
        self._started = 0.0

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started >= self.begin:
            self.pauses.append((info["generation"], time.perf_counter() - self._started))

    def report(self, interval_s: float) -> dict[str, Any]:
        """Per generation: collections, their total and longest (ms), and how many
        lasted a frame interval or more."""
        by_generation: dict[str, Any] = {}
        for generation in sorted({g for g, _ in self.pauses}):
            lengths = [length for g, length in self.pauses if g == generation]
            by_generation[str(generation)] = {
                "collections": len(lengths),
                "total_ms": 1e3 * sum(lengths),
                "max_ms": 1e3 * max(lengths),
                "over_interval": sum(length >= interval_s for length in lengths),
            }
        return by_generation


class SlowCallbacks:
    """Each of the loop's callbacks (a task's step, a call from a thread) that ran
    ``threshold`` seconds or more once ``begin`` has passed, by what it ran: the loop's
    own long work, which neither the probe thread nor the collector sees. Wraps
    ``asyncio.Handle._run`` while installed (a benchmark's diagnosis, never aiodla's):
    asyncio's own ``slow_callback_duration`` works in debug mode only, whose checks
    slow every callback of the run being measured, and it logs rather than counts."""

    def __init__(self, threshold: float = 0.010) -> None:
        self.threshold = threshold
        self.begin = float("inf")
        self.slow: list[tuple[float, str]] = []

    def __enter__(self) -> SlowCallbacks:
        self._run = run = asyncio.Handle._run
        slow, threshold, clock = self.slow, self.threshold, time.perf_counter
        owner = self

        def timed(handle: asyncio.Handle) -> None:
            began = clock()
            run(handle)
            took = clock() - began
            if took >= threshold and began >= owner.begin:
                slow.append((took, _what(handle)))

        asyncio.Handle._run = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.Handle._run = self._run  # type: ignore[method-assign]

    def report(self, most: int = 12) -> list[dict[str, Any]]:
        """The callbacks that ran long, grouped by what they ran, longest total first."""
        groups: dict[str, list[float]] = {}
        for took, what in self.slow:
            groups.setdefault(what, []).append(took)
        ranked = sorted(groups.items(), key=lambda item: -sum(item[1]))[:most]
        return [
            {"what": what, "count": len(t), "total_ms": 1e3 * sum(t), "max_ms": 1e3 * max(t)}
            for what, t in ranked
        ]


def _what(handle: asyncio.Handle) -> str:
    """A callback's name without its arguments' or objects' addresses: a task's
    coroutine, else the function called."""
    callback = getattr(handle, "_callback", None)
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        coro = task.get_coro()
        return f"task {getattr(coro, '__qualname__', type(coro).__name__)}"
    return getattr(callback, "__qualname__", type(callback).__name__)
