"""The emulated device's timeline: DLA cores, CUDA streams and events, in exact time.

Each DLA core is a serial resource with its own exact timeline; a stream is a FIFO of
operations, each stamped with the virtual time it completes; effects apply when
somebody looks (see ``_emulated`` for the whole model). :class:`Timeline` owns that
state (cores, device handles, streams, events, a poisoned context), places operations
and serves the stream and event calls; the runtime's other parts (memory, faults,
compute threads, conversion, graphs) are objects that hold it and work on it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from typing import Protocol, cast

from .._errors import ConfigurationError
from ._protocol import CudaCallError


class Gate(Protocol):
    """What holds a core's tasks before they start (the fault layer's ``TaskGate``)."""

    @property
    def released(self) -> bool: ...
    def _arrived(self) -> None: ...


class TaskTiming(Protocol):
    """What the timeline reads of a task's effect (the fault layer's ``_TaskEffect``)."""

    hung: bool
    duration: float


class CallChecks(Protocol):
    """Where a call fails by injection (the fault layer's ``CallFailures``): ``armed``
    is False while none is, so the calls pay one attribute read then."""

    armed: bool

    def check(self, call: str, core: int | None = None) -> None: ...


class Computing(Protocol):
    """What decides when a task whose outputs a compute function still works out has
    outlasted its timeout (the runtime's ``ComputeThreads``)."""

    def expired(self, operation: _Operation, now: float) -> bool: ...


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
    operation also carries ``device`` (its core). ``computing`` is set while a compute
    function works out the task's outputs on the runtime's compute thread: the stream
    stops there, whatever the time, until they are written or it says the task's time
    is up. It is carried here, not held by the timeline, because only such a task needs
    it.
    """

    __slots__ = ("at", "computing", "device", "effect")

    def __init__(self, effect: Callable[[], None], device: _Device | None = None) -> None:
        self.at: float | None = None
        self.effect = effect
        self.device = device
        self.computing: Computing | None = None


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
    """The emulated device's shared state; places stream operations on the cores'
    timelines and applies their effects; the CUDA stream and event calls.

    ``lock`` guards every part of the state; ``placed`` is notified when a held
    operation is placed or a computing one ends, for whoever waits on a stream.
    """

    def __init__(self, cores: int, clock: Callable[[], float], failures: CallChecks) -> None:
        self.clock = clock
        self.failures = failures
        self.cores = [_Core(index) for index in range(cores)]
        self.lock = threading.RLock()
        self.placed = threading.Condition(self.lock)
        self.ids = itertools.count(0x1000)  # every handle of the runtime, never reused
        self.devices: dict[int, _Device] = {}
        self.streams: dict[int, _Stream] = {}
        self.retired: list[_Stream] = []  # destroyed streams whose work still runs
        self.events: dict[int, _Event] = {}
        self.poisoned: CudaCallError | None = None
        self.compute_failures: dict[int, BaseException] = {}  # by stream handle
        self.device_time = 0.0
        """CPU seconds spent doing the emulated device's work (copies, tasks)."""
        self.invalid_releases = 0
        """Releases of handles that were not live (a double release, say): tests check 0."""

    def released(self, call: str) -> None:
        """After a successful release: in a poisoned context, say it failed anyway."""
        if self.poisoned is not None:
            raise CudaCallError(call, self.poisoned.code)

    def bad_release(self, call: str) -> None:
        """A release of a handle that is not live: a double release, or a stray one."""
        self.invalid_releases += 1
        raise CudaCallError(call, _INVALID_HANDLE if call.startswith("destroy") else _INVALID_VALUE)

    def core(self, core: int) -> _Core:
        if not isinstance(core, int) or not 0 <= core < len(self.cores):
            raise ConfigurationError(f"{core=} is not one of the {len(self.cores)} cores")
        return self.cores[core]

    def core_busy_time(self, core: int) -> float:
        """Seconds of task time on the core's timeline."""
        return self.core(core).busy_time

    def core_tasks(self, core: int) -> int:
        """Tasks that finished on ``core`` (as observed so far)."""
        return self.core(core).tasks_completed

    def tasks_in_flight(self, core: int) -> int:
        """Tasks submitted to ``core`` that have not finished (as observed so far)."""
        target = self.core(core)
        with self.lock:
            return sum(d.tasks_in_flight for d in self.devices.values() if d.core is target)

    def cuda(self, call: str) -> None:
        """Every CUDA call starts here: a poisoned context fails them all."""
        if self.poisoned is not None:
            raise CudaCallError(call, self.poisoned.code)
        if self.failures.armed:
            self.failures.check(call)

    def stream(self, stream: int, call: str) -> _Stream:
        try:
            return self.streams[stream]
        except (KeyError, TypeError):
            raise CudaCallError(call, _INVALID_HANDLE) from None

    # -- the timeline ----------------------------------------------------------------------

    def push(self, stream: _Stream, operation: _Operation, duration: float = 0.0) -> None:
        """Append an operation and place it on the timeline unless a held task is ahead."""
        with self.lock:
            stream.operations.append(operation)
            stream.unplaced.append((operation, duration))
            if len(stream.unplaced) == 1:
                self.place(stream, self.clock())

    def place(self, stream: _Stream, now: float) -> None:
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

    def advance(self, stream: _Stream, now: float) -> None:
        """Apply the effects of the stream's operations whose time has come."""
        operations = stream.operations
        if not operations:
            return
        head = operations[0]
        if head.at is None or head.at > now:
            return
        with self.lock:
            began = time.thread_time()
            while operations:
                head = operations[0]
                if head.at is None or head.at > now:
                    break
                computing = head.computing
                if computing is not None and not computing.expired(head, now):
                    break
                operations.popleft()
                head.effect()
                if self.poisoned is not None:  # a fault on the stream: nothing after it runs
                    break
            self.device_time += time.thread_time() - began

    def advance_all(self) -> None:
        now = self.clock()
        with self.lock:
            for stream in (*self.streams.values(), *self.retired):
                self.advance(stream, now)
            self.retired = [s for s in self.retired if s.operations]

    # -- CUDA streams and events ---------------------------------------------------------

    def create_stream(self) -> int:
        self.cuda("create_stream")
        with self.lock:
            handle = next(self.ids)
            self.streams[handle] = _Stream(handle)
            return handle

    def destroy_stream(self, stream: int) -> None:
        # As cudaStreamDestroy: returns at once; queued work still completes.
        with self.lock:
            target = self.streams.pop(stream, None)
            if target is None:
                self.bad_release("destroy_stream")
            elif target.operations:
                self.retired.append(target)
            self.compute_failures.pop(stream, None)
        self.released("destroy_stream")

    def synchronize_stream(self, stream: int) -> None:
        self.cuda("synchronize_stream")
        target = self.stream(stream, "synchronize_stream")
        while True:
            with self.lock:
                if not target.operations:
                    break
                last = target.operations[-1].at
                # Behind a held task (wait for its gate), or a task whose compute
                # function is still running (wait for it to finish).
                if last is None or target.operations[0].computing is not None:
                    self.placed.wait(0.05)
                    continue
            delay = last - self.clock()
            if delay > 0:
                time.sleep(delay)
            self.advance(target, self.clock())
        if self.poisoned is not None:
            raise CudaCallError("synchronize_stream", self.poisoned.code)

    def create_event(self, timing: bool = False) -> int:
        self.cuda("create_event")
        with self.lock:
            handle = next(self.ids)
            self.events[handle] = _Event(handle, timing)
            return handle

    def destroy_event(self, event: int) -> None:
        with self.lock:
            if self.events.pop(event, None) is None:
                self.bad_release("destroy_event")
        self.released("destroy_event")

    def elapsed_time(self, start: int, end: int) -> float:
        self.cuda("elapsed_time")
        first, last = self.events.get(start), self.events.get(end)
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
        self.cuda("record_event")
        target = self.events.get(event)
        if target is None:
            raise CudaCallError("record_event", _INVALID_HANDLE)
        queue = self.stream(stream, "record_event")
        with self.lock:
            target.recorded += 1
            target.stream = queue
            generation = target.recorded

        operation = _Operation(lambda: None)

        def complete() -> None:
            if generation > target.completed:
                target.completed = generation
                target.time = operation.at or 0.0

        operation.effect = complete
        self.push(queue, operation)

    def query_event(self, event: int) -> bool:
        if self.poisoned is not None:
            raise CudaCallError("query_event", self.poisoned.code)
        target = self.events.get(event)
        if target is None:
            raise CudaCallError("query_event", _INVALID_HANDLE)
        if target.completed >= target.recorded:
            return True
        stream = target.stream
        if stream is not None:
            self.advance(stream, self.clock())
            if self.poisoned is not None:  # the advance reached a fault on the stream
                raise CudaCallError("query_event", self.poisoned.code)
        return target.completed >= target.recorded
