"""The submitter thread: a request's enqueue calls made in C, off the loop's GIL time.

On the GPU stand-in a request's three enqueue calls (two graph launches and
``cudlaSubmitTask``) took about 36 us, most of the loop's time per request, so short
tasks ran below the DLA's speed: the loop could not enqueue them fast enough. A Python
thread making them costs more than it saves (each call's hand-off of the GIL, measured
by ``benchmarks/bench_submitter_thread.py``); a C thread (``submitter.c``) takes no GIL.

The loop hands a slot over with :meth:`Handoff.hand_off` (one C call keeping the GIL)
and goes on; the poller asks :meth:`Handoff.settled` before it queries the slot's event,
since an event not yet recorded again reads as complete. A call that failed on the
thread reaches the engine through the poller, as the slot's completion with
``slot.handoff_failure`` set: the error the runtime's own call raises, and whether the
slot's end was marked on its stream (else the slot is lost to the pool, as when the
loop's own ``retire`` fails).

Only what pays goes over: a request with others waiting behind it whose core has
little work queued ahead (``FEED_BELOW``: the core waits on the loop), on a slot with both graphs
captured for its kind, without stage timing. The rest is made on the loop as before: a
first request of a kind (which captures); a request behind a well-fed core, or with
none waiting behind it (the thread would cost CPU and save nothing; see
``FEED_BELOW``); and one that finds the thread asleep after a quiet spell
(``QUIET``), whose wake-up would add to its latency.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, Any

from ..runtime._handoff_calls import CALL_BIND, HandoffCalls, python_calls
from ._library import HandoffUnavailableError, load

if TYPE_CHECKING:
    from .._slots import Slot
    from ..runtime._protocol import Runtime

__all__ = [
    "FEED_BELOW",
    "LINGER",
    "QUIET",
    "WAITING_AT_LEAST",
    "Handoff",
    "HandoffUnavailableError",
    "calls_for",
]

logger = logging.getLogger("aiodla")

# A push that finds the thread asleep, this long after the one before, is left to the
# loop (a lightly loaded engine), so the thread's wake-up is not added to that request's
# latency. 0 hands everything over. (Chosen, not tuned: with WAITING_AT_LEAST no request
# of a lightly loaded engine gets this far.)
QUIET = 200e-6
# A request goes over only when others wait for a slot behind it and its core has less
# work queued ahead than this: then the core waits on the loop, and the loop's time per
# request is what the thread saves. A core fed further ahead, or an engine with nothing
# waiting (half load, one request at a time), loses nothing to the loop's own calls, and
# the thread would only add its CPU and wake-ups: on the H200 stand-in with every request
# handed over, 58 -> 80 us of CPU per request at 100 us service and the same rate
# (benchmarks/results/threads-compare-cuda-handoff-always.json); with the core's queue
# alone deciding, 104 -> 129 us at half load (threads-compare-cuda-handoff-fed.json).
FEED_BELOW = 200e-6
WAITING_AT_LEAST = 1
# How long the thread looks for more work before it sleeps: the loop hands a batch's
# requests over microseconds apart, and each one that finds it asleep costs a wake-up.
# (Chosen, not tuned: the thread spends this much CPU at the end of every batch.)
LINGER = 20e-6

_QUEUED, _SUBMITTED, _RETIRED = 1, 2, 3


def calls_for(runtime: Runtime, *, native_only: bool) -> HandoffCalls | None:
    """``runtime``'s C entry points; else, unless ``native_only``, callbacks into it."""
    offer = getattr(runtime, "handoff_calls", None)
    calls: HandoffCalls | None = offer() if offer is not None else None
    if calls is None and not native_only:
        calls = python_calls(runtime)
    return calls


class Handoff:
    """The submitter thread of one engine's slots (numbered by ``Slot.number``)."""

    def __init__(
        self,
        calls: HandoffCalls,
        slots: int,
        *,
        quiet: float | None = None,
        linger: float | None = None,
    ) -> None:
        library = load()
        self._library = library
        self._calls = calls
        # Read here, so a test may change the module's figures for the engines it opens.
        self.feed_below = FEED_BELOW
        self.waiting_at_least = WAITING_AT_LEAST
        quiet = QUIET if quiet is None else quiet
        linger = LINGER if linger is None else linger
        handle = library.create(
            slots,
            calls.launch,
            calls.submit,
            calls.record,
            calls.bind or None,
            calls.bind_argument,
            int(quiet * 1e9),
            int(linger * 1e9),
        )
        if not handle:
            raise HandoffUnavailableError("the submitter thread could not be created")
        self._handle: int | None = handle
        bound = ctypes.c_int()
        error = library.start(handle, ctypes.byref(bound))
        if error or bound.value:
            self.close()
            if error:
                raise HandoffUnavailableError(f"starting the submitter thread: errno {error}")
            raise HandoffUnavailableError(
                f"the submitter thread could not make the device current: "
                f"{calls.failure(CALL_BIND, bound.value, -1)}"
            )
        self._push = library.push
        self._state = library.state
        self._graph_handle = calls.graph_handle
        self._launched = calls.launched
        # Per slot: (device, task, stream, event) as the thread's calls take them.
        self._fixed: dict[int, tuple[int, int, int, int]] = {}

    @property
    def native(self) -> bool:
        """True when no Python runs on the thread (the driver's entry points)."""
        return self._calls.native

    def hand_off(self, slot: Slot, graph_before: Any, graph_after: Any) -> bool:
        """Give ``slot``'s calls to the thread (loop thread). False when declined: the
        caller makes them itself."""
        handle = self._handle
        if handle is None:
            return False
        fixed = self._fixed.get(slot.number)
        if fixed is None:
            task = self._calls.task_handle(slot.task)
            fixed = self._fixed[slot.number] = (slot.core.device, task, slot.stream, slot.event)
        device, task, stream, event = fixed
        handle_of = self._graph_handle
        pushed = self._push(
            handle,
            slot.number,
            handle_of(graph_before),
            device,
            task,
            stream,
            handle_of(graph_after),
            event,
        )
        if pushed <= 0:
            if pushed < 0:  # queued twice, or the thread is gone: the engine's bug
                raise RuntimeError(f"{slot!r} could not be handed to the submitter ({pushed})")
            return False
        slot.handoff = True
        launched = self._launched
        if launched is not None:
            launched(graph_before)
            launched(graph_after)
        return True

    def settled(self, slot: Slot) -> bool:
        """Whether the thread is done with ``slot``'s calls (poller; only for a slot
        handed over). On a failure, sets ``slot.handoff_failure``."""
        handle = self._handle
        state = self._state(handle, slot.number) if handle is not None else _SUBMITTED
        if state == _QUEUED:
            return False
        slot.handoff = False
        if state != _SUBMITTED:
            code = ctypes.c_int32()
            call = self._library.failure(handle, slot.number, ctypes.byref(code))
            error = self._calls.failure(call, code.value, slot.stream)
            slot.handoff_failure = (error, state == _RETIRED)
        return True

    def counts(self) -> dict[str, int]:
        """Hand-offs made, pushes declined (the loop made the calls), wake-ups."""
        out = (ctypes.c_uint64 * 3)()
        if self._handle is not None:
            self._library.counts(self._handle, out)
        return dict(zip(("handed", "declined", "wakeups"), (int(v) for v in out), strict=True))

    def close(self) -> None:
        """Stop the thread once it made what is queued (any thread: the wait releases
        the GIL, which a Python runtime's calls on the thread take); idempotent."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self._library.destroy(handle)
