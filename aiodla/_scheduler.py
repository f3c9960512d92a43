"""One engine's requests: the waiting line, every state of a request, and their counts.

A *request* is one ``infer`` call. The scheduler holds the engine's waiting line (FIFO),
hands the dispatcher (``_dispatch``) the next waiting request when it gives the engine
a slot, moves each request through its states and counts how each one ended. Which
slot, which core, and the fault policy that takes a failing core out of rotation are
the dispatcher's. It never touches a runtime or a tensor.

Only the event loop's thread touches this state.
"""

from __future__ import annotations

import asyncio
import collections
import enum
from typing import Any

from ._slots import Slot
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
    """The waiting line and the request counts of one engine.

    State (loop thread only):
    - ``_line``: requests in arrival order; one that ended while queued (cancelled,
      timed out) stays in it until it reaches the front, so ending it is O(1).
    - ``queued`` / ``in_progress``: requests in those states, changed only by
      :meth:`admit`, :meth:`next_request` and :meth:`finish`, so that
      ``submitted == completed + failed + cancelled + timed_out + queued + in_progress``
      holds after every step (``queued`` > 0: a QUEUED request is in the line).
    - every request's ``state``, ``outcome``, ``reason`` (its ``slot`` is the
      dispatcher's, which pairs requests with slots).
    """

    trace: TraceRecorder | None = None  # engine.trace() installs one

    def __init__(self) -> None:
        self._line: collections.deque[Request] = collections.deque()
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

    def next_request(self) -> Request:
        """Pop the first waiting request (``queued`` says there is one): the dispatcher
        gave it a slot, and it is PACKING from then on."""
        line = self._line
        while True:
            request = line.popleft()
            if request.state is RequestState.QUEUED:  # else it ended while it waited
                self.queued -= 1
                self.in_progress += 1
                request.state = RequestState.PACKING
                return request

    def advance(self, request: Request, state: RequestState) -> None:
        """Move a request on between the in-progress states (packing, in flight,
        unpacking): counted in ``in_progress`` throughout."""
        request.state = state

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
