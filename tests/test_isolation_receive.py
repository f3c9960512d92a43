"""The worker's receiving thread (``WorkerServer._receive``): blocked when the worker
holds no task or several, awake around its one task's end at light load, and never
awake for longer than its bounds, whatever arrives when."""

from __future__ import annotations

import math
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


class _Polled:
    """The worker's end of the socket pair, recording the receiving thread's reads: the
    bytes arrive while it polls, during its ``arrive_at``-th read that does not wait.
    A read that waits, or a wait in ``select`` (which asks for the descriptor), gets them
    at once, so a receive that sleeps fails the test rather than hanging it."""

    def __init__(self, mine: socket.socket, theirs: socket.socket, arrive_at: int) -> None:
        self._mine, self._theirs, self._arrive_at = mine, theirs, arrive_at
        self.reads: list[int | str] = []  # each read's flags, or "select"
        self._sent = False

    def _arrive(self) -> None:
        if not self._sent:
            self._sent = True
            self._theirs.sendall(b"soon")

    def fileno(self) -> int:
        self.reads.append("select")
        self._arrive()
        return self._mine.fileno()

    def recvmsg(self, size: int, ancillary: int, flags: int = 0) -> Any:
        # (the worker reads with recvmsg: frame buffers' descriptors come that way)
        self.reads.append(flags)
        if not flags & socket.MSG_DONTWAIT or self.reads.count(flags) == self._arrive_at:
            self._arrive()
        return self._mine.recvmsg(size, ancillary, flags)


def test_awake_it_takes_what_arrives_at_once(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    server, theirs = pair
    monkeypatch.setattr(_worker, "AWAKE_AT_MOST", math.inf)  # awake however long it takes
    one_task(server, due_in=0.0)
    polled = server._sock = _Polled(server._sock, theirs, arrive_at=50)
    # It polled without waiting (awake, not asleep in the kernel) until the bytes came,
    # and took them with the read during which they arrived.
    assert server._receive() == b"soon"
    assert polled.reads == [socket.MSG_DONTWAIT] * 50
