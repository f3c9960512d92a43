"""One feed per DLA core, shared by every engine on an :class:`aiodla.Cores`: which
engine's request goes next on which core.

Each engine keeps its own waiting line, slots, statistics and health (its
:class:`~aiodla._scheduler.Scheduler`); the feeds decide, across all of them, who may
start a task on a core and when. The rule, applied after every admission, completion,
cancellation and release of any engine on the cores:

- **Depth.** A task of an engine below the top priority on a core (some engine on the
  core has a higher one) starts only while the core holds fewer than :data:`DEPTH`
  tasks of all engines together (assigned to a slot and not yet ended), and only while
  the work the core has left, by the estimates, is at most that task's own time. So the
  work queued on the core is never more than two such tasks' time: a task below the top
  priority is never queued behind a long one (a detector's task that just started), and
  when the rule holds it back, a timer lets it start as soon as the core's work left is
  short enough, so the core does not idle meanwhile. A DLA task cannot be pre-empted, so
  this is what bounds the wait of urgent work: a top-priority request waits for at most
  two task times of the longest lower-priority model on the core, besides the
  top-priority work admitted before it, then runs. Its latency is at most its own task
  time plus two task times of the longest lower-priority model on the core (plus the
  loop's round trip). Engines of the top priority, which nobody can be kept waiting
  behind, may fill a core up to :data:`TOP_DEPTH` tasks: more queued work bridges the
  loop's round trip at each task's end, so the core never idles.
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

**Urgent completions.** An engine's poller thread needs the interpreter lock to see
its tasks done, and a loop kept busy by lower-priority engines holds it: the wake-up
comes late. So for an engine above the lowest priority here the loop looks itself: a
loop timer at each of its tasks' expected end (a busy loop runs it on time; an idle one
leaves the lock to the poller), and a look between two batches of a lower-priority
engine's completions (``Poller.harvest(at_least=1)``).

Only the event loop's thread touches this state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from typing import TYPE_CHECKING, Protocol

from ._life import EngineState, Life

if TYPE_CHECKING:
    from ._scheduler import Request, Scheduler
    from ._slots import CoreState, Slot

__all__ = ["DEPTH", "TOP_DEPTH", "Client", "FairShares", "Feeds", "Starter"]

# Tasks a core may hold when a task below the top priority starts: one running, one
# queued behind it.
DEPTH = 2
# Tasks a core may hold when a task of the top priority starts.
TOP_DEPTH = 4
# The loop's looks at an urgent task (see take_due): past its expected end, again this
# often while it runs, this many looks in all; the poller thread still sees it after.
LOOK_AGAIN = 100e-6
LOOKS = 8
# Fair-queuing tags count core time in these units per unit of weight (femtoseconds):
# integers, exact however far the clock runs. (A float clock grown large rounds a small
# cost to nothing: after a weight-1e-16 engine's few grants pushed it to ~1e13, the
# other engines' costs no longer moved their tags and their weights stopped counting.)
TAG_UNITS = 10**15


class Starter(Protocol):
    """What the feeds ask of an engine's flow."""

    life: Life
    scheduler: Scheduler
    loop: asyncio.AbstractEventLoop

    def start(self, request: Request, slot: Slot) -> None: ...
    def sweep(self, at_least: int | None = None) -> list[tuple[Slot, int]] | None: ...
    def on_completions(self, finished: list[tuple[Slot, int]]) -> None: ...


@dataclasses.dataclass(eq=False)
class Client:
    """One engine on the feeds: its place in the order, and what it was granted."""

    flow: Starter
    priority: int
    weight: float
    order: int  # ties go to the engine that joined first
    cores: dict[int, CoreState]  # its own state of each core it uses, by number
    finish_tag: int = 0  # start-time fair queuing: where its last grant ended
    # The weight as an exact fraction: a grant's cost in tags is cost * den // num.
    weight_ratio: tuple[int, int] = (1, 1)
    granted_time: float = 0.0  # seconds of core time granted, by its own estimates
    grants: int = 0

    def waiting(self) -> bool:
        flow = self.flow
        return flow.life.state is EngineState.OPEN and flow.scheduler.queued > 0


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


class Feeds:
    """The feeds of the cores ``numbers``: the engines on them and the decision.

    State (loop thread only): ``clients`` in the order they joined; ``shares``, the
    fair-queuing clock and tags (:class:`FairShares`); ``_running`` /
    ``_again``: a dispatch started from within a grant (a request that ended at its
    start released its slot) is folded into the one running; ``_reopen``: the timer of
    the next dispatch, when the depth rule held a task back until a core's work left is
    short enough (``_reopen_at``: when it is due).
    """

    def __init__(self, numbers: tuple[int, ...]) -> None:
        self.numbers = numbers
        self.clients: list[Client] = []
        self.shares = FairShares()
        self._orders = itertools.count()
        self._running = False
        self._again = False
        self._reopen: asyncio.TimerHandle | None = None
        self._reopen_at = float("inf")
        self._top: dict[int, int] = {}  # per core, the highest priority of its engines
        self.lowest = self.highest = 0  # the lowest and highest priority of the engines here

    def join(self, flow: Starter, priority: int, weight: float) -> Client:
        cores = {core.core: core for core in flow.scheduler.cores}
        client = Client(flow, priority, weight, next(self._orders), cores)
        self.shares.joined(client)
        self.clients.append(client)
        self._rank()
        return client

    def leave(self, client: Client) -> None:
        """The engine is closed: its tasks no longer count, others take its room."""
        if client in self.clients:
            self.clients.remove(client)
            self._rank()
            self.dispatch()

    def _rank(self) -> None:
        self.lowest = min((c.priority for c in self.clients), default=0)
        self.highest = max((c.priority for c in self.clients), default=0)
        self._top = {
            n: max((c.priority for c in self.clients if n in c.cores), default=0)
            for n in self.numbers
        }

    # -- urgent completions: the loop looks itself (see the module's docstring) ------------

    def submitted(self, client: Client, slot: Slot) -> None:
        """``client``'s task went to ``slot``: above the lowest priority here, the loop
        looks at its expected end too."""
        request = slot.request
        if client.priority > self.lowest and request is not None:
            # (expected_done is time.monotonic's; the loop's own clock may differ: uvloop)
            wait = max(0.0, slot.expected_done - time.monotonic())
            client.flow.loop.call_later(wait, self._look, client, slot, request, LOOKS)

    def _look(self, client: Client, slot: Slot, request: Request, looks: int) -> None:
        """The loop's look at an urgent task's expected end: the estimate is rough, so
        while the task still runs, again :data:`LOOK_AGAIN` later, ``looks`` times."""
        self.take_due(client)
        if slot.request is request and looks > 1:
            client.flow.loop.call_later(LOOK_AGAIN, self._look, client, slot, request, looks - 1)

    def take_due_above(self, client: Client) -> None:
        """The loop is between two batches of ``client``'s completions: every engine of
        a higher priority takes its own that are due by now."""
        if client.priority >= self.highest:  # (none above it: one test a batch)
            return
        for other in tuple(self.clients):
            if other.priority > client.priority:
                self.take_due(other)

    def take_due(self, client: Client) -> None:
        """``client`` takes, on the loop, its completions that are due by now."""
        finished = client.flow.sweep(at_least=1)
        if finished:
            client.flow.on_completions(finished)

    def held(self, number: int) -> int:
        """Tasks core ``number`` holds, of every engine (assigned slots)."""
        return sum(c.cores[number].outstanding for c in self.clients if number in c.cores)

    def dispatch(self) -> None:
        """Start waiting requests while some core has room (see the module's rule)."""
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
        held = {n: self.held(n) for n in self.numbers}
        if all(count >= TOP_DEPTH for count in held.values()):
            return False
        waiting = [client for client in self.clients if client.waiting()]
        if not waiting:
            return False
        start_tag = self.shares.start_tag
        waiting.sort(key=lambda c: (-c.priority, start_tag(c), c.order))
        now = time.monotonic()
        free = {n: self._expected_free(n) for n in self.numbers}
        for client in waiting:
            room = [n for n in self.numbers if self._has_room(client, n, held[n], free[n], now)]
            core = self._best_core(client, room, free, now)
            if core is None:
                continue
            assignment = client.flow.scheduler.next_on(core)
            if assignment is None:  # (it has a request queued: cannot happen)
                continue
            cost = core.service_time
            self.shares.charge(client, cost)
            client.granted_time += cost
            client.grants += 1
            # The task queues behind every engine's work on the core, not only behind
            # this engine's: its estimated end (which the poller looks at) starts there.
            core.expected_free = max(core.expected_free, free[core.core])
            client.flow.start(*assignment)
            return True
        return False

    def _has_room(self, client: Client, number: int, held: int, free: float, now: float) -> bool:
        """Whether ``client``'s task may start on core ``number``, which holds ``held``
        tasks and should finish them at ``free`` (see the module's depth rule). When
        only the core's work left holds it back, the next dispatch is timed for when
        that work is short enough."""
        core = client.cores.get(number)
        if core is None:
            return False
        if client.priority >= self._top[number]:
            return held < TOP_DEPTH
        if held >= DEPTH:
            return False
        left = free - now
        if left <= core.service_time:
            return True
        self._dispatch_at(now + left - core.service_time)
        return False

    def _dispatch_at(self, when: float) -> None:
        """Dispatch again at ``when`` (``time.monotonic``), unless one is due sooner."""
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
        self.dispatch()

    def _expected_free(self, number: int) -> float:
        """When core ``number`` should finish what every engine gave it."""
        end = 0.0
        for client in self.clients:
            core = client.cores.get(number)
            if core is not None and core.expected_free > end:
                end = core.expected_free
        return end

    def _best_core(
        self, client: Client, room: list[int], free: dict[int, float], now: float
    ) -> CoreState | None:
        """The core with room where ``client``'s next task would end soonest, by the
        estimates (``free``: when each core should finish what it has; ties: the core
        it used less)."""
        best: CoreState | None = None
        best_key: tuple[float, int] | None = None
        for number in room:
            core = client.cores.get(number)
            if core is None or not core.idle or not core.in_rotation:
                continue
            ends = free[number]
            key = ((ends if ends > now else now) + core.service_time, core.assigned_total)
            if best_key is None or key < best_key:
                best, best_key = core, key
        return best
