"""The device layer: DLA cores, their rings of slots, and every runtime call the engine makes.

A *slot* is one (core, CUDA stream) pair with its own registered buffers, prebuilt task
and completion event. This module opens and releases cores and slots, writes inputs,
enqueues a slot's work on its stream, reads outputs and stage times, keeps each core's
busy time and service-time estimate, and turns runtime failures into aiodla errors.
It is the only module of the engine that calls the :class:`~aiodla.runtime.Runtime`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ._data_path import DevicePath, HostPath, Read, TensorBinding
from ._descriptors import TensorDescriptor
from ._device_arrays import DeviceSource
from ._errors import (
    AiodlaError,
    ConfigurationError,
    DeviceError,
    InputTypeError,
    ModelError,
    RuntimeUnavailableError,
    status_name,
)
from ._options import EngineOptions
from ._preprocess import ImagePreprocess, frames_for
from ._resources import ResourceStack
from ._statistics import BusyWindow, HistogramRecorder, LatencyWindow
from ._tensors import TensorSpec, specs_by_name
from .runtime._protocol import CudaCallError, Runtime, cudla_status
from .runtime._select import select_runtime

__all__ = [
    "DEFAULT_SERVICE_TIME",
    "CompletionProbe",
    "CoreState",
    "Cores",
    "Slot",
    "TensorBinding",
    "completion_probe",
    "device_error",
    "is_sticky",
    "read_model",
]

logger = logging.getLogger("aiodla")

# Until a core has completed tasks, poll as if one task took this long.
DEFAULT_SERVICE_TIME = 0.001


@dataclasses.dataclass(eq=False)
class CoreState:
    """One DLA core: its device handles, slots, service-time estimate and the counts
    the scheduler's policy reads."""

    core: int
    device: int = 0
    module: int = 0
    slots: list[Slot] = dataclasses.field(default_factory=list)
    idle: collections.deque[Slot] = dataclasses.field(default_factory=collections.deque)
    outstanding: int = 0  # slots assigned: to a request or a probe
    assigned_total: int = 0  # ties between equally loaded cores go to the less used one
    completed: int = 0
    failed: int = 0
    busy_time: float = 0.0
    last_completion: float = 0.0
    expected_free: float = 0.0  # when the core should finish what it has (poller back-off)
    service_time: float = DEFAULT_SERVICE_TIME  # estimated seconds per task on this core
    learn_service_time: bool = True  # False when the loadable states it
    # Recent task times as observed: each is the true time plus how late the poller
    # saw it, so the minimum is the estimate. (A mean would grow with the poller's
    # lateness, and the poller would sleep longer the next time: a runaway loop.)
    observed: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=32)
    )
    # Fault policy: out of rotation, no request is assigned here; probes test the core.
    in_rotation: bool = True
    consecutive_failures: int = 0
    probe: asyncio.TimerHandle | None = None
    # Observability.
    busy_window: BusyWindow = dataclasses.field(default_factory=BusyWindow)
    dla_times: LatencyWindow | None = None
    dla_histogram: HistogramRecorder | None = None


@dataclasses.dataclass(eq=False)
class Slot:
    """One (core, stream) pair and everything a request needs on it."""

    core: CoreState
    index: int
    stream: int
    event: int
    task: Any
    inputs: list[TensorBinding]
    outputs: list[TensorBinding]
    request: Any = None  # the scheduler's Request running here, if any
    submitted_at: float = 0.0
    expected_done: float = 0.0
    timing: tuple[int, int, int] | None = None  # events before copy-in, task, copy-out
    probing: bool = False  # the slot runs a probe task for a core out of rotation
    # Device conversion: what each pack kernel reads (pointer, dtype, element strides,
    # the stream to wait for or None), pool memory of device outputs not handed out
    # yet, the device arrays the request's kernels read (released when the slot is),
    # and the event that orders this stream after a device array's producer.
    reads: list[Read] = dataclasses.field(default_factory=list)
    pooled: list[int] = dataclasses.field(default_factory=list)
    keep: tuple[Any, ...] = ()
    ingest_event: int = 0

    def __repr__(self) -> str:
        return f"<Slot core {self.core.core} #{self.index}>"


def new_core(number: int, stated: float | None, options: EngineOptions) -> CoreState:
    """DLA core ``number``'s state, before anything is opened on it: its service time
    as the loadable states it (else learned), its stage-time windows if asked for."""
    core = CoreState(
        number,
        service_time=DEFAULT_SERVICE_TIME if stated is None else stated,
        learn_service_time=stated is None,
    )
    if options.stage_times:
        core.dla_times = LatencyWindow(options.latency_window)
        core.dla_histogram = HistogramRecorder()
    return core


class CompletionProbe(NamedTuple):
    """The three runtime calls the poller thread makes, handed to it by the device layer."""

    make_current: Callable[[], None]
    event_done: Callable[[int], bool]
    core_status: Callable[[int], int]


def completion_probe(runtime: Runtime) -> CompletionProbe:
    """What the poller needs of ``runtime``: a status that cannot be read is reported
    as a failed task (-1 when it names no cuDLA status)."""
    get_last_error = runtime.get_last_error

    def core_status(device: int) -> int:
        try:
            return get_last_error(device)
        except Exception as exc:
            return cudla_status(exc) or -1

    return CompletionProbe(runtime.make_current, runtime.query_event, core_status)


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


class Cores:
    """The DLA cores of one engine, their slots, and the runtime that drives them.

    ``open`` and ``release`` block (the engine runs them in a worker thread); the rest
    runs on the event loop's thread, except :attr:`probe`'s calls, made by the poller.
    """

    def __init__(self, options: EngineOptions) -> None:
        self._options = options
        self.runtime: Runtime | None = None
        self._owns_runtime = False
        self._resources = ResourceStack()
        self.cores: list[CoreState] = []
        self.slots: list[Slot] = []
        self.stated_service_time: float | None = None  # what the loadable says, if anything
        self.inputs: tuple[TensorSpec, ...] = ()
        self.outputs: tuple[TensorSpec, ...] = ()
        self.path: HostPath | DevicePath | None = None
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

    # -- opening and releasing (worker thread) ----------------------------------------------

    def open_model(
        self,
        model: str | os.PathLike[str] | bytes | bytearray | memoryview,
        runtime_choice: str | Runtime,
    ) -> None:
        """Read the loadable (a path, or its bytes), then :meth:`open` it."""
        self.open(read_model(model), runtime_choice)

    def open(self, model: bytes, runtime_choice: str | Runtime) -> None:
        """Pick the runtime, then open every core, its module and its ring of slots."""
        runtime, owned = select_runtime(runtime_choice, model)
        self.runtime, self._owns_runtime = runtime, owned
        options = self._options
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

    def release(self, keep: tuple[int, ...] = ()) -> None:
        """Release every handle in reverse order of creation, except those of the cores
        in ``keep`` (a hung task may still write their memory); then the runtime, if
        this engine made it and nothing is kept."""
        runtime = self.runtime
        if runtime is not None and len(self._resources):
            try:
                runtime.make_current()
            except Exception as exc:  # a poisoned context: release what still can be
                logger.warning("aiodla: making the device current to close failed: %s", exc)
        for slot in self.slots:  # what ended requests left (an engine that died, say)
            if slot.core.core not in keep:
                try:
                    self.recycle(slot)
                except Exception as exc:
                    logger.warning("aiodla: giving back %r's device memory failed: %s", slot, exc)
        failures = self._resources.release_all(keep)
        if failures:
            logger.warning("aiodla: %d release(s) failed while closing", len(failures))
        if self._owns_runtime and runtime is not None and not keep:
            runtime.close()

    def make_current(self) -> None:
        """Make the device current on the calling thread (the loop's, after opening)."""
        assert self.runtime is not None
        self._call("make_current", self.runtime.make_current)

    @property
    def poll_pause(self) -> float:
        assert self.runtime is not None
        return self.runtime.poll_pause

    @property
    def probe(self) -> CompletionProbe:
        assert self.runtime is not None
        return completion_probe(self.runtime)

    # -- one slot's work (loop thread) -------------------------------------------------------

    def write_inputs(self, slot: Slot, arrays: Sequence[Any]) -> None:
        """Stage validated inputs for the slot: packed into its pinned buffers (host
        conversion), or their bytes copied (device conversion; device arrays stay)."""
        assert self.path is not None
        self.path.write_inputs(slot, arrays)

    def write_zeros(self, slot: Slot) -> None:
        """Zeros into every input: the input of a probe task."""
        assert self.path is not None
        self.path.write_zeros(slot)

    def read_outputs(self, slot: Slot) -> Any:
        """Fresh arrays of the slot's outputs (or :class:`DeviceTensor` for a request
        that asked for device outputs): one, or a dict name -> output."""
        assert self.path is not None
        request = slot.request
        device = request is not None and request.device_output
        results = self.path.read_outputs(slot, device)
        if len(results) == 1:
            return results[0]
        return {b.spec.name: r for b, r in zip(slot.outputs, results, strict=True)}

    def import_device(self, spec: TensorSpec, value: Any) -> DeviceSource:
        """A device array as input ``spec`` (see :meth:`DevicePath.import_array`)."""
        if not isinstance(self.path, DevicePath):
            raise InputTypeError(
                f"input {spec.name!r}: a device array needs device conversion "
                "(Engine(convert='device') on a runtime with GPU memory); this engine "
                "converts on the host: pass a numpy array"
            )
        return self.path.import_array(spec, value)

    def recycle(self, slot: Slot) -> None:
        """The slot's work is over: give back what its request held on the device."""
        keep, slot.keep = slot.keep, ()
        for source in keep:
            source.release()
        if self.path is not None:
            self.path.recycle(slot)

    def submit(self, slot: Slot, now: float) -> None:
        """Enqueue the slot's copies in, its task, copies out and its event on its
        stream, and estimate when the core will be done with it. Raises what the runtime
        raised (see :meth:`retire` for the slot afterwards)."""
        runtime = self.runtime
        assert runtime is not None
        stream = slot.stream
        core = slot.core
        timing = slot.timing
        path = self.path
        if timing is not None:
            runtime.record_event(timing[0], stream)
        assert path is not None
        path.enqueue_inputs(slot)
        if timing is not None:
            runtime.record_event(timing[1], stream)
        runtime.submit_task(core.device, slot.task, stream)
        if timing is not None:
            runtime.record_event(timing[2], stream)
        request = slot.request
        path.enqueue_outputs(slot, request is not None and request.device_output)
        runtime.record_event(slot.event, stream)
        slot.submitted_at = now
        core.expected_free = max(now, core.expected_free) + core.service_time
        slot.expected_done = core.expected_free

    def retire(self, slot: Slot, now: float) -> bool:
        """After a failed :meth:`submit`: mark the end of what reached the stream, so the
        slot returns to the pool only after it ran. False when even that fails (the slot
        is lost to the pool)."""
        assert self.runtime is not None
        try:
            self.runtime.record_event(slot.event, slot.stream)
        except Exception as exc:
            logger.error("aiodla: %r retired: %s", slot, exc)
            return False
        slot.submitted_at = slot.expected_done = now
        return True

    def account(self, slot: Slot, status: int, now: float) -> None:
        """Count one finished DLA task: the core's busy time, its service-time estimate
        and the stage times (the fault policy is the scheduler's)."""
        core = slot.core
        # A task's span as observed: from its submission, or from the end of the core's
        # task before it, to when it was seen done. A second task of the core seen done
        # in the same batch has no span of its own (it ended somewhere before ``now``).
        spanned = core.last_completion != now
        elapsed = now - max(slot.submitted_at, core.last_completion)
        core.last_completion = now
        # Observed spans include how late the poller saw the task; a service time the
        # loadable states is the truth for the busy figures.
        if not spanned:
            busy = core.service_time
        elif core.learn_service_time:
            busy = elapsed
        else:
            busy = min(elapsed, core.service_time)
        core.busy_time += busy
        core.busy_window.add(now, busy)
        if slot.timing is not None:
            self._record_stages(slot)
        if status:
            core.failed += 1
            return
        core.completed += 1
        if core.learn_service_time and spanned:
            core.observed.append(elapsed)
            core.service_time = min(core.observed)

    def _record_stages(self, slot: Slot) -> None:
        assert slot.timing is not None
        assert self.stage_windows is not None
        runtime = self.runtime
        assert runtime is not None
        before_copy, before_task, after_task = slot.timing
        try:
            stages = (
                runtime.elapsed_time(before_copy, before_task),
                runtime.elapsed_time(before_task, after_task),
                runtime.elapsed_time(after_task, slot.event),
            )
        except Exception as exc:  # a timing read is never worth failing a request
            logger.debug("aiodla: stage times unavailable: %s", exc)
            return
        self.record_stages(slot, stages)

    def record_stages(self, slot: Slot, stages: tuple[float, float, float]) -> None:
        """Copy-in, DLA and copy-out seconds of ``slot``'s task, into the windows."""
        if self.stage_windows is not None:
            for window, seconds in zip(self.stage_windows, stages, strict=True):
                window.add(seconds)
        core = slot.core
        if core.dla_times is not None and core.dla_histogram is not None:
            core.dla_times.add(stages[1])
            core.dla_histogram.add(stages[1])
