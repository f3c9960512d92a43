"""The dispatcher of an :class:`aiodla.Cores`: which engine's waiting request starts
next, on which core and slot, and which cores are in rotation.

Each engine keeps its own waiting line, request counts, statistics and health (its
:class:`~aiodla._scheduler.Scheduler`) and its ring of slots on each core; the
dispatcher decides, across all of them, who may start a task on a core and when, pairs
the request with a slot, takes the slot back when its work is over, and applies the
fault policy: a core that fails too many tasks in a row leaves an engine's rotation,
and a probe task, started by the same decision once its time has come, brings it back.
It reads each physical core as it is, from the core's one record
(:class:`~aiodla._core_record.CoreRecord`: the tasks it holds of every engine, when it
should finish them), and makes one decision, :meth:`Dispatcher.assign`, after every
admission, completion, cancellation and release of any engine on the cores, and when
a timer it set comes due (a held-back task's or a probe's): no other timer decides.

A lone engine (every lone engine runs on cores of its own, a private
:class:`~aiodla.Cores`) is the fast path of the same decision: nobody ranks above or
beside it, so depth and weight have nothing to decide, its own ring bounds what it
queues, and the rule reduces to its next request on the core in rotation that holds
least (ties: the one it used less).

The rule:

- **Depth.** A task of an engine below the top priority on a core (some engine on the
  core has a higher one) starts only while the core holds fewer than :data:`DEPTH`
  tasks of all engines together (assigned to a slot and not yet ended), and only while
  the work the core has left, by the estimates, is at most :data:`LOWER_LEAD` (or that
  task's own time, if shorter): the lead the loop needs to submit it before the core
  runs dry. So the work queued on the core is never more than one such task and that
  lead: a task below the top priority is never queued behind a long one (a detector's
  task that just started), and when the rule holds it back, a timer lets it start as
  soon as the core's work left is short enough, so the core does not idle meanwhile
  (every held-back task gets one). A DLA task cannot be pre-empted, so this is what
  bounds the wait of urgent work: a top-priority request waits for at most one task
  time of the longest lower-priority model on the core plus :data:`LOWER_LEAD`,
  besides the top-priority work admitted before it, then runs. Its latency is at most
  its own task time plus that (plus the loop's round trip). (Until the lead was its
  own, the rule let a task queue with its own time left on the core: two lower task
  times ahead of urgent work, which was most of a detector's tail.) Engines of the top
  priority, which nobody can be kept waiting behind, may fill a core up to
  :data:`TOP_DEPTH` tasks (a detector's task queues behind the lower tasks already
  there at once, instead of waiting a round trip for one of them to end); several
  engines of the top priority on a core, up to the smallest ring among them there
  (their ``streams_per_core``), never short of :data:`DEPTH`: then the core's room
  runs out before any such engine's ring, so each time a place frees every engine
  with work has an idle slot for it, and weights decide who takes it (were the room
  larger, the rings would decide instead; engines with a ring of one slot take
  turns). Rings of 4
  (``streams_per_core=4``) give the core more queued work to bridge the loop's round
  trip at each task's end; the default 2 keeps one task queued behind the running
  one, as a lone engine does. One engine alone on a core is bounded by its ring.
- **Priority.** Among engines with a request waiting, a higher ``priority`` goes first,
  always; a lower one gets a core only when no engine above it can start there.
- **Weight.** Within one priority, core time is shared in proportion to ``weight``
  among the engines that have work (start-time fair queuing: each grant costs the
  engine its own service-time estimate on that core divided by its weight; an engine
  that had no work does not bank credit for its idle time). The tags are integers
  (:class:`FairShares`), so the shares stay exact however long the engines run.
- **Which core.** The one where the task would end soonest: after what the core should
  finish first (the latest estimated end of every engine's work there: each task's
  estimate from its own model's service time, moved by what the poller saw of the
  core), then its own service time. The time already spent on the running task counts:
  of two cores each running one task, the one whose task started first frees first.

Completions of every engine on the cores come from one poller thread (the ``Cores``'),
so an engine of a higher priority is not kept waiting by the others' pollers for the
interpreter lock: no look of the loop's own is needed.

Only the event loop's thread touches this state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from ._core_record import CoreRecord, give_back, take
from ._life import EngineState, Life

if TYPE_CHECKING:
    from ._scheduler import Request, Scheduler
    from ._slots import CoreLane, Slot

__all__ = ["DEPTH", "LOWER_LEAD", "TOP_DEPTH", "Client", "Dispatcher", "FairShares", "Starter"]

# Tasks a core may hold when a task below the top priority starts: one running, one
# queued behind it.
DEPTH = 2
# A task below the top priority queues behind the core's work only when that work has
# at most this long left (or its own task time, if shorter): enough for the loop to
# see the time come and submit it (a timer's lateness and a submission, a few hundred
# microseconds on a loaded virtual machine), so the core does not idle, and no more,
# since urgent work arriving meanwhile waits for it.
LOWER_LEAD = 0.5e-3
# Tasks a core may hold at most when a task of the top priority starts (fewer where an
# engine of that priority has a smaller ring on the core: see the depth rule).
TOP_DEPTH = 4
# Fair-queuing tags count core time in these units per unit of weight (femtoseconds):
# integers, exact however far the clock runs. (A float clock grown large rounds a small
# cost to nothing: after a weight-1e-16 engine's few grants pushed it to ~1e13, the
# other engines' costs no longer moved their tags and their weights stopped counting.)
TAG_UNITS = 10**15


class Starter(Protocol):
    """What the dispatcher asks of an engine's flow."""

    life: Life
    scheduler: Scheduler
    lanes: list[CoreLane]  # its lane on each core, in the order of its cores

    def start(self, request: Request, slot: Slot) -> None: ...
    def probe(self, slot: Slot) -> None: ...


@dataclasses.dataclass(eq=False)
class Client:
    """One engine on the dispatcher: its place in the order, its slots and fault
    policy, and what it was granted."""

    flow: Starter
    priority: int
    weight: float
    order: int  # ties go to the engine that joined first
    lanes: dict[int, CoreLane]  # its own lane on each core it uses, by core number
    own_lanes: list[CoreLane]  # the same lanes, in the order of its cores
    idle_slots: int  # its slots not assigned
    max_faults: int | None = None  # failures in a row that take a core out of rotation
    probe_interval: float = 1.0  # seconds between probes of a core out of rotation
    finish_tag: int = 0  # start-time fair queuing: where its last grant ended
    # The weight as an exact fraction: a grant's cost in tags is cost * den // num.
    weight_ratio: tuple[int, int] = (1, 1)
    granted_time: float = 0.0  # seconds of core time granted, by its own estimates
    grants: int = 0


class FairShares:
    """Start-time fair queuing within each priority, in integer tags (:data:`TAG_UNITS`).

    State (loop thread only): ``_virtual``, per priority, the start tag of the last
    grant (the clock); each client's ``finish_tag``, where its last grant ended.
    """

    def __init__(self) -> None:
        self._virtual: dict[int, int] = {}

    def joined(self, client: Client) -> None:
        """A client joining starts at its priority's clock: no credit for the past."""
        client.weight_ratio = client.weight.as_integer_ratio()
        client.finish_tag = self._virtual.get(client.priority, 0)

    def start_tag(self, client: Client) -> int:
        """Where ``client``'s next grant would start (lower goes first)."""
        virtual = self._virtual.get(client.priority, 0)
        tag = client.finish_tag
        return tag if tag > virtual else virtual

    def charge(self, client: Client, cost: float) -> None:
        """``client`` was granted ``cost`` seconds of core time: the clock moves to its
        start, its finish tag past it by the cost divided by its weight."""
        start = self.start_tag(client)
        self._virtual[client.priority] = start
        numerator, denominator = client.weight_ratio
        client.finish_tag = start + round(cost * TAG_UNITS) * denominator // numerator


class Dispatcher:
    """The decision for the cores whose records are ``records`` (by core number).

    State (loop thread only): ``clients`` in the order they joined, each with its
    ``idle_slots``; every lane's ``in_rotation`` and ``consecutive_failures`` (the
    fault policy) and every request's ``slot`` and slot's ``request`` (the pairing);
    ``_probes``, the lanes out of rotation and when each one's probe is due;
    ``shares``, the fair-queuing clock and tags (:class:`FairShares`); ``_alone``, the
    one engine on the cores while it is alone (the fast path); ``_top``, per core, the
    highest priority of its engines, and ``_depth``, the tasks a top-priority task may
    fill it to; ``_running`` / ``_again``: an assignment started from
    within a grant (a request that ended at its start released its slot) is folded into
    the one running; ``_reopen``: the timer of the next assignment, when the depth rule
    held a task back until a core's work left is short enough (``_reopen_at``: when it
    is due; a probe's comes due the same way). The records themselves are written by
    ``_core_record`` alone.
    """

    def __init__(self, records: Mapping[int, CoreRecord]) -> None:
        self.records = dict(records)
        self.clients: list[Client] = []
        self.shares = FairShares()
        self._orders = itertools.count()
        self._running = False
        self._again = False
        self._reopen: asyncio.TimerHandle | None = None
        self._reopen_at = float("inf")
        self._alone: Client | None = None
        self._probes: dict[int, tuple[Client, CoreLane, float]] = {}  # by id of the lane
        self._top: dict[int, int] = dict.fromkeys(self.records, 0)
        self._depth: dict[int, int] = dict.fromkeys(self.records, TOP_DEPTH)

    def join(
        self,
        flow: Starter,
        priority: int,
        weight: float,
        *,
        max_faults: int | None = None,
        probe_interval: float = 1.0,
    ) -> Client:
        cores = list(flow.lanes)
        lanes = {core.core: core for core in cores}
        idle = sum(len(core.idle) for core in cores)
        order = next(self._orders)
        client = Client(
            flow, priority, weight, order, lanes, cores, idle, max_faults, probe_interval
        )
        self.shares.joined(client)
        self.clients.append(client)
        self._rank()
        return client

    def leave(self, client: Client) -> None:
        """The engine is closed: its tasks no longer count, others take its room."""
        self.cancel_probes(client)
        if client in self.clients:
            self.clients.remove(client)
            self._rank()
            self.assign()

    def _rank(self) -> None:
        clients = self.clients
        self._alone = clients[0] if len(clients) == 1 else None
        self._top = {
            n: max((c.priority for c in clients if n in c.lanes), default=0) for n in self.records
        }
        self._depth = {n: self._room(n) for n in self.records}

    def _room(self, number: int) -> int:
        """Tasks a top-priority task may fill core ``number`` to: :data:`TOP_DEPTH`; with
        several engines of the top priority there, the smallest of their rings, at
        least :data:`DEPTH` (so weights decide among them); one engine alone on the
        core: its ring, as a lone engine's."""
        on_core = [c for c in self.clients if number in c.lanes]
        rings = [len(c.lanes[number].slots) for c in on_core if c.priority >= self._top[number]]
        if len(on_core) == 1:
            return rings[0]
        if len(rings) < 2:  # (one engine of the top priority: nobody to share it with)
            return TOP_DEPTH
        return max(DEPTH, min(TOP_DEPTH, *rings))

    def held(self, number: int) -> int:
        """Tasks core ``number`` holds, of every engine (assigned slots)."""
        return self.records[number].held

    def assign(self) -> None:
        """Start waiting requests while some core has room (see the module's rule)."""
        if self._probes:
            self._start_probes()
        alone = self._alone
        if alone is not None:  # the fast path: one engine, bounded by its ring alone
            flow = alone.flow
            if flow.life.state is not EngineState.OPEN:
                return
            scheduler = flow.scheduler
            cores = alone.own_lanes
            while alone.idle_slots and scheduler.queued:
                best: CoreLane | None = None
                for core in cores:  # in rotation, with an idle slot, holding least
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
                if best is None:
                    return
                # (as _pair, inlined: a call less for every request of a lone engine)
                slot: Slot = take(best)
                alone.idle_slots -= 1
                request = scheduler.next_request()
                request.slot = slot
                slot.request = request
                flow.start(request, slot)
            return
        if self._running:
            self._again = True
            return
        self._running = True
        try:
            while True:
                self._again = False
                while self._grant():
                    pass
                if not self._again:
                    return
        finally:
            self._running = False

    def _grant(self) -> bool:
        """Start one request on the best core for it; False when none can start."""
        records = self.records
        depth = self._depth
        for number, record in records.items():
            held = record.held
            if held < depth[number] or held < DEPTH:  # (room for the top, or below it)
                break
        else:
            return False
        open_ = EngineState.OPEN
        waiting = [
            client
            for client in self.clients
            if client.flow.scheduler.queued and client.flow.life.state is open_
        ]
        if not waiting:
            return False
        if len(waiting) > 1:
            start_tag = self.shares.start_tag
            waiting.sort(key=lambda c: (-c.priority, start_tag(c), c.order))
        now = time.monotonic()
        for client in waiting:
            core = self._best_core(client, now)
            if core is None:
                continue
            cost = core.service_time
            self.shares.charge(client, cost)
            client.granted_time += cost
            client.grants += 1
            client.flow.start(*self._pair(client, core))
            return True
        return False

    # -- slots ---------------------------------------------------------------------------

    def _pair(self, client: Client, core: CoreLane) -> tuple[Request, Slot]:
        """Give ``client``'s next waiting request an idle slot of ``core`` (it has
        both): PACKING from then on."""
        slot: Slot = take(core)
        client.idle_slots -= 1
        request = client.flow.scheduler.next_request()
        request.slot = slot
        slot.request = request
        return request, slot

    def release(self, client: Client, slot: Slot) -> None:
        """``slot``'s work is over: idle again, its request (if it still had one) no
        longer holds it (the caller assigns again afterwards)."""
        request = slot.request
        if request is not None:
            request.slot = None
            slot.request = None
        give_back(slot)
        client.idle_slots += 1

    def lost_slot(self, request: Request) -> None:
        """The request's slot failed to take its work: the request no longer holds it
        (the slot comes back, with no request, once its stream ran what reached it)."""
        slot = request.slot
        request.slot = None
        if slot is not None:
            slot.request = None

    # -- the fault policy --------------------------------------------------------------

    def task_ended(self, client: Client, core: CoreLane, status: int) -> bool:
        """Count a task's status against ``client``'s lane ``core``; True when the core
        leaves rotation now (too many failures in a row while another of its cores
        serves), and its probe is then due a ``probe_interval`` later. A success only
        resets the count (the flow asks only when there is one to reset)."""
        if not status:
            core.consecutive_failures = 0
            return False
        core.consecutive_failures += 1
        limit = client.max_faults
        if (
            limit is None
            or not core.in_rotation
            or core.consecutive_failures < limit
            or not any(other.in_rotation for other in client.own_lanes if other is not core)
        ):
            return False
        core.in_rotation = False
        self.probe_later(client, core)
        return True

    def probe_ended(self, client: Client, core: CoreLane, status: int) -> bool:
        """A probe task of a core out of rotation ended; True when it brings the core
        back (it succeeded), else the core is probed again later."""
        if status:
            self.probe_later(client, core)
            return False
        core.in_rotation = True
        core.consecutive_failures = 0
        return True

    def suspend(self, client: Client) -> None:
        """No core of ``client`` takes a request until :meth:`resume` (its worker
        process is replaced); no probe runs meanwhile."""
        self.cancel_probes(client)
        for core in client.own_lanes:
            core.in_rotation = False

    def resume(self, client: Client) -> None:
        """Every core of ``client`` is back in rotation with a clean record of faults."""
        for core in client.own_lanes:
            core.in_rotation = True
            core.consecutive_failures = 0

    def probe_later(self, client: Client, core: CoreLane) -> None:
        """Probe ``client``'s lane ``core`` (out of rotation) a ``probe_interval`` from
        now: the assignment then starts its probe task."""
        due = time.monotonic() + client.probe_interval
        self._probes[id(core)] = (client, core, due)
        self._assign_at(due)

    def cancel_probes(self, client: Client) -> None:
        """No probe of ``client``'s cores is due any more (it closes, or dies)."""
        for core in client.own_lanes:
            self._probes.pop(id(core), None)

    def _start_probes(self) -> None:
        """Start each probe that is due, on an idle slot of its core (one whose slots
        are all still busy, a hung task's, is probed again later); time the next."""
        now = time.monotonic()
        for key, (client, core, due) in list(self._probes.items()):
            if due > now:
                self._assign_at(due)
                continue
            del self._probes[key]
            flow = client.flow
            if flow.life.state is not EngineState.OPEN or core.in_rotation:
                continue
            if not core.idle:
                self.probe_later(client, core)
                continue
            slot: Slot = take(core)
            client.idle_slots -= 1
            flow.probe(slot)

    def _best_core(self, client: Client, now: float) -> CoreLane | None:
        """The core with room for ``client``'s task where it would end soonest, by the
        estimates (after what the core should finish first; ties: the core it used
        less)."""
        best: CoreLane | None = None
        best_key: tuple[float, int] | None = None
        records = self.records
        for number, core in client.lanes.items():
            if not core.idle or not core.in_rotation:
                continue
            record = records[number]
            free = record.expected_free
            if not self._has_room(client, core, record, free, now):
                continue
            key = ((free if free > now else now) + core.service_time, core.assigned_total)
            if best_key is None or key < best_key:
                best, best_key = core, key
        return best

    def _has_room(
        self, client: Client, core: CoreLane, record: CoreRecord, free: float, now: float
    ) -> bool:
        """Whether ``client``'s task may start on ``core``, whose record says what it
        holds and when it should be free (see the module's depth rule). When only the
        core's work left holds it back, the next assignment is timed for when that
        work is short enough."""
        held = record.held
        number = record.number
        if client.priority >= self._top[number]:
            return held < self._depth[number]
        if held >= DEPTH:
            return False
        left = free - now
        lead = core.service_time if core.service_time < LOWER_LEAD else LOWER_LEAD
        if left <= lead:
            return True
        self._assign_at(now + left - lead)
        return False

    def _assign_at(self, when: float) -> None:
        """Assign again at ``when`` (``time.monotonic``), unless one is due sooner."""
        if when >= self._reopen_at:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop runs (a close outside it): nothing can start anyway
            return
        if self._reopen is not None:  # due later: this one replaces it
            self._reopen.cancel()
        self._reopen_at = when
        self._reopen = loop.call_later(max(0.0, when - time.monotonic()), self._reopened)

    def _reopened(self) -> None:
        self._reopen = None
        self._reopen_at = float("inf")
        self.assign()
