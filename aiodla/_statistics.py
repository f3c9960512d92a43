"""Engine statistics: frozen snapshots, and the latency window they are built from."""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["CoreStatistics", "EngineStatistics", "LatencySummary", "LatencyWindow"]


@dataclasses.dataclass(frozen=True)
class LatencySummary:
    """Request latency (seconds, from ``infer`` to result) over the recent window."""

    count: int
    p50: float
    p90: float
    p99: float
    max: float
    mean: float


@dataclasses.dataclass(frozen=True)
class CoreStatistics:
    """One DLA core as the engine sees it."""

    core: int
    completed: int
    failed: int
    in_flight: int
    busy_slots: int
    idle_slots: int
    busy_time: float
    """Seconds the core had a task running, estimated from completion times."""


@dataclasses.dataclass(frozen=True)
class EngineStatistics:
    """A snapshot of the engine: totals, per-core counts and latency percentiles.

    ``submitted`` counts requests admitted to the queue; each ends as exactly one of
    ``completed``, ``failed``, ``cancelled`` or ``timed_out`` — or is still ``queued``
    or ``in_flight``. ``rejected`` counts ``infer_nowait`` calls refused for a full queue;
    they were never submitted. A request whose result was ready when its caller was
    cancelled counts as completed.
    """

    state: str
    submitted: int
    completed: int
    failed: int
    cancelled: int
    timed_out: int
    rejected: int
    queued: int
    in_flight: int
    cores: tuple[CoreStatistics, ...]
    latency: LatencySummary


class LatencyWindow:
    """The last ``size`` latencies in a ring; percentiles are computed on demand."""

    def __init__(self, size: int) -> None:
        self._values = np.zeros(size, dtype=np.float64)
        self._next = 0
        self._count = 0

    def add(self, seconds: float) -> None:
        self._values[self._next] = seconds
        self._next = (self._next + 1) % self._values.size
        if self._count < self._values.size:
            self._count += 1

    def summary(self) -> LatencySummary:
        if not self._count:
            return LatencySummary(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        values = self._values[: self._count]
        p50, p90, p99 = np.percentile(values, (50, 90, 99))
        return LatencySummary(
            self._count, float(p50), float(p90), float(p99), float(values.max()), float(values.mean())
        )
