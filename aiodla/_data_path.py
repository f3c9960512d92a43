"""How a slot's tensors travel between the caller and the DLA buffers, on its stream.

Two paths, chosen once when the engine opens (``Engine(convert=...)``):

- **host conversion**: the loop thread packs each input into the slot's pinned
  staging buffer in the DLA layout (numpy, :mod:`aiodla._layout`), the stream copies
  it to the registered buffer, runs the task and copies the DLA bytes back; the loop
  unpacks them.
- **device conversion** (cuDLA hybrid mode as meant): the host copies only the
  caller's bytes (or none: a device array, or a camera frame in device memory, is read
  where it lies), and the runtime's conversion kernels pack them into the DLA buffer
  and unpack the outputs into the logical layout *on the slot's stream*, around the
  task. With ``zero_copy`` (an integrated GPU), staging buffers are mapped: the
  kernels read and write them in place and no copy is enqueued at all.
  ``output="device"`` leaves the outputs in stream-ordered pool memory, handed out as
  :class:`~aiodla.DeviceTensor`.

Every buffer is allocated when the slot opens; the request path allocates nothing
except pool memory for device outputs.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._bindings import FrameRead, Read, Staging, TensorBinding
from ._device_arrays import DeviceSource, DeviceTensor, import_device_array
from ._device_frames import device_frame_read, import_device_frame
from ._errors import InputTypeError, InputValueError, RuntimeUnavailableError
from ._frame_buffers import read_in_buffer
from ._frame_plan import _PLANAR
from ._source_dtypes import SOURCE_DTYPES, WIDEST, accepted_dtypes, device_dtype_check

if TYPE_CHECKING:
    from ._frame_buffers import FrameSource
    from ._postprocess import Postprocess
    from ._postprocess_stream import StreamDetect
    from ._preprocess import ImagePreprocess
    from ._slots import Slot
    from ._tensors import TensorSpec
    from .runtime import HostBuffer, Kernels, Runtime
from .runtime._protocol import DetectsOnStream, offers

__all__ = ["DataPath", "DevicePath", "HostPath", "TensorBinding"]

_Array = np.ndarray[Any, Any]

#: Copies up to this size keep the GIL (see :func:`copy_small`).
GIL_HELD_COPY = 64 * 1024

logger = logging.getLogger("aiodla")


def copy_small(destination: memoryview, array: _Array) -> bool:
    """Copy a C-contiguous ``array`` of at most ``GIL_HELD_COPY`` bytes into
    ``destination`` (the bytes of a dense array of its dtype and shape) keeping the GIL;
    False, copying nothing, for any other array.

    numpy releases the GIL for any copy of 500 elements or more. On a loaded engine the
    poller takes it meanwhile and the loop waits for it back: a thread hop that costs
    more than copying a few kilobytes (a model's input of a 32x32 image, most outputs).
    """
    if array.nbytes > GIL_HELD_COPY or not array.flags.c_contiguous:
        return False
    destination[:] = array.data.cast("B")
    return True


def _dense_strides(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    _, c, h, w = shape
    return (c * h * w, h * w, w, 1)


# Allocation and release go through the device layer's resource stack.
Allocate = Callable[[str, Callable[..., Any], Callable[..., Any], Any], Any]


class HostPath:
    """Host conversion: numpy packs and unpacks; the stream copies DLA bytes."""

    converts_on_device = False
    fused = False  # (camera frames are pre-processed on the host)
    zero_copy = False
    detect: StreamDetect | None = None  # post-processing stays on the host, in numpy

    def use_frame_buffers(self, frames: FrameSource) -> None:
        """Host conversion packs from any array: frame buffers need nothing here."""

    def prepare_detect(self, postprocess: Postprocess) -> None:
        """Host conversion post-processes on the host (numpy), after the unpack."""

    def bind_slot(self, slot: Slot, allocate: Allocate) -> None:
        """Nothing per slot beyond its tensors' buffers."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def import_array(self, spec: TensorSpec, value: Any) -> DeviceSource:
        raise InputTypeError(
            f"input {spec.name!r}: a device array needs device conversion "
            "(Engine(convert='device') on a runtime with GPU memory); this engine "
            "converts on the host: pass a numpy array"
        )

    def staged_elsewhere(self, slot: Slot, reads: Sequence[Read]) -> None:
        """Another process staged the slot's inputs (``isolation="process"``): in
        place, as DLA bytes in the shared staging; nothing is left to take."""

    def bind(
        self,
        spec: TensorSpec,
        device_ptr: int,
        registered: int,
        output: bool,
        allocate: Allocate,
        preprocess: ImagePreprocess | None = None,
    ) -> TensorBinding:
        runtime = self.runtime
        host = allocate(spec.name, runtime.host_alloc, runtime.host_free, spec.size)
        binding = TensorBinding(spec, device_ptr, registered, host, spec.bind(host.array))
        if preprocess is not None:  # opened once: pre-processing allocates nothing per frame
            binding.preprocess, binding.scratch = preprocess, np.empty(spec.shape, np.float32)
        return binding

    def write_inputs(self, slot: Slot, arrays: Sequence[Any], limit: int | None = None) -> bool:
        """Pack ``arrays`` into the slot's pinned buffers (a camera frame pre-processed
        on the host first). Packs nothing and returns False when that moves more than
        ``limit`` bytes on the host: every packed tensor's, and a frame's own bytes and
        its pre-processed model input."""
        if limit is not None:
            moved = 0
            for binding, array in zip(slot.inputs, arrays, strict=True):
                moved += binding.spec.size
                if binding.preprocess is not None and binding.scratch is not None:
                    moved += array.nbytes + binding.scratch.nbytes
            if moved > limit:
                return False
        for binding, array in zip(slot.inputs, arrays, strict=True):
            assert binding.bound is not None
            if binding.preprocess is not None:
                pre = binding.preprocess
                array = pre.apply(array, binding.spec, binding.scratch, validate=False)
            binding.bound.write(array, checked=True)
        return True

    def write_zeros(self, slot: Slot) -> None:
        for binding in slot.inputs:
            assert binding.bound is not None
            binding.bound.write(np.zeros(binding.spec.shape, binding.spec.numpy_dtype))

    def graph_kinds(self, slot: Slot, device: bool) -> tuple[Hashable | None, Hashable | None]:
        """What makes the slot's work before and after its task differ between requests
        (the graph keys, see ``aiodla._graphs``): here nothing."""
        return (), ()

    def enqueue_inputs(self, slot: Slot) -> None:
        copy = self.runtime.copy_to_device
        for binding in slot.inputs:
            copy(binding.device_ptr, binding.host, binding.spec.size, slot.stream)

    def enqueue_outputs(self, slot: Slot, device: bool) -> None:
        copy = self.runtime.copy_to_host
        for binding in slot.outputs:
            copy(binding.host, binding.device_ptr, binding.spec.size, slot.stream)

    def read_outputs(self, slot: Slot, device: bool) -> list[Any]:
        results = []
        for binding in slot.outputs:
            assert binding.bound is not None
            array = binding.bound.read()
            results.append(_host_backed(array) if device else array)
        return results

    def recycle(self, slot: Slot) -> None:
        """Nothing outlives a request on this path."""


def _host_backed(array: _Array) -> DeviceTensor:
    return DeviceTensor(
        pointer=int(array.ctypes.data),
        shape=array.shape,
        dtype=array.dtype,
        device=None,
        release=None,
        to_host=None,
        host_array=array,
    )


def _elements(spec: TensorSpec) -> int:
    return math.prod(spec.shape)


class DevicePath:
    """Device conversion: the runtime's kernels pack and unpack on the slot's stream."""

    converts_on_device = True

    def __init__(self, runtime: Kernels, zero_copy: bool) -> None:
        self.runtime = runtime
        self.zero_copy = zero_copy
        self.ingest_stream = 0  # device arrays' exports are ordered before its work
        self.fused = False  # camera frames go to the GPU raw, pre-processed by one kernel
        self.frame_buffers: FrameSource | None = None  # the engine's, once it makes some
        self.detect: StreamDetect | None = None  # post-processing on the slot's stream
        # input name -> its pre-processing, for the inputs that take camera frames
        self.preprocessing: dict[str, ImagePreprocess] = {}

    def use_frame_buffers(self, frames: FrameSource) -> None:
        """Read frames lying in these engine frame buffers in place (or by one copy)."""
        self.frame_buffers = frames

    def import_array(self, spec: TensorSpec, value: Any) -> DeviceSource:
        """A device array as input ``spec``: checked, and its export ordered before the
        ingest stream (raises an InputError, before anything is queued). For an input
        with an ``ImagePreprocess``, a camera frame (:func:`import_device_frame`)."""
        pre = self.preprocessing.get(spec.name)
        if pre is not None:
            if not self.fused:
                raise InputTypeError(
                    f"input {spec.name!r}: a camera frame in device memory needs the GPU "
                    "pre-processing kernel, which this engine could not prepare when it "
                    "opened (the warning logged then says why); pass the frame as a host array"
                )
            runtime = self.runtime
            return import_device_frame(
                value, spec, pre, runtime.device, self.ingest_stream, runtime.pointer_device
            )
        source = self._import(spec, value)
        pointer, itemsize = source.pointer, source.dtype.itemsize
        if pointer == 0 or pointer % itemsize:
            # A kernel reading it would fault: a sticky error, the engine's death.
            source.release()
            raise InputValueError(
                f"input {spec.name!r}: the device array's data pointer {pointer:#x} is "
                f"{'null' if pointer == 0 else f'not aligned to its {itemsize}-byte elements'}"
            )
        return source

    def _import(self, spec: TensorSpec, value: Any) -> DeviceSource:
        return import_device_array(
            value,
            name=spec.name,
            shape=spec.shape,
            accepts=device_dtype_check(spec),
            device=self.runtime.device,
            stream=self.ingest_stream,
            locate=self.runtime.pointer_device,  # the array interface names no device
        )

    def prepare(
        self,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        preprocessing: Sequence[ImagePreprocess | None] = (),
    ) -> None:
        """Have the runtime ready every conversion requests may need (the CUDA runtime
        compiles them now, at open, never on the request path)."""
        packs = [(spec, dtype) for spec in inputs for dtype in accepted_dtypes(spec)]
        unpacks = [(spec, spec.result_dtype) for spec in outputs]
        self.runtime.prepare_conversions(packs, unpacks)
        if any(preprocessing):
            targets = [
                (s, pre) for s, pre in zip(inputs, preprocessing, strict=True) if pre is not None
            ]
            self.preprocessing = {spec.name: pre for spec, pre in targets}
            try:
                self.runtime.prepare_preprocess(targets)
            except RuntimeUnavailableError as exc:
                # The conversions work: pre-process on the host and pack on the GPU.
                logger.warning("aiodla: pre-processing camera frames on the host: %s", exc)
            else:
                self.fused = True

    def prepare_detect(self, postprocess: Postprocess) -> None:
        """Run ``postprocess`` on the slots' streams when the runtime can (compiled now,
        at open); else it stays on the host, after the unpack, as with host conversion."""
        from ._postprocess_stream import StreamDetect

        detects: DetectsOnStream | None = offers(self.runtime, DetectsOnStream)
        if detects is None:
            return
        runtime = self.runtime
        try:
            program = detects.prepare_detect(postprocess.plan)
        except RuntimeUnavailableError as exc:
            logger.warning("aiodla: post-processing detections on the host: %s", exc)
            return
        self.detect = StreamDetect(runtime, program, postprocess, self.zero_copy)

    def bind_slot(self, slot: Slot, allocate: Allocate) -> None:
        """The slot's buffers beyond its tensors' (the detector's, at open)."""
        if self.detect is not None:
            self.detect.bind_slot(slot, allocate)

    def bind(
        self,
        spec: TensorSpec,
        device_ptr: int,
        registered: int,
        output: bool,
        allocate: Allocate,
        preprocess: ImagePreprocess | None = None,
    ) -> TensorBinding:
        runtime = self.runtime
        # Inputs: the caller's bytes in any accepted type (or a camera frame up to its
        # largest); outputs: the logical results.
        itemsize = spec.result_dtype.itemsize if output else WIDEST
        nbytes = _elements(spec) * itemsize
        if preprocess is not None:
            nbytes = max(nbytes, preprocess.max_frame_nbytes)
        if self.zero_copy:

            def host_alloc(nbytes: int) -> HostBuffer:  # mapped: kernels reach it in place
                return runtime.host_alloc(nbytes, mapped=True)

            host = allocate(spec.name, host_alloc, runtime.host_free, nbytes)
            return TensorBinding(spec, device_ptr, registered, host, preprocess=preprocess)
        host = allocate(spec.name, runtime.host_alloc, runtime.host_free, nbytes)
        raw = allocate(spec.name, runtime.malloc, runtime.free, nbytes)
        return TensorBinding(spec, device_ptr, registered, host, raw=raw, preprocess=preprocess)

    # -- one request (loop thread, or a worker thread for large inputs) -----------------

    def write_inputs(self, slot: Slot, arrays: Sequence[Any], limit: int | None = None) -> bool:
        """Stage host arrays' bytes (any layout in, dense out) and record what each pack
        kernel reads; device arrays, and camera frames the kernels read in place from an
        engine frame buffer, stay where they are. Stages nothing and returns False when
        that would copy more than ``limit`` bytes on the host (the engine's
        ``offload_bytes``: the caller stages them in a worker thread instead)."""
        found: list[Read | None] = []
        copied = 0
        for binding, value in zip(slot.inputs, arrays, strict=True):
            read = self._read_in_place(binding, value)
            if read is None:
                copied += value.nbytes
                if binding.preprocess is not None and not self.fused:
                    copied += _elements(binding.spec) * 4  # (the float32 model input)
            found.append(read)
        if limit is not None and copied > limit:
            return False
        if None not in found:  # every input read where it lies: nothing to copy on the host
            slot.reads = found  # type: ignore[assignment]  # (no None in it)
            return True
        slot.reads = [
            self._stage(binding, value) if read is None else read
            for binding, value, read in zip(slot.inputs, arrays, found, strict=True)
        ]
        return True

    def _read_in_place(self, binding: TensorBinding, value: Any) -> Read | None:
        """The read of an input the kernels take where it lies (a device array, a frame
        in an engine frame buffer); None for one the host must copy into staging."""
        if isinstance(value, DeviceSource):
            if binding.preprocess is not None:
                return device_frame_read(binding.preprocess, value)
            n, c, h, w = value.strides
            # 0: after the ingest stream (DLPack); else the interface's own stream
            return (value.pointer, value.dtype, (n, c, h, w), value.wait_stream or 0)
        if binding.preprocess is not None and self.fused:
            return self._frame_buffer_read(binding, value)
        return None

    def _stage(self, binding: TensorBinding, array: _Array) -> Read:
        """A host array copied into the binding's staging: a camera frame's own bytes
        (the fused kernel does the rest on the stream), a frame pre-processed on the
        host into the model input, or a tensor's bytes as they are."""
        spec, preprocess = binding.spec, binding.preprocess
        if preprocess is not None and self.fused:
            staged = binding.host.array[: array.nbytes].reshape(array.shape)
            np.copyto(staged, array)
            height, width = array.shape[:2]
            if preprocess.source in _PLANAR:
                height = height * 2 // 3
            pointer = self._staged_at(binding)
            # The staged copy is dense whatever the caller's strides (a crop, a flip).
            return FrameRead(pointer, height, width, staged.strides[0], array.nbytes)
        if preprocess is not None:
            # The model input, pre-processed on the host straight into staging.
            staged = binding.host.array[: _elements(spec) * 4].view(np.float32)
            preprocess.apply(array, spec, staged.reshape(spec.shape), validate=False)
            array = staged.reshape(spec.shape)
            pointer = self._staged_at(binding)
            return (pointer, array.dtype, _dense_strides(spec.shape), None)
        return self._stage_array(binding, array)

    def _frame_buffer_read(self, binding: TensorBinding, array: _Array) -> FrameRead | None:
        """The read of a frame lying in an engine frame buffer, in place (mapped) or by
        one copy from that buffer; None for any other frame, or one whose rows the
        kernel cannot follow (pixels not packed, rows not ascending) or whose bytes do
        not fit the device staging (those are staged as always)."""
        frames = self.frame_buffers
        found = None if frames is None else frames.find(array)
        if found is None:
            return None
        buffer, offset = found
        shape, strides, itemsize = array.shape, array.strides, array.itemsize  # (read once)
        pixel = itemsize * shape[2] if len(shape) == 3 else itemsize
        pitch, row = strides[0], shape[1] * pixel
        packed = strides[-1] == itemsize and (len(shape) == 2 or strides[1] == pixel)
        if not packed or pitch < row:
            return None
        height, width = shape[0], shape[1]
        if binding.preprocess is not None and binding.preprocess.source in _PLANAR:
            height = height * 2 // 3
        span = (shape[0] - 1) * pitch + row
        if self.zero_copy and buffer.device_ptr:
            return FrameRead(buffer.device_ptr + offset, height, width, pitch, span)
        if offset + span > binding.host.nbytes:
            return None
        return FrameRead(binding.raw + offset, height, width, pitch, offset + span, buffer.ptr)

    def _stage_array(
        self, binding: TensorBinding, array: _Array
    ) -> tuple[int, np.dtype[Any], tuple[int, int, int, int], int | None]:
        staged = binding.staged.get(array.dtype)
        if staged is None:
            if array.dtype not in SOURCE_DTYPES:
                # check_array let it through (int64 into a float tensor, say): the host
                # stores it as the tensor's type first, as the host path would.
                return self._stage_array(binding, array.astype(binding.spec.numpy_dtype))
            staged = binding.staged[array.dtype] = self._staging_of(binding, array.dtype)
        if not copy_small(staged.raw, array):
            np.copyto(staged.array, array, casting="unsafe")
        return staged.read  # type: ignore[return-value]

    def _staging_of(self, binding: TensorBinding, dtype: np.dtype[Any]) -> Staging:
        spec = binding.spec
        nbytes = _elements(spec) * dtype.itemsize
        raw = binding.host.array[:nbytes]
        read = (self._staged_at(binding), dtype, _dense_strides(spec.shape), None)
        return Staging(raw.view(dtype).reshape(spec.shape), read, raw.data)

    def _staged_at(self, binding: TensorBinding) -> int:
        """Where the kernels read the binding's staged bytes: the mapped staging itself,
        or its device copy."""
        return binding.host.device_ptr if self.zero_copy else binding.raw

    def staged_elsewhere(self, slot: Slot, reads: Sequence[Read]) -> None:
        """Take reads that another process staged into the slot's shared staging
        (``isolation="process"``): the same reads, at this process's addresses."""
        local: list[Read] = []
        for binding, read in zip(slot.inputs, reads, strict=True):
            pointer = self._staged_at(binding)
            if isinstance(read, FrameRead) and read.source:  # in an application's frame buffer
                assert self.frame_buffers is not None  # (the worker's, mapped there)
                local.append(read_in_buffer(self.frame_buffers, read, pointer, self.zero_copy))
            elif isinstance(read, FrameRead):
                local.append(read._replace(pointer=pointer))
            else:
                local.append((pointer, read[1], read[2], None))
        slot.reads = local

    def write_zeros(self, slot: Slot) -> None:
        slot.reads = [
            self._stage_array(b, np.zeros(b.spec.shape, b.spec.numpy_dtype)) for b in slot.inputs
        ]

    def graph_kinds(self, slot: Slot, device: bool) -> tuple[Hashable | None, Hashable | None]:
        """What makes the slot's work before and after its task differ between
        requests. Before: the reads (their types; a frame's size), or None when a
        device array's pointer and producer change with each request. After: None for
        device outputs (pool memory, new with each request)."""
        after: Hashable | None = None if device and self.runtime.has_device_memory else ()
        if after is not None and self.detect is not None:
            after = self.detect.graph_key(slot)  # the detector's frame
        reads = slot.reads
        for read in reads:
            # a device array or frame
            if (read.wait if type(read) is FrameRead else read[3]) is not None:
                return None, after
        return tuple(reads), after

    def enqueue_inputs(self, slot: Slot) -> None:
        runtime = self.runtime
        ingest_stream = self.ingest_stream
        stream = slot.stream
        for binding, read in zip(slot.inputs, slot.reads, strict=True):
            if isinstance(read, FrameRead):
                if read.wait is not None:  # a device frame: its producer's work first
                    runtime.record_event(slot.ingest_event, read.wait or ingest_stream)
                    runtime.wait_event(stream, slot.ingest_event)
                elif read.source:  # an engine frame buffer, from its start
                    assert self.frame_buffers is not None
                    source = self.frame_buffers.buffer_at(read.source)
                    runtime.copy_to_device(binding.raw, source, read.nbytes, stream)
                elif not self.zero_copy:
                    runtime.copy_to_device(binding.raw, binding.host, read.nbytes, stream)
                runtime.preprocess(
                    binding.spec,
                    read.pointer,
                    read.height,
                    read.width,
                    read.pitch,
                    binding.device_ptr,
                    stream,
                )
                continue
            pointer, dtype, strides, wait = read
            if wait is None:  # staged host bytes
                if not self.zero_copy:
                    nbytes = _elements(binding.spec) * dtype.itemsize
                    runtime.copy_to_device(binding.raw, binding.host, nbytes, stream)
            else:
                # A device array: its producer's work first. DLPack exports were
                # ordered before the ingest stream's work; an array interface names
                # its own stream.
                runtime.record_event(slot.ingest_event, wait or ingest_stream)
                runtime.wait_event(stream, slot.ingest_event)
            runtime.pack(binding.spec, dtype, pointer, strides, binding.device_ptr, stream)

    def enqueue_outputs(self, slot: Slot, device: bool) -> None:
        if self.detect is not None:  # the heads are read in their DLA layout: no unpack
            self.detect.enqueue(slot, device)
            return
        runtime = self.runtime
        stream = slot.stream
        pooled = device and runtime.has_device_memory
        for binding in slot.outputs:
            spec = binding.spec
            if pooled:
                nbytes = _elements(spec) * spec.result_dtype.itemsize
                target = runtime.malloc_async(nbytes, stream)
                slot.pooled.append(target)
            elif self.zero_copy:
                target = binding.host.device_ptr
            else:
                target = binding.raw
            runtime.unpack(spec, spec.result_dtype, binding.device_ptr, target, stream)
            if not pooled and not self.zero_copy:
                nbytes = _elements(spec) * spec.result_dtype.itemsize
                runtime.copy_to_host(binding.host, target, nbytes, stream)

    def read_outputs(self, slot: Slot, device: bool) -> list[Any]:
        if self.detect is not None:
            return [self.detect.read(slot, device)]
        if slot.pooled:
            pooled, slot.pooled = slot.pooled, []
            return [
                self._device_tensor(b.spec, p) for b, p in zip(slot.outputs, pooled, strict=True)
            ]
        results = []
        for binding in slot.outputs:
            view = binding.results
            if view is None:
                spec = binding.spec
                nbytes = _elements(spec) * spec.result_dtype.itemsize
                view = binding.host.array[:nbytes].view(spec.result_dtype).reshape(spec.shape)
                binding.results = view
            # A copy: the staging buffer serves the slot's next request.
            array = np.empty_like(view)
            if not copy_small(array.data.cast("B"), view):
                np.copyto(array, view)
            results.append(_host_backed(array) if device else array)
        return results

    def _device_tensor(self, spec: TensorSpec, pointer: int) -> DeviceTensor:
        runtime = self.runtime
        return DeviceTensor(
            pointer=pointer,
            shape=spec.shape,
            dtype=spec.result_dtype,
            device=runtime.device,
            release=functools.partial(runtime.free_async, pointer),
            to_host=functools.partial(runtime.read_device, pointer),
            host_array=None,
        )

    def recycle(self, slot: Slot) -> None:
        """The slot's work is over: pool memory nobody took goes back (a request
        cancelled after it was submitted, say)."""
        pooled, slot.pooled = slot.pooled, []
        for pointer in pooled:
            self.runtime.free_async(pointer)


#: The data path of an engine: chosen once, at open.
DataPath = HostPath | DevicePath


def release_sources(sources: Sequence[Any]) -> None:
    """Give back device arrays a request held (their DLPack capsules, say)."""
    for source in sources:
        source.release()
