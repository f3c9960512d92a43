"""The emulated runtime's device data path: layout conversion as stream operations,
cross-stream waits, pool memory and mapped (zero-copy) host buffers.

The CUDA runtime runs these conversions as NVRTC kernels on the slot's stream; here
the same operations are queued on the emulated stream and run numpy's conversion
(``TensorSpec.pack`` / ``unpack``) over the emulated device memory when the stream
reaches them. The engine drives both runtimes through the same calls, so CI covers
the device path's logic: which buffers, which pointers and strides, in which order.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import RuntimeUnavailableError
from ._conversion_source import plan_program
from ._protocol import TransferCounts
from ._timeline import _Operation, _Stream

if TYPE_CHECKING:
    from .._frame_plan import Preprocessing
    from .._tensors import TensorSpec

__all__ = ["EmulatedConversion"]

_INVALID_VALUE = 1
_DEVICE_ALIGNMENT = 256  # what cudaMalloc guarantees
_NOT_READY_WAIT = 0.0002  # seconds between looks at an event a wait depends on


def _reach(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int]:
    """The lowest and one past the highest element offsets a strided array reaches
    (strides may be negative: a flipped view)."""
    low = sum((size - 1) * step for size, step in zip(shape, strides, strict=True) if step < 0)
    high = sum((size - 1) * step for size, step in zip(shape, strides, strict=True) if step > 0)
    return low, high + 1


class EmulatedConversion:
    """Mixed into :class:`~aiodla.runtime.EmulatedRuntime` (whose state it uses)."""

    counts: TransferCounts
    device = 0
    has_device_memory = False  # "device" memory is host memory: outputs stay host-backed
    _conversions: set[tuple[str, TensorSpec, np.dtype[Any]]]
    _frames: dict[TensorSpec, Preprocessing]

    _device_memory: dict[int, np.ndarray[Any, Any]]
    _device_starts: list[int]
    _next_address: int

    if TYPE_CHECKING:  # provided by the runtime's other layers (declared for mypy only)

        def _cuda(self, call: str) -> None: ...
        def _stream(self, stream: int, call: str) -> _Stream: ...
        def _push(self, stream: _Stream, operation: _Operation, duration: float = 0.0) -> None: ...
        def _device_range(self, ptr: int, nbytes: int, call: str) -> np.ndarray[Any, Any]: ...
        def query_event(self, event: int) -> bool: ...
        def malloc(self, nbytes: int) -> int: ...
        def _changed(self) -> None: ...
        def free(self, ptr: int) -> None: ...

    # -- conversions -------------------------------------------------------------------

    def prepare_conversions(
        self,
        packs: Sequence[tuple[TensorSpec, np.dtype[Any]]],
        unpacks: Sequence[tuple[TensorSpec, np.dtype[Any]]],
    ) -> None:
        self._cuda("prepare_conversions")
        # The same program the CUDA runtime would compile must be one it can generate:
        # a pair its kernels refuse fails here too, in CI.
        try:
            plan_program(packs, unpacks)
        except ValueError as exc:
            raise RuntimeUnavailableError(
                f"the GPU layout conversion cannot serve: {exc}"
            ) from None
        # As compiled kernels are: only the pairs prepared can be launched.
        self._conversions.update(("pack", spec, np.dtype(dtype)) for spec, dtype in packs)
        self._conversions.update(("unpack", spec, np.dtype(dtype)) for spec, dtype in unpacks)

    def _check_prepared(self, kind: str, spec: TensorSpec, dtype: np.dtype[Any]) -> None:
        if (kind, spec, dtype) not in self._conversions:
            raise ValueError(
                f"no {kind} conversion was prepared for tensor {spec.name!r} ({dtype})"
            )

    def pack(
        self,
        spec: TensorSpec,
        source: np.dtype[Any],
        src: int,
        src_strides: tuple[int, int, int, int],
        dst: int,
        stream: int,
    ) -> None:
        self._cuda("pack")
        self._check_prepared("pack", spec, source)
        itemsize = source.itemsize
        low, high = _reach(spec.shape, src_strides)
        raw = self._device_range(src + low * itemsize, (high - low) * itemsize, "pack")
        values: np.ndarray[Any, Any] = np.ndarray(
            spec.shape,
            source,
            buffer=raw,
            offset=-low * itemsize,
            strides=tuple(s * itemsize for s in src_strides),
        )
        target = self._device_range(dst, spec.size, "pack")
        queue = self._stream(stream, "pack")
        self.counts.conversions += 1

        # checked=True: the engine checked the values (host arrays) or, for device
        # arrays, leaves them to the conversion's rules (NaN stores 0), as the kernel does.
        def effect() -> None:
            spec.bind(target).write(values, checked=True)

        self._push(queue, _Operation(effect))

    def unpack(
        self, spec: TensorSpec, result: np.dtype[Any], src: int, dst: int, stream: int
    ) -> None:
        self._cuda("unpack")
        self._check_prepared("unpack", spec, result)
        raw = self._device_range(src, spec.size, "unpack")
        nbytes = int(np.prod(spec.shape)) * result.itemsize
        target = self._device_range(dst, nbytes, "unpack").view(result).reshape(spec.shape)
        queue = self._stream(stream, "unpack")
        self.counts.conversions += 1

        def effect() -> None:
            np.copyto(target, spec.unpack(raw, dtype=result))

        self._push(queue, _Operation(effect))

    def is_integrated(self) -> bool:
        return False  # like a discrete GPU; Engine(zero_copy=True) maps buffers anyway

    def pointer_device(self, ptr: int) -> int:
        self._device_range(ptr, 1, "pointer_device")  # raises for an unknown address
        return 0

    def prepare_preprocess(self, targets: Sequence[tuple[TensorSpec, Preprocessing]]) -> None:
        self._cuda("prepare_preprocess")
        for spec, pre in targets:
            pre.check_target(spec)
            self._frames[spec] = pre

    def preprocess(
        self,
        spec: TensorSpec,
        frame: int,
        height: int,
        width: int,
        pitch: int,
        dst: int,
        stream: int,
    ) -> None:
        self._cuda("preprocess")
        pre = self._frames.get(spec)
        if pre is None:
            raise ValueError(f"no pre-processing was prepared for tensor {spec.name!r}")
        if pre.source == "nv12":  # the UV rows follow the Y rows at the same pitch
            shape: tuple[int, ...] = (height * 3 // 2, width)
            strides: tuple[int, ...] = (pitch, 1)
        else:
            channels = len(pre.source)
            shape, strides = (height, width, channels), (pitch, channels, 1)
        extent = (shape[0] - 1) * pitch + int(np.prod(shape[1:]))
        image = np.ndarray(
            shape, np.uint8, self._device_range(frame, extent, "preprocess"), 0, strides
        )
        target = self._device_range(dst, spec.size, "preprocess")
        queue = self._stream(stream, "preprocess")
        self.counts.conversions += 1

        def effect() -> None:
            spec.pack(pre.apply(image, spec, validate=False), target, validate=False)

        self._push(queue, _Operation(effect))

    # -- ordering between streams ----------------------------------------------------------

    def wait_event(self, stream: int, event: int) -> None:
        """The emulated streams have no cross-stream edges: the wait happens here, on
        the calling thread, until the event's work is done (producers of device arrays
        in tests have little or none queued)."""
        self._cuda("wait_event")
        self._stream(stream, "wait_event")
        while not self.query_event(event):
            time.sleep(_NOT_READY_WAIT)

    # -- memory ---------------------------------------------------------------------------

    def malloc_async(self, nbytes: int, stream: int) -> int:
        self._stream(stream, "malloc_async")
        pointer = self.malloc(nbytes)
        self.counts.allocations -= 1  # malloc counted it; it is a pool allocation
        self.counts.pool_allocations += 1
        return pointer

    def free_async(self, ptr: int) -> None:
        self.free(ptr)

    def _map(self, memory: np.ndarray[Any, Any]) -> int:
        """Give ``memory`` a device address (with the lock held)."""
        address = self._next_address
        span = -(-memory.nbytes // _DEVICE_ALIGNMENT) * _DEVICE_ALIGNMENT
        self._next_address += span + _DEVICE_ALIGNMENT  # a gap: overruns never alias
        self._device_memory[address] = memory
        self._changed()
        bisect.insort(self._device_starts, address)
        return address

    def _unmap(self, address: int) -> None:
        self._changed()
        del self._device_memory[address]
        self._device_starts.remove(address)

    def read_device(self, src: int, out: np.ndarray[Any, Any]) -> None:
        self._cuda("read_device")
        np.copyto(
            out.reshape(-1).view(np.uint8), self._device_range(src, out.nbytes, "read_device")
        )
