"""Pinned host memory for the CUDA runtime: ``cudaHostAlloc``'s, and memory the caller
allocated and page-locks (``cudaHostRegister``: the staging that ``isolation="process"``
shares between two processes), each remembered so that it is freed exactly once."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ._cuda_errors import check_cuda
from ._protocol import CudaCallError, HostBuffer, TransferCounts

__all__ = ["PinnedMemory"]

_INVALID_VALUE = 1


class PinnedMemory:
    """The CUDA runtime's pinned buffers; ``cudart`` gives the bindings to call (looked
    up at each call: tests replace them)."""

    def __init__(self, counts: TransferCounts, cudart: Callable[[], Any]) -> None:
        self.counts = counts
        self._cudart = cudart
        self._lock = threading.Lock()
        self._host_buffers: dict[int, HostBuffer] = {}
        self._registered_host: set[int] = set()  # host_register's, not cudaHostAlloc's

    def host_alloc(self, nbytes: int, mapped: bool = False) -> HostBuffer:
        if nbytes <= 0:
            raise CudaCallError("cudaHostAlloc", _INVALID_VALUE)
        rt = self._cudart()
        flags = rt.cudaHostAllocPortable
        if mapped:
            flags |= rt.cudaHostAllocMapped
        pointer = int(check_cuda("cudaHostAlloc", rt.cudaHostAlloc(nbytes, flags)))
        device_pointer = self._device_pointer(pointer, rt.cudaFreeHost) if mapped else 0
        storage = (ctypes.c_ubyte * nbytes).from_address(pointer)
        buffer = HostBuffer(pointer, np.ctypeslib.as_array(storage), device_pointer)
        with self._lock:
            self._host_buffers[pointer] = buffer
        self.counts.allocations += 1
        return buffer

    def host_register(
        self, array: np.ndarray[Any, np.dtype[np.uint8]], mapped: bool = False
    ) -> HostBuffer:
        """Page-lock memory the caller allocated (``cudaHostRegister``), so async
        copies read and write it in place: the staging that ``isolation="process"``
        shares between two processes. ``mapped``: kernels reach it in place too, at
        the buffer's ``device_ptr``. Released with :meth:`host_free`."""
        pointer, nbytes = int(array.ctypes.data), int(array.nbytes)
        if nbytes <= 0:
            raise CudaCallError("cudaHostRegister", _INVALID_VALUE)
        flags = self._cudart().cudaHostRegisterPortable
        if mapped:
            flags |= self._cudart().cudaHostRegisterMapped
        check_cuda("cudaHostRegister", self._cudart().cudaHostRegister(pointer, nbytes, flags))
        device_pointer = (
            self._device_pointer(pointer, self._cudart().cudaHostUnregister) if mapped else 0
        )
        buffer = HostBuffer(pointer, array, device_pointer)
        with self._lock:
            self._host_buffers[pointer] = buffer
            self._registered_host.add(pointer)
        return buffer

    def host_free(self, buffer: HostBuffer) -> None:
        # Freeing pinned memory twice would corrupt the driver's tables; refuse instead.
        with self._lock:
            if self._host_buffers.get(buffer.ptr) is not buffer:
                raise CudaCallError("cudaFreeHost", _INVALID_VALUE)
            del self._host_buffers[buffer.ptr]
            registered = buffer.ptr in self._registered_host
            self._registered_host.discard(buffer.ptr)
        if registered:  # the memory is its owner's: only the page-locking ends here
            check_cuda("cudaHostUnregister", self._cudart().cudaHostUnregister(buffer.ptr))
            return
        check_cuda("cudaFreeHost", self._cudart().cudaFreeHost(buffer.ptr))

    def _device_pointer(self, pointer: int, undo: Callable[[int], Any]) -> int:
        """The device address of mapped host memory at ``pointer``; when there is none,
        ``undo`` the allocation or registration and raise."""
        try:
            return int(
                check_cuda(
                    "cudaHostGetDevicePointer", self._cudart().cudaHostGetDevicePointer(pointer, 0)
                )
            )
        except CudaCallError:
            undo(pointer)
            raise
