"""Device buffers for decoded pictures: a pool of one size, and a picture over one.

A source that keeps its pictures on the GPU copies each one out of memory that is not
its to keep (a decoder's surface, which the next ``Decode`` overwrites; a decoding
process's slot, which it fills again) into a buffer of its own :class:`DevicePool`, and
hands it on as a :class:`DeviceNV12`, a small object exposing
``__cuda_array_interface__`` over the buffer. The buffer returns to the pool when that
object is gone, as host frames return to theirs (:mod:`aiodla._frame_pool`), and is
freed once both the pool is closed and the buffer is back.
"""

from __future__ import annotations

import logging
import threading
import weakref

from cuda.bindings import runtime as _rt

from .runtime._cuda_errors import check_cuda

__all__ = ["DeviceNV12", "DevicePool", "copy_within_device"]

logger = logging.getLogger("aiodla")


class DevicePool:
    """Device buffers of one size for one stream's pictures: taken on the reader
    thread, given back by whichever thread drops a picture's last array, freed once
    both the pool is closed and the buffer is back."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[int] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
        return int(check_cuda("cudaMalloc", _rt.cudaMalloc(self.nbytes)))

    def give_back(self, pointer: int) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(pointer)
                return
        _free(pointer)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for pointer in free:
            _free(pointer)


def _free(pointer: int) -> None:
    try:
        check_cuda("cudaFree", _rt.cudaFree(pointer))
    except Exception as exc:  # on whichever thread let the picture go: never raise there
        logger.warning("aiodla: freeing a device picture's buffer failed: %s", exc)


class DeviceNV12:
    """A picture in a buffer of ``pool`` as a CUDA array (Y rows then the chroma rows,
    ``(height * 3 // 2, width)`` bytes); the buffer returns to the pool with it."""

    __slots__ = ("__cuda_array_interface__", "__weakref__")

    def __init__(self, pool: DevicePool, pointer: int, width: int, height: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (height * 3 // 2, width),
            "typestr": "|u1",
            "data": (pointer, False),
            "strides": None,
            "version": 3,
            "stream": None,  # the copy into it was synchronized before it left
        }
        weakref.finalize(self, pool.give_back, pointer)


def copy_within_device(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``src`` to ``dst`` in device memory, on the legacy default
    stream, and wait for it: the copy is whole before either side is used again."""
    kind = _rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    check_cuda("cudaMemcpyAsync", _rt.cudaMemcpyAsync(dst, src, nbytes, kind, 0))
    check_cuda("cudaStreamSynchronize", _rt.cudaStreamSynchronize(0))
