"""The worker's receiving thread (``WorkerServer._receive``): blocked when the worker
holds no task or several, awake around its one task's end at light load, and never
awake for longer than its bounds, whatever arrives when."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from aiodla._isolation import _worker
from aiodla._isolation._worker import WorkerServer

# A receive that spins past its bounds burns the whole wait below; one that keeps them
# uses a few milliseconds at most (the bounds are 2 ms awake, 0.3 ms after delivery).
LATE = 0.15
BOUNDED_CPU = 0.05


@pytest.fixture
def pair() -> Iterator[tuple[WorkerServer, socket.socket]]:
    mine, theirs = socket.socketpair()
    server = WorkerServer(mine, SimpleNamespace(slots=[]), None)  # type: ignore[arg-type]
    yield server, theirs
    mine.close()
    theirs.close()


def send_later(sock: socket.socket, seconds: float, data: bytes) -> threading.Timer:
    timer = threading.Timer(seconds, sock.sendall, (data,))
    timer.start()
    return timer


def receive(server: WorkerServer) -> tuple[bytes, float, float]:
    """What ``_receive`` returned, after how long, and the CPU it used meanwhile."""
    started, cpu = time.monotonic(), time.thread_time()
    data = server._receive()
    return data, time.monotonic() - started, time.thread_time() - cpu


class _Slot:
    def __init__(self, expected_done: float) -> None:
        self.expected_done = expected_done


def one_task(server: WorkerServer, due_in: float) -> Any:
    slot = _Slot(time.monotonic() + due_in)
    server._watched.add(slot)
    return slot


def test_no_task_in_the_worker_blocks(pair: Any) -> None:
    server, theirs = pair
    send_later(theirs, LATE, b"a")
    data, waited, cpu = receive(server)
    assert data == b"a" and waited >= LATE * 0.9 and cpu < BOUNDED_CPU


def test_one_task_asleep_until_just_before_its_end(pair: Any) -> None:
    server, theirs = pair
    one_task(server, due_in=LATE * 2)
    send_later(theirs, LATE, b"early")  # before the task's end: the sleep ends with it
    data, waited, cpu = receive(server)
    assert data == b"early" and waited < LATE * 2 and cpu < BOUNDED_CPU


def test_one_task_awake_after_its_end_then_blocked_after_the_delivery(pair: Any) -> None:
    server, theirs = pair
    slot = one_task(server, due_in=0.0)

    def deliver() -> None:  # as the poller's thread does after sending the batch
        server._watched.discard(slot)
        server._delivered_at = time.monotonic()

    threading.Timer(0.001, deliver).start()
    send_later(theirs, LATE, b"late")  # long after the delivery: no spin till then
    data, waited, cpu = receive(server)
    assert data == b"late" and waited >= LATE * 0.9 and cpu < BOUNDED_CPU


def test_a_task_that_never_ends_bounds_the_awake_wait(pair: Any) -> None:
    server, theirs = pair
    one_task(server, due_in=0.0)  # overdue and never delivered (a hung core)
    send_later(theirs, LATE, b"x")
    data, _, cpu = receive(server)
    assert data == b"x" and cpu < BOUNDED_CPU


def test_awake_it_takes_what_arrives_at_once(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    server, theirs = pair
    monkeypatch.setattr(_worker, "AWAKE_AT_MOST", 1.0)  # awake through the whole wait
    one_task(server, due_in=0.0)
    send_later(theirs, 0.05, b"soon")
    data, waited, cpu = receive(server)
    # It spun (used the CPU) rather than slept, and had the bytes as soon as they came.
    assert data == b"soon" and 0.045 <= waited < 0.2 and cpu > 0.02
