"""The shared cores' decision itself (:class:`aiodla._dispatch.Dispatcher`), on engines
reduced to what it reads: priority decides every grant, not only through the depth rule.
Each time a core has room and requests of several priorities wait, the highest goes,
even where fair queuing alone would pick the lower one (it joined first and has been
granted nothing); a lower priority goes only where no higher one can start."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import sys
import time
import types
from typing import Any

import pytest

from aiodla import _dispatch
from aiodla._core_record import CoreRecord
from aiodla._dispatch import DEPTH, LOWER_LEAD, TOP_DEPTH, Client, Dispatcher, FairShares
from aiodla._life import EngineState

from support import wait_until


@dataclasses.dataclass(eq=False)
class Slot:
    core: Core
    request: Any = None


@dataclasses.dataclass(eq=False)
class Started:
    """A request the dispatcher started (it holds its slot)."""

    name: str
    slot: Any = None


@dataclasses.dataclass(eq=False)
class Core:
    """An engine's own lane on one core, as the dispatcher reads and takes it; ``record``
    is the physical core's, shared by every engine on it."""

    core: int
    record: CoreRecord
    ring: int = 4
    service_time: float = 0.001
    in_rotation: bool = True
    consecutive_failures: int = 0
    assigned_total: int = 0
    slots: list[Slot] = dataclasses.field(default_factory=list)
    idle: collections.deque[Slot] = dataclasses.field(default_factory=collections.deque)

    def __post_init__(self) -> None:
        self.slots = [Slot(self) for _ in range(self.ring)]
        self.idle.extend(self.slots)


class Engine:
    """What the feeds ask of an engine's flow: its state, its queue, its start."""

    def __init__(
        self, name: str, started: list[str], records: dict[int, CoreRecord], slots: int = 4
    ) -> None:
        self.name = name
        self.started = started
        self.life = dataclasses.make_dataclass("Life", ["state"])(EngineState.OPEN)
        self.scheduler = self
        self.cores = [Core(n, record, slots) for n, record in records.items()]
        self.lanes = self.cores
        self.queued = 0
        self.client: Client | None = None  # (the dispatcher's, once it joined)

    def next_request(self) -> Started:
        self.queued -= 1
        return Started(self.name)

    def start(self, request: Started, slot: Slot) -> None:
        self.started.append(request.name)

    def probe(self, slot: Slot) -> None:
        self.started.append(f"probe {self.name}")

    def end_one(self, feeds: Dispatcher, number: int = 0) -> None:
        """The oldest of its tasks on core ``number`` ended."""
        core = self.cores[number]
        busy = next(slot for slot in core.slots if slot not in core.idle)
        assert self.client is not None
        feeds.release(self.client, busy)
        feeds.assign()


def join(feeds: Dispatcher, engine: Engine, priority: int, weight: float) -> Client:
    engine.client = feeds.join(engine, priority=priority, weight=weight)
    return engine.client


def low_and_high(high_slots: int = 4) -> tuple[list[str], Engine, Engine, Dispatcher]:
    """A low (priority 0, joined first) and a high (priority 1) engine on one core,
    and the list their starts go to."""
    started: list[str] = []
    records = {0: CoreRecord(0)}
    low, high = Engine("low", started, records), Engine("high", started, records, high_slots)
    feeds = Dispatcher(records)
    join(feeds, low, 0, 1.0)
    join(feeds, high, 1, 1.0)
    return started, low, high, feeds


def test_a_waiting_higher_priority_goes_first_though_fair_queuing_says_otherwise() -> None:
    started, low, high, feeds = low_and_high()  # low joined first: ties go to it
    low.queued, high.queued = 3, 3
    feeds.assign()
    # The high engine fills the core to its depth before any low task starts; a low
    # one would have started first by the fair-queuing order alone.
    assert started == ["high"] * 3
    assert feeds.held(0) == 3 < TOP_DEPTH and low.queued == 3


def test_a_lower_priority_goes_where_no_higher_one_can_start() -> None:
    started, low, high, feeds = low_and_high(high_slots=1)
    low.queued, high.queued = 3, 3
    feeds.assign()
    # The high engine's one slot is busy: a low task may queue behind it (depth 2).
    assert started == ["high", "low"] and feeds.held(0) == DEPTH
    for _ in range(2):  # at each end of a high task, its next goes before the next low
        high.end_one(feeds)
        low.end_one(feeds)
    assert started == ["high", "low", "high", "low", "high", "low"]


def test_a_lower_task_waits_until_the_work_left_on_the_core_is_short() -> None:
    # The high engine's task has 50 ms left on the core (it just started): one low task
    # queued behind it would make urgent work arriving now wait 50 ms + 1 ms, beyond
    # the rule's two low task times. Count alone (one held, depth two) would let it go.
    started, low, high, feeds = low_and_high(high_slots=1)
    high.queued = 1
    feeds.assign()
    assert started == ["high"]
    feeds.records[0].expected_free = time.monotonic() + 0.050  # (the core record's estimate)
    low.queued = 1
    feeds.assign()
    assert started == ["high"] and low.queued == 1
    # Its task near its end: what is left is shorter than one low task, which may queue.
    feeds.records[0].expected_free = time.monotonic() + 0.0005
    feeds.assign()
    assert started == ["high", "low"] and feeds.held(0) == DEPTH


@pytest.mark.asyncio
async def test_a_held_back_task_starts_when_the_work_left_is_short_with_no_other_event() -> None:
    # Nothing ends or arrives meanwhile: the feeds' own timer starts the low task once
    # the high task's work left is at most one low task, before the high task ends (so
    # the core is never left idle between them).
    started, low, high, feeds = low_and_high(high_slots=1)
    high.queued = 1
    feeds.assign()
    feeds.records[0].expected_free = end = time.monotonic() + 0.040
    low.cores[0].service_time = 0.010
    low.queued = 1
    feeds.assign()
    assert started == ["high"]
    await wait_until(lambda: started == ["high", "low"])
    assert time.monotonic() >= end - 0.010  # not before the work left was short enough
    assert time.monotonic() < end + 0.5  # (its timer's, not a later one's: 30 ms from now)
    assert not high.cores[0].idle  # the high task still held: no end was needed


@pytest.mark.asyncio
async def test_every_held_back_task_gets_its_timer_not_only_the_first() -> None:
    # Twice over: a high task just started (40 ms left), a low task held back. The
    # second hold must start on its own timer as the first did, with no other event.
    started, low, high, feeds = low_and_high(high_slots=1)
    low.cores[0].service_time = 0.010
    for round_ in range(1, 3):
        high.queued = 1
        feeds.assign()
        feeds.records[0].expected_free = end = time.monotonic() + 0.040
        low.queued = 1
        feeds.assign()
        assert started == ["high", "low"] * (round_ - 1) + ["high"]
        await wait_until(lambda: started == ["high", "low"] * round_)  # noqa: B023
        assert time.monotonic() >= end - 0.010
        high.end_one(feeds)
        low.end_one(feeds)
        feeds.records[0].expected_free = 0.0


def client(priority: int, weight: float, order: int) -> Client:
    return Client(
        flow=None,  # type: ignore[arg-type]
        priority=priority,
        weight=weight,
        order=order,
        lanes={},
        own_lanes=[],
        idle_slots=0,
    )


def granted(shares: FairShares, clients: tuple[Client, ...], grants: int) -> list[int]:
    """The order of ``grants`` grants of a millisecond each to ``clients``, each going to
    the one fair queuing puts first (the smallest start tag, then the earlier opened)."""
    orders = []
    for _ in range(grants):
        chosen = min(clients, key=lambda c: (shares.start_tag(c), c.order))
        shares.charge(chosen, 0.001)
        orders.append(chosen.order)
    return orders


def grants_to(shares: FairShares, clients: tuple[Client, ...], grants: int) -> list[int]:
    """How many of ``grants`` grants (as :func:`granted`) each of ``clients`` got."""
    orders = granted(shares, clients, grants)
    return [orders.count(c.order) for c in clients]


def test_fair_shares_stay_exact_however_far_the_clock_has_run() -> None:
    # The smallest weight, alone on its priority for a while, moves the clock far (here
    # as far as centuries of grants would): costs of a millisecond must still count.
    shares = FairShares()
    slow, three, one = client(0, 0.001, 0), client(0, 3.0, 1), client(0, 1.0, 2)
    shares.joined(slow)
    for _ in range(2):
        shares.charge(slow, 1e10)
    for c in (three, one):
        shares.joined(c)
    assert grants_to(shares, (three, one), 400) == [300, 100]


def test_engines_of_one_priority_fill_a_core_to_their_smallest_ring() -> None:
    # Rings of 2 (the default streams_per_core): were the core's room TOP_DEPTH, each
    # engine's ring would run out first, each end would free only its engine's slot,
    # and the grants would alternate whatever the weights. The room is the rings'.
    started: list[str] = []
    records = {0: CoreRecord(0)}
    heavy, light = Engine("heavy", started, records, 2), Engine("light", started, records, 2)
    feeds = Dispatcher(records)
    join(feeds, heavy, 0, 2.0)
    join(feeds, light, 0, 1.0)
    heavy.queued = light.queued = 100
    feeds.assign()
    assert feeds.held(0) == 2
    engines = {"heavy": heavy, "light": light}
    for task in range(60):  # the core ends its tasks in the order they started
        engines[started[task]].end_one(feeds)
        assert feeds.held(0) == 2
    assert started[2:62].count("heavy") == pytest.approx(40, abs=2)


def test_a_ring_of_one_slot_still_leaves_room_for_a_task_queued_behind() -> None:
    started: list[str] = []
    records = {0: CoreRecord(0)}
    one, other = Engine("one", started, records, 1), Engine("other", started, records, 1)
    feeds = Dispatcher(records)
    join(feeds, one, 0, 1.0)
    join(feeds, other, 0, 1.0)
    one.queued = other.queued = 3
    feeds.assign()
    assert started == ["one", "other"] and feeds.held(0) == DEPTH


def two_engines_on_core_0(ring: int) -> tuple[Dispatcher, list[str], Engine, Engine, Client]:
    """Engines "a" and "b", each with a ring of ``ring`` slots, of one priority and
    weight on core 0 of a dispatcher; and a's client."""
    started: list[str] = []
    records = {0: CoreRecord(0)}
    a, b = Engine("a", started, records, ring), Engine("b", started, records, ring)
    feeds = Dispatcher(records)
    client = join(feeds, a, 0, 1.0)
    join(feeds, b, 0, 1.0)
    return feeds, started, a, b, client


def two_cores_with(
    first: tuple[str, int, int, int], second: tuple[str, int, int, int]
) -> tuple[Dispatcher, list[str], Engine, Engine]:
    """A dispatcher over cores 0 and 1 and two engines of weight 1 on it, each given as
    (name, its one core, its ring of slots, its priority)."""
    started: list[str] = []
    records = {0: CoreRecord(0), 1: CoreRecord(1)}
    feeds = Dispatcher(records)
    engines = []
    for name, core, ring, priority in (first, second):
        engine = Engine(name, started, {core: records[core]}, ring)
        join(feeds, engine, priority, 1.0)
        engines.append(engine)
    return feeds, started, engines[0], engines[1]


def test_one_engine_alone_on_a_core_fills_its_whole_ring() -> None:
    feeds, started, wide, _ = two_cores_with(("wide", 0, 8, 0), ("other", 1, 2, 0))
    wide.queued = 10
    feeds.assign()
    assert feeds.held(0) == 8 > TOP_DEPTH  # nobody beside it there: its ring bounds it
    assert started == ["wide"] * 8


@pytest.mark.asyncio
async def test_a_core_out_of_rotation_is_probed_by_the_assignment_when_due() -> None:
    # The fault policy is the dispatcher's: a core leaves rotation after max_faults
    # failures in a row (another core serving), and its probe starts on its own timer,
    # a probe_interval later, on an idle slot of that core; a failed probe is retried.
    started: list[str] = []
    records = {0: CoreRecord(0), 1: CoreRecord(1)}
    one = Engine("one", started, records, 2)
    feeds = Dispatcher(records)
    client = one.client = feeds.join(one, 0, 1.0, max_faults=2, probe_interval=0.02)
    core = one.cores[0]
    assert not feeds.task_ended(client, core, 7) and core.in_rotation
    began = time.monotonic()
    assert feeds.task_ended(client, core, 7) and not core.in_rotation
    one.queued = 1
    feeds.assign()
    assert started == ["one"] and one.cores[1].record.held == 1  # the core in rotation
    await wait_until(lambda: started == ["one", "probe one"])
    assert time.monotonic() - began >= 0.015
    assert len(core.idle) == 1 and client.idle_slots == 2
    assert not feeds.probe_ended(client, core, 7)  # failed: probed again later
    feeds.release(client, next(s for s in core.slots if s not in core.idle))
    await wait_until(lambda: started.count("probe one") == 2)
    assert feeds.probe_ended(client, core, 0) and core.in_rotation


@pytest.mark.asyncio
async def test_a_closing_engines_probe_does_not_start() -> None:
    started: list[str] = []
    records = {0: CoreRecord(0), 1: CoreRecord(1)}
    one = Engine("one", started, records, 2)
    feeds = Dispatcher(records)
    client = one.client = feeds.join(one, 0, 1.0, max_faults=1, probe_interval=0.01)
    assert feeds.task_ended(client, one.cores[0], 7)
    feeds.cancel_probes(client)
    await asyncio.sleep(0.05)
    feeds.assign()
    assert started == []


def test_the_one_top_priority_engine_queues_behind_lower_tasks_at_once() -> None:
    # A detector with the default ring of 2 on a core where a classifier keeps two
    # tasks (its depth): its request starts at once, queued behind them, instead of
    # waiting a round trip for one of them to end. Its ring bounds its own tasks.
    started, low, high, feeds = low_and_high(high_slots=2)
    low.queued = 5
    feeds.assign()
    assert started == ["low", "low"] and feeds.held(0) == DEPTH
    high.queued = 3
    feeds.assign()
    assert started == ["low", "low", "high", "high"] and feeds.held(0) == TOP_DEPTH


def test_a_lower_task_of_a_long_model_waits_for_the_lead_not_its_own_time() -> None:
    # A 10 ms classifier below a detector whose task has 5 ms left: under the old
    # rule (work left at most its own time) it would queue now, and urgent work
    # arriving meanwhile would wait 5 + 10 ms; it waits until LOWER_LEAD is left.
    started, low, high, feeds = low_and_high(high_slots=1)
    low.cores[0].service_time = 0.010
    high.queued = 1
    feeds.assign()
    feeds.records[0].expected_free = time.monotonic() + 0.005
    low.queued = 1
    feeds.assign()
    assert started == ["high"] and low.queued == 1
    feeds.records[0].expected_free = time.monotonic() + LOWER_LEAD / 2
    feeds.assign()
    assert started == ["high", "low"]


def probing_pair(
    intervals: tuple[float, float] = (0.01, 0.01), first_ring: int = 2
) -> tuple[list[str], Engine, Engine, Dispatcher]:
    """Engines ``a`` and ``b`` (each on cores 0 and 1), ``a``'s core 0 out of rotation
    first, then ``b``'s, with the probe intervals given: the probes are due in that
    order. No loop runs: the assignment starts them only when called."""
    started: list[str] = []
    records = {0: CoreRecord(0), 1: CoreRecord(1)}
    a, b = Engine("a", started, records, first_ring), Engine("b", started, records)
    feeds = Dispatcher(records)
    for engine, interval in zip((a, b), intervals, strict=True):
        engine.client = feeds.join(engine, 0, 1.0, max_faults=1, probe_interval=interval)
    for engine in (a, b):
        assert engine.client is not None and feeds.task_ended(engine.client, engine.cores[0], 7)
    return started, a, b, feeds


def test_a_probe_not_yet_due_does_not_hold_back_a_later_one_that_is() -> None:
    started, _, _, feeds = probing_pair(intervals=(10.0, 0.01))
    time.sleep(0.02)
    feeds.assign()
    assert started == ["probe b"]


def test_a_closing_engines_due_probe_is_dropped_and_the_next_one_starts() -> None:
    started, a, _, feeds = probing_pair()
    a.life.state = EngineState.CLOSING
    time.sleep(0.02)
    feeds.assign()
    assert started == ["probe b"]
    assert not a.cores[0].in_rotation  # (left as it was: the engine is closing)
    time.sleep(0.02)
    feeds.assign()
    assert started == ["probe b"]  # dropped, not put off


def test_a_core_whose_slots_are_all_busy_is_probed_once_one_is_free() -> None:
    # A hung task holds a's one slot on its core out of rotation: its probe, due, is
    # put off by another interval; b's, due as well, starts meanwhile.
    started: list[str] = []
    records = {0: CoreRecord(0), 1: CoreRecord(1)}
    a, b = Engine("a", started, records, 1), Engine("b", started, records)
    feeds = Dispatcher(records)
    for engine in (a, b):
        engine.client = feeds.join(engine, 0, 1.0, max_faults=1, probe_interval=0.01)
    a.queued = 2
    feeds.assign()  # a's one slot on each core
    assert started == ["a", "a"] and not a.cores[0].idle
    for engine in (a, b):
        assert engine.client is not None and feeds.task_ended(engine.client, engine.cores[0], 7)
    time.sleep(0.02)
    feeds.assign()
    assert started == ["a", "a", "probe b"]
    a.end_one(feeds)  # the hung task ends: its slot is idle again
    time.sleep(0.02)
    feeds.assign()
    assert started == ["a", "a", "probe b", "probe a"]


def test_a_lost_worker_suspends_every_core_and_its_replacement_brings_them_back() -> None:
    started: list[str] = []
    records = {0: CoreRecord(0), 1: CoreRecord(1)}
    one = Engine("one", started, records, 2)
    feeds = Dispatcher(records)
    client = one.client = feeds.join(one, 0, 1.0, max_faults=2, probe_interval=0.01)
    cores = one.cores
    for _ in range(2):
        feeds.task_ended(client, cores[0], 7)
    assert not cores[0].in_rotation  # its probe is due in 10 ms
    feeds.task_ended(client, cores[1], 7)  # (one failure of two allowed)
    feeds.suspend(client)
    # (the statistics report each core's flag as it is: False, not merely falsy)
    assert [core.in_rotation for core in cores] == [False, False]
    one.queued = 1
    time.sleep(0.02)
    feeds.assign()
    assert started == []  # neither a request nor the probe cancelled with the worker
    feeds.resume(client)
    assert [core.in_rotation for core in cores] == [True, True]
    assert [core.consecutive_failures for core in cores] == [0, 0]
    feeds.assign()
    assert started == ["one"]
    # Counted from zero again: one failure on a core does not take it out.
    assert not feeds.task_ended(client, cores[1], 7) and cores[1].in_rotation
    assert feeds.task_ended(client, cores[1], 7) and not cores[1].in_rotation


def test_an_engine_that_had_no_work_banks_no_credit() -> None:
    # One engine ran alone for ten grants while the other, as heavy, had nothing to
    # do: once both have work they take turns, the idle time counting for nothing.
    shares = FairShares()
    busy, idle = client(0, 1.0, 0), client(0, 1.0, 1)
    for c in (busy, idle):
        shares.joined(c)
    for _ in range(10):
        shares.charge(busy, 0.001)
    assert granted(shares, (busy, idle), 10) == [idle.order, busy.order] * 5


def test_a_weight_below_one_gets_its_share() -> None:
    shares = FairShares()
    half, one = client(0, 0.5, 0), client(0, 1.0, 1)
    for c in (half, one):
        shares.joined(c)
    assert grants_to(shares, (half, one), 300) == [100, 200]


def test_a_task_goes_to_the_core_where_its_own_model_would_end_soonest() -> None:
    # Both cores idle; the engine's model takes 10 ms on core 0, 1 ms on core 1 (its
    # own estimates, core by core): core 1, whatever their order.
    started: list[str] = []
    records = {0: CoreRecord(0), 1: CoreRecord(1)}
    a, b = Engine("a", started, records, 2), Engine("b", started, records, 2)
    feeds = Dispatcher(records)
    join(feeds, a, 0, 1.0)
    join(feeds, b, 0, 1.0)
    a.cores[0].service_time, a.cores[1].service_time = 0.010, 0.001
    a.queued = 1
    feeds.assign()
    assert started == ["a"] and [feeds.held(0), feeds.held(1)] == [0, 1]


def test_the_top_engine_fills_its_core_to_top_depth_though_another_core_has_room() -> None:
    # Core 1 is empty (no engine of these uses it), so the dispatcher looks on; the
    # one top-priority engine on core 0, its ring of 8, still stops at TOP_DEPTH.
    feeds, started, _, high = two_cores_with(("low", 0, 2, 0), ("high", 0, 8, 1))
    high.queued = 10
    feeds.assign()
    assert started == ["high"] * TOP_DEPTH and feeds.held(0) == TOP_DEPTH


@pytest.mark.asyncio
async def test_a_held_back_lower_task_is_timed_for_when_its_lead_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The dispatcher's clock stands still at 100 s: the work left is what the test
    # says, and the next assignment is timed for when the lead is left, no sooner.
    monkeypatch.setattr(_dispatch, "time", types.SimpleNamespace(monotonic=lambda: 100.0))
    started, low, high, feeds = low_and_high(high_slots=1)
    high.queued = 1
    feeds.assign()
    record = feeds.records[0]
    record.expected_free = 100.040  # the high task just started
    low.cores[0].service_time = 0.010  # longer than the lead: LOWER_LEAD is its lead
    low.queued = 1
    feeds.assign()
    assert started == ["high"]
    assert feeds._reopen_at == pytest.approx(100.040 - LOWER_LEAD, abs=1e-9)
    # A task shorter than the lead waits until only its own time is left.
    low.cores[0].service_time = LOWER_LEAD / 5
    record.expected_free = 100.0 + LOWER_LEAD * 0.8
    feeds.assign()
    assert started == ["high"]
    assert feeds._reopen_at == pytest.approx(100.0 + LOWER_LEAD * 0.6, abs=1e-9)
    record.expected_free = 100.0 + LOWER_LEAD / 10  # less than its own time left
    feeds.assign()
    assert started == ["high", "low"]
    if feeds._reopen is not None:
        feeds._reopen.cancel()


def test_each_grant_counts_once_with_its_own_estimate() -> None:
    # What Cores.shares() reports: per engine, tasks granted and their core time by
    # the engine's own service-time estimate.
    started: list[str] = []
    records = {0: CoreRecord(0)}
    a, b = Engine("a", started, records, 2), Engine("b", started, records, 2)
    feeds = Dispatcher(records)
    ca, cb = join(feeds, a, 0, 1.0), join(feeds, b, 0, 1.0)
    a.cores[0].service_time, b.cores[0].service_time = 0.002, 0.003
    a.queued = b.queued = 1
    feeds.assign()
    assert sorted(started) == ["a", "b"]
    a.end_one(feeds)
    a.queued = 1
    feeds.assign()
    assert (ca.grants, cb.grants) == (2, 1)
    assert ca.granted_time == pytest.approx(0.004) and cb.granted_time == pytest.approx(0.003)


def test_a_released_slot_and_its_request_let_go_of_each_other() -> None:
    # A step off the loop gives its request's slot back when it ends, unless a close
    # took the slot back meanwhile: it reads the request's slot to know. Released, the
    # request holds no slot, and the idle slot no request.
    feeds, _, a, _, client = two_engines_on_core_0(ring=2)
    pairs: list[tuple[Started, Slot]] = []
    a.start = lambda request, slot: pairs.append((request, slot))  # type: ignore[method-assign]
    a.queued = 1
    feeds.assign()
    ((request, slot),) = pairs
    assert request.slot is slot and slot.request is request and feeds.held(0) == 1
    feeds.release(client, slot)
    assert request.slot is None and slot.request is None
    assert slot in a.cores[0].idle and feeds.held(0) == 0 and client.idle_slots == 2


def test_requests_ending_at_their_start_are_assigned_in_one_loop_not_recursively() -> None:
    # A request past its deadline ends at its start: its slot comes back and the flow
    # asks for an assignment from within the grant. Thousands in a row are folded into
    # the assignment running, not each a frame deeper on the stack.
    feeds, started, a, _, client = two_engines_on_core_0(ring=2)

    def ends_at_its_start(request: Started, slot: Slot) -> None:
        started.append(request.name)
        feeds.release(client, slot)
        feeds.assign()

    a.start = ends_at_its_start  # type: ignore[method-assign]
    many = 3 * sys.getrecursionlimit()
    a.queued = many
    feeds.assign()
    assert len(started) == many and a.queued == 0 and feeds.held(0) == 0


def test_an_engine_joining_late_starts_at_its_prioritys_clock() -> None:
    # One engine ran ten grants before the other joined: no credit for that past.
    shares = FairShares()
    early, late = client(0, 1.0, 0), client(0, 1.0, 1)
    shares.joined(early)
    for _ in range(10):
        shares.charge(early, 0.001)
    shares.joined(late)
    assert granted(shares, (early, late), 10) == [late.order, early.order] * 5


def test_engines_of_one_priority_with_large_rings_fill_a_core_to_top_depth() -> None:
    feeds, started, a, b, _ = two_engines_on_core_0(ring=8)
    a.queued = b.queued = 10
    feeds.assign()
    assert feeds.held(0) == TOP_DEPTH and sorted(started) == ["a", "a", "b", "b"]
