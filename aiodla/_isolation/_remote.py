"""The device layer as the application's process sees it with ``isolation="process"``.

:class:`RemoteDevice` is a sibling of :class:`~aiodla._local_device.LocalDevice` (both are a
:class:`~aiodla._device.DeviceLayer`): the same cores, slots, service-time estimates and
accounting, read by the same scheduler and flow, but no runtime in this process. Every
slot's staging buffers are views of the worker's shared staging, and a submitted slot
goes to the :class:`~._supervisor.Supervisor`, which batches it to the worker and is the
flow's completion source. Staging stays here, on the loop (or its worker threads), into
and out of shared memory: packing to the DLA layout with host conversion; with device
conversion, the caller's bytes, whose reads go to the worker with the slot. The bytes
are copied no extra time; a frame in one of the engine's frame buffers (this process's
shared memory, which each worker maps: :mod:`._shared_frames`) is not copied at all.

The slot objects live as long as the engine: when a worker is replaced, the same slots
are bound to the new worker's staging, so the scheduler never sees a slot change.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import numpy as np

from .._bindings import TensorBinding
from .._core_record import CoreRecord, expect
from .._core_setup import read_model
from .._data_path import DataPath, DevicePath, HostPath
from .._device import CompletionSink
from .._device_arrays import DeviceSource
from .._errors import ConfigurationError, InputTypeError
from .._frame_buffers import FrameBuffers
from .._options import EngineOptions
from .._postprocess import open_postprocess
from .._preprocess import ImagePreprocess, preprocessing_for
from .._slots import CoreLane, Slot, account, new_core, record_stages
from .._statistics import EngineHealth, LatencyWindow, WorkerStatistics
from .._tensors import TensorSpec
from ..runtime._protocol import HostBuffer, Kernels, Runtime, WorkerControls
from ..runtime._select import loaded_libraries
from ._launch import Worker
from ._shared_frames import SharedFrame, SharedFrameMemory
from ._staging import map_staging
from ._supervisor import Supervisor, WorkerState, launch_worker

__all__ = ["NO_CUDA_IPC", "RemoteDevice", "open_remote"]

NO_CUDA_IPC = (
    "device arrays cannot cross into the worker process of isolation='process': "
    "CUDA IPC is unavailable on Tegra (Jetson); pass a numpy (host or pinned) array, "
    "or use isolation='thread'"
)
RUNTIME_ELSEWHERE = (
    "with isolation='process' the runtime lives in the worker process (device "
    "outputs and runtime handles stay there; outputs are host arrays)"
)

ModelSource = str | os.PathLike[str] | bytes | bytearray | memoryview


async def open_remote(
    model: ModelSource,
    runtime_choice: str | Runtime,
    options: EngineOptions,
    records: Mapping[int, CoreRecord] | None = None,
) -> RemoteDevice:
    """Start the worker, open the model there, and build the slots on its staging;
    each core's lane shares the physical core's record in ``records`` (the shared
    cores'; None: records of its own)."""
    controls = runtime_choice if isinstance(runtime_choice, WorkerControls) else None
    if not isinstance(runtime_choice, str) and controls is None:
        raise ConfigurationError(
            "isolation='process' builds its runtime in the worker process: pass "
            "runtime='auto', 'cuda' or 'emulated', not a runtime instance"
        )
    data = await anyio.to_thread.run_sync(read_model, model)
    fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(EngineOptions)}
    fields.update(
        isolation="thread",  # inside the worker, the runtime is in-process
        scales=dict(options.scales),
        preprocess=dict(options.preprocess),
    )
    # A GPU stand-in this process loaded is the libcudla the worker must use too.
    # aiodla.testing's controlled runtime: the worker runs an emulated runtime of its
    # own, which the controls reach through the supervisor.
    choice = "emulated" if controls is not None else runtime_choice
    libraries = [str(path) for path in loaded_libraries()] if choice != "emulated" else []
    # Controls armed there before this open (a call that fails while opening, say) are
    # the first worker's only: a replacement opens as a fresh device does.
    setup: list[Any] = [] if controls is None else controls.worker_setup(data)
    message = (data, choice, fields, libraries, setup)
    try:
        worker = await launch_worker(asyncio.get_running_loop(), message)
    finally:
        setup.clear()
    if records is None:
        records = {number: CoreRecord(number) for number in options.cores}
    return RemoteDevice(options, message, worker, controls, data, records)


class RemoteDevice:
    """Cores whose runtime runs in a supervised worker process (a
    :class:`~aiodla._device.DeviceLayer`), built from the first worker's layout."""

    def __init__(
        self,
        options: EngineOptions,
        open_message: tuple[Any, ...],
        worker: Worker,
        controls: WorkerControls | None,
        loadable: bytes,
        records: Mapping[int, CoreRecord],
    ) -> None:
        self._options = options
        self._open_message = open_message
        self._first = worker
        self._controls = controls
        self._loadable = loadable
        ready = worker.ready
        self.inputs: tuple[TensorSpec, ...] = tuple(ready["inputs"])
        self.outputs: tuple[TensorSpec, ...] = tuple(ready["outputs"])
        self.preprocessing: tuple[ImagePreprocess | None, ...] = preprocessing_for(
            self.inputs, options.preprocess
        )
        self.stated_service_time: float | None = ready["stated_service_time"]
        # Engine(postprocess=...): in this process, on the host (after the unpack).
        self.postprocess = open_postprocess(options, self.inputs, self.outputs)
        self.stage_windows: tuple[LatencyWindow, ...] | None = (
            tuple(LatencyWindow(options.latency_window) for _ in range(3))
            if options.stage_times
            else None
        )
        self._failures: dict[int, BaseException] = {}  # by slot id, from the worker
        self.take_compute_failure: Callable[[Slot], BaseException | None] | None = (
            self._take_failure
        )
        # The application never enqueues device work: the path only stages and reads
        # back. With device conversion it stages the caller's bytes; the reads it
        # records go to the worker with the slot (its pointers are the worker's to set).
        self.path: DataPath = HostPath(_NO_RUNTIME)
        self.detects_on_stream = False  # (post-processing is this process's, on the host)
        if ready["device_path"]:
            path = DevicePath(_NO_RUNTIME, zero_copy=False)
            path.fused = ready["fused"]
            self.path = path
        self.lanes: list[CoreLane] = []
        self.slots: list[Slot] = []
        self._numbers: dict[int, int] = {}  # slot id -> its number in the worker
        for number in options.cores:
            core = new_core(number, self.stated_service_time, options, records[number])
            self.lanes.append(core)
            for index in range(options.streams_per_core):
                inputs = self._bindings(self.inputs, True)
                slot = Slot(core, index, 0, 0, None, inputs, self._bindings(self.outputs, False))
                self._numbers[id(slot)] = len(self.slots)
                core.slots.append(slot)
                core.idle.append(slot)
                self.slots.append(slot)
        self.bind_worker(ready, worker.staging_fd)
        # Frame buffers: this process's shared memory, which each worker maps.
        self._shared = SharedFrameMemory()
        self._frames = FrameBuffers(self._shared, mapped=False)
        self.path.use_frame_buffers(self._frames)
        self._serving: list[Supervisor] = []  # the one :meth:`start` made
        self._detach: list[Callable[[], None]] = []  # from aiodla.testing's controls

    def _bindings(self, specs: tuple[TensorSpec, ...], inputs: bool) -> list[TensorBinding]:
        empty = HostBuffer(0, np.zeros(0, np.uint8))
        bindings = []
        for number, spec in enumerate(specs):
            binding = TensorBinding(spec, 0, 0, empty)
            pre = self.preprocessing[number] if inputs else None
            if pre is not None:  # as HostPath.bind: allocated once, used per frame
                binding.preprocess, binding.scratch = pre, np.empty(spec.shape, np.float32)
            bindings.append(binding)
        return bindings

    # -- serving -------------------------------------------------------------------------

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        sink: CompletionSink,
        die: Callable[[BaseException], None],
    ) -> Supervisor:
        """The supervisor of the first worker and its replacements: the flow's
        completion source, reporting what the worker's poller finds done."""
        supervisor = Supervisor(
            self._options, self._open_message, self._first, self, sink, die, loop
        )
        self._serving.append(supervisor)
        if self._controls is not None:
            self._detach.append(self._controls.attach_worker(supervisor, self._loadable))
        return supervisor

    @property
    def supervisor(self) -> Supervisor:
        """The supervisor, once started (the engine starts it as it opens)."""
        return self._serving[0]

    def bind_worker(self, ready: dict[str, Any], fd: int) -> None:
        """A worker said it is ready: bind every slot to its staging."""
        staging = map_staging(fd, ready["staging_size"])
        layout: Sequence[Sequence[tuple[int, int]]] = ready["layout"]
        host_path = not self.path.converts_on_device
        for slot, places in zip(self.slots, layout, strict=True):
            for binding, (offset, nbytes) in zip(
                (*slot.inputs, *slot.outputs), places, strict=True
            ):
                view = staging[offset : offset + nbytes]
                binding.rehost(HostBuffer(0, view), binding.spec.bind(view) if host_path else None)
        self._failures.clear()

    @property
    def runtime(self) -> Runtime:
        raise ConfigurationError(RUNTIME_ELSEWHERE)

    def health(self) -> EngineHealth | None:
        """The engine's health while a lost worker is replaced, else None."""
        supervisor = self.supervisor
        if supervisor.state is not WorkerState.RESTARTING:
            return None
        return EngineHealth(
            "restarting",
            f"a new worker process is starting after {supervisor.last_loss or 'a loss'}; "
            "queued requests wait for it",
        )

    def statistics(self) -> WorkerStatistics | None:
        """The worker process's figures."""
        supervisor = self.supervisor
        loss = supervisor.last_loss
        return WorkerStatistics(
            state=supervisor.state.value,
            pid=supervisor.pid,
            restarts=len(supervisor.restart_times),
            restart_times=tuple(supervisor.restart_times),
            last_loss=None if loss is None else str(loss),
        )

    def submission(self, slot: Slot) -> int | tuple[int, list[Any]]:
        """What the worker needs to submit ``slot``: its number, with the reads its
        conversion kernels take when the worker converts on the device."""
        number = self._numbers[id(slot)]
        return (number, slot.reads) if self.path.converts_on_device else number

    # -- one slot's work (loop thread) -------------------------------------------------------

    def write_inputs(self, slot: Slot, arrays: Sequence[Any], limit: int | None = None) -> bool:
        return self.path.write_inputs(slot, arrays, limit)

    def write_zeros(self, slot: Slot) -> None:
        self.path.write_zeros(slot)

    def read_outputs(self, slot: Slot) -> Any:
        """As :meth:`LocalDevice.read_outputs`; post-processing runs here, on the host."""
        results = self.path.read_outputs(slot, False)
        postprocess = self.postprocess
        if postprocess is not None:
            request = slot.request
            return postprocess.run(results, request.arrays if request is not None else ())
        if len(results) == 1:
            return results[0]
        return {b.spec.name: r for b, r in zip(slot.outputs, results, strict=True)}

    def import_device(self, spec: TensorSpec, value: Any) -> DeviceSource:
        raise InputTypeError(f"input {spec.name!r}: {NO_CUDA_IPC}")

    def check_device_output(self, postprocess: bool = False) -> None:
        raise ConfigurationError(RUNTIME_ELSEWHERE)

    def recycle(self, slot: Slot) -> None:
        """Nothing is held on a device here."""

    def submit(self, slot: Slot, now: float) -> None:
        """Estimate when the slot's core is done with it (the supervisor sends it to
        the worker as the flow watches it)."""
        expect(slot, now)

    def retire(self, slot: Slot, now: float) -> bool:
        """Never needed: :meth:`submit` does not fail here (a failed submission in the
        worker comes back as the slot's completion, with its error)."""
        return False

    def account(self, slot: Slot, status: int, now: float) -> None:
        account(slot, status, now)

    def record_failure(self, slot: Slot, failure: BaseException) -> None:
        self._failures[id(slot)] = failure

    def record_stages(self, slot: Slot, stages: tuple[float, float, float]) -> None:
        record_stages(slot, stages, self.stage_windows)

    def _take_failure(self, slot: Slot) -> BaseException | None:
        return self._failures.pop(id(slot), None) if self._failures else None

    def frame_buffers(self, count: Any, shape: Any, dtype: Any) -> list[Any]:
        """Arrays in shared memory of this process that the worker maps
        (:mod:`._shared_frames`): a request on one sends the worker where the frame
        lies, not its bytes. With host conversion, packing reads them here."""
        arrays = self._frames.create(count, shape, dtype)
        new = self._shared.take_new()
        if self.path.converts_on_device:  # (host conversion packs frames here)
            self.supervisor.share_frames(new)
        return arrays

    def shared_frames(self) -> list[SharedFrame]:
        """Every frame buffer, for a worker that starts serving to map: none when it
        converts on the host (the application packs frames into the staging)."""
        frames = self._shared.every()
        return frames if self.path.converts_on_device else []

    # -- releasing --------------------------------------------------------------------------

    def release(self, keep: tuple[int, ...] = ()) -> None:
        """Stop the worker (it releases its handles itself) and let go of the staging."""
        for supervisor in self._serving:
            supervisor.shut_down()
        if not self._serving:  # opened, never served: the first worker goes as it is
            self._first.channel.abandon()
            self._first.process.kill()
            self._first.process.wait()
        while self._detach:
            self._detach.pop()()
        # The workers are gone: the descriptors too; the memory with the last arrays.
        self._frames.close()
        self._shared.close()
        empty = HostBuffer(0, np.zeros(0, np.uint8))
        for slot in self.slots:
            for binding in (*slot.inputs, *slot.outputs):
                binding.rehost(empty, None)

    def abandon(self) -> None:
        """The engine was collected unclosed: kill and reap the worker, no round trip."""
        for supervisor in self._serving:
            supervisor.abandon()
        self._shared.close()


class _NoRuntime:
    """The application's path only stages and reads back; a runtime call is a bug."""

    capabilities: frozenset[type] = frozenset()

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the application process called the runtime ({name})")


_NO_RUNTIME: Kernels = _NoRuntime()  # (a __getattr__ answers every attribute)
