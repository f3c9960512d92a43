"""Engine statistics: frozen snapshots, and the recorders they are built from.

Only the event loop's thread records; ``Engine.statistics()`` copies the recorders into
frozen dataclasses, so a snapshot never changes under its reader.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from ._errors import (
    ComputeError,
    DeviceError,
    EngineClosedError,
    EngineDeadError,
    PostprocessError,
    TaskError,
    WorkerLostError,
)

__all__ = [
    "FAILURE_REASONS",
    "LATENCY_BUCKETS",
    "BusyWindow",
    "CoreStatistics",
    "EngineHealth",
    "EngineStatistics",
    "Histogram",
    "HistogramRecorder",
    "LatencySummary",
    "LatencyWindow",
    "StageTimes",
    "WorkerStatistics",
    "failure_reason",
    "unopened_statistics",
]

# The causes ``EngineStatistics.failures`` splits ``failed`` into, each a key of it:
# the DLA reported an error, a cuDLA or CUDA call failed, the emulated runtime's
# compute= function failed, you closed the engine, the device broke it, anything else.
FAILURE_REASONS = (
    "task", "device", "compute", "postprocess", "closed", "worker_lost", "dead", "other",
)  # fmt: skip


def failure_reason(error: BaseException) -> str:
    """The ``EngineStatistics.failures`` key for an error a request failed with."""
    if isinstance(error, TaskError):
        return "task"
    if isinstance(error, ComputeError):
        return "compute"
    if isinstance(error, PostprocessError):
        return "postprocess"
    if isinstance(error, DeviceError):
        return "device"
    if isinstance(error, EngineClosedError):
        return "closed"
    if isinstance(error, WorkerLostError):  # (an EngineDeadError; the engine lives on)
        return "worker_lost"
    if isinstance(error, EngineDeadError):
        return "dead"
    return "other"


# Upper bounds (seconds) of histogram buckets: DLA tasks last about 1-5 ms, requests
# queue for up to seconds under overload.
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclasses.dataclass(frozen=True)
class LatencySummary:
    """Durations (seconds) over the recent window: count and percentiles."""

    count: int
    p50: float
    p90: float
    p99: float
    max: float
    mean: float


@dataclasses.dataclass(frozen=True)
class Histogram:
    """All durations since the engine opened, in cumulative buckets (Prometheus style).

    ``counts[i]`` is how many were ``<= bounds[i]``; ``count`` is the total (the
    implicit ``+Inf`` bucket) and ``sum`` their sum in seconds.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    sum: float


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """Where a request's device time went (only with ``stage_times=True``)."""

    copy_in: LatencySummary
    dla: LatencySummary
    copy_out: LatencySummary


@dataclasses.dataclass(frozen=True)
class CoreStatistics:
    """One DLA core as the engine sees it."""

    core: int
    completed: int
    """Tasks that finished without error."""
    failed: int
    """Tasks that finished with a DLA error status."""
    in_flight: int
    busy_slots: int
    idle_slots: int
    busy_time: float
    """Seconds the core had a task running, estimated from completion times."""
    busy_fraction: float
    """Share of the recent window (``BusyWindow.SECONDS``, or the time since the engine
    opened when that is shorter) the core was busy, 0..1."""
    in_rotation: bool
    """False while the core is out of rotation after repeated faults."""
    consecutive_failures: int
    dla_time: LatencySummary | None
    """Measured DLA time per task (only with ``stage_times=True``)."""
    dla_histogram: Histogram | None


@dataclasses.dataclass(frozen=True)
class EngineStatistics:
    """A snapshot of the engine: totals, per-core counts and latency percentiles.

    ``submitted`` counts requests admitted to the queue; each ends as exactly one of
    ``completed``, ``failed``, ``cancelled`` or ``timed_out`` — or is still ``queued``
    or ``in_flight``. ``rejected`` counts ``infer_nowait`` calls refused for a full queue;
    they were never submitted. A request whose result was ready when its caller was
    cancelled counts as completed. ``failures`` splits ``failed`` by cause: ``task``
    (the DLA reported an error), ``device`` (a cuDLA or CUDA call failed), ``compute``
    (the emulated runtime's ``compute=`` function failed), ``closed``,
    ``worker_lost`` (in flight on a worker process that was lost, ``isolation="process"``),
    ``dead`` and ``other``.
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
    """From ``infer`` to result, completed requests, recent window."""
    queue_wait: LatencySummary
    """From ``infer`` to getting a slot, recent window."""
    latency_histogram: Histogram
    queue_wait_histogram: Histogram
    failures: Mapping[str, int]
    stages: StageTimes | None
    worker: WorkerStatistics | None = None
    """With ``isolation="process"``: the worker process and its replacements."""
    batching: BatchStatistics | None = None
    """With ``Engine(batch=...)``: the single items and the tasks they ran in; the
    counts above are of tasks (and of whole batches callers passed)."""


@dataclasses.dataclass(frozen=True)
class BatchStatistics:
    """Single items and the tasks they ran in (``EngineStatistics.batching``).

    ``items`` counts the single items submitted; each ends as exactly one of
    ``completed``, ``failed``, ``cancelled`` or ``timed_out``, or is still ``waiting``
    (for its task to be assembled) or ``running`` (in a task). ``tasks`` counts the
    tasks assembled; ``sizes`` maps a number of items to how many tasks held that many
    (the batch-size histogram). A task is handed to the engine only while it has a
    slot for it: until then items wait here, where a cancelled or timed-out item
    leaves its batch and the next item takes its row. Whole batches passed by a caller
    are requests of the engine's own counts, not items.
    """

    batch: int
    items: int
    completed: int
    failed: int
    cancelled: int
    timed_out: int
    waiting: int
    running: int
    tasks: int
    sizes: Mapping[int, int]
    withdrawn: int
    """Tasks assembled whose items had all ended (cancelled, timed out) before the
    task's result: withdrawn as a cancelled request is, so one still queued in the
    engine never ran (one already on the DLA ran, its rows dropped)."""
    rejected: int
    """Items ``infer_nowait`` refused because ``max_queue`` tasks' worth of items
    (``max_queue × batch``, at least one task's) were waiting; never counted in
    ``items``."""
    latency: LatencySummary
    """From ``infer`` to the item's row, completed items, recent window: the latency a
    caller of a batched engine sees (``EngineStatistics.latency`` is per task, from
    the task's hand-over to its result)."""
    latency_histogram: Histogram


@dataclasses.dataclass(frozen=True)
class WorkerStatistics:
    """The worker process of an ``isolation="process"`` engine.

    ``state`` is ``serving``, ``restarting``, ``failed`` (past ``max_restarts``: the
    engine is dead), ``starting`` or ``stopped``; ``pid`` the current worker's;
    ``restarts`` how many workers replaced a lost one, ``restart_times`` how long each
    replacement took (seconds from the loss to the new worker ready); ``last_loss``
    the last :class:`WorkerLostError`'s message.
    """

    state: str
    pid: int | None
    restarts: int
    restart_times: tuple[float, ...]
    last_loss: str | None


@dataclasses.dataclass(frozen=True)
class EngineHealth:
    """``ok``, ``degraded`` (a core out of rotation), ``dead`` (the device broke the
    engine), or ``closed``; ``reason`` says why in words."""

    status: str
    reason: str
    cores_out: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class LatencyWindow:
    """The last ``size`` durations in a ring; percentiles are computed on demand."""

    def __init__(self, size: int) -> None:
        # A list, not a numpy array: storing a Python float in it is several times
        # cheaper, and this runs for every request.
        self._values = [0.0] * size
        self._next = 0
        self._count = 0

    def add(self, seconds: float) -> None:
        index = self._next
        self._values[index] = seconds
        index += 1
        self._next = 0 if index == len(self._values) else index
        if self._count < index:
            self._count = index

    def summary(self) -> LatencySummary:
        if not self._count:
            return LatencySummary(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        values = np.asarray(self._values[: self._count])
        p50, p90, p99 = np.percentile(values, (50, 90, 99))
        return LatencySummary(
            self._count,
            float(p50),
            float(p90),
            float(p99),
            float(np.max(values)),
            float(np.mean(values)),
        )


class HistogramRecorder:
    """Counts durations into fixed buckets; O(log buckets) per observation."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def add(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> Histogram:
        cumulative, running = [], 0
        for count in self._counts[:-1]:
            running += count
            cumulative.append(running)
        return Histogram(self._bounds, tuple(cumulative), running + self._counts[-1], self._sum)


class Durations:
    """One kind of duration (a request's latency, its wait in the queue): the last
    ``size`` in a window for percentiles, and every one in a histogram for metrics.
    One call records both, for every request."""

    def __init__(self, size: int) -> None:
        self.window = LatencyWindow(size)
        self.histogram = HistogramRecorder()

    def add(self, seconds: float) -> None:
        self.window.add(seconds)
        self.histogram.add(seconds)


class BusyWindow:
    """Busy time of one core over about the last ``SECONDS`` seconds.

    Kept in one-second buckets, so memory stays constant whatever the task rate (a
    list of every task of the last ten seconds held tens of thousands of entries).
    ``opened`` is when the core started serving, on the engine's clock
    (``time.monotonic``); by default, when the window is made, which the engine does
    as it opens.
    """

    SECONDS = 10.0
    _BUCKETS = 10

    def __init__(self, opened: float | None = None) -> None:
        self._opened = time.monotonic() if opened is None else opened
        self._busy = [0.0] * self._BUCKETS
        self._second = [-1] * self._BUCKETS  # which whole second each bucket holds

    def add(self, end: float, busy: float) -> None:
        second = int(end)
        index = second % self._BUCKETS
        if self._second[index] != second:
            self._second[index] = second
            self._busy[index] = 0.0
        self._busy[index] += busy

    def fraction(self, now: float) -> float:
        oldest = int(now) - self._BUCKETS + 1
        busy = sum(
            b for b, second in zip(self._busy, self._second, strict=True) if second >= oldest
        )
        # Divide by the time the window actually covers: in the first SECONDS after
        # opening, a fixed SECONDS would count the time before the core existed as
        # idle (a core busy all of its first 2 s would read 0.2, not 1).
        covered = min(self.SECONDS, now - self._opened)
        if covered <= 0.0:
            return 0.0  # no task can have ended by the moment the core opened
        return min(1.0, busy / covered)


def unopened_statistics(state: str, window: int) -> EngineStatistics:
    """The figures of an engine that never opened: no cores, nothing counted."""
    latency = LatencyWindow(window).summary()
    histogram = HistogramRecorder().snapshot()
    return EngineStatistics(
        state=state,
        submitted=0,
        completed=0,
        failed=0,
        cancelled=0,
        timed_out=0,
        rejected=0,
        queued=0,
        in_flight=0,
        cores=(),
        latency=latency,
        queue_wait=latency,
        latency_histogram=histogram,
        queue_wait_histogram=histogram,
        failures=MappingProxyType(dict.fromkeys(FAILURE_REASONS, 0)),
        stages=None,
        worker=None,
    )
