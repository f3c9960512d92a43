"""A worker process while it opens the model, and after it ended.

Until a new worker says it is ready (its layout and shared staging), its channel's
messages go to a :class:`Handshake`; the :class:`~._supervisor.Supervisor` takes the
channel over from then on. :func:`reap` collects the exit status of a worker that went.
"""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any, NamedTuple

import anyio

from .._errors import WorkerLostError
from ._channel import Channel
from ._process import _kill, _wait

__all__ = ["EXIT_GRACE", "Handshake", "HungUp", "Worker", "open_lost", "reap"]

# A lost worker that has not exited this long after its channel closed is killed.
EXIT_GRACE = 2.0


class Worker(NamedTuple):
    """A worker that opened the model: its process, its channel, what it said when
    ready (layout, tensors, runtime), and the descriptor of its shared staging."""

    process: subprocess.Popen[bytes]
    channel: Channel
    ready: dict[str, Any]
    staging_fd: int


async def reap(process: subprocess.Popen[bytes], kill: bool) -> int | None:
    """The worker's exit status, killing it first if asked or if it lingers."""
    if kill:
        _kill(process)
    try:
        return await anyio.to_thread.run_sync(_wait, process, EXIT_GRACE)
    except subprocess.TimeoutExpired:
        _kill(process)
        return await anyio.to_thread.run_sync(_wait, process)


class Handshake:
    """The channel's receiver while the worker opens the model."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.ready: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.said: str | None = None  # the worker's own last words on why it goes

    def on_messages(self, messages: list[Any]) -> None:
        for message in messages:
            kind = message[0]
            if kind == "lost":
                self.said = message[1]  # the hang-up follows
            elif kind in ("ready", "open_failed") and not self.ready.done():
                if kind == "ready":
                    self.ready.set_result(message[1])
                else:
                    self.ready.set_exception(message[1])

    def on_hang_up(self, why: str) -> None:
        if not self.ready.done():
            self.ready.set_exception(HungUp(why))


class HungUp(Exception):
    """The worker's channel closed before it said it was ready."""


def open_lost(
    pid: int, status: int | None, exc: BaseException, said: str | None, timeout: float
) -> WorkerLostError | None:
    """Why a worker did not open the model: it ended, or it did not answer within
    ``timeout`` seconds (anyio's timeout is bare); None for anything else (a
    cancellation), which goes on as it is."""
    if isinstance(exc, HungUp):
        return WorkerLostError(
            f"the worker process (pid {pid}) ended while opening the model "
            f"(exit status {status}): {said or exc}",
            cause=said or str(exc),
            exit_status=status,
        )
    if isinstance(exc, TimeoutError):
        return WorkerLostError(
            f"the worker process (pid {pid}) did not open the model within "
            f"{timeout:g} s (exit status {status})",
            cause="open timed out",
            exit_status=status,
        )
    return None
