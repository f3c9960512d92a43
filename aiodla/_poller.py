"""The poller: one thread that notices finished slots and tells the event loop.

It sweeps the CUDA events of in-flight slots and hands every completion found in one
sweep to the loop with a single ``call_soon_threadsafe``. With each completion it reads
the core's cuDLA status at once: cuDLA latches the status of the core's most recent
failed task, so reading it as each task is seen done ties a failure to its own task
(read later, after the core's next task ended too, it could belong to either). It
never touches futures or scheduler state.

It knows when each slot should finish (the engine's estimate from the core's service
time and queue). When it sweeps:

* one task in flight on a core (light load): just before that task's expected end, then
  polling with short pauses (none for the CUDA runtime, whose queries release the GIL),
  so a result reaches its caller as soon as it can;
* a task with at least ``LATE_WAKE`` of work queued behind it on its core, or on a core
  the loop refills after every batch (a loaded engine): at its expected end and not
  before, since a late wake-up costs that core nothing, while every wake-up costs the
  host tens of microseconds of CPU;
* several queued on a core (a loaded engine): when the core has only ``reserve`` seconds
  of queued work left (a few service times), so one wake-up brings the loop several
  completions, and the loop refills the core before it runs dry. Every wake-up costs the
  loop a thread hop and every query takes the GIL: at short service times both, paid
  per completion, would cost more than the loop has to spare;
* a slot overdue (a hung core, a slow task): with back-off, so a hung core costs little.

After posting a batch it waits, without polling, until the loop has handled it and run
the callers it woke: while the loop works, every poll would take the GIL from it and
every wake-up would add a hop. When its next sweep is planned for well after that (a
loaded core's next task, ``RESERVE`` or more away), it sleeps until then instead: one
wake-up per batch, not two, and ``watch`` rings if a slot is due sooner. Then the loop
looks first (``harvest``): when several slots should have finished meanwhile
(``HARVEST_AT_LEAST``, by the estimates, which costs no query), it takes what is done
itself and goes on to the next batch with no hop at all; otherwise it hands polling back
(``consumed``). Fewer completions are not worth the loop's own queries and a batch's
fixed cost: an earlier version that swept after every batch, however few tasks were due,
cost the loop more CPU on the H200 than the hops saved. One lock decides who sweeps;
the loop never waits for it (a sweep in progress will post what it finds).

Each core's slots are kept in the order they were submitted, which is the order the
core runs their tasks: a sweep queries a core's slots from the front and stops at the
first not done, so a sweep costs a query or two per core, not one per slot.

A wake-up that reaches a closed loop is dropped: after close nothing listens.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from ._slots import CompletionProbe, Slot
from ._trace import TraceRecorder

__all__ = ["Poller", "PollerShare", "SharedPoller"]

logger = logging.getLogger("aiodla")

# Start polling this long before a slot's expected completion; estimates are rough.
# Never more than half a service time early: at short service times a wider window
# would keep the poller spinning, and taking the GIL, all the time.
SPIN_WINDOW = 300e-6
# A loaded core is left at least this much queued work (and at least two service
# times) when its completions are collected: enough for the thread hop to the loop
# (about 80 us on a virtual machine) and for the loop to refill the core's ring.
RESERVE = 500e-6
# Longest pause between sweeps once a slot is overdue (a hung core, a slow task).
MAX_BACKOFF = 2e-3
# With nothing in flight, sleep at most this long between checks of the stop flag.
IDLE_WAIT = 0.5
# The loop sweeps between batches only when at least this many slots should be done.
# Measured on the H200 at 100 us service times, 4 streams per core: 0.85 x ideal with
# no sweep by the loop, 0.87 with a threshold of 2, 0.89 with 4.
HARVEST_AT_LEAST = 4
# Longest wait for the loop to handle a posted batch before sweeping anyway (a loop
# that never answers, e.g. one that is closing, must not stall the poller).
CONSUME_WAIT = 2e-3
# How late a timed sleep may end on a loaded virtual machine (a one-off timing of
# lock.acquire(timeout) on this project's 2-CPU machine: 95 to 150 us late, often
# more). A core with at least this much work queued behind the task the poller waits
# for loses nothing when the poller wakes that late, so it sleeps until the task's
# expected end instead of polling from SPIN_WINDOW before it: each wake-up cost 40 to
# 65 us of the thread's CPU in that timing, more than a spin window's work saved.
LATE_WAKE = 300e-6
# Service times between two looks at a core's task before its estimate that found it
# running (see _take_done).
PEEK_EVERY = 4


class Poller:
    """Polls in-flight slots' events on a dedicated thread."""

    def __init__(
        self,
        probe: CompletionProbe,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[list[tuple[Slot, int]]], None],
        fail: Callable[[BaseException], None],
        *,
        pause: float,
        name: str = "aiodla-poller",
    ) -> None:
        self._probe = probe
        self._loop = loop
        # Weak: the thread must not keep a dropped engine alive (it could never warn
        # that it was not closed, and the thread would run forever).
        self._deliver = weakref.WeakMethod(deliver)
        self._fail = weakref.WeakMethod(fail)
        self._pause = pause
        self._incoming: collections.deque[Slot] = collections.deque()
        # Each core's slots in flight, in the order they were submitted (the order the
        # core runs their tasks). The thread sweeps them, and so may the loop between
        # batches: whoever holds ``_sweeping`` owns them; ``_changes`` counts changes.
        self._lanes: dict[int, collections.deque[Slot]] = {}
        # Cores whose last completion left work queued behind it: the loop refills them
        # after each batch, so their next task is waited for as a loaded core's.
        self._loaded: set[int] = set()
        # When each core's next look at a task before its estimate may be made.
        self._peeks: dict[int, float] = {}
        self._sweeping = threading.Lock()
        self._changes = 0
        # A lock used as a doorbell: the poller sleeps in acquire(timeout), ``watch``
        # releases it. (threading.Event costs several times more per ring.)
        self._bell = threading.Lock()
        self._bell.acquire()
        self._stopping = False
        self._wake_at = float("inf")  # when the poller means to sweep next
        self._unconsumed = False  # a batch is posted and the loop has not handled it yet
        self._awaiting_consumption = False  # the poller sleeps until the loop consumes
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.sweeps = 0
        self.wakeups = 0
        self.trace: TraceRecorder | None = None  # engine.trace() installs one

    def start(self) -> None:
        self._thread.start()

    def deliver_to(self, deliver: Callable[[list[tuple[Slot, int]]], None]) -> None:
        """Post the next batches to ``deliver`` (weakly held, as the first one was)."""
        self._deliver = weakref.WeakMethod(deliver)

    def watch(self, slot: Slot) -> None:
        """Poll ``slot`` from now on (loop thread). Wakes the poller only if it would
        otherwise sleep past the slot's expected completion."""
        self._incoming.append(slot)
        if slot.expected_done - SPIN_WINDOW < self._wake_at:
            self._ring()

    def consumed(self) -> None:
        """The loop has handled the last batch and run what it woke (loop thread):
        the poller may sweep again."""
        self._unconsumed = False
        if self._awaiting_consumption:  # else the poller sleeps to a planned sweep: let it
            self._ring()

    def stop(self) -> None:
        """Ask the thread to end (any thread); ``join`` waits for it."""
        self._stopping = True
        self._ring()

    def _ring(self) -> None:
        with contextlib.suppress(RuntimeError):  # rung already, not yet answered
            self._bell.release()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _post(self, target: weakref.WeakMethod[Callable[..., None]], argument: object) -> None:
        callback = target()
        if callback is None:  # the engine was dropped
            self._stopping = True
            return
        try:
            self._loop.call_soon_threadsafe(callback, argument)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            self._stopping = True

    def _run(self) -> None:
        try:
            self._probe.make_current()
            self._sweep_until_stopped()
        except BaseException as exc:  # any failure here makes the engine dead
            logger.error("aiodla: poller stopped: %s", exc)
            self._post(self._fail, exc)

    def _take_incoming(self) -> None:
        """Move watched slots into their cores' lanes (the caller holds _sweeping)."""
        incoming = self._incoming
        if not incoming:
            return
        lanes = self._lanes
        while incoming:
            slot = incoming.popleft()
            lane = lanes.get(id(slot.core))
            if lane is None:
                lane = lanes[id(slot.core)] = collections.deque()
            lane.append(slot)
        self._changes += 1

    def harvest(self, at_least: int | None = None) -> list[tuple[Slot, int]]:
        """Sweep on the loop thread between two batches, if ``at_least`` slots should be
        done by now (default ``HARVEST_AT_LEAST``): what is done is handled at once,
        with no hop through the poller. Empty otherwise, or while the poller thread
        sweeps (it will post what it finds).
        """
        if at_least is None:
            at_least = HARVEST_AT_LEAST
        if not self._sweeping.acquire(blocking=False):
            return []
        try:
            self._take_incoming()
            now = time.monotonic()
            due = 0
            for lane in self._lanes.values():
                for slot in lane:
                    if slot.expected_done > now:
                        break
                    due += 1
            if due < at_least:
                return []
            return self._take_done(now)
        finally:
            self._sweeping.release()

    def _sweep_until_stopped(self) -> None:
        clock = time.monotonic
        planned_at = -1  # the value of _changes that ``plan`` was made for
        plan = _Plan(0.0, 0.0, 0.0)
        while not self._stopping:
            idle = False
            with self._sweeping:
                self._take_incoming()
                if not any(self._lanes.values()):
                    idle = True
                    done = []
                else:
                    now = clock()
                    self.sweeps += 1
                    done = self._take_done(now)
                    if planned_at != self._changes:
                        planned_at, plan = self._changes, self._plan()
            if idle:
                self._sleep(IDLE_WAIT)
                continue
            if done:
                self.wakeups += 1
                self._unconsumed = True
                self._post(self._deliver, done)
                # Wait for the loop to handle the batch, unless a sweep is planned for
                # well after it will have (a loaded core's next task): then that
                # wake-up is the only one, and ``watch`` rings for anything due sooner.
                ahead = plan.at - plan.window - clock()
                if not RESERVE <= ahead < IDLE_WAIT:
                    self._await_consumed()
                    continue
            if planned_at != self._changes:
                continue  # the loop harvested meanwhile: plan again
            now = clock()
            ahead = plan.at - plan.window - now
            if ahead > 0:
                self._sleep(min(ahead, IDLE_WAIT))
            elif now > plan.at + plan.window:
                # Overdue: back off in proportion, so a hung task is polled rarely.
                self._sleep(min(MAX_BACKOFF, max(self._pause, plan.step, (now - plan.at) / 8)))
            elif self._pause:
                self._sleep(self._pause)
            else:
                time.sleep(0)  # let the loop thread have the GIL between sweeps

    def _plan(self) -> _Plan:
        return _next_sweep(self._lanes, self._loaded)

    def _take_done(self, now: float) -> list[tuple[Slot, int]]:
        """Take the finished slots off the front of each core's lane, each with its
        core's status (the caller holds ``_sweeping``). A core runs its tasks in order,
        so past its first slot not done (or not due yet) nothing is queried."""
        query = self._probe.event_done
        status = self._probe.core_status
        loaded = self._loaded
        peeks = self._peeks
        done = []
        for key, lane in self._lanes.items():
            took = False
            while lane:
                slot = lane[0]
                # Past a task found done, the next is queried even before its estimate:
                # found done, it shows that the core runs ahead of the estimates; found
                # running after its estimate, behind; either moves them (see
                # Cores.account). A look that finds it running waits PEEK_EVERY service
                # times before the core's next (with two slots a core, every sweep would
                # pay for one).
                due = slot.expected_done - _window(slot) <= now
                if not due and (not took or now < peeks.get(key, 0.0)):
                    break
                if not query(slot.event):
                    if now > slot.expected_done:  # the core runs behind the estimates
                        slot.behind = now - slot.expected_done
                    if not due:
                        peeks[key] = now + PEEK_EVERY * slot.core.service_time
                    break
                lane.popleft()
                if now < slot.expected_done:  # the core runs ahead of the estimates
                    slot.behind = now - slot.expected_done
                took = True
                if lane:
                    loaded.add(key)
                else:
                    loaded.discard(key)
                # The status is read right after each event is seen done: read later,
                # after the core's next task also ended, it could belong to either.
                done.append((slot, status(slot.core.device)))
        if done:
            self._changes += 1
        if self.trace is not None:
            self.trace.sweep(now, done)
        return done

    def _await_consumed(self) -> None:
        # ``watch`` must not ring meanwhile (it would only wake the poller to wait
        # again): a wake-up time in the past tells it the poller is awake.
        self._wake_at = 0.0
        deadline = time.monotonic() + CONSUME_WAIT
        self._awaiting_consumption = True
        try:
            while self._unconsumed and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._bell.acquire(timeout=left)
        finally:
            self._awaiting_consumption = False

    def _sleep(self, seconds: float) -> None:
        # Publish the wake-up time *before* looking at the incoming slots: ``watch``
        # appends before it reads ``_wake_at``, so one of the two always sees the other.
        self._wake_at = time.monotonic() + seconds
        if not self._incoming:
            self._bell.acquire(timeout=seconds)
        self._wake_at = 0.0  # awake: the next sweep drains the incoming slots anyway


def _window(slot: Slot) -> float:
    """How early to start polling ``slot``: never more than half a service time."""
    return min(SPIN_WINDOW, slot.core.service_time / 2)


class _Plan(NamedTuple):
    """The next sweep: due ``at``, polled from ``window`` before it, and past it retried
    no more often than every ``step`` seconds."""

    at: float
    window: float
    step: float


def _next_sweep(
    lanes: dict[int, collections.deque[Slot]], loaded: set[int] | frozenset[int] = frozenset()
) -> _Plan:
    """When to sweep next, and how early polling may start around it.

    For each core: when the first slot of its lane is due, or, when more work is queued
    on it than its reserve, the moment only the reserve is left (see the module's
    docstring). A core that will still have ``LATE_WAKE`` of work queued when its first
    slot ends (queued now, or refilled by the loop after the last batch) is not polled
    early: a late wake-up costs it nothing. The earliest over the cores wins.
    """
    best = _Plan(float("inf"), SPIN_WINDOW, 0.0)
    for key, lane in lanes.items():
        if not lane:
            continue
        head = lane[0]
        first = head.expected_done
        service = head.core.service_time
        behind = lane[-1].expected_done - first
        if len(lane) > 1:
            reserve = max(RESERVE, 2 * service)
            first = max(first, lane[-1].expected_done - reserve)
        if behind >= LATE_WAKE or (key in loaded and service >= LATE_WAKE):
            window, step = 0.0, service / 16
        else:
            window, step = _window(head), 0.0
        if first - window < best.at - best.window:
            best = _Plan(first, window, step)
    return best


class SharedPoller:
    """One poller thread for every engine on an :class:`aiodla.Cores`.

    Each engine's flow takes its completions from a :class:`PollerShare`, made by
    :meth:`share`; a batch the thread (or a loop's harvest) found goes to the flows of
    its slots, the highest priority first. On a lone engine's own cores (``private``:
    one engine, ever), its batches go straight to its flow and its harvests straight
    to the poller: no routing, no call more than a poller of its own made. (On shared
    cores a batch may still hold the slots of an engine that left, whose tasks ran
    past its close: those go nowhere, never to the engine that stayed.) The thread
    lives until :meth:`stop`, when the cores close; an engine that closes only leaves.
    A failure of the thread, or of a sweep on the loop, is the CUDA context's, under
    every engine here (``fail``).
    Only the event loop's thread calls it, except ``stop`` and ``join``.
    """

    def __init__(
        self,
        probe: CompletionProbe,
        loop: asyncio.AbstractEventLoop,
        fail: Callable[[BaseException], None],
        *,
        pause: float,
        private: bool = False,
    ) -> None:
        self._fail = fail
        self._private = private
        self._sinks: dict[int, _Sink] = {}  # by id of each engine's lane on a core
        self._members: list[PollerShare] = []  # highest priority first
        self.poller = Poller(probe, loop, self.deliver, self.failed, pause=pause)
        self.poller.start()

    def share(self, sink: _Sink, lanes: list[Any], priority: int) -> PollerShare:
        """Where the flow ``sink`` of an engine whose lanes are ``lanes`` takes its
        completions from."""
        member = PollerShare(self, sink, lanes, priority)
        for lane in lanes:
            self._sinks[id(lane)] = sink
        self._members.append(member)
        self._members.sort(key=lambda m: -m.priority)
        self._route()
        return member

    def leave(self, member: PollerShare) -> None:
        """The engine closed: a late completion of its slots goes nowhere."""
        if member in self._members:
            self._members.remove(member)
            for lane in member.lanes:
                self._sinks.pop(id(lane), None)
            self._route()

    def _route(self) -> None:
        """Batches straight to a lone engine's flow on its own cores, else through
        :meth:`deliver`; its harvests likewise."""
        members, poller = self._members, self.poller
        if self._private and len(members) == 1:
            alone = members[0]
            poller.deliver_to(alone.sink.on_completions)
            alone.harvest = poller.harvest  # type: ignore[method-assign]
            return
        poller.deliver_to(self.deliver)
        for member in members:
            member.harvest = member.routed_harvest  # type: ignore[method-assign]

    @property
    def engines(self) -> int:
        return len(self._members)

    def deliver(self, finished: list[tuple[Slot, int]]) -> None:
        """A batch of completions (loop thread): each flow takes its own."""
        sinks = self._sinks
        first = sinks.get(id(finished[0][0].core))
        for slot, _ in finished:
            if sinks.get(id(slot.core)) is not first:
                break
        else:  # one engine's batch (the common case)
            if first is not None:
                first.on_completions(finished)
            return
        parts: dict[int, list[tuple[Slot, int]]] = {}
        for done in finished:
            parts.setdefault(id(sinks.get(id(done[0].core))), []).append(done)
        for member in list(self._members):  # highest priority first
            part = parts.get(id(member.sink))
            if part:
                member.sink.on_completions(part)

    def harvest(self, member: PollerShare, at_least: int | None) -> list[tuple[Slot, int]]:
        """A sweep on the loop for ``member``: its own completions come back, the other
        engines' are handed to them."""
        found = self.poller.harvest(at_least)
        if not found:
            return found
        sinks, sink = self._sinks, member.sink
        own = [done for done in found if sinks.get(id(done[0].core)) is sink]
        if len(own) < len(found):
            self.deliver([done for done in found if sinks.get(id(done[0].core)) is not sink])
        return own

    def failed(self, error: BaseException) -> None:
        self._fail(error)

    def stop(self) -> None:
        self.poller.stop()

    def join(self, timeout: float | None = None) -> None:
        self.poller.join(timeout)


class _Sink(Protocol):
    def on_completions(self, finished: list[tuple[Slot, int]]) -> None: ...


class PollerShare:
    """An engine's view of its :class:`SharedPoller`: the completion source of its flow
    (``watch`` and ``consumed`` are the poller's own; ``stop`` leaves)."""

    def __init__(self, shared: SharedPoller, sink: _Sink, lanes: list[Any], priority: int) -> None:
        self.shared = shared
        self.sink = sink
        self.lanes = lanes
        self.priority = priority
        poller = shared.poller
        self.watch = poller.watch
        self.consumed = poller.consumed

    def harvest(self, at_least: int | None = None) -> list[tuple[Slot, int]]:
        """A sweep on the loop (the poller's own while the engine is alone on it)."""
        return self.shared.harvest(self, at_least)

    routed_harvest = harvest

    @property
    def sweeps(self) -> int:
        return self.shared.poller.sweeps

    @property
    def wakeups(self) -> int:
        return self.shared.poller.wakeups

    def stop(self) -> None:
        self.shared.leave(self)

    def join(self, timeout: float | None = None) -> None:
        """Nothing to wait for: the thread is the cores'."""

    @property
    def trace(self) -> TraceRecorder | None:
        return self.shared.poller.trace

    @trace.setter
    def trace(self, recorder: TraceRecorder | None) -> None:
        self.shared.poller.trace = recorder
