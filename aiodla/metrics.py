"""Prometheus metrics for aiodla engines (the ``aiodla[metrics]`` extra).

:class:`EngineCollector` is a ``prometheus_client`` collector: on every scrape it
takes ``engine.statistics()`` and ``engine.health()`` of each engine it watches and
turns them into metric families, labelled by the name you gave the engine::

    from prometheus_client import REGISTRY, start_http_server
    from aiodla.metrics import EngineCollector

    async with Engine("detector.bin") as engine:
        REGISTRY.register(EngineCollector({"detector": engine}))
        start_http_server(9464, addr="127.0.0.1")
        ...

Names follow Prometheus conventions and Triton's vocabulary (``nv_inference_*``); every
family carries the label ``engine``:

=========================================  =========  ===================================
name                                       type       labels, meaning
=========================================  =========  ===================================
aiodla_request_success_total               counter    requests that returned a result
aiodla_request_failure_total               counter    ``reason``: task, device, closed,
                                                      dead, other (the failures of
                                                      ``EngineStatistics.failures``),
                                                      timeout, cancelled, rejected
aiodla_request_duration_seconds            histogram  ``infer`` to result, successes
aiodla_queue_duration_seconds              histogram  ``infer`` to getting a DLA slot
aiodla_pending_requests                    gauge      requests waiting for a slot
aiodla_inflight_requests                   gauge      requests holding a slot
aiodla_dla_task_success_total              counter    ``core``: tasks that succeeded
aiodla_dla_task_failure_total              counter    ``core``: tasks with a DLA error
aiodla_dla_task_duration_seconds           histogram  ``core``: measured DLA time per
                                                      task (only with ``stage_times``)
aiodla_core_busy_seconds_total             counter    ``core``: time the core had a task
aiodla_core_busy_ratio                     gauge      ``core``: busy share, last ~10 s
aiodla_core_in_rotation                    gauge      ``core``: 1 serving, 0 out after
                                                      repeated faults
aiodla_engine_health                       gauge      ``status``: 1 for the engine's
                                                      status (ok, degraded, dead,
                                                      closed), 0 for the others
=========================================  =========  ===================================

Each request ends as one success or one failure of one reason, so the two counters
add up to the requests that ended; ``rejected`` counts ``infer_nowait`` calls refused
for a full queue, which were never admitted. Counters restart at zero only with a new
engine under the same name, which Prometheus reads as a counter reset.

Threads: an engine's figures change on its event loop's thread, so a scrape from
another thread (``start_http_server`` serves from its own) reads them on that loop and
waits for the answer at most ``timeout`` seconds; an engine whose loop does not answer
in time is left out of that scrape, with a warning logged. A scrape on the loop's own
thread (an asyncio HTTP handler) reads them at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ._engine import Engine
from ._errors import ConfigurationError
from ._statistics import EngineHealth, EngineStatistics, Histogram

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["FAILURE_REASONS", "HEALTH_STATUSES", "EngineCollector"]

logger = logging.getLogger("aiodla.metrics")

# The reason label of aiodla_request_failure_total: EngineStatistics.failures' causes,
# then the ways a request ends unserved that statistics counts apart.
FAILURE_REASONS = ("task", "device", "closed", "dead", "other", "timeout", "cancelled",
                   "rejected")
HEALTH_STATUSES = ("ok", "degraded", "dead", "closed")

_MISSING_EXTRA = (
    "aiodla.metrics needs prometheus_client, which the 'metrics' extra installs: "
    "pip install 'aiodla[metrics]'"
)


def _client() -> Any:
    """The ``prometheus_client.core`` module, or an ImportError saying how to get it."""
    try:
        from prometheus_client import core
    except ImportError as exc:
        raise ImportError(_MISSING_EXTRA) from exc
    return core


@dataclasses.dataclass(frozen=True)
class _Watched:
    engine: Engine
    loop: asyncio.AbstractEventLoop | None


@dataclasses.dataclass(frozen=True)
class _Reading:
    name: str
    statistics: EngineStatistics
    health: EngineHealth


class EngineCollector:
    """Exposes the statistics and health of engines to a Prometheus registry.

    ``engines`` maps the ``engine`` label to an :class:`aiodla.Engine`; :meth:`add`
    and :meth:`remove` change the set later. Create it, or add engines, from the
    engines' event loop (any coroutine), or pass that loop as ``loop``: scrapes from
    other threads read each engine on its loop. ``timeout`` bounds that wait.
    """

    def __init__(
        self,
        engines: Mapping[str, Engine] | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        timeout: float = 1.0,
    ) -> None:
        _client()
        if not timeout > 0:
            raise ConfigurationError(f"{timeout=} must be > 0 seconds")
        self._timeout = timeout
        self._engines: dict[str, _Watched] = {}
        for name, engine in (engines or {}).items():
            self.add(name, engine, loop=loop)

    @property
    def names(self) -> tuple[str, ...]:
        """The engine labels watched, in the order they were added."""
        return tuple(self._engines)

    def add(
        self, name: str, engine: Engine, *, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        """Watch ``engine`` under the label ``engine=name``.

        ``loop`` is the engine's event loop; by default the loop running this call.
        """
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"engine name {name!r} must be a non-empty string")
        if not isinstance(engine, Engine):
            raise ConfigurationError(
                f"{name!r}: expected an aiodla Engine, got {type(engine).__name__}"
            )
        if name in self._engines:
            raise ConfigurationError(f"an engine named {name!r} is watched already")
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise ConfigurationError(
                    f"add engine {name!r} from its event loop (in a coroutine), or pass "
                    "loop=: scrapes from other threads must read it there"
                ) from None
        self._engines[name] = _Watched(engine, loop)

    def remove(self, name: str) -> None:
        """Stop watching the engine labelled ``name``; its series end."""
        self._engines.pop(name, None)

    # -- the prometheus_client collector protocol ----------------------------------------------

    def describe(self) -> list[Metric]:
        """The families, without samples: registering needs no scrape of the engines."""
        return list(self._families([]))

    def collect(self) -> Iterator[Metric]:
        readings = []
        for name, watched in list(self._engines.items()):
            reading = self._read(name, watched)
            if reading is not None:
                readings.append(reading)
        return self._families(readings)

    # -- reading engines -----------------------------------------------------------------------

    def _read(self, name: str, watched: _Watched) -> _Reading | None:
        engine, loop = watched.engine, watched.loop
        assert loop is not None

        def read() -> _Reading:
            return _Reading(name, engine.statistics(), engine.health())

        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        # Off its loop's thread only while that loop runs can a read race the engine;
        # a stopped or closed loop changes nothing any more.
        if running is loop or not loop.is_running():
            return read()
        answer: concurrent.futures.Future[_Reading] = concurrent.futures.Future()

        def read_on_loop() -> None:
            if not answer.set_running_or_notify_cancel():
                return  # the scrape gave up waiting
            try:
                answer.set_result(read())
            except BaseException as exc:
                answer.set_exception(exc)

        try:
            loop.call_soon_threadsafe(read_on_loop)
        except RuntimeError:  # closed since the check above
            return read()
        try:
            return answer.result(self._timeout)
        except concurrent.futures.TimeoutError:
            answer.cancel()
            logger.warning(
                "aiodla.metrics: engine %r left out of this scrape: its event loop did "
                "not answer within %g s (is it blocked?)", name, self._timeout,
            )
            return None

    # -- building the families ---------------------------------------------------------------

    def _families(self, readings: list[_Reading]) -> Iterator[Metric]:
        core = _client()
        counter, gauge, histogram = (core.CounterMetricFamily, core.GaugeMetricFamily,
                                     core.HistogramMetricFamily)
        engine_label = ["engine"]
        core_labels = ["engine", "core"]

        success = counter("aiodla_request_success", "Requests that returned a result.",
                          labels=engine_label)
        failure = counter(
            "aiodla_request_failure",
            "Requests that ended without a result, by reason: task (the DLA task failed), "
            "device (a cuDLA or CUDA call failed), closed, dead, other, timeout, "
            "cancelled; rejected: infer_nowait refused for a full queue.",
            labels=["engine", "reason"],
        )
        request_duration = histogram(
            "aiodla_request_duration_seconds",
            "Seconds from infer() to its result, for requests that succeeded.",
            labels=engine_label,
        )
        queue_duration = histogram(
            "aiodla_queue_duration_seconds",
            "Seconds from infer() to getting a DLA slot.", labels=engine_label,
        )
        pending = gauge("aiodla_pending_requests", "Requests waiting for a DLA slot.",
                        labels=engine_label)
        inflight = gauge("aiodla_inflight_requests", "Requests holding a DLA slot.",
                         labels=engine_label)
        task_success = counter("aiodla_dla_task_success", "DLA tasks that succeeded.",
                               labels=core_labels)
        task_failure = counter("aiodla_dla_task_failure",
                               "DLA tasks that ended with a DLA error status.",
                               labels=core_labels)
        task_duration = histogram(
            "aiodla_dla_task_duration_seconds",
            "Measured DLA time per task (engines with stage_times=True).", labels=core_labels,
        )
        busy_seconds = counter("aiodla_core_busy_seconds",
                               "Seconds the DLA core had a task running.", labels=core_labels)
        busy_ratio = gauge("aiodla_core_busy_ratio",
                           "Share of about the last 10 s the DLA core was busy, 0 to 1.",
                           labels=core_labels)
        in_rotation = gauge(
            "aiodla_core_in_rotation",
            "1 while the DLA core serves requests, 0 while out of rotation after faults.",
            labels=core_labels,
        )
        health = gauge(
            "aiodla_engine_health",
            "1 for the engine's health status (ok, degraded, dead, closed), 0 for the others.",
            labels=["engine", "status"],
        )

        for reading in readings:
            name, stats = reading.name, reading.statistics
            success.add_metric([name], stats.completed)
            ended = {
                **{reason: stats.failures.get(reason, 0) for reason in FAILURE_REASONS[:5]},
                "timeout": stats.timed_out,
                "cancelled": stats.cancelled,
                "rejected": stats.rejected,
            }
            for reason in FAILURE_REASONS:
                failure.add_metric([name, reason], ended[reason])
            request_duration.add_metric([name], *_buckets(stats.latency_histogram))
            queue_duration.add_metric([name], *_buckets(stats.queue_wait_histogram))
            pending.add_metric([name], stats.queued)
            inflight.add_metric([name], stats.in_flight)
            for figures in stats.cores:
                labels = [name, str(figures.core)]
                task_success.add_metric(labels, figures.completed)
                task_failure.add_metric(labels, figures.failed)
                busy_seconds.add_metric(labels, figures.busy_time)
                busy_ratio.add_metric(labels, figures.busy_fraction)
                in_rotation.add_metric(labels, 1 if figures.in_rotation else 0)
                if figures.dla_histogram is not None:
                    task_duration.add_metric(labels, *_buckets(figures.dla_histogram))
            for status in HEALTH_STATUSES:
                health.add_metric([name, status], 1 if reading.health.status == status else 0)

        yield from (success, failure, request_duration, queue_duration, pending, inflight,
                    task_success, task_failure, task_duration, busy_seconds, busy_ratio,
                    in_rotation, health)


def _buckets(snapshot: Histogram) -> tuple[list[tuple[str, float]], float]:
    """A Histogram snapshot as HistogramMetricFamily takes it: cumulative buckets by
    their upper bound, ``+Inf`` last, and the sum."""
    from prometheus_client import utils

    # Bucket bounds spelled as Go spells floats (1.0, 0.0005), as client libraries do.
    spell: Callable[[float], str] = utils.floatToGoString
    buckets: list[tuple[str, float]] = [
        (spell(bound), count) for bound, count in zip(snapshot.bounds, snapshot.counts, strict=True)
    ]
    buckets.append(("+Inf", snapshot.count))
    return buckets, snapshot.sum
