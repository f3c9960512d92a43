"""Engine frame buffers lent to video sources, each back only when its frame is gone.

A source given an engine writes each decoded picture straight into one of that
engine's frame buffers (pinned memory: ``infer`` then skips its staging copy). The
danger is refilling a buffer while a request still reads it, so a buffer is *lent*
with its frame and comes back only once nothing can read it any more: the frame's
array is a view over the buffer through a small owner object, every view of that array
(numpy collapses bases) keeps the owner alive, and the owner's finalizer returns the
buffer. A request holds its input array until it ends, so a buffer in a request is
never refilled; neither is one the application still holds.

Buffers are pooled per engine and picture size, and shared by that engine's sources:
a source that closes leaves its buffers to the next, so opening and closing sources
does not grow the engine's frame buffers. Each source may hold at most ``quota``
buffers at once; past it (an application that keeps every frame), a frame goes into a
plain numpy array instead, which ``infer`` stages as it stages any array. Nothing waits.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ._frame_buffers import when_closed

__all__ = ["FramePool", "Lender", "pool_for"]

_POOLS: weakref.WeakKeyDictionary[Any, dict[tuple[int, int], FramePool]] = (
    weakref.WeakKeyDictionary()
)
_POOLS_LOCK = threading.Lock()


class FramePool:
    """Free frame buffers of one engine and one size. Thread-safe: buffers come back on
    whichever thread drops a frame's last array."""

    def __init__(self, allocate: Callable[[int], list[np.ndarray[Any, Any]]]) -> None:
        self._allocate = allocate  # n -> n new buffers; may raise EngineClosedError
        self._free: list[np.ndarray[Any, Any]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.allocated = 0

    def take(self) -> np.ndarray[Any, Any]:
        with self._lock:
            if self._free:
                return self._free.pop()
        buffer = self._allocate(1)[0]
        with self._lock:
            first = not self.allocated
            self.allocated += 1
        if first:
            # Let go of every free buffer when the engine closes, so it frees them then
            # rather than when this pool is collected.
            when_closed(buffer, self._engine_closed)
        return buffer

    def give_back(self, buffer: np.ndarray[Any, Any]) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(buffer)

    def _engine_closed(self) -> None:
        with self._lock:
            self._closed = True
            self._free.clear()


def pool_for(
    engine: Any, shape: tuple[int, int], allocate: Callable[[int], list[np.ndarray[Any, Any]]]
) -> FramePool:
    """The pool of ``engine``'s buffers of ``shape`` (made on first use)."""
    with _POOLS_LOCK:
        pools = _POOLS.setdefault(engine, {})
        pool = pools.get(shape)
        if pool is None:
            pool = pools[shape] = FramePool(allocate)
        return pool


class _Owner:
    """The base of a lent frame's array: alive exactly as long as some view of it."""

    def __init__(self, buffer: np.ndarray[Any, Any]) -> None:
        self.buffer = buffer  # keeps the engine's memory mapped while the frame lives
        interface = dict(buffer.__array_interface__)
        interface["data"] = (interface["data"][0], True)  # frames are read-only
        self.__array_interface__ = interface


class Lender:
    """One source's side of a pool: at most ``quota`` buffers out at once."""

    def __init__(self, quota: int) -> None:
        self._quota = quota
        self._out = 0
        self._lock = threading.Lock()
        self.unpooled = 0  # frames that went into plain arrays because the quota was used

    @property
    def out(self) -> int:
        return self._out

    def lend(
        self,
        pool: FramePool | None,
        shape: tuple[int, int],
        fill: Callable[[np.ndarray[Any, Any]], None],
    ) -> np.ndarray[Any, Any]:
        """A read-only array of ``shape`` holding what ``fill`` wrote: a pool buffer
        while this source holds fewer than its quota, else a fresh numpy array."""
        with self._lock:
            pooled = pool is not None and self._out < self._quota
            if pooled:
                self._out += 1
        if not pooled or pool is None:
            self.unpooled += pool is not None
            array = np.empty(shape, np.uint8)
            fill(array)
            array.flags.writeable = False
            return array
        try:
            buffer = pool.take()
        except BaseException:
            self._returned()
            raise
        try:
            fill(buffer)
        except BaseException:
            self._back(pool, buffer)
            raise
        owner = _Owner(buffer)
        weakref.finalize(owner, self._back, pool, buffer)
        return np.asarray(owner)

    def _back(self, pool: FramePool, buffer: np.ndarray[Any, Any]) -> None:
        pool.give_back(buffer)
        self._returned()

    def _returned(self) -> None:
        with self._lock:
            self._out -= 1
