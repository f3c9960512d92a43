"""What an engine shows of itself in numbers: its statistics, read from its flow and its
device layer (the engine's ``statistics()``)."""

from __future__ import annotations

import time
from types import MappingProxyType

from ._batching import Batcher
from ._device import DeviceLayer
from ._flow import Flow
from ._options import EngineOptions
from ._scheduler import Outcome
from ._slots import CoreLane
from ._statistics import (
    CoreStatistics,
    EngineStatistics,
    StageTimes,
    unopened_statistics,
)

__all__ = ["engine_statistics"]


def engine_statistics(
    state: str,
    flow: Flow | None,
    device: DeviceLayer,
    options: EngineOptions,
    batcher: Batcher | None = None,
) -> EngineStatistics:
    """A snapshot of an engine's counts, per-core figures, latencies and histograms."""
    if flow is None:
        return unopened_statistics(state, options.latency_window)
    scheduler = flow.scheduler
    ended = scheduler.ended
    windows = device.stage_windows
    stages = None if windows is None else StageTimes(*(w.summary() for w in windows))
    now = time.monotonic()
    return EngineStatistics(
        state=state,
        submitted=scheduler.submitted,
        completed=ended[Outcome.COMPLETED],
        failed=ended[Outcome.FAILED],
        cancelled=ended[Outcome.CANCELLED],
        timed_out=ended[Outcome.TIMED_OUT],
        rejected=scheduler.rejected,
        queued=scheduler.queued,
        in_flight=scheduler.in_progress,
        cores=tuple(_core_statistics(core, now) for core in device.lanes),
        latency=flow.latency.window.summary(),
        queue_wait=flow.queue_wait.window.summary(),
        latency_histogram=flow.latency.histogram.snapshot(),
        queue_wait_histogram=flow.queue_wait.histogram.snapshot(),
        failures=MappingProxyType(dict(scheduler.failures)),
        stages=stages,
        worker=device.statistics(),
        batching=None if batcher is None else batcher.statistics(),
    )


def _core_statistics(core: CoreLane, now: float) -> CoreStatistics:
    return CoreStatistics(
        core=core.core,
        completed=core.completed,
        failed=core.failed,
        in_flight=len(core.slots) - len(core.idle),
        busy_slots=len(core.slots) - len(core.idle),
        idle_slots=len(core.idle),
        busy_time=core.busy_time,
        busy_fraction=core.busy_window.fraction(now),
        in_rotation=core.in_rotation,
        consecutive_failures=core.consecutive_failures,
        dla_time=None if core.dla_times is None else core.dla_times.summary(),
        dla_histogram=None if core.dla_histogram is None else core.dla_histogram.snapshot(),
    )
