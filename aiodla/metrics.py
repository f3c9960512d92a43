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
aiodla_stage_duration_seconds              gauge      ``stage`` (copy_in, compute,
                                                      copy_out), ``quantile`` (0.5,
                                                      0.9, 0.99): recent requests'
                                                      device time per stage (only with
                                                      ``stage_times``)
aiodla_dla_task_success_total              counter    ``core``: tasks that succeeded
aiodla_dla_task_failure_total              counter    ``core``: tasks with a DLA error
aiodla_dla_task_duration_seconds           histogram  ``core``: measured DLA time per
                                                      task (only with ``stage_times``)
aiodla_core_busy_seconds_total             counter    ``core``: time the core had a task
aiodla_core_busy_ratio                     gauge      ``core``: busy share of the last
                                                      10 s (of the time since the engine
                                                      opened, until 10 s have passed)
aiodla_core_in_rotation                    gauge      ``core``: 1 serving, 0 out after
                                                      repeated faults
aiodla_engine_health                       gauge      ``status``: 1 for the engine's
                                                      status (ok, degraded, dead,
                                                      closed), 0 for the others
aiodla_batch_items_total                   counter    ``outcome``: single items of an
                                                      ``Engine(batch=...)`` by how they
                                                      ended (completed, failed,
                                                      cancelled, timed_out)
aiodla_batch_size                          histogram  items per assembled task (buckets
                                                      1 to the model's batch N)
=========================================  =========  ===================================

``EngineCollector(..., naming="triton")`` exports instead the per-model families of
NVIDIA Triton Inference Server, so dashboards and alerts written for Triton read aiodla
unchanged; the engine's name is the label ``model`` and ``version`` is given to
:meth:`~EngineCollector.add` (``"1"`` by default):

=========================================  =========  ===================================
nv_inference_request_success               counter    requests that returned a result
nv_inference_request_failure               counter    requests that ended without one
                                                      (every reason above, rejected
                                                      included, as Triton counts them)
nv_inference_count                         counter    inferences performed
nv_inference_exec_count                    counter    executions (DLA tasks): equal to
                                                      the successes, and to the
                                                      inferences unless the engine
                                                      assembles items (``batch=``):
                                                      then the inferences are its
                                                      completed items
nv_inference_request_duration_us           counter    cumulative microseconds from
                                                      ``infer`` to result, successes
nv_inference_queue_duration_us             counter    cumulative microseconds waiting
                                                      for a DLA slot
nv_inference_compute_infer_duration_us     counter    cumulative microseconds of DLA
                                                      time: measured with
                                                      ``stage_times``, else the cores'
                                                      busy time
nv_inference_pending_request_count         gauge      requests waiting for a slot
=========================================  =========  ===================================

:class:`VideoSourceCollector` does the same for video sources
(:class:`aiodla.VideoSource`), every family labelled ``source`` (the source's name: its
URI without credentials)::

    REGISTRY.register(VideoSourceCollector([camera1, camera2]))

=========================================  =========  ===================================
aiodla_video_frames_decoded_total          counter    frames out of the decoder
aiodla_video_frames_delivered_total        counter    frames handed to the application
aiodla_video_frames_dropped_total          counter    frames a newer one replaced unread
aiodla_video_decode_errors_total           counter    packets the decoder could not decode
aiodla_video_reconnects_total              counter    re-openings after a loss
aiodla_video_frame_rate                    gauge      decoded frames a second (last 2 s)
aiodla_video_decode_cpu_seconds_total      counter    the reader thread's CPU seconds
aiodla_video_source_state                  gauge      ``state``: 1 for the source's state
                                                      (connecting, streaming,
                                                      reconnecting, ended, failed,
                                                      closed), 0 for the others
aiodla_video_source_info                   gauge      1, with ``decoder`` and ``codec``
=========================================  =========  ===================================

Triton's counters are written as Triton writes them, without ``_total``; prometheus_client
appends ``_total`` to every sample of a family typed counter, so these counters go out
untyped (``rate()`` and ``increase()`` read them the same).

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
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ._engine import Engine
from ._errors import ConfigurationError
from ._statistics import (
    FAILURE_REASONS,
    BatchStatistics,
    EngineHealth,
    EngineStatistics,
    Histogram,
    LatencySummary,
)
from ._video_source import VideoSource, VideoSourceState

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = [
    "HEALTH_STATUSES",
    "NAMINGS",
    "REQUEST_FAILURE_REASONS",
    "STAGES",
    "STAGE_QUANTILES",
    "EngineCollector",
    "VideoSourceCollector",
]

logger = logging.getLogger("aiodla.metrics")

# The reason label of aiodla_request_failure_total: EngineStatistics.failures' causes,
# then the ways a request ends unserved that statistics counts apart.
REQUEST_FAILURE_REASONS = (*FAILURE_REASONS, "timeout", "cancelled", "rejected")
HEALTH_STATUSES = ("ok", "degraded", "restarting", "dead", "closed")
NAMINGS = ("aiodla", "triton")
# The stage label of aiodla_stage_duration_seconds, in the order a request passes them;
# "compute" is StageTimes.dla, Triton's word for it.
STAGES = ("copy_in", "compute", "copy_out")
# The quantiles a LatencySummary holds, spelled as a Prometheus summary labels them.
STAGE_QUANTILES = ("0.5", "0.9", "0.99")
_MICROSECONDS = 1e6

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
    version: str


@dataclasses.dataclass(frozen=True)
class _Reading:
    name: str
    version: str
    statistics: EngineStatistics
    health: EngineHealth


class EngineCollector:
    """Exposes the statistics and health of engines to a Prometheus registry.

    ``engines`` maps the ``engine`` label to an :class:`aiodla.Engine`; :meth:`add`
    and :meth:`remove` change the set later. Create it, or add engines, from the
    engines' event loop (any coroutine), or pass that loop as ``loop``: scrapes from
    other threads read each engine on its loop. ``timeout`` bounds that wait.
    ``naming`` picks the families: ``"aiodla"`` (all of the engine's figures) or
    ``"triton"`` (Triton's per-model families, for dashboards written for Triton).
    """

    def __init__(
        self,
        engines: Mapping[str, Engine] | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        timeout: float = 1.0,
        naming: str = "aiodla",
    ) -> None:
        _client()
        if not timeout > 0:
            raise ConfigurationError(f"{timeout=} must be > 0 seconds")
        if naming not in NAMINGS:
            raise ConfigurationError(f"{naming=} must be one of {', '.join(NAMINGS)}")
        self._timeout = timeout
        self._naming = naming
        self._engines: dict[str, _Watched] = {}
        for name, engine in (engines or {}).items():
            self.add(name, engine, loop=loop)

    @property
    def names(self) -> tuple[str, ...]:
        """The engine labels watched, in the order they were added."""
        return tuple(self._engines)

    @property
    def naming(self) -> str:
        """``"aiodla"`` or ``"triton"``: which families a scrape gets."""
        return self._naming

    def add(
        self,
        name: str,
        engine: Engine,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        version: str = "1",
    ) -> None:
        """Watch ``engine`` under the label ``engine=name`` (``model=name`` with
        Triton's naming).

        ``loop`` is the engine's event loop; by default the loop running this call.
        ``version`` is the label ``version`` of Triton's naming (the aiodla naming has
        none).
        """
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"engine name {name!r} must be a non-empty string")
        if not isinstance(version, str) or not version:
            raise ConfigurationError(f"{version=} must be a non-empty string")
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
        self._engines[name] = _Watched(engine, loop, version)

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
            return _Reading(name, watched.version, engine.statistics(), engine.health())

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
                "not answer within %g s (is it blocked?)",
                name,
                self._timeout,
            )
            return None

    # -- building the families ---------------------------------------------------------------

    def _families(self, readings: list[_Reading]) -> Iterator[Metric]:
        if self._naming == "triton":
            return _triton_families(readings)
        return _aiodla_families(readings)


def _aiodla_families(readings: list[_Reading]) -> Iterator[Metric]:
    core = _client()
    counter, gauge, histogram = (
        core.CounterMetricFamily,
        core.GaugeMetricFamily,
        core.HistogramMetricFamily,
    )
    engine_label = ["engine"]
    core_labels = ["engine", "core"]

    success = counter(
        "aiodla_request_success", "Requests that returned a result.", labels=engine_label
    )
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
        "Seconds from infer() to getting a DLA slot.",
        labels=engine_label,
    )
    pending = gauge(
        "aiodla_pending_requests", "Requests waiting for a DLA slot.", labels=engine_label
    )
    inflight = gauge(
        "aiodla_inflight_requests", "Requests holding a DLA slot.", labels=engine_label
    )
    stage_duration = gauge(
        "aiodla_stage_duration_seconds",
        "Device seconds per request in each stage (copy_in, compute, copy_out), quantiles "
        "over the recent requests (engines with stage_times=True).",
        labels=["engine", "stage", "quantile"],
    )
    task_success = counter(
        "aiodla_dla_task_success", "DLA tasks that succeeded.", labels=core_labels
    )
    task_failure = counter(
        "aiodla_dla_task_failure",
        "DLA tasks that ended with a DLA error status.",
        labels=core_labels,
    )
    task_duration = histogram(
        "aiodla_dla_task_duration_seconds",
        "Measured DLA time per task (engines with stage_times=True).",
        labels=core_labels,
    )
    busy_seconds = counter(
        "aiodla_core_busy_seconds", "Seconds the DLA core had a task running.", labels=core_labels
    )
    busy_ratio = gauge(
        "aiodla_core_busy_ratio",
        "Share of the last 10 s (of the time since the engine opened, before that) the "
        "DLA core was busy, 0 to 1.",
        labels=core_labels,
    )
    in_rotation = gauge(
        "aiodla_core_in_rotation",
        "1 while the DLA core serves requests, 0 while out of rotation after faults.",
        labels=core_labels,
    )
    batch_items = counter(
        "aiodla_batch_items",
        "Single items of engines that assemble batches, by how they ended.",
        labels=["engine", "outcome"],
    )
    batch_size = histogram(
        "aiodla_batch_size", "Items per assembled task (batch size).", labels=engine_label
    )
    health = gauge(
        "aiodla_engine_health",
        "1 for the engine's health status (ok, degraded, dead, closed), 0 for the others.",
        labels=["engine", "status"],
    )

    for reading in readings:
        name, stats = reading.name, reading.statistics
        success.add_metric([name], stats.completed)
        for reason, count in _failures_by_reason(stats).items():
            failure.add_metric([name, reason], count)
        request_duration.add_metric([name], *_buckets(stats.latency_histogram))
        queue_duration.add_metric([name], *_buckets(stats.queue_wait_histogram))
        pending.add_metric([name], stats.queued)
        inflight.add_metric([name], stats.in_flight)
        if stats.stages is not None:
            by_stage = dict(
                zip(
                    STAGES,
                    (stats.stages.copy_in, stats.stages.dla, stats.stages.copy_out),
                    strict=True,
                )
            )
            for stage, summary in by_stage.items():
                for quantile, value in _quantiles(summary):
                    stage_duration.add_metric([name, stage, quantile], value)
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
        batched = stats.batching
        if batched is not None:
            for outcome in ("completed", "failed", "cancelled", "timed_out"):
                batch_items.add_metric([name, outcome], getattr(batched, outcome))
            batch_size.add_metric([name], *_size_buckets(batched))

    yield from (
        success,
        failure,
        request_duration,
        queue_duration,
        pending,
        inflight,
        stage_duration,
        task_success,
        task_failure,
        task_duration,
        busy_seconds,
        busy_ratio,
        in_rotation,
        health,
        batch_items,
        batch_size,
    )


def _triton_families(readings: list[_Reading]) -> Iterator[Metric]:
    core = _client()
    labels = ["model", "version"]

    def cumulative(name: str, documentation: str) -> Any:
        # Untyped, not counter: prometheus_client would write a counter's samples as
        # name_total, and Triton's series (what its dashboards query) have no _total.
        return core.UntypedMetricFamily(name, documentation, labels=labels)

    success = cumulative(
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes (cumulative).",
    )
    failure = cumulative(
        "nv_inference_request_failure",
        "Number of failed inference requests, all batch sizes (cumulative): DLA or device "
        "errors, closed or dead engine, timeouts, cancellations, rejections.",
    )
    inferences = cumulative(
        "nv_inference_count",
        "Number of inferences performed (cumulative; one per request on the DLA).",
    )
    executions = cumulative(
        "nv_inference_exec_count",
        "Number of model executions performed (cumulative; one per request on the DLA).",
    )
    request_duration = cumulative(
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds, successful requests.",
    )
    queue_duration = cumulative(
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds (waiting for a DLA slot).",
    )
    compute_duration = cumulative(
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds: measured DLA time with "
        "stage_times=True, else the DLA cores' busy time.",
    )
    pending = core.GaugeMetricFamily(
        "nv_inference_pending_request_count",
        "Instantaneous number of pending requests awaiting execution (a DLA slot).",
        labels=labels,
    )

    for reading in readings:
        model, stats = [reading.name, reading.version], reading.statistics
        success.add_metric(model, stats.completed)
        failure.add_metric(model, sum(_failures_by_reason(stats).values()))
        # One request is one DLA task, so, as Triton says of models without batching,
        # inferences = executions = successes; an engine that assembles items counts
        # its completed items as inferences.
        batched = stats.batching
        inferences.add_metric(model, stats.completed if batched is None else batched.completed)
        executions.add_metric(model, stats.completed)
        request_duration.add_metric(model, stats.latency_histogram.sum * _MICROSECONDS)
        queue_duration.add_metric(model, stats.queue_wait_histogram.sum * _MICROSECONDS)
        measured = [c.dla_histogram.sum for c in stats.cores if c.dla_histogram is not None]
        compute = sum(measured) if measured else sum(c.busy_time for c in stats.cores)
        compute_duration.add_metric(model, compute * _MICROSECONDS)
        pending.add_metric(model, stats.queued)

    yield from (
        success,
        failure,
        inferences,
        executions,
        request_duration,
        queue_duration,
        compute_duration,
        pending,
    )


def _failures_by_reason(stats: EngineStatistics) -> dict[str, int]:
    """Requests that ended without a result, for each of REQUEST_FAILURE_REASONS."""
    ended = {reason: stats.failures.get(reason, 0) for reason in FAILURE_REASONS}
    ended["timeout"] = stats.timed_out
    ended["cancelled"] = stats.cancelled
    ended["rejected"] = stats.rejected
    return ended


def _quantiles(summary: LatencySummary) -> list[tuple[str, float]]:
    """(quantile label, seconds) of a summary; none for an empty window, whose zeros
    would read as instant stages."""
    if not summary.count:
        return []
    return list(zip(STAGE_QUANTILES, (summary.p50, summary.p90, summary.p99), strict=True))


def _size_buckets(stats: BatchStatistics) -> tuple[list[tuple[str, float]], float]:
    """The batch-size histogram: cumulative tasks by items per task, 1 to N."""
    buckets: list[tuple[str, float]] = []
    total = 0
    for size in range(1, stats.batch + 1):
        total += stats.sizes.get(size, 0)
        buckets.append((f"{size}.0", total))
    buckets.append(("+Inf", total))
    return buckets, sum(size * count for size, count in stats.sizes.items())


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


class VideoSourceCollector:
    """Exposes the statistics of video sources to a Prometheus registry, labelled by
    each source's name (see the table above). ``add`` and ``remove`` change the set.

    A source's figures are read whole from any thread, so a scrape does not go through
    the sources' event loop.
    """

    def __init__(self, sources: Iterable[VideoSource] = ()) -> None:
        _client()
        self._sources: dict[str, VideoSource] = {}
        for source in sources:
            self.add(source)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._sources)

    def add(self, source: VideoSource) -> None:
        """Watch ``source`` under ``source=source.name``."""
        if not isinstance(source, VideoSource):
            raise ConfigurationError(f"expected an aiodla VideoSource, got {type(source).__name__}")
        if source.name in self._sources:
            raise ConfigurationError(f"a video source named {source.name!r} is watched already")
        self._sources[source.name] = source

    def remove(self, name: str) -> None:
        self._sources.pop(name, None)

    def describe(self) -> list[Metric]:
        return list(_video_families([]))

    def collect(self) -> Iterator[Metric]:
        return _video_families([source.statistics() for source in list(self._sources.values())])


def _video_families(readings: list[Any]) -> Iterator[Metric]:
    core = _client()
    counter, gauge = core.CounterMetricFamily, core.GaugeMetricFamily
    label = ["source"]
    counts = [
        ("aiodla_video_frames_decoded", "Frames out of the decoder.", "decoded"),
        ("aiodla_video_frames_delivered", "Frames handed to the application.", "delivered"),
        ("aiodla_video_frames_dropped", "Frames a newer frame replaced unread.", "dropped"),
        ("aiodla_video_decode_errors", "Packets the decoder could not decode.", "decode_errors"),
        ("aiodla_video_reconnects", "Re-openings of the source after a loss.", "reconnects"),
        (
            "aiodla_video_decode_cpu_seconds",
            "CPU seconds of the source's reader thread.",
            "decode_cpu",
        ),
    ]
    for name, documentation, field in counts:
        family = counter(name, documentation, labels=label)
        for stats in readings:
            family.add_metric([stats.name], getattr(stats, field))
        yield family
    rate = gauge(
        "aiodla_video_frame_rate", "Decoded frames a second over the last 2 s.", labels=label
    )
    for stats in readings:
        rate.add_metric([stats.name], stats.fps)
    yield rate
    state = gauge(
        "aiodla_video_source_state",
        "1 for the source's state, 0 for the others.",
        labels=["source", "state"],
    )
    for stats in readings:
        for each in VideoSourceState:
            state.add_metric([stats.name, each.value], float(stats.state == each.value))
    yield state
    info = gauge(
        "aiodla_video_source_info",
        "The source's decoder and codec.",
        labels=["source", "decoder", "codec"],
    )
    for stats in readings:
        info.add_metric([stats.name, stats.decoder, stats.codec or ""], 1.0)
    yield info
