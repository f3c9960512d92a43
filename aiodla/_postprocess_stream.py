"""Post-processing on the slot's stream: the device path's detector step after the task.

With device conversion on a runtime that can (``DetectsOnStream``, in
:mod:`aiodla.runtime._protocol`: the CUDA runtime's NVRTC kernels, the emulated
runtime's numpy stream operation), a ``postprocess=Detect(...)`` runs *on the slot's
stream* after the DLA task: decode and threshold per head straight from the heads' DLA
buffers (no unpack), rank and cap, the IoU bitmask, the greedy pass and the compaction,
into a small output buffer (:mod:`aiodla.runtime._detect_output`), of which the host
copies back only that buffer (about 7 KB for ``max_det=300``; none at all with mapped
staging on an integrated GPU). The engine returns :class:`~aiodla.Detections` from those
bytes.

Boxes reach the frame's pixels (step 7 of :mod:`aiodla._detect_math`) on the device:
the decode step needs the frame anyway, to drop the boxes that have nothing inside it
before ranking and NMS (step 4), so the work after the task differs with the frame's
size, and a slot captures one graph per frame size (:meth:`StreamDetect.graph_key`).
``output="device"`` results keep their arrays on the device as
:class:`~aiodla.DeviceTensor`, sharing one pool allocation that goes back once all
three are gone. The count and the drop counts come back to the host either way (the
count is the arrays' length).

Every buffer is allocated when the slot opens: a scratch buffer and an output buffer
in device memory and a pinned buffer for the copy back (or one mapped buffer).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._detect import Detections
from ._device_arrays import DeviceTensor
from ._errors import PostprocessError
from .runtime._detect_output import HEADER, OutputReader, read_count, read_dropped

if TYPE_CHECKING:
    from ._frame_plan import Geometry
    from ._postprocess import Postprocess
    from ._slots import Slot
    from .runtime import HostBuffer, Kernels
    from .runtime._protocol import DetectProgramLike

__all__ = ["StreamDetect"]

Allocate = Callable[[str, Callable[..., Any], Callable[..., Any], Any], Any]


class _Buffers:
    __slots__ = ("host", "out", "reader", "work")

    def __init__(self, work: int, out: int, host: HostBuffer, reader: OutputReader) -> None:
        self.work = work
        self.out = out  # where the kernels write: device memory, or the mapped host buffer
        self.host = host
        self.reader = reader  # the Detections in ``host``, by views made once


class _SharedRelease:
    """One pool allocation behind several device tensors: given back at the last one."""

    def __init__(self, count: int, release: Callable[[], None]) -> None:
        self._left = count
        self._release = release
        self._lock = threading.Lock()  # tensors are dropped on any thread

    def __call__(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._release()


class StreamDetect:
    """One engine's detector on its slots' streams (see the module's docstring)."""

    def __init__(
        self,
        runtime: Kernels,
        program: DetectProgramLike,
        postprocess: Postprocess,
        zero_copy: bool,
    ) -> None:
        self.runtime = runtime
        self.program = program
        self.postprocess = postprocess
        self.layout = program.layout
        self.zero_copy = zero_copy
        self._heads = postprocess.heads  # output index of each head, in the plan's order
        self._buffers: dict[int, _Buffers] = {}  # by id(slot)
        self._detect: Any = runtime.detect  # type: ignore[attr-defined]

    def bind_slot(self, slot: Slot, allocate: Allocate) -> None:
        """Allocate the slot's scratch and output buffers (at open)."""
        runtime = self.runtime
        work = allocate("detector scratch", runtime.malloc, runtime.free, self.program.work_bytes)
        nbytes = self.program.out_bytes
        if self.zero_copy:

            def host_alloc(nbytes: int) -> HostBuffer:  # the kernels write it in place
                return runtime.host_alloc(nbytes, mapped=True)

            host = allocate("detector output", host_alloc, runtime.host_free, nbytes)
            out = host.device_ptr
        else:
            out = allocate("detector output", runtime.malloc, runtime.free, nbytes)
            host = allocate("detector output", runtime.host_alloc, runtime.host_free, nbytes)
        reader = OutputReader(host.array[: self.layout.size], self.layout)
        self._buffers[id(slot)] = _Buffers(work, out, host, reader)

    def graph_key(self, slot: Slot) -> tuple[int, ...]:
        """What makes the slot's work after its task differ between requests of host
        results: the frame's size (the geometry the kernels take), or nothing when the
        boxes stay in model-input pixels."""
        frame = self._frame(slot)
        return () if frame is None else frame[1]

    def enqueue(self, slot: Slot, device: bool) -> None:
        """The slot's post-processing after its task, and the copy of what it kept."""
        runtime = self.runtime
        buffers = self._buffers[id(slot)]
        stream = slot.stream
        heads = [slot.outputs[index].device_ptr for index in self._heads]
        frame = self._frame(slot)
        geometry, size = (None, None) if frame is None else frame
        if device and runtime.has_device_memory:
            out = runtime.malloc_async(self.program.out_bytes, stream)
            slot.pooled.append(out)
            self._detect(self.program, heads, buffers.work, out, stream, geometry, size)
            runtime.copy_to_host(buffers.host, out, HEADER, stream)  # the counts only
            return
        self._detect(self.program, heads, buffers.work, buffers.out, stream, geometry, size)
        if not self.zero_copy:
            runtime.copy_to_host(buffers.host, buffers.out, self.program.out_bytes, stream)

    def read(self, slot: Slot, device: bool) -> Detections:
        """The slot's Detections, once its stream is done; PostprocessError when the
        device's post-processing failed or left an output that cannot be read."""
        buffers = self._buffers[id(slot)]
        # Any failure here is this request's PostprocessError: the engine answers that
        # (the request fails alone, its slot goes back), where another exception left
        # the request unanswered and its slot taken.
        try:
            if slot.pooled:
                (pointer,), slot.pooled = slot.pooled, []
                header = buffers.host.array
                return self._on_device(pointer, read_count(header, self.layout), header)
            found = buffers.reader.read()
            if device:  # a runtime without device memory: host-backed, as its outputs are
                found = Detections(
                    *(_host_backed(a) for a in (found.boxes, found.scores, found.classes)),
                    outside=found.outside,
                    not_finite=found.not_finite,
                )
        except Exception as exc:
            raise PostprocessError(f"post-processing failed: {exc}") from exc
        return found

    def _frame(self, slot: Slot) -> tuple[Geometry, tuple[int, int]] | None:
        request = slot.request
        return self.postprocess.frame_of(request.arrays if request is not None else ())

    def _on_device(self, pointer: int, count: int, header: Any) -> Detections:
        runtime = self.runtime
        layout = self.layout
        release = _SharedRelease(3, functools.partial(runtime.free_async, pointer))
        arrays = []
        for offset, shape, dtype in (
            (layout.boxes, (count, 4), np.float32),
            (layout.scores, (count,), np.float32),
            (layout.classes, (count,), np.int32),
        ):
            at = pointer + offset
            arrays.append(
                DeviceTensor(
                    pointer=at,
                    shape=shape,
                    dtype=np.dtype(dtype),
                    device=runtime.device,
                    release=release,
                    to_host=functools.partial(runtime.read_device, at),
                )
            )
        outside, not_finite = read_dropped(header)
        return Detections(*arrays, outside=outside, not_finite=not_finite)


def _host_backed(array: np.ndarray[Any, Any]) -> DeviceTensor:
    array = np.ascontiguousarray(array)
    return DeviceTensor(
        pointer=int(array.ctypes.data),
        shape=array.shape,
        dtype=array.dtype,
        device=None,
        host_array=array,
    )
