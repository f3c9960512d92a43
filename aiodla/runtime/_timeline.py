"""The emulated device's timeline: DLA cores, CUDA streams and events, in exact time.

Each DLA core is a serial resource with its own exact timeline; a stream is a FIFO of
operations, each stamped with the virtual time it completes; effects apply when
somebody looks (see ``_emulated`` for the whole model). :class:`Timeline` holds the
placement and the stream and event calls; the fault layer and the runtime build on it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol, cast

from .._errors import ConfigurationError
from ._protocol import CudaCallError

if TYPE_CHECKING:
    import threading


class Gate(Protocol):
    """What holds a core's tasks before they start (the fault layer's ``TaskGate``)."""

    @property
    def released(self) -> bool: ...
    def _arrived(self) -> None: ...


class TaskTiming(Protocol):
    """What the timeline reads of a task's effect (the fault layer's ``_TaskEffect``)."""

    hung: bool
    duration: float


DEFAULT_TASK_TIMEOUT = 30.0  # seconds, cuDLA's default
# cudaError_t values the emulator raises.
_INVALID_VALUE = 1
_INVALID_HANDLE = 400
_NOT_READY = 600


@dataclasses.dataclass(eq=False)
class _Core:
    index: int
    free_at: float = 0.0
    busy_time: float = 0.0
    tasks_started: int = 0
    tasks_completed: int = 0
    hung: bool = False
    # injected task failures: (cudlaStatus, surfaces as a sticky error on the stream)
    failures: collections.deque[tuple[int, bool]] = dataclasses.field(
        default_factory=collections.deque
    )
    gate: Gate | None = None
    # Streams stopped at a task of this held core, in the order those tasks came.
    blocked: collections.deque[_Stream] = dataclasses.field(default_factory=collections.deque)
    handles: int = 0


@dataclasses.dataclass(eq=False)
class _Device:
    handle: int
    core: _Core
    module: int | None = None
    registrations: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    last_error: int = 0
    tasks_in_flight: int = 0
    timeout: float = DEFAULT_TASK_TIMEOUT


@dataclasses.dataclass(eq=False)
class _Event:
    handle: int
    timing: bool = False
    recorded: int = 0
    completed: int = 0
    stream: _Stream | None = None
    time: float = 0.0  # the emulated time the stream reached the last completed record


class _Operation:
    """One stream operation: the virtual time it completes at, and its effect.

    ``at`` is None while the operation waits behind a task of a held core. A task's
    operation also carries ``device`` (its core). ``computing`` is True while a
    compute function works out the task's outputs on the runtime's compute thread:
    the stream stops there, whatever the time, until they are written.
    """

    __slots__ = ("at", "computing", "device", "effect")

    def __init__(self, effect: Callable[[], None], device: _Device | None = None) -> None:
        self.at: float | None = None
        self.effect = effect
        self.device = device
        self.computing = False


class _Stream:
    """A FIFO of operations with its own position on the emulated timeline."""

    __slots__ = ("clock", "handle", "operations", "unplaced")

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.clock = 0.0  # when the last placed operation completes
        self.operations: collections.deque[_Operation] = collections.deque()
        # The tail of ``operations`` not on the timeline yet: a held task and what
        # follows it. Usually empty.
        self.unplaced: collections.deque[tuple[_Operation, float]] = collections.deque()


class Timeline:
    """Places stream operations on the cores' timelines and applies their effects;
    the CUDA stream and event calls. The state is created by the runtime's
    ``__init__``; the fault layer overrides :meth:`_check_injected`."""

    _clock: Callable[[], float]
    _cores: list[_Core]
    _lock: threading.RLock
    _placed: threading.Condition
    _ids: Iterator[int]
    _streams: dict[int, _Stream]
    _retired: list[_Stream]
    _events: dict[int, _Event]
    _poisoned: CudaCallError | None
    _compute_failures: dict[int, BaseException]
    device_time: float
    invalid_releases: int

    def _released(self, call: str) -> None:
        """After a successful release: in a poisoned context, say it failed anyway."""
        if self._poisoned is not None:
            raise CudaCallError(call, self._poisoned.code)

    def _bad_release(self, call: str) -> None:
        """A release of a handle that is not live: a double release, or a stray one."""
        self.invalid_releases += 1
        raise CudaCallError(call, _INVALID_HANDLE if call.startswith("destroy") else _INVALID_VALUE)

    def _core(self, core: int) -> _Core:
        if not isinstance(core, int) or not 0 <= core < len(self._cores):
            raise ConfigurationError(f"{core=} is not one of the {len(self._cores)} cores")
        return self._cores[core]

    def core_busy_time(self, core: int) -> float:
        """Seconds of task time on the core's timeline."""
        return self._core(core).busy_time

    def core_tasks(self, core: int) -> int:
        """Tasks that finished on ``core`` (as observed so far)."""
        return self._core(core).tasks_completed

    def _check_injected(self, call: str, core: int | None = None) -> None:
        """Where an injected failure of ``call`` would raise; none at this layer."""

    def _cuda(self, call: str) -> None:
        """Every CUDA call starts here: a poisoned context fails them all."""
        if self._poisoned is not None:
            raise CudaCallError(call, self._poisoned.code)
        self._check_injected(call)

    def _stream(self, stream: int, call: str) -> _Stream:
        try:
            return self._streams[stream]
        except (KeyError, TypeError):
            raise CudaCallError(call, _INVALID_HANDLE) from None

    # -- the timeline ----------------------------------------------------------------------

    def _push(self, stream: _Stream, operation: _Operation, duration: float = 0.0) -> None:
        """Append an operation and place it on the timeline unless a held task is ahead."""
        with self._lock:
            stream.operations.append(operation)
            stream.unplaced.append((operation, duration))
            if len(stream.unplaced) == 1:
                self._place(stream, self._clock())

    def _place(self, stream: _Stream, now: float) -> None:
        """Stamp the stream's unplaced operations with completion times, in order,
        until one is a task of a held core (that stream then waits for the gate)."""
        unplaced = stream.unplaced
        while unplaced:
            operation, duration = unplaced[0]
            device = operation.device
            if device is None:
                stream.clock = max(stream.clock, now) + duration
            else:
                if device.core.gate is not None:
                    device.core.blocked.append(stream)
                    return
                self._start_task(operation, device, stream, now)
            operation.at = stream.clock
            unplaced.popleft()

    def _start_task(
        self, operation: _Operation, device: _Device, stream: _Stream, now: float
    ) -> None:
        core = device.core
        start = max(core.free_at, stream.clock, now)
        # Only a task's operation has a device, and its effect always has a timing.
        effect = cast("TaskTiming", operation.effect)
        duration = device.timeout if effect.hung else effect.duration
        core.tasks_started += 1
        core.busy_time += duration
        core.free_at = stream.clock = start + duration

    def _advance(self, stream: _Stream, now: float) -> None:
        """Apply the effects of the stream's operations whose time has come."""
        operations = stream.operations
        if not operations:
            return
        head = operations[0]
        if head.at is None or head.at > now:
            return
        with self._lock:
            began = time.thread_time()
            while operations:
                head = operations[0]
                if head.at is None or head.at > now:
                    break
                if head.computing and not self._compute_expired(head, now):
                    break
                operations.popleft()
                head.effect()
                if self._poisoned is not None:  # a fault on the stream: nothing after it runs
                    break
            self.device_time += time.thread_time() - began

    def _compute_expired(self, operation: _Operation, now: float) -> bool:
        """(Lock held) Whether a task whose compute function still runs has outlasted
        its task timeout, and so ends now (the compute layer decides)."""
        return False

    def _advance_all(self) -> None:
        now = self._clock()
        with self._lock:
            for stream in (*self._streams.values(), *self._retired):
                self._advance(stream, now)
            self._retired = [s for s in self._retired if s.operations]

    # -- CUDA streams and events ---------------------------------------------------------

    def create_stream(self) -> int:
        self._cuda("create_stream")
        with self._lock:
            handle = next(self._ids)
            self._streams[handle] = _Stream(handle)
            return handle

    def destroy_stream(self, stream: int) -> None:
        # As cudaStreamDestroy: returns at once; queued work still completes.
        with self._lock:
            target = self._streams.pop(stream, None)
            if target is None:
                self._bad_release("destroy_stream")
            elif target.operations:
                self._retired.append(target)
            self._compute_failures.pop(stream, None)
        self._released("destroy_stream")

    def synchronize_stream(self, stream: int) -> None:
        self._cuda("synchronize_stream")
        target = self._stream(stream, "synchronize_stream")
        while True:
            with self._lock:
                if not target.operations:
                    break
                last = target.operations[-1].at
                # Behind a held task (wait for its gate), or a task whose compute
                # function is still running (wait for it to finish).
                if last is None or target.operations[0].computing:
                    self._placed.wait(0.05)
                    continue
            delay = last - self._clock()
            if delay > 0:
                time.sleep(delay)
            self._advance(target, self._clock())
        if self._poisoned is not None:
            raise CudaCallError("synchronize_stream", self._poisoned.code)

    def create_event(self, timing: bool = False) -> int:
        self._cuda("create_event")
        with self._lock:
            handle = next(self._ids)
            self._events[handle] = _Event(handle, timing)
            return handle

    def destroy_event(self, event: int) -> None:
        with self._lock:
            if self._events.pop(event, None) is None:
                self._bad_release("destroy_event")
        self._released("destroy_event")

    def elapsed_time(self, start: int, end: int) -> float:
        self._cuda("elapsed_time")
        first, last = self._events.get(start), self._events.get(end)
        if first is None or last is None or not (first.timing and last.timing):
            raise CudaCallError("elapsed_time", _INVALID_HANDLE)
        if (
            first.completed < first.recorded
            or last.completed < last.recorded
            or not (first.recorded and last.recorded)
        ):
            raise CudaCallError("elapsed_time", _NOT_READY)
        return last.time - first.time

    def record_event(self, event: int, stream: int) -> None:
        self._cuda("record_event")
        target = self._events.get(event)
        if target is None:
            raise CudaCallError("record_event", _INVALID_HANDLE)
        queue = self._stream(stream, "record_event")
        with self._lock:
            target.recorded += 1
            target.stream = queue
            generation = target.recorded

        operation = _Operation(lambda: None)

        def complete() -> None:
            if generation > target.completed:
                target.completed = generation
                target.time = operation.at or 0.0

        operation.effect = complete
        self._push(queue, operation)

    def query_event(self, event: int) -> bool:
        if self._poisoned is not None:
            raise CudaCallError("query_event", self._poisoned.code)
        target = self._events.get(event)
        if target is None:
            raise CudaCallError("query_event", _INVALID_HANDLE)
        if target.completed >= target.recorded:
            return True
        stream = target.stream
        if stream is not None:
            self._advance(stream, self._clock())
            if self._poisoned is not None:  # the advance reached a fault on the stream
                raise CudaCallError("query_event", self._poisoned.code)
        return target.completed >= target.recorded
