"""Frame buffers with ``isolation="process"``: memory the application's process owns
and the worker maps, so a camera frame crosses to the worker by reference.

The application's side, :class:`SharedFrameMemory`, is where the engine's
:class:`~aiodla._frame_buffers.FrameBuffers` allocate: each buffer is an anonymous
shared-memory file of its own (``memfd_create``) mapped here, so the in-process rules
hold unchanged (the arrays, their views, the guard after close, the memory freed once
the last array goes). Its descriptor stays open while the buffer lives: every worker,
the first and each replacement, gets it over the control channel (``SCM_RIGHTS``) and
maps the buffer too.

The worker's side, :class:`MappedFrames`, maps each buffer and page-locks it with the
worker's runtime (mapped, on a GPU that reads host memory in place), as the runtime's
own pinned memory is in-process. A request on a frame buffer then sends only which
buffer and where the frame lies in it (a :class:`~aiodla._bindings.FrameRead` whose
``source`` is the buffer's address in the application); the worker's conversion
kernels read it there, or copy it from there, never through the slot's staging.

The worker keeps its mappings until it closes: the application frees a buffer only
once its engine closed, which ends the worker first.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import AiodlaError
from ..runtime._protocol import HostBuffer, HostRegistration
from ._channel import Channel
from ._staging import whole_pages

__all__ = ["FDS_PER_MESSAGE", "MappedFrames", "SharedFrame", "SharedFrameMemory", "send_frames"]

logger = logging.getLogger("aiodla")

#: Descriptors one "frames" message carries (what the receiving ends make room for).
FDS_PER_MESSAGE = 16

#: A buffer as the worker learns of it: its address in the application (the key its
#: reads name), its size, and the descriptor of its memory.
SharedFrame = tuple[int, int, int]


def _map(fd: int, nbytes: int) -> mmap.mmap:
    """The file's first ``nbytes`` (rounded to pages), shared. From Python 3.13 the
    mapping keeps no descriptor of its own (before, it holds a duplicate until it is
    unmapped, with the buffer's last array)."""
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, whole_pages(nbytes), trackfd=False)
    return mmap.mmap(fd, whole_pages(nbytes))


class SharedFrameMemory:
    """The application's side: frame buffers in shared memory, one file each (a
    :class:`~aiodla._frame_buffers.HostMemory`). ``host_free`` may be called on any
    thread (the one that drops a closed engine's last array of a buffer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[int, SharedFrame] = {}  # by address: what a worker maps
        self._new: list[SharedFrame] = []  # made since the last :meth:`take_new`
        self._closed = False

    def host_alloc(self, nbytes: int, mapped: bool = False) -> HostBuffer:
        """A buffer of ``nbytes`` (``mapped`` is the worker's to honour, not ours)."""
        fd = os.memfd_create("aiodla-frames", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, whole_pages(nbytes))
            memory = _map(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        # The array keeps the mapping: it goes when the last view of the buffer does.
        array: np.ndarray[Any, np.dtype[np.uint8]] = np.frombuffer(memory, np.uint8, nbytes)
        buffer = HostBuffer(int(array.ctypes.data), array)
        with self._lock:
            if self._closed:  # (the engine checks first: this is a race with its close)
                os.close(fd)
                raise AiodlaError("the engine's frame buffers are closed")
            shared = (buffer.ptr, nbytes, fd)
            self._files[buffer.ptr] = shared
            self._new.append(shared)
        return buffer

    def host_free(self, buffer: HostBuffer) -> None:
        """The buffer's descriptor goes now, its mapping with its last array."""
        with self._lock:
            shared = self._files.pop(buffer.ptr, None)
        if shared is not None:
            os.close(shared[2])

    def take_new(self) -> list[SharedFrame]:
        """The buffers made since the last call (for the worker that serves now)."""
        with self._lock:
            new, self._new = self._new, []
        return new

    def every(self) -> list[SharedFrame]:
        """Every buffer alive (for a worker that starts serving); the descriptors stay
        this object's."""
        with self._lock:
            self._new.clear()
            return list(self._files.values())

    def __len__(self) -> int:
        return len(self._files)

    def close(self) -> None:
        """No worker maps a buffer any more (the engine closed): close every descriptor
        now; the memory goes with the buffers' last arrays. Idempotent, any thread."""
        with self._lock:
            self._closed = True
            files, self._files = self._files, {}
            self._new.clear()
        for _, _, fd in files.values():
            with contextlib.suppress(OSError):
                os.close(fd)


def send_frames(channel: Channel, frames: Sequence[SharedFrame]) -> None:
    """Tell the worker at the other end of ``channel`` to map ``frames``, a few
    descriptors per message (they go with its first byte)."""
    for start in range(0, len(frames), FDS_PER_MESSAGE):
        part = frames[start : start + FDS_PER_MESSAGE]
        channel.send(("frames", [(key, nbytes) for key, nbytes, _ in part]), [f for *_, f in part])


class MappedFrames:
    """The worker's side: the application's frame buffers mapped and page-locked here,
    found by their address in the application (a
    :class:`~aiodla._frame_buffers.FrameSource`)."""

    def __init__(self, runtime: HostRegistration, mapped: bool) -> None:
        self._runtime = runtime
        self._mapped = mapped  # with a device address: kernels read frames in place
        self._buffers: dict[int, HostBuffer] = {}
        self._failed: dict[int, str] = {}  # why a buffer could not be mapped here

    def add(self, frames: Sequence[tuple[int, int]], fds: Sequence[int]) -> None:
        """Map and page-lock each buffer (its descriptor is closed here: the mapping
        keeps the memory). A buffer that fails is remembered with why: the requests
        that read it fail saying so, the rest serve on."""
        for index, (key, nbytes) in enumerate(frames):
            fd = fds[index] if index < len(fds) else -1
            if key in self._buffers:  # told twice (a new buffer as a worker is adopted)
                if fd >= 0:
                    os.close(fd)
                continue
            try:
                if fd < 0:
                    raise AiodlaError("its descriptor did not arrive")
                try:
                    memory = _map(fd, nbytes)
                finally:
                    os.close(fd)
                view: np.ndarray[Any, np.dtype[np.uint8]] = np.frombuffer(memory, np.uint8, nbytes)
                self._buffers[key] = self._runtime.host_register(view, self._mapped)
            except Exception as exc:
                logger.warning("aiodla worker: frame buffer %#x not mapped: %s", key, exc)
                self._failed[key] = str(exc)
        for fd in fds[len(frames) :]:  # (never sent so; not to be kept open either)
            with contextlib.suppress(OSError):
                os.close(fd)

    def find(self, array: np.ndarray[Any, Any]) -> tuple[HostBuffer, int] | None:
        """None: the application finds its frames; the worker reads what it names."""
        return None

    def buffer_at(self, address: int) -> HostBuffer:
        """The buffer the application knows at ``address``, as mapped here."""
        buffer = self._buffers.get(address)
        if buffer is None:
            why = self._failed.get(address, "the application never shared it")
            raise AiodlaError(f"frame buffer {address:#x} is not mapped in the worker: {why}")
        return buffer

    def __len__(self) -> int:
        return len(self._buffers)

    def close(self) -> None:
        """Unlock every buffer (before the runtime closes); the mappings go with the
        arrays over them. Idempotent."""
        buffers, self._buffers = self._buffers, {}
        for buffer in buffers.values():
            try:
                self._runtime.host_free(buffer)
            except Exception as exc:  # the rest are still released
                logger.warning("aiodla worker: unlocking a frame buffer failed: %s", exc)
