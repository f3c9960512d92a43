"""Frame buffers: memory the engine owns and a camera reader fills in place.

``engine.frame_buffers(count, shape, dtype=np.uint8)`` returns numpy arrays over pinned
host memory of the runtime (``host_alloc``; mapped where the GPU shares the host's
memory, so kernels read a frame where it lies). When ``infer`` is given such an array
(or a view of one) for an input with an ``ImagePreprocess``, the engine reads the frame
from it instead of copying it into the slot's staging first.

The rules: a buffer serves the engine until it closes. Dropping your reference to a
buffer while a request reads it is safe (the request holds the array until it ends).
Writing into a buffer while a request reads it is not: keep a ring of buffers, as
:meth:`LatestFrameStream.frame_buffer <aiodla.LatestFrameStream.frame_buffer>` does.
After the engine closed, a buffer is refused: writing into one raises
:class:`~aiodla.EngineClosedError` (``buffer[...] = ...``; the arrays handed out also
turn read-only, so ``np.copyto`` or OpenCV's ``read(image=buffer)`` fail too), and
``infer`` refuses it as it refuses any request. Its memory is freed only once no
array of it is left, so a late read never touches freed memory.

The same holds with ``isolation="process"``: the buffers are then shared memory that
the application's process owns and the worker maps (:mod:`aiodla._isolation._shared_frames`),
and a request on one sends the worker only where the frame lies in it.
"""

from __future__ import annotations

import bisect
import logging
import math
import numbers
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ._bindings import FrameRead
from ._errors import ConfigurationError, EngineClosedError

if TYPE_CHECKING:
    from .runtime import HostBuffer

__all__ = [
    "FrameBuffer",
    "FrameBuffers",
    "FrameSource",
    "HostMemory",
    "read_in_buffer",
    "when_closed",
]

logger = logging.getLogger("aiodla")

_MAX_COUNT = 256  # buffers in one call: a ring per camera is a handful


class HostMemory(Protocol):
    """Where frame buffers are allocated: the runtime's pinned memory in-process, the
    application's shared memory with ``isolation="process"``."""

    def host_alloc(self, nbytes: int, mapped: bool = False) -> HostBuffer: ...
    def host_free(self, buffer: HostBuffer) -> None: ...


class FrameSource(Protocol):
    """Frame buffers as a data path reads them: by any view of one (where its frame
    lies), and by a buffer's address (a read's ``source``)."""

    def find(self, array: np.ndarray[Any, Any]) -> tuple[HostBuffer, int] | None: ...
    def buffer_at(self, address: int) -> HostBuffer: ...


def read_in_buffer(frames: FrameSource, read: FrameRead, staging: int, mapped: bool) -> FrameRead:
    """A read another process made of its frame buffer ``read.source`` (its pointer is
    the frame's offset in the buffer), at this process's addresses: where the buffer is
    ``mapped``, in place; else copied from the buffer's start into ``staging``. Raises
    when ``frames`` has no such buffer."""
    buffer = frames.buffer_at(read.source)
    if mapped:
        span = read.nbytes - read.pointer
        return read._replace(pointer=buffer.device_ptr + read.pointer, nbytes=span, source=0)
    return read._replace(pointer=staging + read.pointer)


class _State:
    """Whether the engine that owns a set of frame buffers has closed, and who wants to
    know when it does (a video source's pool of buffers lets go of them then, so they
    are freed with the rest)."""

    __slots__ = ("closed", "on_close")

    def __init__(self) -> None:
        self.closed = False
        self.on_close: list[Callable[[], None]] = []


class FrameBuffer(np.ndarray):
    """A numpy array in an engine's frame-buffer memory (and its views): an ordinary
    array, except that assigning into it once its engine closed raises
    :class:`~aiodla.EngineClosedError` instead of writing into memory the engine gave up."""

    _frames: _State | None = None

    def __array_finalize__(self, obj: Any) -> None:
        # Views keep the buffer's state; a fresh result (``frame * 2``) is no buffer.
        state = getattr(obj, "_frames", None)
        self._frames = state if state is not None and np.may_share_memory(self, obj) else None

    def __setitem__(self, key: Any, value: Any) -> None:
        state = self._frames
        if state is not None and state.closed:
            raise EngineClosedError(
                "this frame buffer belongs to an engine that was closed: it takes no more "
                "frames (make frame buffers of the engine you use now)"
            )
        super().__setitem__(key, value)


class _Memory:
    """Owns one buffer's pinned memory for as long as any array of it lives: every
    array and view of a frame buffer has this as its base (numpy collapses bases to the
    first object that is not an array), so its finalizer runs after the last one."""

    def __init__(self, buffer: HostBuffer) -> None:
        self.buffer = buffer
        self.__array_interface__ = {
            "shape": (buffer.nbytes,),
            "typestr": "|u1",
            "data": (buffer.ptr, False),
            "version": 3,
        }


class FrameBuffers:
    """One engine's frame buffers: allocation, lookup by address, release at close."""

    def __init__(self, runtime: HostMemory, mapped: bool) -> None:
        self._runtime = runtime
        self._mapped = mapped
        self._starts: list[int] = []  # sorted buffer addresses, for lookup
        self._buffers: list[HostBuffer] = []  # in the same order
        self._by_address: dict[int, HostBuffer] = {}
        self._state = _State()
        # Per buffer: its memory's owner while arrays of it live (see close), and the
        # arrays handed out, made read-only at close.
        self._alive: dict[int, weakref.ref[_Memory]] = {}
        self._handed: list[weakref.ref[FrameBuffer]] = []

    def create(self, count: Any, shape: Any, dtype: Any = np.uint8) -> list[np.ndarray[Any, Any]]:
        """``count`` arrays of ``shape`` and ``dtype`` in the runtime's pinned memory.
        ConfigurationError for a count, shape or dtype out of range; EngineClosedError
        once closed."""
        if self._state.closed:
            raise EngineClosedError("the engine is closed: it makes no more frame buffers")
        if isinstance(count, bool) or not isinstance(count, numbers.Integral):
            raise ConfigurationError(f"{count=} must be an integer")
        if not 1 <= int(count) <= _MAX_COUNT:
            raise ConfigurationError(f"{count=} must be within 1..{_MAX_COUNT}")
        if isinstance(shape, numbers.Integral):
            shape = (shape,)
        if not isinstance(shape, Sequence) or not shape:
            raise ConfigurationError(f"{shape=} must be a non-empty sequence of sizes")
        sizes = tuple(_positive(s) for s in shape)
        if not all(sizes):
            raise ConfigurationError(f"{shape=} must hold positive integers")
        try:
            kind = np.dtype(dtype)
        except TypeError as exc:
            raise ConfigurationError(f"{dtype=} is not a numpy dtype: {exc}") from None
        if kind.hasobject or kind.itemsize == 0:
            raise ConfigurationError(f"{dtype=} cannot live in device-visible memory")
        nbytes = math.prod(sizes) * kind.itemsize
        arrays = []
        for _ in range(int(count)):
            buffer = self._runtime.host_alloc(nbytes, mapped=self._mapped)
            at = bisect.bisect(self._starts, buffer.ptr)
            self._starts.insert(at, buffer.ptr)
            self._buffers.insert(at, buffer)
            self._by_address[buffer.ptr] = buffer
            memory = _Memory(buffer)
            self._alive[buffer.ptr] = weakref.ref(memory)
            raw: np.ndarray[Any, Any] = np.asarray(memory)
            array = raw[:nbytes].view(kind).reshape(sizes).view(FrameBuffer)
            array._frames = self._state
            self._handed.append(weakref.ref(array))
            arrays.append(array)
        return arrays

    def find(self, array: np.ndarray[Any, Any]) -> tuple[HostBuffer, int] | None:
        """The buffer that holds every byte ``array`` reads, and the offset of its first
        element in it; None when the array lies elsewhere (or no buffer exists)."""
        if not self._starts:
            return None
        first, low, high = _bounds(array)
        at = bisect.bisect(self._starts, low) - 1
        if at < 0:
            return None
        buffer = self._buffers[at]
        if high > buffer.ptr + buffer.nbytes:
            return None
        return buffer, first - buffer.ptr

    def buffer_at(self, address: int) -> HostBuffer:
        """The buffer that starts at ``address`` (one :meth:`find` returned)."""
        return self._by_address[address]

    def __len__(self) -> int:
        return len(self._buffers)

    def close(self) -> None:
        """Refuse every buffer from now on and free its memory, at once where no array
        of it is left, else once the last one goes (the engine calls this once its
        requests have ended). Idempotent."""
        self._state.closed = True
        listeners, self._state.on_close = self._state.on_close, []
        for listener in listeners:
            listener()
        buffers, self._buffers, self._starts = self._buffers, [], []
        self._by_address.clear()
        for ref in self._handed:
            array = ref()
            if array is not None:
                array.flags.writeable = False
        self._handed.clear()
        alive, self._alive = self._alive, {}
        for buffer in buffers:
            memory = alive[buffer.ptr]()
            if memory is None:
                self._runtime.host_free(buffer)
            else:
                weakref.finalize(memory, _free_late, self._runtime, buffer)


def when_closed(buffer: np.ndarray[Any, Any], listener: Callable[[], None]) -> None:
    """Call ``listener()`` when the engine that owns frame buffer ``buffer`` closes, before
    it frees its buffers (at once when it has closed already)."""
    state = buffer._frames if isinstance(buffer, FrameBuffer) else None
    if state is None:
        raise ValueError("not an engine's frame buffer")
    if state.closed:
        listener()
    else:
        state.on_close.append(listener)


def _free_late(runtime: HostMemory, buffer: HostBuffer) -> None:
    """Free a closed engine's buffer once its last array went (on whichever thread let
    it go): never raise there."""
    try:
        runtime.host_free(buffer)
    except Exception as exc:
        logger.warning("aiodla: freeing a closed engine's frame buffer failed: %s", exc)


def _positive(value: object) -> int:
    """``value`` as a positive int, or 0 when it is not one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return 0
    return max(int(value), 0)


def _bounds(array: np.ndarray[Any, Any]) -> tuple[int, int, int]:
    """The address of an array's first element, the lowest byte it reads and one past
    its highest (any strides)."""
    # (__array_interface__ builds a dict each time: read once, on every request)
    first = int(array.__array_interface__["data"][0])
    # A whole frame: its bytes in one run. (numpy counts every empty array contiguous,
    # so the strides below always have elements to reach.)
    if array.flags.c_contiguous:
        return first, first, first + array.nbytes
    low = high = first
    for size, stride in zip(array.shape, array.strides, strict=True):
        reach = (size - 1) * stride
        low, high = (low + reach, high) if reach < 0 else (low, high + reach)
    return first, low, high + array.itemsize
