"""The dispatcher of an :class:`aiodla.Cores`: which engine's waiting request starts
next, and on which core.

Each engine keeps its own waiting line, slots, statistics and health (its
:class:`~aiodla._scheduler.Scheduler`); the dispatcher decides, across all of them, who
may start a task on a core and when. It reads each physical core as it is, from the
core's one record (:class:`~aiodla._core_record.CoreRecord`: the tasks it holds of every
engine, when it should finish them), and makes one decision, :meth:`Dispatcher.assign`,
after every admission, completion, cancellation and release of any engine on the
cores. A lone engine's own :meth:`~aiodla._scheduler.Scheduler.next_assignment` is this
rule's fast path for one engine (every lone engine runs on cores of its own, a private
:class:`~aiodla.Cores`): nobody ranks above or beside it, so depth and weight have
nothing to decide, its own ring bounds what it queues, and the rule reduces to the
next request on the core with the least work held.

The rule:

- **Depth.** A task of an engine below the top priority on a core (some engine on the
  core has a higher one) starts only while the core holds fewer than :data:`DEPTH`
  tasks of all engines together (assigned to a slot and not yet ended), and only while
  the work the core has left, by the estimates, is at most that task's own time. So the
  work queued on the core is never more than two such tasks' time: a task below the top
  priority is never queued behind a long one (a detector's task that just started), and
  when the rule holds it back, a timer lets it start as soon as the core's work left is
  short enough, so the core does not idle meanwhile (every held-back task gets one). A
  DLA task cannot be pre-empted, so this is what bounds the wait of urgent work: a
  top-priority request waits for at most two task times of the longest lower-priority
  model on the core, besides the top-priority work admitted before it, then runs. Its
  latency is at most its own task time plus two task times of the longest
  lower-priority model on the core (plus the loop's round trip). Engines of the top
  priority, which nobody can be kept waiting behind, may fill a core up to the
  smallest ring among them there (their ``streams_per_core``), never past
  :data:`TOP_DEPTH` tasks nor short of :data:`DEPTH`: then the core's room runs out
  before any such engine's ring, so each time a place frees every engine with work
  has an idle slot for it, and weights decide who takes it (were the room larger, the
  rings would decide instead; engines with a ring of one slot take turns). Rings of 4
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

from ._core_record import CoreRecord
from ._life import EngineState, Life

if TYPE_CHECKING:
    from ._scheduler import Request, Scheduler
    from ._slots import CoreLane, Slot

__all__ = ["DEPTH", "TOP_DEPTH", "Client", "Dispatcher", "FairShares", "Starter"]

# Tasks a core may hold when a task below the top priority starts: one running, one
# queued behind it.
DEPTH = 2
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

    def start(self, request: Request, slot: Slot) -> None: ...


@dataclasses.dataclass(eq=False)
class Client:
    """One engine on the dispatcher: its place in the order, and what it was granted."""

    flow: Starter
    priority: int
    weight: float
    order: int  # ties go to the engine that joined first
    lanes: dict[int, CoreLane]  # its own lane on each core it uses, by core number
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

    State (loop thread only): ``clients`` in the order they joined; ``shares``, the
    fair-queuing clock and tags (:class:`FairShares`); ``_alone``, the flow of the one
    engine on the cores while it is alone (the fast path); ``_top``, per core, the
    highest priority of its engines, and ``_depth``, the tasks a top-priority task may
    fill it to; ``_running`` / ``_again``: an assignment started from
    within a grant (a request that ended at its start released its slot) is folded into
    the one running; ``_reopen``: the timer of the next assignment, when the depth rule
    held a task back until a core's work left is short enough (``_reopen_at``: when it
    is due). The records themselves are written by ``_core_record`` alone.
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
        self._alone: Starter | None = None
        self._top: dict[int, int] = dict.fromkeys(self.records, 0)
        self._depth: dict[int, int] = dict.fromkeys(self.records, TOP_DEPTH)

    def join(self, flow: Starter, priority: int, weight: float) -> Client:
        lanes = {core.core: core for core in flow.scheduler.cores}
        client = Client(flow, priority, weight, next(self._orders), lanes)
        self.shares.joined(client)
        self.clients.append(client)
        self._rank()
        return client

    def leave(self, client: Client) -> None:
        """The engine is closed: its tasks no longer count, others take its room."""
        if client in self.clients:
            self.clients.remove(client)
            self._rank()
            self.assign()

    def _rank(self) -> None:
        clients = self.clients
        self._alone = clients[0].flow if len(clients) == 1 else None
        self._top = {
            n: max((c.priority for c in clients if n in c.lanes), default=0) for n in self.records
        }
        self._depth = {n: self._room(n) for n in self.records}

    def _room(self, number: int) -> int:
        """Tasks a top-priority task may fill core ``number`` to: the smallest ring of
        the top-priority engines there, at most :data:`TOP_DEPTH` and at least
        :data:`DEPTH` (one engine alone on the core: its ring, as a lone engine's)."""
        on_core = [c for c in self.clients if number in c.lanes]
        rings = [len(c.lanes[number].slots) for c in on_core if c.priority >= self._top[number]]
        if not rings:
            return TOP_DEPTH
        if len(on_core) == 1:
            return rings[0]
        return max(DEPTH, min(TOP_DEPTH, *rings))

    def held(self, number: int) -> int:
        """Tasks core ``number`` holds, of every engine (assigned slots)."""
        return self.records[number].held

    def assign(self) -> None:
        """Start waiting requests while some core has room (see the module's rule)."""
        alone = self._alone
        if alone is not None:  # the fast path: one engine, bounded by its ring alone
            if alone.life.state is EngineState.OPEN:
                next_assignment = alone.scheduler.next_assignment
                while (assignment := next_assignment()) is not None:
                    alone.start(*assignment)
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
            assignment = client.flow.scheduler.next_on(core)
            if assignment is None:  # (it has a request queued: cannot happen)
                continue
            cost = core.service_time
            self.shares.charge(client, cost)
            client.granted_time += cost
            client.grants += 1
            client.flow.start(*assignment)
            return True
        return False

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
        if left <= core.service_time:
            return True
        self._assign_at(now + left - core.service_time)
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
