"""A DLA core's state and its ring of slots: what the scheduler, the poller and the
flow read and write of the device layer, with no runtime call of their own."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, NamedTuple

from ._core_record import CoreRecord, busy_stated, follow, span
from ._options import EngineOptions
from ._statistics import BusyWindow, HistogramRecorder, LatencyWindow
from .runtime._protocol import Runtime, cudla_status

if TYPE_CHECKING:
    from ._bindings import Read, TensorBinding

__all__ = [
    "DEFAULT_SERVICE_TIME",
    "CompletionProbe",
    "CoreLane",
    "Slot",
    "account",
    "completion_probe",
    "new_core",
    "record_stages",
]

# Until a core has completed tasks, poll as if one task took this long.
DEFAULT_SERVICE_TIME = 0.001


@dataclasses.dataclass(eq=False)
class CoreLane:
    """One engine's lane on DLA core ``core``: its device handle and module there, its
    slots, its model's service-time estimate and the counts its fault policy reads.
    ``record`` is the physical core itself, which every engine on it shares
    (``_core_record``: the tasks it holds and when it should be free)."""

    core: int
    record: CoreRecord = dataclasses.field(default_factory=CoreRecord)
    device: int = 0
    module: int = 0
    slots: list[Slot] = dataclasses.field(default_factory=list)
    idle: collections.deque[Slot] = dataclasses.field(default_factory=collections.deque)
    assigned_total: int = 0  # ties between equally loaded cores go to the less used one
    completed: int = 0
    failed: int = 0
    busy_time: float = 0.0
    service_time: float = DEFAULT_SERVICE_TIME  # estimated seconds per task on this core
    learn_service_time: bool = True  # False when the loadable states it
    # Recent task times as observed: each is the true time plus how late the poller
    # saw it, so the minimum is the estimate. (A mean would grow with the poller's
    # lateness, and the poller would sleep longer the next time: a runaway loop.)
    observed: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=32)
    )
    # Fault policy (the dispatcher's): out of rotation, no request is assigned here;
    # probe tasks test the core.
    in_rotation: bool = True
    consecutive_failures: int = 0
    # Observability.
    busy_window: BusyWindow = dataclasses.field(default_factory=BusyWindow)
    dla_times: LatencyWindow | None = None
    dla_histogram: HistogramRecorder | None = None


@dataclasses.dataclass(eq=False)
class Slot:
    """One (core, stream) pair and everything a request needs on it."""

    core: CoreLane
    index: int
    stream: int
    event: int
    task: Any
    inputs: list[TensorBinding]
    outputs: list[TensorBinding]
    request: Any = None  # the scheduler's Request running here, if any
    submitted_at: float = 0.0
    expected_done: float = 0.0
    # How far the core's timeline is from ``expected_done`` as the poller found it:
    # > 0 when it found the task still running that long after its estimate, < 0 when
    # it found it done that long before, 0 without such evidence (see
    # ``_core_record.follow``).
    behind: float = 0.0
    timing: tuple[int, int, int] | None = None  # events before copy-in, task, copy-out
    probing: bool = False  # the slot runs a probe task for a core out of rotation
    # Device conversion: what each pack kernel reads (pointer, dtype, element strides,
    # the stream to wait for or None), pool memory of device outputs not handed out
    # yet, the device arrays the request's kernels read (released when the slot is),
    # and the event that orders this stream after a device array's producer.
    reads: list[Read] = dataclasses.field(default_factory=list)
    pooled: list[int] = dataclasses.field(default_factory=list)
    keep: tuple[Any, ...] = ()
    ingest_event: int = 0
    # Graphs of the work before and after the task, by kind of request (see _graphs).
    graphs_in: dict[Hashable, Any] = dataclasses.field(default_factory=dict)
    graphs_out: dict[Hashable, Any] = dataclasses.field(default_factory=dict)

    def __repr__(self) -> str:
        return f"<Slot core {self.core.core} #{self.index}>"


def new_core(
    number: int, stated: float | None, options: EngineOptions, record: CoreRecord
) -> CoreLane:
    """An engine's lane on DLA core ``number`` (whose record is ``record``), before
    anything is opened on it: its service time as the loadable states it (else
    learned), its stage-time windows if asked for."""
    core = CoreLane(
        number,
        record,
        service_time=DEFAULT_SERVICE_TIME if stated is None else stated,
        learn_service_time=stated is None,
    )
    if options.stage_times:
        core.dla_times = LatencyWindow(options.latency_window)
        core.dla_histogram = HistogramRecorder()
    return core


class CompletionProbe(NamedTuple):
    """The three runtime calls the poller thread makes, handed to it by the device layer."""

    make_current: Callable[[], None]
    event_done: Callable[[int], bool]
    core_status: Callable[[int], int]


def completion_probe(runtime: Runtime) -> CompletionProbe:
    """What the poller needs of ``runtime``: a status that cannot be read is reported
    as a failed task (-1 when it names no cuDLA status)."""
    get_last_error = runtime.get_last_error

    def core_status(device: int) -> int:
        try:
            return get_last_error(device)
        except Exception as exc:
            return cudla_status(exc) or -1

    return CompletionProbe(runtime.make_current, runtime.query_event, core_status)


def account(slot: Slot, status: int, now: float) -> None:
    """Count one finished DLA task: the core's busy time and its service-time estimate
    (the fault policy is the dispatcher's)."""
    core = slot.core
    elapsed, spanned = span(slot, now)
    if slot.behind:
        follow(slot)
    # The bounds of a task's span are the physical core's, over every engine on it: an
    # engine's own last completion would count the other engines' tasks as its own.
    if core.learn_service_time:
        busy = elapsed if spanned else core.service_time
    else:
        busy = busy_stated(slot, now)
    core.busy_time += busy
    core.busy_window.add(now, busy)
    if status:
        core.failed += 1
        return
    core.completed += 1
    if core.learn_service_time and spanned:
        core.observed.append(elapsed)
        core.service_time = min(core.observed)


def record_stages(
    slot: Slot,
    stages: tuple[float, float, float],
    windows: tuple[LatencyWindow, ...] | None,
) -> None:
    """Copy-in, DLA and copy-out seconds of ``slot``'s task, into the windows."""
    if windows is not None:
        for window, seconds in zip(windows, stages, strict=True):
            window.add(seconds)
    core = slot.core
    if core.dla_times is not None and core.dla_histogram is not None:
        core.dla_times.add(stages[1])
        core.dla_histogram.add(stages[1])
