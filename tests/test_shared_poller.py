"""The one poller of an aiodla.Cores: a batch goes to each engine's flow, the highest
priority first; a harvest on the loop hands the other engines theirs; an engine that
left gets nothing more."""

from __future__ import annotations

from typing import Any

from test_poller import FakeLoop, FakeRuntime

from aiodla._core_record import CoreRecord
from aiodla._poller import SharedPoller
from aiodla._slots import CoreLane, Slot, completion_probe


class Flow:
    """What the poller asks of an engine's flow: it records the batches it gets."""

    def __init__(self, name: str, got: list[tuple[str, list[int]]]) -> None:
        self.name = name
        self.got = got

    def on_completions(self, finished: list[tuple[Slot, int]]) -> None:
        self.got.append((self.name, [slot.event for slot, _ in finished]))


def lane(number: int, record: CoreRecord) -> CoreLane:
    return CoreLane(number, record)


def done(event: int, core: CoreLane) -> tuple[Slot, int]:
    return Slot(core, event, 0, event, None, [], []), 0


def shared() -> tuple[SharedPoller, list[tuple[str, list[int]]], list[CoreLane]]:
    records = {0: CoreRecord(0)}
    poller = SharedPoller(
        completion_probe(FakeRuntime()),  # type: ignore[arg-type]
        FakeLoop(),  # type: ignore[arg-type]
        lambda error: None,
        pause=0.0,
    )
    got: list[tuple[str, list[int]]] = []
    lanes = [lane(0, records[0]) for _ in range(3)]
    for name, priority, core in (("low", 0, lanes[0]), ("high", 2, lanes[1]), ("mid", 1, lanes[2])):
        poller.share(Flow(name, got), [core], priority)
    return poller, got, lanes


def test_a_batch_of_several_engines_goes_to_the_highest_priority_first() -> None:
    poller, got, (low, high, mid) = shared()
    try:
        poller.deliver([done(1, low), done(2, mid), done(3, high), done(4, low)])
        assert got == [("high", [3]), ("mid", [2]), ("low", [1, 4])]
        got.clear()
        poller.deliver([done(5, mid), done(6, mid)])  # one engine's batch: as it came
        assert got == [("mid", [5, 6])]
    finally:
        poller.stop()
        poller.join(5)


def test_an_engine_that_left_gets_nothing_more() -> None:
    poller, got, (low, high, _) = shared()
    try:
        member = next(m for m in poller._members if m.lanes == [low])
        member.stop()  # its engine closed
        assert poller.engines == 2
        poller.deliver([done(1, low)])
        poller.deliver([done(2, low), done(3, high)])
        assert got == [("high", [3])]
    finally:
        poller.stop()
        poller.join(5)


def test_a_harvest_for_one_engine_hands_the_others_theirs(monkeypatch: Any) -> None:
    poller, got, (low, high, _) = shared()
    try:
        found = [done(1, low), done(2, high)]
        monkeypatch.setattr(poller.poller, "harvest", lambda at_least=None: found)
        member = next(m for m in poller._members if m.lanes == [low])
        own = member.harvest()
        assert [slot.event for slot, _ in own] == [1]
        assert got == [("high", [2])]
    finally:
        poller.stop()
        poller.join(5)
