"""Who runs next, and where: requests, every transition of theirs, and the policy.

A *request* is one ``infer`` call. The scheduler holds the waiting line, pairs waiting
requests with idle slots (FIFO among requests; the core in rotation with the least
outstanding work among cores), moves each request through its states and counts how
each one ended, and applies the fault policy that takes a failing core out of rotation.
It decides and returns what to do; it never touches a runtime or a tensor.

Only the event loop's thread touches this state.
"""

from __future__ import annotations

import asyncio
import collections
import enum
from typing import Any

from ._core_record import give_back, take
from ._slots import CoreLane, Slot
from ._statistics import FAILURE_REASONS
from ._trace import TraceRecorder

__all__ = ["Outcome", "Request", "RequestState", "Scheduler"]


class RequestState(enum.Enum):
    QUEUED = "queued"  # waiting for a slot
    PACKING = "packing"  # granted a slot; its input is being packed (maybe off the loop)
    IN_FLIGHT = "in flight"  # enqueued on a stream
    UNPACKING = "unpacking"  # done on the device; its coroutine unpacks off the loop
    DONE = "done"  # its one outcome is decided


class Outcome(enum.Enum):
    """How a request ended, as its caller saw it."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    # Members are singletons compared by identity: hashing by identity is as correct as
    # Enum's hash of the name, and it is a C slot instead of a Python call for each of
    # the two lookups in ``Scheduler.ended`` that every request makes.
    __hash__ = object.__hash__


class Request:
    """One ``infer`` call on its way through the engine.

    ``state`` is the one record of where it is. ``future`` is what its coroutine
    awaits: its one outcome, the result or an error, set once by the flow. ``step``:
    the task of its step off the loop (packing, unpacking: ``_offload``), if it had one.
    """

    __slots__ = (
        "arrays",
        "deadline",
        "device_output",
        "future",
        "outcome",
        "reason",
        "slot",
        "sources",
        "started",
        "state",
        "step",
        "timer",
    )

    def __init__(
        self,
        arrays: tuple[Any, ...],
        future: asyncio.Future[Any],
        started: float,
        sources: tuple[Any, ...] = (),
        device_output: bool = False,
    ) -> None:
        self.arrays = arrays
        self.future = future
        self.started = started
        self.device_output = device_output  # infer(..., output="device")
        # Device arrays the request reads (released once no kernel can read them: when
        # it ends unstarted, or with its slot).
        self.sources = sources
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.state = RequestState.QUEUED
        self.slot: Slot | None = None
        self.outcome: Outcome | None = None
        self.reason: str | None = None  # the failure reason, for a FAILED outcome
        # Its step off the loop while PACKING or UNPACKING (``_offload``), if any.
        self.step: asyncio.Task[None] | None = None


class Scheduler:
    """The waiting line, the idle slots, the request counts and the fault policy.

    State (loop thread only):
    - ``_line``: requests in arrival order; one that ended while queued (cancelled,
      timed out) stays in it until it reaches the front, so ending it is O(1).
    - ``queued`` / ``in_progress``: requests in those states, changed only by
      :meth:`admit`, :meth:`next_assignment` and :meth:`finish`, so that
      ``submitted == completed + failed + cancelled + timed_out + queued + in_progress``
      holds after every step.
    - ``idle_slots``: the engine's slots not assigned, changed by :meth:`take` and
      :meth:`release` (which change the core's record through ``_core_record``).
    - each core's ``in_rotation`` and ``consecutive_failures`` (the fault policy).
    - every request's ``state``, ``slot``, ``outcome``, ``reason``.
    """

    trace: TraceRecorder | None = None  # engine.trace() installs one

    def __init__(self, cores: list[CoreLane], max_consecutive_faults: int | None = None) -> None:
        self.cores = cores
        self._max_faults = max_consecutive_faults
        self._line: collections.deque[Request] = collections.deque()
        self.idle_slots = sum(len(core.idle) for core in cores)
        self.queued = 0
        self.in_progress = 0
        self.submitted = 0
        self.rejected = 0
        self.ended: dict[Outcome, int] = dict.fromkeys(Outcome, 0)
        self.failures: dict[str, int] = dict.fromkeys(FAILURE_REASONS, 0)

    # -- requests -----------------------------------------------------------------------------

    def admit(self, request: Request) -> None:
        self.submitted += 1
        self.queued += 1
        self._line.append(request)

    def reject(self) -> None:
        """A request refused at admission (queue full); it was never submitted."""
        self.rejected += 1

    def next_assignment(self) -> tuple[Request, Slot] | None:
        """Pop the first waiting request and give it an idle slot of the best core; None
        if either is missing. The request is PACKING from then on."""
        line = self._line
        while self.idle_slots and line:
            core = self._best_core()
            if core is None:
                return None
            request = line.popleft()
            if request.state is not RequestState.QUEUED:
                continue  # it ended while it waited
            return request, self._assign(request, core)
        return None

    def next_on(self, core: CoreLane) -> tuple[Request, Slot] | None:
        """Pop the first waiting request and give it an idle slot of ``core`` (which
        must have one): the choice of the shared cores' dispatcher (``_dispatch``)."""
        line = self._line
        while line:
            request = line.popleft()
            if request.state is RequestState.QUEUED:
                return request, self._assign(request, core)
        return None

    def _assign(self, request: Request, core: CoreLane) -> Slot:
        self.idle_slots -= 1
        slot: Slot = take(core)
        self.queued -= 1
        self.in_progress += 1
        request.state = RequestState.PACKING
        request.slot = slot
        slot.request = request
        return slot

    def advance(self, request: Request, state: RequestState) -> None:
        """Move a request on between the in-progress states (packing, in flight,
        unpacking): counted in ``in_progress`` throughout."""
        request.state = state

    def lost_slot(self, request: Request) -> None:
        """The request's slot failed to take its work: the request no longer holds it."""
        slot = request.slot
        request.slot = None
        if slot is not None:
            slot.request = None

    def finish(self, request: Request, outcome: Outcome, reason: str | None = None) -> bool:
        """Decide the request's one outcome; False if it had one already."""
        state = request.state
        if state is RequestState.DONE:
            return False
        if state is RequestState.QUEUED:
            self.queued -= 1
        else:
            self.in_progress -= 1
        request.state = RequestState.DONE
        request.outcome = outcome
        request.reason = reason
        request.arrays = ()
        self.ended[outcome] += 1
        if reason is not None:
            self.failures[reason] += 1
        if self.trace is not None:
            self.trace.ended(request, outcome.value)
        return True

    def recount_as_cancelled(self, request: Request) -> None:
        """The caller saw a cancellation although the request had ended otherwise (a
        cancel that raced its result or deadline): count it as what the caller saw."""
        outcome = request.outcome
        if outcome is None or outcome is Outcome.CANCELLED:
            return
        self._count(outcome, request.reason, -1)
        self._count(Outcome.CANCELLED, None, 1)
        request.outcome, request.reason = Outcome.CANCELLED, None

    def _count(self, outcome: Outcome, reason: str | None, step: int) -> None:
        self.ended[outcome] += step
        if reason is not None:
            self.failures[reason] += step

    def drain(self, reason: str) -> list[Request]:
        """End every waiting request as failed for ``reason`` (closing, dying) and take
        it out of the line; the caller delivers the error to each."""
        waiting = [request for request in self._line if request.state is RequestState.QUEUED]
        self._line.clear()
        for request in waiting:
            self.finish(request, Outcome.FAILED, reason)
        return waiting

    # -- slots --------------------------------------------------------------------------------

    def _best_core(self) -> CoreLane | None:
        """The core in rotation with an idle slot and the least outstanding work."""
        best: CoreLane | None = None
        for core in self.cores:
            if (
                core.idle
                and core.in_rotation
                and (
                    best is None
                    or (core.record.held, core.assigned_total)
                    < (best.record.held, best.assigned_total)
                )
            ):
                best = core
        return best

    def take(self, core: CoreLane) -> Slot:
        """Take an idle slot of ``core`` (which must have one)."""
        self.idle_slots -= 1
        slot: Slot = take(core)
        return slot

    def release(self, slot: Slot) -> None:
        """The slot's work is over; it is idle again."""
        request = slot.request
        if request is not None:
            request.slot = None
            slot.request = None
        give_back(slot)
        self.idle_slots += 1

    # -- the fault policy ---------------------------------------------------------------------

    def task_ended(self, core: CoreLane, status: int) -> bool:
        """Count a task's status against its core; True when the core must leave
        rotation now (too many failures in a row while another core serves). A success
        only resets the count (the flow asks only when there is one to reset)."""
        if not status:
            core.consecutive_failures = 0
            return False
        core.consecutive_failures += 1
        limit = self._max_faults
        if (
            limit is None
            or not core.in_rotation
            or core.consecutive_failures < limit
            or not any(other.in_rotation for other in self.cores if other is not core)
        ):
            return False
        core.in_rotation = False
        return True

    def suspend(self) -> None:
        """No core takes a request until :meth:`resume` (a worker process is replaced)."""
        for core in self.cores:
            core.in_rotation = False

    def resume(self) -> None:
        """Every core is back in rotation with a clean record of faults."""
        for core in self.cores:
            core.in_rotation = True
            core.consecutive_failures = 0

    def probe_ended(self, core: CoreLane, status: int) -> bool:
        """A probe task of a core out of rotation ended; True when it brings the core
        back (it succeeded), False when the core must be probed again."""
        if status:
            return False
        core.in_rotation = True
        core.consecutive_failures = 0
        return True
