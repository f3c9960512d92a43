"""A physical core's record when the worker process that ran it is replaced
(``_core_record.forget``): what the old worker was given is gone, so the next task is
expected from its own submission, and its span is not bounded by the old worker's last
completion."""

from __future__ import annotations

from aiodla._core_record import expect, forget, span
from aiodla._slots import CoreLane, Slot


def lane_with_a_slot() -> tuple[CoreLane, Slot]:
    core = CoreLane(0, service_time=1.0)
    slot = Slot(core, 0, 0, 0, None, [], [])
    core.slots = [slot]
    return core, slot


def test_a_replaced_worker_leaves_no_queue_and_no_last_completion() -> None:
    core, slot = lane_with_a_slot()
    expect(slot, 100.0)  # the old worker was given a task, then more: busy until 150
    core.record.expected_free = 150.0
    span(slot, 101.0)  # and it was seen finishing one at 101
    forget(core)
    # The new worker's first task: expected one service time after its submission...
    expect(slot, 120.0)
    assert slot.expected_done == 121.0 and core.record.expected_free == 121.0
    # ... and, seen done, it ran from its submission.
    elapsed, spanned = span(slot, 120.5)
    assert (elapsed, spanned) == (0.5, True)


def test_without_a_replacement_the_core_queues_behind_what_it_holds() -> None:
    core, slot = lane_with_a_slot()
    core.record.expected_free = 150.0
    expect(slot, 120.0)
    assert slot.expected_done == 151.0
