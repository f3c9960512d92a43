"""Staging memory shared by the application and its worker process.

Every slot's staging buffer (the bytes a request packs, the bytes its outputs come
back in) lives in one anonymous shared-memory file (``memfd_create``) that the worker
creates, page-locks through its runtime and hands to the application with the message
that says it is ready. The application packs inputs and unpacks outputs in place, as
it would in its own process: a request's bytes are copied no extra time. The file has
no name, so nothing is left in ``/dev/shm`` whichever process dies first: the memory
goes when the last mapping of it does.

The worker's runtime sees :class:`StagingRuntime`: its own runtime, whose
``host_alloc`` carves pinned buffers out of that file instead of allocating them.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import numpy as np

from .._errors import ConfigurationError
from ..runtime._protocol import HostBuffer, HostRegistration, Runtime, offers

__all__ = ["SharedStaging", "StagingRuntime", "map_staging", "whole_pages"]

_PAGE = mmap.PAGESIZE


def whole_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages, at least one: what a mapping of it spans."""
    return -(-max(nbytes, 1) // _PAGE) * _PAGE


class SharedStaging:
    """The worker's side: one growing memfd, a page-aligned mapping per buffer, each
    registered (page-locked) with the runtime. ``layout`` maps a buffer's address to
    its (offset, size) in the file, for the application."""

    def __init__(self, runtime: Runtime) -> None:
        registers: HostRegistration | None = offers(runtime, HostRegistration)
        if registers is None:
            raise ConfigurationError(
                f"isolation='process' needs a runtime that can page-lock shared memory "
                f"(host_register); the {runtime.name} runtime cannot"
            )
        self._register = registers.host_register
        self._runtime = runtime
        self.fd = os.memfd_create("aiodla-staging", os.MFD_CLOEXEC)
        self.size = 0
        self.layout: dict[int, tuple[int, int]] = {}
        self._maps: dict[int, mmap.mmap] = {}

    def host_alloc(self, nbytes: int, mapped: bool = False) -> HostBuffer:
        offset = self.size
        length = whole_pages(nbytes)
        os.ftruncate(self.fd, offset + length)
        self.size = offset + length
        memory = mmap.mmap(self.fd, length, offset=offset)
        view: np.ndarray[Any, np.dtype[np.uint8]] = np.frombuffer(memory, np.uint8, nbytes)
        buffer: HostBuffer = self._register(view, mapped)
        self.layout[buffer.ptr] = (offset, nbytes)
        self._maps[buffer.ptr] = memory
        return buffer

    def host_free(self, buffer: HostBuffer) -> None:
        self._runtime.host_free(buffer)
        self.layout.pop(buffer.ptr, None)
        # The mapping goes when the last view of it does (a numpy view pins it).
        self._maps.pop(buffer.ptr, None)

    def close(self) -> None:
        os.close(self.fd)


def _members(protocol: type) -> set[str]:
    """What a protocol asks of an implementation: its methods and its attributes."""
    declared = {name for name in dir(protocol) if not name.startswith("_")}
    return declared | set(protocol.__annotations__)


# The core's members (each capability's are added for a runtime that declares it).
_RUNTIME_MEMBERS = _members(Runtime)


class StagingRuntime:
    """The worker's runtime as the device layer sees it: every call is the real
    runtime's, except host allocations, which come from the shared staging."""

    def __init__(self, runtime: Runtime, staging: SharedStaging) -> None:
        self._runtime = runtime
        self._staging = staging
        # Bound here, not only through __getattr__: from Python 3.12, isinstance against
        # a protocol looks attributes up statically, so a runtime made only of
        # __getattr__ is refused as none. The capabilities are the runtime's own.
        members = set(_RUNTIME_MEMBERS)
        for capability in runtime.capabilities:
            members |= _members(capability)
        for name in sorted(members - {"host_alloc", "host_free"}):
            setattr(self, name, getattr(runtime, name))

    def host_alloc(self, nbytes: int, mapped: bool = False) -> HostBuffer:
        return self._staging.host_alloc(nbytes, mapped)

    def host_free(self, buffer: HostBuffer) -> None:
        self._staging.host_free(buffer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)


def map_staging(fd: int, size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The application's side: the whole staging file as one array (the descriptor is
    closed here; the mapping keeps the memory)."""
    try:
        memory = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return np.frombuffer(memory, np.uint8)
