"""Frame buffers: memory the engine owns and a camera reader fills in place.

``engine.frame_buffers(count, shape, dtype=np.uint8)`` returns numpy arrays over pinned
host memory of the runtime (``host_alloc``; mapped where the GPU shares the host's
memory, so kernels read a frame where it lies). When ``infer`` is given such an array
(or a view of one) for an input with an ``ImagePreprocess``, the engine reads the frame
from it instead of copying it into the slot's staging first.

The rules: a buffer stays valid until the engine closes; the engine frees them all
then, after its last request ended. Dropping your reference to a buffer while a request
reads it is safe (the request holds the array until it ends). Writing into a buffer
while a request reads it is not: keep a ring of buffers (one in flight, one waiting,
one being filled for a :class:`~aiodla.LatestFrameStream`).
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._errors import ConfigurationError

if TYPE_CHECKING:
    from .runtime import HostBuffer, Runtime

__all__ = ["FrameBuffers"]

_MAX_COUNT = 256  # buffers in one call: a ring per camera is a handful


class FrameBuffers:
    """One engine's frame buffers: allocation, lookup by address, release at close."""

    def __init__(self, runtime: Runtime, mapped: bool) -> None:
        self._runtime = runtime
        self._mapped = mapped
        self._starts: list[int] = []  # sorted buffer addresses, for lookup
        self._buffers: list[HostBuffer] = []  # in the same order
        self._by_address: dict[int, HostBuffer] = {}

    def create(self, count: Any, shape: Any, dtype: Any = np.uint8) -> list[np.ndarray[Any, Any]]:
        """``count`` arrays of ``shape`` and ``dtype`` in the runtime's pinned memory.
        ConfigurationError for a count, shape or dtype out of range."""
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
            arrays.append(buffer.array[:nbytes].view(kind).reshape(sizes))
        return arrays

    def find(self, array: np.ndarray[Any, Any]) -> tuple[HostBuffer, int] | None:
        """The buffer that holds every byte ``array`` reads, and the offset of its first
        element in it; None when the array lies elsewhere (or no buffer exists)."""
        if not self._starts:
            return None
        low, high = _bounds(array)
        at = bisect.bisect(self._starts, low) - 1
        if at < 0:
            return None
        buffer = self._buffers[at]
        if high > buffer.ptr + buffer.nbytes:
            return None
        return buffer, int(array.__array_interface__["data"][0]) - buffer.ptr

    def buffer_at(self, address: int) -> HostBuffer:
        """The buffer that starts at ``address`` (one :meth:`find` returned)."""
        return self._by_address[address]

    def __len__(self) -> int:
        return len(self._buffers)

    def close(self) -> None:
        """Free every buffer (the engine calls this once its requests have ended)."""
        buffers, self._buffers, self._starts = self._buffers, [], []
        self._by_address.clear()
        for buffer in buffers:
            self._runtime.host_free(buffer)


def _positive(value: object) -> int:
    """``value`` as a positive int, or 0 when it is not one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return 0
    return max(int(value), 0)


def _bounds(array: np.ndarray[Any, Any]) -> tuple[int, int]:
    """The first byte an array reads and one past its last (any strides)."""
    low = high = int(array.__array_interface__["data"][0])
    for size, stride in zip(array.shape, array.strides, strict=True):
        if size == 0:
            return low, low
        reach = (size - 1) * stride
        low, high = (low + reach, high) if reach < 0 else (low, high + reach)
    return low, high + array.itemsize
