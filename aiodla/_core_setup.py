"""Opening the device layer: the runtime, every core's device and module, and each
slot's stream, events, registered buffers, staging and task, created in order and
remembered for release; and how runtime failures become aiodla errors."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from ._data_path import DevicePath, HostPath
from ._descriptors import TensorDescriptor
from ._errors import (
    AiodlaError,
    ConfigurationError,
    DeviceError,
    ModelError,
    RuntimeUnavailableError,
    status_name,
)
from ._frame_buffers import FrameBuffers
from ._graphs import Graphs
from ._options import EngineOptions
from ._preprocess import ImagePreprocess, frames_for
from ._resources import ResourceStack
from ._slots import CoreState, Slot, new_core
from ._statistics import LatencyWindow
from ._tensors import TensorSpec, specs_by_name
from .runtime._protocol import CudaCallError, Runtime, cudla_status
from .runtime._select import select_runtime

__all__ = ["CoreSetup", "device_error", "is_sticky", "read_model"]

logger = logging.getLogger("aiodla")


def device_error(doing: str, exc: BaseException) -> AiodlaError | None:
    """The aiodla error for a runtime failure while ``doing`` (a phrase such as
    ``"core 1: submitting the request"``), or None when ``exc`` is no device failure.

    The one translation from runtime exceptions to aiodla errors: a CUDA error or a
    cuDLA status becomes a :class:`DeviceError` carrying it.
    """
    if isinstance(exc, AiodlaError):
        return exc
    if isinstance(exc, CudaCallError):
        return DeviceError(f"{doing} failed: {exc}", cuda_error=exc.code)
    status = cudla_status(exc)
    if status is None:
        return None
    detail = getattr(exc, "detail", None)  # the emulated runtime says what it caught
    return DeviceError(
        f"{doing} failed: {status_name(status)}" + (f" ({detail})" if detail else ""),
        status=status,
    )


def read_model(model: str | os.PathLike[str] | bytes | bytearray | memoryview) -> bytes:
    """The loadable's bytes, from a path or from bytes."""
    if isinstance(model, (bytes, bytearray, memoryview)):
        data = bytes(model)
    else:
        try:
            with open(model, "rb") as file:
                data = file.read()
        except OSError as exc:
            raise ModelError(
                f"cannot read model {os.fspath(model)!r}: {exc.strerror or exc}"
            ) from exc
    if not data:
        where = "" if isinstance(model, (bytes, bytearray, memoryview)) else f" {model!r}"
        raise ModelError(f"the model{where} is empty (0 bytes): not a loadable")
    return data


def is_sticky(exc: BaseException) -> bool:
    """True for a CUDA error that leaves the process's CUDA context unusable."""
    return isinstance(exc, CudaCallError) and exc.sticky


class CoreSetup:
    """The cores of one engine as opened: runtime, cores, slots, tensors and the data
    path. ``open`` blocks (the engine runs it in a worker thread); what was created
    is released by :class:`~aiodla._cores.Cores`."""

    def __init__(self, options: EngineOptions) -> None:
        self._options = options
        self.runtime: Runtime | None = None
        self._owns_runtime = False
        self._resources = ResourceStack()
        self._frames: FrameBuffers | None = None  # made by the first frame_buffers()
        self.cores: list[CoreState] = []
        self.slots: list[Slot] = []
        self.stated_service_time: float | None = None  # what the loadable says, if anything
        self.inputs: tuple[TensorSpec, ...] = ()
        self.outputs: tuple[TensorSpec, ...] = ()
        self.path: HostPath | DevicePath | None = None
        # Captures and launches the slots' graphs; None when Engine(graphs=False).
        self.graphs: Graphs | None = None
        # The pre-processing of each input that takes camera frames, else None.
        self.frames: tuple[ImagePreprocess | None, ...] = ()
        # The emulated runtime's failed compute= functions, by slot (None when no
        # module of this engine has one: nothing to ask with each completion then).
        self.take_compute_failure: Callable[[Slot], BaseException | None] | None = None
        self.stage_windows = (
            tuple(LatencyWindow(options.latency_window) for _ in range(3))
            if options.stage_times
            else None
        )

    # -- opening (worker thread) --------------------------------------------------------------

    def open_model(
        self,
        model: str | os.PathLike[str] | bytes | bytearray | memoryview,
        runtime_choice: str | Runtime,
    ) -> None:
        """Read the loadable (a path, or its bytes), then :meth:`open` it."""
        self.open(read_model(model), runtime_choice)

    def open(self, model: bytes, runtime_choice: str | Runtime) -> None:
        """Pick the runtime, then open every core, its module and its ring of slots."""
        trust = self._options.trust_compute
        runtime, owned = select_runtime(runtime_choice, model, trust_compute=trust)
        self.runtime, self._owns_runtime = runtime, owned
        options = self._options
        if options.graphs:
            self.graphs = Graphs(runtime, self._resources)
        self._call("make_current", runtime.make_current)
        available = self._call("device_count", runtime.device_count)
        for number in options.cores:
            if number >= available:
                raise ConfigurationError(
                    f"DLA core {number} does not exist: the {runtime.name} runtime has "
                    f"{available} core(s)"
                )
        # An emulator loadable states its service time; a DLA loadable's is learned.
        stated = self.stated_service_time = runtime.stated_service_time(model)
        reference: tuple[tuple[TensorDescriptor, ...], tuple[TensorDescriptor, ...]] | None = None
        for number in options.cores:
            core = new_core(number, stated, options)
            self.cores.append(core)
            found = self._open_core(core, model)
            if reference is None:
                reference = found
                self._set_specs(found)
            elif found != reference:
                raise ModelError(
                    f"core {number} reports other tensor descriptors than core "
                    f"{options.cores[0]}; the same loadable must describe the same tensors"
                )
            if self.path is None:
                self.path = self._choose_path(runtime)
            for index in range(options.streams_per_core):
                self._open_slot(core, index)
        if any(runtime.module_computes(core.module) for core in self.cores):
            take = runtime.take_compute_failure
            self.take_compute_failure = lambda slot: take(slot.stream)

    def _choose_path(self, runtime: Runtime) -> HostPath | DevicePath:
        """Host or device conversion (``Engine(convert=...)``); the device path's
        conversions are made ready here, before any slot exists."""
        options = self._options
        convert = options.convert
        if convert == "host" or (convert == "auto" and not runtime.has_device_memory):
            return HostPath(runtime)
        zero_copy = options.zero_copy
        if zero_copy is None:
            zero_copy = self._call("is_integrated", runtime.is_integrated)
        path = DevicePath(runtime, zero_copy)
        try:
            path.prepare(self.inputs, self.outputs, self.frames)
        except RuntimeUnavailableError as exc:
            if convert == "device":
                raise
            logger.warning("aiodla: converting on the host: %s", exc)
            return HostPath(runtime)
        path.ingest_stream = self._create(
            "device arrays", -1, runtime.create_stream, runtime.destroy_stream
        )
        return path

    def _open_core(
        self, core: CoreState, model: bytes
    ) -> tuple[tuple[TensorDescriptor, ...], tuple[TensorDescriptor, ...]]:
        runtime = self.runtime
        assert runtime is not None
        where = f"core {core.core}"
        core.device = self._create(
            where, core.core, runtime.create_device, runtime.destroy_device, core.core
        )
        task_timeout = self._options.task_timeout
        if task_timeout is not None:
            self._call(
                f"{where}: set_task_timeout",
                runtime.set_task_timeout,
                core.device,
                max(1, round(task_timeout * 1000)),
            )
        core.module = self._create(
            where, core.core, runtime.load_module, runtime.unload_module, core.device, model
        )
        descriptors = self._call(f"{where}: module_tensors", runtime.module_tensors, core.module)
        return tuple(descriptors[0]), tuple(descriptors[1])

    def _set_specs(
        self, descriptors: tuple[Sequence[TensorDescriptor], Sequence[TensorDescriptor]]
    ) -> None:
        inputs = tuple(TensorSpec.from_descriptor(d) for d in descriptors[0])
        outputs = tuple(TensorSpec.from_descriptor(d) for d in descriptors[1])
        by_name = specs_by_name([*inputs, *outputs])
        scales = self._options.scales
        for name in scales:
            spec = by_name.get(name)
            if spec is None:
                raise ConfigurationError(
                    f"scales names tensor {name!r}, which the model does not have; "
                    f"it has {sorted(by_name)}"
                )
            if not spec.is_integer:
                raise ConfigurationError(
                    f"scales[{name!r}]: tensor {name!r} is {spec.dtype}; only integer "
                    "tensors take a quantization scale"
                )
        self.inputs = tuple(s.with_scale(scales.get(s.name)) for s in inputs)
        self.outputs = tuple(s.with_scale(scales.get(s.name)) for s in outputs)
        self.frames = frames_for(self.inputs, self._options.preprocess)

    def _open_slot(self, core: CoreState, index: int) -> None:
        runtime = self.runtime
        assert runtime is not None
        where = f"core {core.core} slot {index}"
        stream = self._create(where, core.core, runtime.create_stream, runtime.destroy_stream)
        timed = self._options.stage_times
        event = self._create(where, core.core, runtime.create_event, runtime.destroy_event, timed)
        timing = None
        if timed:
            marks = [
                self._create(where, core.core, runtime.create_event, runtime.destroy_event, True)
                for _ in range(3)
            ]
            timing = (marks[0], marks[1], marks[2])
        path = self.path
        assert path is not None
        bindings = []
        for number, spec in enumerate((*self.inputs, *self.outputs)):
            what = f"{where} tensor {spec.name!r}"
            pointer = self._create(what, core.core, runtime.malloc, runtime.free, spec.size)
            registered = self._call(
                f"{what}: mem_register", runtime.mem_register, core.device, pointer, spec.size
            )
            self._resources.push(
                f"{what}: registration", core.core, runtime.mem_unregister, core.device, registered
            )

            def allocate(name: str, create: Any, release: Any, nbytes: Any) -> Any:
                return self._create(f"{where} tensor {name!r}", core.core, create, release, nbytes)

            frames = None if number >= len(self.inputs) else self.frames[number]
            output = number >= len(self.inputs)
            bindings.append(path.bind(spec, pointer, registered, output, allocate, frames))
        inputs, outputs = bindings[: len(self.inputs)], bindings[len(self.inputs) :]
        task = self._call(
            f"{where}: make_task",
            runtime.make_task,
            core.module,
            [b.registered for b in inputs],
            [b.registered for b in outputs],
        )
        slot = Slot(core, index, stream, event, task, inputs, outputs, timing=timing)
        if isinstance(path, DevicePath):
            slot.ingest_event = self._create(
                where, core.core, runtime.create_event, runtime.destroy_event
            )
        core.slots.append(slot)
        core.idle.append(slot)
        self.slots.append(slot)

    def _call(self, what: str, call: Any, *args: Any) -> Any:
        """Run one device call while opening; failures name the call and where (and the
        size, for an allocation)."""
        try:
            return call(*args)
        except Exception as exc:
            error = device_error(f"opening the engine: {what}", exc)
            if error is None or error is exc:
                raise
            if call in self._allocations():
                error.args = (f"{error} ({args[0]} bytes asked for)",)
            raise error from exc

    def _allocations(self) -> tuple[Any, ...]:
        runtime = self.runtime
        assert runtime is not None
        return (runtime.malloc, runtime.host_alloc)

    def _create(self, where: str, owner: int, create: Any, release: Any, *args: Any) -> Any:
        """Create one handle and remember how to release it."""
        what = f"{where}: {create.__name__}"
        handle = self._call(what, create, *args)
        self._resources.push(what, owner, release, handle)
        return handle
