"""The emulated runtime's device data path: layout conversion and pre-processing as
stream operations, and cross-stream waits.

The CUDA runtime runs these conversions as NVRTC kernels on the slot's stream; here
the same operations are queued on the emulated stream and run numpy's conversion
(``TensorSpec.pack`` / ``unpack``) over the emulated device memory when the stream
reaches them. The engine drives both runtimes through the same calls, so CI covers
the device path's logic: which buffers, which pointers and strides, in which order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import RuntimeUnavailableError
from .._frame_plan import _PLANAR
from ._conversion_source import plan_program
from ._timeline import _Operation

if TYPE_CHECKING:
    from .._frame_plan import Preprocessing
    from .._tensors import TensorSpec
    from ._emulated_memory import EmulatedMemory
    from ._timeline import Timeline

__all__ = ["EmulatedConversion"]

_NOT_READY_WAIT = 0.0002  # seconds between looks at an event a wait depends on


def _reach(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int]:
    """The lowest and one past the highest element offsets a strided array reaches
    (strides may be negative: a flipped view)."""
    low = sum((size - 1) * step for size, step in zip(shape, strides, strict=True) if step < 0)
    high = sum((size - 1) * step for size, step in zip(shape, strides, strict=True) if step > 0)
    return low, high + 1


class EmulatedConversion:
    """The conversions and pre-processing prepared, and the calls that queue them."""

    def __init__(self, timeline: Timeline, memory: EmulatedMemory) -> None:
        self._timeline = timeline
        self._memory = memory
        self._conversions: set[tuple[str, TensorSpec, np.dtype[Any]]] = set()
        self._frames: dict[TensorSpec, Preprocessing] = {}  # prepared, by tensor

    # -- conversions -------------------------------------------------------------------

    def prepare_conversions(
        self,
        packs: Sequence[tuple[TensorSpec, np.dtype[Any]]],
        unpacks: Sequence[tuple[TensorSpec, np.dtype[Any]]],
    ) -> None:
        self._timeline.cuda("prepare_conversions")
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
        self._timeline.cuda("pack")
        self._check_prepared("pack", spec, source)
        itemsize = source.itemsize
        low, high = _reach(spec.shape, src_strides)
        raw = self._memory.device_range(src + low * itemsize, (high - low) * itemsize, "pack")
        values: np.ndarray[Any, Any] = np.ndarray(
            spec.shape,
            source,
            buffer=raw,
            offset=-low * itemsize,
            strides=tuple(s * itemsize for s in src_strides),
        )
        target = self._memory.device_range(dst, spec.size, "pack")
        queue = self._timeline.stream(stream, "pack")
        self._memory.counts.conversions += 1

        # checked=True: the engine checked the values (host arrays) or, for device
        # arrays, leaves them to the conversion's rules (NaN stores 0), as the kernel does.
        def effect() -> None:
            spec.bind(target).write(values, checked=True)

        self._timeline.push(queue, _Operation(effect))

    def unpack(
        self, spec: TensorSpec, result: np.dtype[Any], src: int, dst: int, stream: int
    ) -> None:
        self._timeline.cuda("unpack")
        self._check_prepared("unpack", spec, result)
        raw = self._memory.device_range(src, spec.size, "unpack")
        nbytes = int(math.prod(spec.shape)) * result.itemsize
        target = self._memory.device_range(dst, nbytes, "unpack").view(result).reshape(spec.shape)
        queue = self._timeline.stream(stream, "unpack")
        self._memory.counts.conversions += 1

        def effect() -> None:
            np.copyto(target, spec.unpack(raw, dtype=result))

        self._timeline.push(queue, _Operation(effect))

    def prepare_preprocess(self, targets: Sequence[tuple[TensorSpec, Preprocessing]]) -> None:
        self._timeline.cuda("prepare_preprocess")
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
        self._timeline.cuda("preprocess")
        pre = self._frames.get(spec)
        if pre is None:
            raise ValueError(f"no pre-processing was prepared for tensor {spec.name!r}")
        if pre.source in _PLANAR:  # the chroma rows follow the Y rows at the same pitch
            shape: tuple[int, ...] = (height * 3 // 2, width)
            strides: tuple[int, ...] = (pitch, 1)
        else:
            channels = len(pre.source)
            shape, strides = (height, width, channels), (pitch, channels, 1)
        extent = (shape[0] - 1) * pitch + int(math.prod(shape[1:]))
        image = np.ndarray(
            shape, np.uint8, self._memory.device_range(frame, extent, "preprocess"), 0, strides
        )
        target = self._memory.device_range(dst, spec.size, "preprocess")
        queue = self._timeline.stream(stream, "preprocess")
        self._memory.counts.conversions += 1

        def effect() -> None:
            spec.pack(pre.apply(image, spec, validate=False), target, validate=False)

        self._timeline.push(queue, _Operation(effect))

    # -- ordering between streams ----------------------------------------------------------

    def wait_event(self, stream: int, event: int) -> None:
        """The emulated streams have no cross-stream edges: the wait happens here, on
        the calling thread, until the event's work is done (producers of device arrays
        in tests have little or none queued)."""
        self._timeline.cuda("wait_event")
        self._timeline.stream(stream, "wait_event")
        while not self._timeline.query_event(event):
            time.sleep(_NOT_READY_WAIT)
