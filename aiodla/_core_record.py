"""One record per physical DLA core, shared by every engine on it, and every change to it.

Each engine keeps its own lane on a core (:class:`~aiodla._slots.CoreLane`: its device
handle and module there, its ring of slots, its model's service-time estimate); the
core itself, which every engine on a :class:`~aiodla.Cores` feeds, is one
:class:`CoreRecord`: how many tasks it holds, of every engine, and when it should
finish them. A lone engine has records of its own; engines on one ``Cores`` share the
``Cores``' records, so the dispatcher reads the core as it is, with no sum over engines.

This module is the record's one writer: slots taken and given back, the expected end
of a submitted task, the estimates moved to where the poller found the core, and the
estimates forgotten when a worker process that ran the core is replaced. Only the
event loop's thread calls it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Protocol

__all__ = [
    "CoreRecord",
    "Lane",
    "Placed",
    "busy_stated",
    "expect",
    "follow",
    "forget",
    "give_back",
    "span",
    "take",
]


@dataclasses.dataclass(eq=False)
class CoreRecord:
    """Physical DLA core ``number``, as every engine on it sees it (-1: a record made
    with a lane outside any engine, as tests make them)."""

    number: int = -1
    held: int = 0  # slots assigned on this core, of every engine: tasks it holds or will
    expected_free: float = 0.0  # when it should finish what every engine gave it
    # Busy-time accounting, over every engine's tasks: a task of one engine cannot have
    # started before the core finished another engine's, so the bounds are the core's.
    last_completion: float = 0.0  # when the poller last saw one of its tasks done
    accounted_until: float = 0.0  # how far stated service times' busy figures reached


class Lane(Protocol):
    """What this module reads and writes of an engine's lane on a core
    (:class:`~aiodla._slots.CoreLane`)."""

    record: CoreRecord
    idle: collections.deque[Any]
    slots: list[Any]
    assigned_total: int
    service_time: float


class Placed(Protocol):
    """What this module reads and writes of a slot (:class:`~aiodla._slots.Slot`)."""

    core: Any  # its Lane
    submitted_at: float
    expected_done: float
    behind: float


def take(core: Lane) -> Any:
    """Take an idle slot of the engine's lane ``core`` (which must have one)."""
    core.record.held += 1
    core.assigned_total += 1
    return core.idle.popleft()


def give_back(slot: Placed) -> None:
    """The slot's work is over: idle again, and no longer held by its core."""
    core = slot.core
    core.record.held -= 1
    core.idle.append(slot)


def expect(slot: Placed, now: float) -> None:
    """``slot``'s task was submitted at ``now``: it queues behind everything its core
    holds, of every engine, and takes its own model's service time."""
    core = slot.core
    record = core.record
    slot.submitted_at = now
    slot.behind = 0.0
    free = record.expected_free
    record.expected_free = slot.expected_done = (free if free > now else now) + core.service_time


def follow(slot: Placed) -> None:
    """Move the estimates of the tasks queued behind ``slot`` on its core (and of the
    core's end) to where the evidence puts the core's timeline.

    Each submission's estimate is the core's previous one plus the service time, so a
    service time a little off the real one (a loadable's stated time, a stand-in's
    overhead) moves a saturated core's estimates ever further from its tasks. Too early,
    the poller queries every task several times and wakes the loop for each one
    (``benchmarks/bench_estimates.py``, stated 2 % short at 1 ms: 4.7 queries a request
    instead of 1.0, and twice the CPU); too late, the ring runs dry before the poller
    looks. Only the poller's evidence (``slot.behind``) moves them, and never past it: a
    task found still running after its estimate moves those behind it later by that
    much; one found done before its estimate, earlier by as much. The poller's lateness
    in seeing a task done moves nothing, so no error feeds on itself.
    """
    estimate, offset = slot.expected_done, slot.behind
    for other in slot.core.slots:
        if other.expected_done > estimate:
            other.expected_done += offset
    slot.core.record.expected_free += offset


def span(slot: Placed, now: float) -> tuple[float, bool]:
    """``slot``'s task was seen done at ``now``: how long it may have run, from its
    submission or from the core's task before it (of any engine), whichever is later;
    and whether it has a span of its own (False: a second task of the core seen done in
    the same sweep, which ended somewhere before ``now``)."""
    record = slot.core.record
    spanned = record.last_completion != now
    elapsed = now - max(slot.submitted_at, record.last_completion)
    record.last_completion = now
    return elapsed, spanned


def busy_stated(slot: Placed, now: float) -> float:
    """The busy time of ``slot``'s task seen done at ``now``, its service time stated by
    the loadable: the stated time from where the task could start (not before its
    submission, nor before the core's earlier tasks of every engine as counted), never
    past ``now``. The time its predecessor was seen done is no bound: seen late (a
    batch, a loaded host), it would count the task short, and the core idle when it
    never was; and a time stated long must not count a core busier than the clock."""
    record = slot.core.record
    start = max(slot.submitted_at, record.accounted_until)
    busy: float = min(slot.core.service_time, max(0.0, now - start))
    record.accounted_until = start + busy
    return busy


def forget(core: Lane) -> None:
    """The worker process that ran ``core`` was replaced: what it was given is gone,
    and its last completion is no bound on the next task's span."""
    core.record.expected_free = 0.0
    core.record.last_completion = 0.0
