"""The device layer as the application's process sees it with ``isolation="process"``.

:class:`RemoteCores` is :class:`~aiodla._cores.Cores` without a runtime: the same cores,
slots, service-time estimates and accounting, read by the same scheduler and flow,
but every slot's staging buffers are views of the worker's shared staging, and
``submit`` hands the slot to the :class:`~._supervisor.Supervisor`, which batches it to
the worker. Staging stays here, on the loop (or its worker threads), into and out of
shared memory: packing to the DLA layout with host conversion; with device conversion,
the caller's bytes, whose reads go to the worker with the slot. The bytes are copied no
extra time.

The slot objects live as long as the engine: when a worker is replaced, the same slots
are bound to the new worker's staging, so the scheduler never sees a slot change.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from .._cores import Cores, Slot, TensorBinding, new_core, read_model
from .._data_path import DevicePath, HostPath
from .._device_arrays import DeviceSource
from .._errors import ConfigurationError, InputTypeError
from .._options import EngineOptions
from .._preprocess import frames_for
from .._statistics import EngineHealth, WorkerStatistics
from .._tensors import TensorSpec
from ..emulator._standin import loaded_standins
from ..runtime._protocol import HostBuffer, Runtime
from ._staging import map_staging
from ._supervisor import Supervisor, WorkerState

if TYPE_CHECKING:
    from .._flow import CompletionSource, Flow

__all__ = ["NO_CUDA_IPC", "RemoteCores"]

NO_CUDA_IPC = (
    "device arrays cannot cross into the worker process of isolation='process': "
    "CUDA IPC is unavailable on Tegra (Jetson); pass a numpy (host or pinned) array, "
    "or use isolation='thread'"
)


class RemoteCores(Cores):
    """Cores whose runtime runs in a supervised worker process."""

    def __init__(self, options: EngineOptions) -> None:
        super().__init__(options)
        self.supervisor: Supervisor | None = None
        self.worker_runtime = ""  # the name of the runtime the worker runs
        self._failures: dict[int, BaseException] = {}  # by slot id, from the worker
        self._numbers: dict[int, int] = {}  # slot id -> its number in the worker
        self.take_compute_failure = self._take_failure
        self._detach: Callable[[], None] | None = None  # from aiodla.testing's controls

    # -- opening: the worker's handshake ---------------------------------------------------

    async def start(
        self,
        model: str | os.PathLike[str] | bytes | bytearray | memoryview,
        runtime_choice: str | Runtime,
        flow: Flow,
        die: Callable[[BaseException], None],
    ) -> None:
        """Start the worker, open the model there and build the slots on its staging."""
        attach = getattr(runtime_choice, "attach_worker", None)
        if not isinstance(runtime_choice, str) and attach is None:
            raise ConfigurationError(
                "isolation='process' builds its runtime in the worker process: pass "
                "runtime='auto', 'cuda' or 'emulated', not a runtime instance"
            )
        data = await anyio.to_thread.run_sync(read_model, model)
        fields = {f.name: getattr(self._options, f.name) for f in dataclasses.fields(EngineOptions)}
        fields.update(
            isolation="thread",  # inside the worker, the runtime is in-process
            scales=dict(self._options.scales),
            preprocess=dict(self._options.preprocess),
        )
        # A GPU stand-in this process loaded is the libcudla the worker must use too.
        # aiodla.testing's controlled runtime: the worker runs an emulated runtime of
        # its own, which the controls reach through the supervisor.
        choice = "emulated" if attach is not None else runtime_choice
        standins = [str(path) for path in loaded_standins()] if choice != "emulated" else []
        # Controls armed there before this open (a call that fails while opening, say)
        # are the first worker's only: a replacement opens as a fresh device does.
        setup_for = getattr(runtime_choice, "worker_setup", None)
        setup: list[Any] = [] if setup_for is None else setup_for(data)
        message = (data, choice, fields, standins, setup)
        supervisor = Supervisor(self._options, message, self, flow, die)
        self.supervisor = supervisor
        try:
            await supervisor.start()
        finally:
            setup.clear()
        if attach is not None:
            self._detach = attach(supervisor, data)

    def bind_worker(self, ready: dict[str, Any], fd: int) -> None:
        """The worker said it is ready: the first time, build cores and slots as the
        worker has them; after a restart, bind the same slots to the new staging."""
        staging = map_staging(fd, ready["staging_size"])
        self.worker_runtime = ready["runtime"]
        if not self.slots:
            self._build(ready)
        layout: Sequence[Sequence[tuple[int, int]]] = ready["layout"]
        host_path = isinstance(self.path, HostPath)
        for slot, places in zip(self.slots, layout, strict=True):
            for binding, (offset, nbytes) in zip(
                (*slot.inputs, *slot.outputs), places, strict=True
            ):
                view = staging[offset : offset + nbytes]
                binding.rehost(HostBuffer(0, view), binding.spec.bind(view) if host_path else None)
        self._failures.clear()

    def _build(self, ready: dict[str, Any]) -> None:
        options = self._options
        self.inputs, self.outputs = tuple(ready["inputs"]), tuple(ready["outputs"])
        self.frames = frames_for(self.inputs, options.preprocess)
        stated = self.stated_service_time = ready["stated_service_time"]
        # The application never enqueues device work: the path only stages and reads
        # back. With device conversion it stages the caller's bytes; the reads it
        # records go to the worker with the slot (its pointers are the worker's to set).
        if ready["device_path"]:
            path = DevicePath(_NO_RUNTIME, zero_copy=False)
            path.fused = ready["fused"]
            self.path = path
        else:
            self.path = HostPath(_NO_RUNTIME)
        for number in options.cores:
            core = new_core(number, stated, options)
            self.cores.append(core)
            for index in range(options.streams_per_core):
                slot = Slot(core, index, 0, 0, None, self._bindings(self.inputs, True), [])
                slot.outputs = self._bindings(self.outputs, False)
                self._numbers[id(slot)] = len(self.slots)
                core.slots.append(slot)
                core.idle.append(slot)
                self.slots.append(slot)

    def _bindings(self, specs: tuple[TensorSpec, ...], inputs: bool) -> list[TensorBinding]:
        empty = HostBuffer(0, np.zeros(0, np.uint8))
        bindings = []
        for number, spec in enumerate(specs):
            binding = TensorBinding(spec, 0, 0, empty)
            frames = self.frames[number] if inputs else None
            if frames is not None:  # as HostPath.bind: allocated once, used per frame
                binding.frames, binding.scratch = frames, np.empty(spec.shape, np.float32)
            bindings.append(binding)
        return bindings

    # -- what the engine calls ---------------------------------------------------------------

    @property
    def runtime(self) -> Runtime | None:
        raise ConfigurationError(
            "with isolation='process' the runtime lives in the worker process (device "
            "outputs and runtime handles stay there; outputs are host arrays)"
        )

    @runtime.setter
    def runtime(self, value: Runtime | None) -> None:
        """The base class's constructor sets it; here there is none to set."""

    @property
    def completions(self) -> CompletionSource | None:
        """The worker's completions, which the supervisor reads from the channel."""
        return self.supervisor

    @property
    def restarting(self) -> EngineHealth | None:
        """The engine's health while a lost worker is replaced, else None."""
        supervisor = self.supervisor
        if supervisor is None or supervisor.state is not WorkerState.RESTARTING:
            return None
        return EngineHealth(
            "restarting",
            f"a new worker process is starting after {supervisor.last_loss or 'a loss'}; "
            "queued requests wait for it",
        )

    def worker_statistics(self) -> WorkerStatistics | None:
        supervisor = self.supervisor
        if supervisor is None:
            return None
        loss = supervisor.last_loss
        return WorkerStatistics(
            state=supervisor.state.value,
            pid=supervisor.pid,
            restarts=len(supervisor.restart_times),
            restart_times=tuple(supervisor.restart_times),
            last_loss=None if loss is None else str(loss),
        )

    def number(self, slot: Slot) -> int:
        return self._numbers[id(slot)]

    def submission(self, slot: Slot) -> int | tuple[int, list[Any]]:
        """What the worker needs to submit ``slot``: its number, with the reads its
        conversion kernels take when the worker converts on the device."""
        number = self._numbers[id(slot)]
        return number if isinstance(self.path, HostPath) else (number, slot.reads)

    def make_current(self) -> None:
        """No CUDA in this process: nothing to make current."""

    def import_device(self, spec: TensorSpec, value: Any) -> DeviceSource:
        raise InputTypeError(f"input {spec.name!r}: {NO_CUDA_IPC}")

    def submit(self, slot: Slot, now: float) -> None:
        """Hand the slot to the worker (batched); estimate when its core is done."""
        core = slot.core
        slot.submitted_at = now
        core.expected_free = max(now, core.expected_free) + core.service_time
        slot.expected_done = core.expected_free
        assert self.supervisor is not None
        self.supervisor.submit(slot)

    def retire(self, slot: Slot, now: float) -> bool:
        """Never needed: :meth:`submit` does not fail here (a failed submission in the
        worker comes back as the slot's completion, with its error)."""
        return False

    def record_failure(self, slot: Slot, failure: BaseException) -> None:
        self._failures[id(slot)] = failure

    def _take_failure(self, slot: Slot) -> BaseException | None:
        return self._failures.pop(id(slot), None) if self._failures else None

    def frame_buffers(self, count: Any, shape: Any, dtype: Any) -> list[Any]:
        raise ConfigurationError(
            "frame_buffers need the runtime in this process (isolation='thread'); with "
            "isolation='process' pass frames as numpy arrays"
        )

    def release(self, keep: tuple[int, ...] = ()) -> None:
        """Stop the worker (it releases its handles itself) and let go of the staging."""
        if self.supervisor is not None:
            self.supervisor.shut_down()
        if self._detach is not None:
            self._detach()
            self._detach = None
        empty = HostBuffer(0, np.zeros(0, np.uint8))
        for slot in self.slots:
            for binding in (*slot.inputs, *slot.outputs):
                binding.rehost(empty, None)


class _NoRuntime:
    """The application's path only stages and reads back; a runtime call is a bug."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the application process called the runtime ({name})")


_NO_RUNTIME: Runtime = _NoRuntime()  # (a __getattr__ answers every attribute)
