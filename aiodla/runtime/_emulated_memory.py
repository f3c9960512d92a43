"""The emulated runtime's memory: device allocations, pinned host buffers, and the
copies between them as stream operations.

"Device pointers" are addresses handed out for bounds-checked numpy buffers, spaced
so that an overrun never lands in another allocation; a pointer is resolved to the
bytes it names by :meth:`EmulatedMemory.device_range`, cached until memory, a
registration or a module changes (``generation`` counts those changes, so a task
validated once is revalidated only after one).
"""

from __future__ import annotations

import bisect
import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from ._protocol import CudaCallError, HostBuffer, TransferCounts
from ._timeline import _INVALID_VALUE, _Operation

if TYPE_CHECKING:
    from ._timeline import Timeline

__all__ = ["EmulatedMemory"]

_DEVICE_ALIGNMENT = 256  # what cudaMalloc guarantees
_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation
_HOST_MEMORY_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


def _zeros(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.zeros(nbytes, dtype=np.uint8)


def _allocate(call: str, nbytes: int, padding: int = 0) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``nbytes`` (+ ``padding``) of zeroed host memory; when the host has none, the
    error the real ``cudaMalloc`` / ``cudaHostAlloc`` gives (the engine then names the
    tensor it was for)."""
    try:
        return _zeros(nbytes + padding)
    except MemoryError:
        raise CudaCallError(
            call, _MEMORY_ALLOCATION, detail=f"{nbytes} bytes asked for, more than is free"
        ) from None


class EmulatedMemory:
    """Device and host memory of the emulated runtime, and the copies.

    ``copy_bandwidth``: bytes per second of a copy, instantaneous when None.
    """

    def __init__(self, timeline: Timeline, copy_bandwidth: float | None) -> None:
        self._timeline = timeline
        self.copy_bandwidth = copy_bandwidth
        self.counts = TransferCounts()
        self.device_memory: dict[int, np.ndarray[Any, Any]] = {}
        self._device_starts: list[int] = []
        self._next_address = 0x7F00_0000_0000
        self.host_memory: dict[int, HostBuffer] = {}
        self.generation = 0  # bumped by every change to memory, registrations, modules
        self._ranges: dict[tuple[int, int], np.ndarray[Any, Any]] = {}

    def changed(self) -> None:
        """Memory, a registration or a module changed: cached lookups are stale."""
        self.generation += 1
        self._ranges.clear()

    def device_range(self, ptr: int, nbytes: int, call: str) -> np.ndarray[Any, Any]:
        """The bytes ``[ptr, ptr + nbytes)`` of one live device allocation."""
        cached = self._ranges.get((ptr, nbytes))
        if cached is not None:
            return cached
        with self._timeline.lock:
            index = bisect.bisect_right(self._device_starts, ptr) - 1
            if index >= 0 and nbytes > 0:
                start = self._device_starts[index]
                memory = self.device_memory[start]
                if ptr + nbytes <= start + memory.nbytes:
                    view = memory[ptr - start : ptr - start + nbytes]
                    self._ranges[(ptr, nbytes)] = view
                    return view
        raise CudaCallError(call, _INVALID_VALUE)

    def map(self, memory: np.ndarray[Any, Any]) -> int:
        """Give ``memory`` a device address (with the lock held)."""
        address = self._next_address
        span = -(-memory.nbytes // _DEVICE_ALIGNMENT) * _DEVICE_ALIGNMENT
        self._next_address += span + _DEVICE_ALIGNMENT  # a gap: overruns never alias
        self.device_memory[address] = memory
        self.changed()
        bisect.insort(self._device_starts, address)
        return address

    def _unmap(self, address: int) -> None:
        self.changed()
        del self.device_memory[address]
        self._device_starts.remove(address)

    # -- allocations -----------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        self._timeline.cuda("malloc")
        if nbytes <= 0:
            raise CudaCallError("malloc", _INVALID_VALUE)
        with self._timeline.lock:
            self.counts.allocations += 1
            return self.map(_allocate("malloc", nbytes))

    def free(self, ptr: int) -> None:
        timeline = self._timeline
        with timeline.lock:
            if ptr not in self.device_memory:
                timeline.bad_release("free")
            for device in timeline.devices.values():
                if any(raw == ptr for raw, _ in device.registrations.values()):
                    raise CudaCallError("free", _INVALID_VALUE)
            self._unmap(ptr)
        timeline.released("free")

    def malloc_async(self, nbytes: int, stream: int) -> int:
        self._timeline.stream(stream, "malloc_async")
        pointer = self.malloc(nbytes)
        self.counts.allocations -= 1  # malloc counted it; it is a pool allocation
        self.counts.pool_allocations += 1
        return pointer

    def free_async(self, ptr: int) -> None:
        self.free(ptr)

    def host_alloc(self, nbytes: int, mapped: bool = False) -> HostBuffer:
        self._timeline.cuda("host_alloc")
        if nbytes <= 0:
            raise CudaCallError("host_alloc", _INVALID_VALUE)
        # 64-byte aligned, as pinned pages are, so vectorized packing sees aligned rows.
        backing = _allocate("host_alloc", nbytes, padding=64)
        skip = -backing.ctypes.data % 64
        array = backing[skip : skip + nbytes]
        with self._timeline.lock:
            # Mapped: the same bytes also have a device address, as cudaHostAllocMapped
            # memory has, so conversions read and write them in place.
            buffer = HostBuffer(int(array.ctypes.data), array, self.map(array) if mapped else 0)
            self.host_memory[buffer.ptr] = buffer
            self.counts.allocations += 1
        return buffer

    def host_register(
        self, array: np.ndarray[Any, np.dtype[np.uint8]], mapped: bool = False
    ) -> HostBuffer:
        """Page-lock memory the caller allocated (``cudaHostRegister``): the staging
        that ``isolation="process"`` shares between two processes; ``mapped``, with a
        device address as well (``cudaHostRegisterMapped``). Released with
        ``host_free``, which leaves the memory to its owner."""
        self._timeline.cuda("host_register")
        if array.nbytes <= 0:
            raise CudaCallError("host_register", _INVALID_VALUE)
        with self._timeline.lock:
            pointer = int(array.ctypes.data)
            if pointer in self.host_memory:  # registering twice is an error in CUDA
                raise CudaCallError("host_register", _HOST_MEMORY_ALREADY_REGISTERED)
            buffer = HostBuffer(pointer, array, self.map(array) if mapped else 0)
            self.host_memory[buffer.ptr] = buffer
        return buffer

    def host_free(self, buffer: HostBuffer) -> None:
        timeline = self._timeline
        with timeline.lock:
            if self.host_memory.pop(buffer.ptr, None) is None:
                timeline.bad_release("host_free")
            elif buffer.device_ptr:
                self._unmap(buffer.device_ptr)
        timeline.released("host_free")

    def pointer_device(self, ptr: int) -> int:
        self.device_range(ptr, 1, "pointer_device")  # raises for an unknown address
        return 0

    # -- copies ------------------------------------------------------------------------------

    def _host(self, buffer: HostBuffer, nbytes: int, call: str) -> np.ndarray[Any, Any]:
        if self.host_memory.get(buffer.ptr) is not buffer or not 0 < nbytes <= buffer.nbytes:
            raise CudaCallError(call, _INVALID_VALUE)
        return buffer.array[:nbytes]

    def _copy(
        self, dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any], stream: int, call: str
    ) -> None:
        timeline = self._timeline
        queue = timeline.stream(stream, call)
        duration = dst.nbytes / self.copy_bandwidth if self.copy_bandwidth else 0.0
        timeline.push(queue, _Operation(functools.partial(np.copyto, dst, src)), duration)

    def copy_to_device(self, dst: int, src: HostBuffer, nbytes: int, stream: int) -> None:
        self._timeline.cuda("copy_to_device")
        self.counts.copies_to_device += 1
        self.counts.bytes_to_device += nbytes
        target = self.device_range(dst, nbytes, "copy_to_device")
        self._copy(target, self._host(src, nbytes, "copy_to_device"), stream, "copy_to_device")

    def copy_to_host(self, dst: HostBuffer, src: int, nbytes: int, stream: int) -> None:
        self._timeline.cuda("copy_to_host")
        self.counts.copies_to_host += 1
        self.counts.bytes_to_host += nbytes
        source = self.device_range(src, nbytes, "copy_to_host")
        self._copy(self._host(dst, nbytes, "copy_to_host"), source, stream, "copy_to_host")

    def read_device(self, src: int, out: np.ndarray[Any, Any]) -> None:
        self._timeline.cuda("read_device")
        np.copyto(out.reshape(-1).view(np.uint8), self.device_range(src, out.nbytes, "read_device"))
