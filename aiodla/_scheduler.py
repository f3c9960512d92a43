"""Who runs next, and where: requests, slots and the scheduling policy.

A *slot* is one (DLA core, CUDA stream) pair with its own buffers, prebuilt task and
event. A *request* is one ``infer`` call. The scheduler pairs them: FIFO among waiting
requests, and the core with the least outstanding work among cores that have an idle
slot. It does no device work itself; the engine performs each assignment.

Only the event loop's thread touches this state.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
from typing import Any

from ._layout import BoundTensor
from ._statistics import BusyWindow, HistogramRecorder, LatencyWindow
from ._tensors import TensorSpec
from .runtime._protocol import HostBuffer

__all__ = ["CoreState", "Request", "RequestState", "Scheduler", "Slot", "TensorBinding"]


class RequestState(enum.Enum):
    QUEUED = "queued"  # waiting for a slot
    PACKING = "packing"  # granted a slot; its coroutine packs the input off the loop
    IN_FLIGHT = "in flight"  # enqueued on a stream
    UNPACKING = "unpacking"  # done on the device; its coroutine unpacks off the loop
    DONE = "done"  # result, error, cancellation or timeout delivered


class Request:
    """One ``infer`` call on its way through the engine."""

    __slots__ = ("arrays", "deadline", "future", "slot", "started", "state", "timer")

    def __init__(
        self, arrays: tuple[Any, ...], future: asyncio.Future[Any], started: float
    ) -> None:
        self.arrays = arrays
        self.future = future
        self.started = started
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.state = RequestState.QUEUED
        self.slot: Slot | None = None


@dataclasses.dataclass(eq=False)
class TensorBinding:
    """One tensor of one slot: its spec, device buffer, DLA registration and host buffer
    (``bound``: the host buffer's layout views, computed once)."""

    spec: TensorSpec
    device_ptr: int
    registered: int
    host: HostBuffer
    bound: BoundTensor


@dataclasses.dataclass(eq=False)
class CoreState:
    """One DLA core: its device handle, slots and the counts the policy reads."""

    core: int
    device: int = 0
    module: int = 0
    slots: list[Slot] = dataclasses.field(default_factory=list)
    idle: collections.deque[Slot] = dataclasses.field(default_factory=collections.deque)
    outstanding: int = 0  # slots assigned: packing, in flight or unpacking
    assigned_total: int = 0  # ties between equally loaded cores go to the less used one
    completed: int = 0
    failed: int = 0
    busy_time: float = 0.0
    last_completion: float = 0.0
    expected_free: float = 0.0  # when the core should finish what it has (poller back-off)
    service_time: float = 0.001  # estimated seconds per task on this core
    learn_service_time: bool = True  # False when the loadable states it
    # Recent task times as observed: each is the true time plus how late the poller
    # saw it, so the minimum is the estimate. (A mean would grow with the poller's
    # lateness, and the poller would sleep longer the next time: a runaway loop.)
    observed: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=32)
    )
    # Fault policy: out of rotation, no request is assigned here; probes test the core.
    in_rotation: bool = True
    consecutive_failures: int = 0
    probe: asyncio.TimerHandle | None = None
    # Observability.
    busy_window: BusyWindow = dataclasses.field(default_factory=BusyWindow)
    dla_times: LatencyWindow | None = None
    dla_histogram: HistogramRecorder | None = None


@dataclasses.dataclass(eq=False)
class Slot:
    """One (core, stream) pair and everything a request needs on it."""

    core: CoreState
    index: int
    stream: int
    event: int
    task: Any
    inputs: list[TensorBinding]
    outputs: list[TensorBinding]
    request: Request | None = None
    submitted_at: float = 0.0
    expected_done: float = 0.0
    timing: tuple[int, int, int] | None = None  # events before copy-in, task, copy-out
    probing: bool = False  # the slot runs a probe task for a core out of rotation

    def __repr__(self) -> str:
        return f"<Slot core {self.core.core} #{self.index}>"


class Scheduler:
    """The waiting line and the idle slots; pairs them by the engine's policy.

    State (loop thread only):
    - ``_line``: requests in arrival order; cancelled or expired ones stay in it until
      they reach the front (``_dead`` counts them), so cancelling is O(1).
    - each core's ``idle`` deque and ``outstanding`` count.
    """

    def __init__(self, cores: list[CoreState]) -> None:
        self.cores = cores
        self._line: collections.deque[Request] = collections.deque()
        self._dead = 0
        self._idle_total = sum(len(core.idle) for core in cores)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot (cancelled ones excluded)."""
        return len(self._line) - self._dead

    @property
    def idle_slots(self) -> int:
        return self._idle_total

    def enqueue(self, request: Request) -> None:
        self._line.append(request)

    def discard(self, request: Request) -> None:
        """A queued request ended (cancelled, timed out); it is skipped when reached."""
        self._dead += 1

    def drain(self) -> list[Request]:
        """Take every live waiting request out of the line (closing, dying)."""
        live = [request for request in self._line if not request.future.done()]
        self._line.clear()
        self._dead = 0
        return live

    def next_assignment(self) -> tuple[Request, Slot] | None:
        """Pop the first live request and the slot it gets, or None if either is missing."""
        while self._idle_total and self._line:
            core = self._best_core()
            if core is None:
                return None
            request = self._line.popleft()
            if request.future.done():
                self._dead -= 1
                continue
            return request, self.take(core)
        return None

    def _best_core(self) -> CoreState | None:
        """The core in rotation with an idle slot and the least outstanding work."""
        best: CoreState | None = None
        for core in self.cores:
            if (
                core.idle
                and core.in_rotation
                and (
                    best is None
                    or (core.outstanding, core.assigned_total)
                    < (best.outstanding, best.assigned_total)
                )
            ):
                best = core
        return best

    def take(self, core: CoreState) -> Slot:
        """Take an idle slot of ``core`` (which must have one)."""
        core.outstanding += 1
        core.assigned_total += 1
        self._idle_total -= 1
        return core.idle.popleft()

    def release(self, slot: Slot) -> None:
        """The slot's work is over; it is idle again."""
        slot.request = None
        slot.core.outstanding -= 1
        slot.core.idle.append(slot)
        self._idle_total += 1
