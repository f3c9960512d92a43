"""The emulated runtime: cuDLA hybrid mode and the CUDA calls, in Python and numpy.

For machines with no DLA and no GPU (laptops, CI). It is *strict*: every misuse the
real library rejects raises the ``cudla.Status`` the real one would, so engine bugs
show up here before they reach a Jetson.

Model ("eager timeline, lazy data"):

- Each DLA core is a serial resource with its own exact timeline. When a task is
  submitted, it is placed on its core's timeline at once: it starts at
  ``max(core free, its stream reached it, submitted, gate released)`` and ends exactly
  ``latency`` seconds later. Tasks of one core take their places in submission order.
  So measured throughput can be held against ``cores / latency``.
- A stream is a FIFO of operations, each stamped with the virtual time it completes.
  Copies are instantaneous unless ``copy_bandwidth`` (bytes per second) is set.
- Nothing runs in the background: an operation's effect (a copy, a task's outputs, an
  event completing, a status latched) happens when somebody looks — ``query_event``,
  ``synchronize_stream``, ``get_last_error``, a destroy — and the clock has passed its
  time. Observed from outside this is what a device does; it needs no thread, so the
  emulator adds no hand-offs of the GIL. ``device_time`` says how much CPU that work
  took in whichever thread looked (benchmarks subtract it from aiodla's host cost).
- "Device pointers" are addresses of bounds-checked numpy buffers; registration hands
  out a different address, so a task given an unregistered pointer fails as on a DLA.
- ``get_last_error`` latches the status of a failed task until it is read.
- A *compute function* (``compute=``, see ``aiodla.emulator._compute``) replaces the
  loadable's op with the user's own computation. It is the one piece of device work
  that does not wait for an observer: each core that runs one has a compute thread,
  which takes the core's tasks in submission order, applies the operations ahead of
  a task as their time comes (the copies of its inputs), runs the function and writes
  the outputs. Until then the task's operation stops its stream, so an event after it
  completes no earlier than the function returned, and never on a thread that merely
  looked (the event loop's, say). The task's time on the core is still the loadable's.

Parts, each an object the runtime holds: ``_timeline`` owns the shared state
(cores, device handles, streams, events), places operations and serves the stream
and event calls; ``_emulated_memory`` the memory and copies; ``_faults`` the test
controls (:meth:`EmulatedRuntime.fail_next_task`, :meth:`~EmulatedRuntime.hang_core`,
:meth:`~EmulatedRuntime.hold`, :meth:`~EmulatedRuntime.poison`,
:meth:`~EmulatedRuntime.fail_call`); ``_compute_threads`` runs compute functions
(:meth:`~EmulatedRuntime.bind_compute`, :meth:`~EmulatedRuntime.take_compute_failure`);
``_emulated_conversion`` the conversions; ``_emulated_graphs`` records a capturing
stream's calls and makes them again at each graph launch. This module holds the
cuDLA calls and hands each other call straight to the part that serves it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, overload

import numpy as np
from cuda.bindings import cudla

from .._descriptors import TensorDescriptor
from .._errors import ConfigurationError, LoadableFormatError
from ..emulator._compute import ComputeFunction, ComputeTask
from ..emulator._format import EmulatorModel, parse_loadable, stated_latency
from ..emulator._ops import ModelRunner
from ._compute_threads import ComputeThreads
from ._emulated_conversion import EmulatedConversion
from ._emulated_detect import EmulatedDetect
from ._emulated_graphs import EmulatedGraphs
from ._emulated_memory import EmulatedMemory
from ._faults import (
    _EXTERNAL_DEVICE,
    CallFailures,
    EmulatedCudlaError,
    FaultInjection,
    TaskGate,
    _reject,
)
from ._protocol import (
    ComputeFunctions,
    CudaCallError,
    DetectsOnStream,
    GraphCapture,
    HostBuffer,
    HostRegistration,
    Kernels,
    TransferCounts,
)
from ._timeline import Timeline, _Device, _Operation

__all__ = ["EmulatedCudlaError", "EmulatedRuntime", "TaskGate"]

MAX_HANDLES_PER_CORE = 16  # cudla.h: at most 16 device handles per DLA
REGISTRATION_ALIGNMENT = 32
_REGISTERED_TAG = 1 << 56  # registered addresses differ from raw ones, as on a Jetson


@dataclasses.dataclass(eq=False)
class _Module:
    handle: int
    device: _Device
    model: EmulatorModel
    compute: ComputeFunction | None = None


@dataclasses.dataclass(eq=False)
class _Task:
    module: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    # What submit_task resolved last time, valid while no memory or module changed
    # (the memory's ``generation``): validation is then a comparison, not a search.
    resolved: tuple[int, int, EmulatorModel, ModelRunner | ComputeTask] | None = None

    def resolve(
        self, target: _Device, loaded: _Module, memory: EmulatedMemory
    ) -> tuple[int, int, EmulatorModel, ModelRunner | ComputeTask]:
        """Validate the task against the device as cuDLA would; its tensors' buffers."""
        if loaded.device is not target:
            raise _reject("invalid_module", "the task's module is loaded on another device")
        model = loaded.model
        if len(self.inputs) != len(model.inputs) or len(self.outputs) != len(model.outputs):
            raise _reject(
                "invalid_param",
                f"task has {len(self.inputs)} inputs/{len(self.outputs)} outputs, the module "
                f"{len(model.inputs)}/{len(model.outputs)}",
            )
        views_in = [
            _registered_view(target, p, s, memory)
            for p, s in zip(self.inputs, model.inputs, strict=True)
        ]
        views_out = [
            _registered_view(target, p, s, memory)
            for p, s in zip(self.outputs, model.outputs, strict=True)
        ]
        runner: ModelRunner | ComputeTask
        if loaded.compute is not None:
            runner = ComputeTask(loaded.compute, model.inputs, model.outputs, views_in, views_out)
        else:
            runner = ModelRunner(model, views_in, views_out)
        return memory.generation, target.handle, model, runner


def _registered_view(
    device: _Device, registered: int, spec: Any, memory: EmulatedMemory
) -> np.ndarray[Any, Any]:
    entry = device.registrations.get(registered)
    if entry is None:
        raise _reject("invalid_address", f"tensor {spec.name!r}: {registered:#x} is not registered")
    raw, nbytes = entry
    if nbytes < spec.size:
        raise _reject(
            "invalid_param",
            f"tensor {spec.name!r} needs {spec.size} bytes, registration has {nbytes}",
        )
    return memory.device_range(raw, spec.size, "submit_task")


_F = TypeVar("_F", bound=Callable[..., Any])


class _Served(Generic[_F]):
    """A call of the runtime that one of its parts serves.

    Read on a runtime, it is that part's own bound method (or the graphs' recording of
    it), kept in the instance's ``__dict__`` from the first read on: a request pays no
    call through the runtime. A subclass that overrides the call keeps its override
    (nothing is kept then) and reaches the part's through ``super()``.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, runtime: None, owner: type | None = None) -> _Served[_F]: ...
    @overload
    def __get__(self, runtime: EmulatedRuntime, owner: type | None = None) -> _F: ...
    def __get__(
        self, runtime: EmulatedRuntime | None, owner: type | None = None
    ) -> _Served[_F] | _F:
        if runtime is None:
            return self
        call: _F = runtime._served[self._name]
        first = next(k for k in type(runtime).__mro__ if self._name in vars(k))
        if vars(first)[self._name] is self:
            runtime.__dict__[self._name] = call
        return call


class EmulatedRuntime:
    """cuDLA hybrid mode and the CUDA calls aiodla needs, emulated on the CPU.

    ``cores``: how many DLA cores exist (Orin has 2). ``copy_bandwidth``: bytes per
    second of host/device copies, instantaneous when None. ``clock``: the time source.
    ``compute``: the user's own computation for every module loaded here, a callable
    or a reference ``"module:function"`` (see :meth:`bind_compute` for one loadable's,
    and ``aiodla.emulator._compute`` for what it takes and returns); without one, a
    loadable's own compute reference, else its op, computes the outputs.
    ``trust_compute``: import and run a loadable's compute reference; without it, a
    loadable that names one is refused (a model file is data, not code to run).
    """

    # Every capability the engine uses, declared: each is checked whole at open.
    capabilities: frozenset[type] = frozenset(
        {GraphCapture, Kernels, HostRegistration, ComputeFunctions, DetectsOnStream}
    )

    name = "emulated"
    # Seconds the poller pauses between sweeps near a completion. Emulated events are
    # cheap to query but each sweep takes the GIL from the event loop.
    poll_pause = 100e-6
    device = 0
    has_device_memory = False  # "device" memory is host memory: outputs stay host-backed

    # The calls the runtime's parts serve, each the part's own method (or its recording
    # by the graphs, for the calls that enqueue stream work): see _Served.
    create_stream: _Served[Callable[[], int]] = _Served()
    destroy_stream: _Served[Callable[[int], None]] = _Served()
    synchronize_stream: _Served[Callable[[int], None]] = _Served()
    create_event: _Served[Callable[..., int]] = _Served()
    destroy_event: _Served[Callable[[int], None]] = _Served()
    elapsed_time: _Served[Callable[[int, int], float]] = _Served()
    record_event: _Served[Callable[[int, int], None]] = _Served()
    query_event: _Served[Callable[[int], bool]] = _Served()
    malloc: _Served[Callable[[int], int]] = _Served()
    free: _Served[Callable[[int], None]] = _Served()
    malloc_async: _Served[Callable[[int, int], int]] = _Served()
    free_async: _Served[Callable[[int], None]] = _Served()
    host_alloc: _Served[Callable[..., HostBuffer]] = _Served()
    host_register: _Served[Callable[..., HostBuffer]] = _Served()
    host_free: _Served[Callable[[HostBuffer], None]] = _Served()
    pointer_device: _Served[Callable[[int], int]] = _Served()
    read_device: _Served[Callable[[int, np.ndarray[Any, Any]], None]] = _Served()
    copy_to_device: _Served[Callable[[int, HostBuffer, int, int], None]] = _Served()
    copy_to_host: _Served[Callable[[HostBuffer, int, int, int], None]] = _Served()
    prepare_conversions: _Served[Callable[..., None]] = _Served()
    pack: _Served[Callable[..., None]] = _Served()
    unpack: _Served[Callable[..., None]] = _Served()
    prepare_preprocess: _Served[Callable[..., None]] = _Served()
    preprocess: _Served[Callable[..., None]] = _Served()
    prepare_detect: _Served[Callable[..., Any]] = _Served()  # post-processing on a stream
    detect: _Served[Callable[..., None]] = _Served()
    wait_event: _Served[Callable[[int, int], None]] = _Served()
    begin_capture: _Served[Callable[[int], None]] = _Served()
    end_capture: _Served[Callable[[int], int]] = _Served()
    launch_graph: _Served[Callable[[int, int], None]] = _Served()
    destroy_graph: _Served[Callable[[int], None]] = _Served()
    take_compute_failure: _Served[Callable[[int], BaseException | None]] = _Served()

    def __init__(
        self,
        cores: int = 2,
        *,
        copy_bandwidth: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        compute: ComputeFunction | str | None = None,
        trust_compute: bool = False,
    ) -> None:
        if not isinstance(cores, int) or isinstance(cores, bool) or cores < 1:
            raise ConfigurationError(f"{cores=} must be an int >= 1")
        if copy_bandwidth is not None and not copy_bandwidth > 0:
            raise ConfigurationError(f"{copy_bandwidth=} must be > 0 bytes per second")
        self._call_failures = CallFailures()
        timeline = self._timeline = Timeline(cores, clock, self._call_failures)
        memory = self._memory = EmulatedMemory(timeline, copy_bandwidth)
        self._faults = FaultInjection(timeline, self._call_failures)
        self._compute_threads = ComputeThreads(timeline, compute, trust_compute)
        conversion = EmulatedConversion(timeline, memory)
        detect = EmulatedDetect(timeline, memory)
        graphs = self._graphs = EmulatedGraphs(timeline)
        self._modules: dict[int, _Module] = {}
        self.counts: TransferCounts = memory.counts
        served: dict[object, tuple[str, ...]] = {
            timeline: _TIMELINE_CALLS,
            memory: _MEMORY_CALLS,
            conversion: ("prepare_conversions", "prepare_preprocess"),
            detect: ("prepare_detect",),
            graphs: ("begin_capture", "end_capture", "launch_graph", "destroy_graph"),
            self._compute_threads: ("take_compute_failure",),
        }
        self._served = {
            name: getattr(part, name) for part, names in served.items() for name in names
        }
        recorded: dict[object, dict[str, int]] = {
            timeline: _RECORDED_TIMELINE,
            memory: _RECORDED_MEMORY,
            conversion: _RECORDED_CONVERSION,
            detect: {"detect": 4},
        }
        for part, calls in recorded.items():
            for name, position in calls.items():
                self._served[name] = graphs.recorded(getattr(part, name), position)

    @property
    def copy_bandwidth(self) -> float | None:
        return self._memory.copy_bandwidth

    @property
    def trust_compute(self) -> bool:
        return self._compute_threads.trust_compute

    @property
    def device_time(self) -> float:
        """CPU seconds spent doing the emulated device's work (copies, tasks)."""
        return self._timeline.device_time

    @property
    def invalid_releases(self) -> int:
        """Releases of handles that were not live (a double release, say): tests check 0."""
        return self._timeline.invalid_releases

    def live_handles(self) -> dict[str, int]:
        """How many of each kind of handle are alive (all zero after a clean close)."""
        timeline, memory = self._timeline, self._memory
        with timeline.lock:
            return {
                "devices": len(timeline.devices),
                "modules": len(self._modules),
                "registrations": sum(len(d.registrations) for d in timeline.devices.values()),
                "streams": len(timeline.streams),
                "events": len(timeline.events),
                "device_memory": len(memory.device_memory),
                "host_memory": len(memory.host_memory),
                "graphs": len(self._graphs.graphs),
            }

    # -- test controls (see ``_faults``) --------------------------------------------------

    def fail_next_task(
        self, core: int, status: int = 0x40000001, *, on_stream: bool = False
    ) -> None:
        """The next task submitted to ``core`` fails with ``status`` (a cudlaStatus);
        its outputs are not written.

        By default the failure shows only through ``get_last_error``. ``on_stream=True``
        makes it surface as a DLA hardware fault does in hybrid mode (NVIDIA's
        cuDLAErrorReporting sample): a sticky ``cudaErrorExternalDevice`` on the task's
        stream, which poisons the context, while ``get_last_error`` still reports the
        status.
        """
        self._faults.fail_next_task(core, status, on_stream=on_stream)

    def hang_core(self, core: int, hung: bool = True) -> None:
        """Tasks submitted to ``core`` from now hang until the device's task timeout,
        then fail with ``ERROR_DLA_ERR_ENGINE_TIMEOUT``; ``hung=False`` ends that."""
        self._faults.hang_core(core, hung)

    def hold(self, core: int) -> TaskGate:
        """Hold every task submitted to ``core`` before it starts, until released."""
        return self._faults.hold(core)

    def poison(self, code: int = _EXTERNAL_DEVICE) -> None:
        """Poison the CUDA context: from now every CUDA call raises a sticky error, and
        the work queued on the device is lost. Releasing a CUDA handle then raises too,
        but the handle counts as released (the process's end reclaims it)."""
        self._faults.poison(code)

    def fail_call(
        self,
        call: str,
        error: BaseException | int,
        *,
        after: int = 0,
        core: int | None = None,
    ) -> None:
        """Make the runtime method ``call`` fail once, after ``after`` successful calls.

        ``error`` is an exception, or a number: a cudlaStatus for cuDLA calls, a
        cudaError_t for CUDA calls. ``core`` limits it to calls about that DLA core.
        """
        if not callable(getattr(self, call, None)) or call.startswith("_"):
            raise ConfigurationError(f"{call=} is not a runtime method")
        self._faults.fail_call(call, error, after=after, core=core)

    def core_busy_time(self, core: int) -> float:
        """Seconds of task time on the core's timeline."""
        return self._timeline.core_busy_time(core)

    def core_tasks(self, core: int) -> int:
        """Tasks that finished on ``core`` (as observed so far)."""
        return self._timeline.core_tasks(core)

    def tasks_in_flight(self, core: int) -> int:
        """Tasks submitted to ``core`` that have not finished (as observed so far):
        running, waiting behind the core's other tasks, held by a gate, or hung."""
        return self._timeline.tasks_in_flight(core)

    def bind_compute(self, loadable: bytes, compute: ComputeFunction | str | None) -> None:
        """Let ``compute`` compute the outputs of every module loaded from
        ``loadable`` from now on (None: undo), in place of the runtime's ``compute=``
        and of the loadable's own compute reference. Modules loaded already keep
        theirs."""
        self._compute_threads.bind_compute(loadable, compute)

    def module_computes(self, module: int) -> bool:
        """Whether a compute function computes this module's outputs (then the
        engine asks :meth:`take_compute_failure` with each completion)."""
        return self._module(module).compute is not None

    def _device(self, device: int) -> _Device:
        try:
            return self._timeline.devices[device]
        except (KeyError, TypeError):
            raise _reject("invalid_device", f"device handle {device!r} is not live") from None

    # -- discovery -----------------------------------------------------------------------

    def version(self) -> int:
        return 1_002_001

    def device_count(self) -> int:
        return len(self._timeline.cores)

    def stated_service_time(self, loadable: bytes) -> float | None:
        return stated_latency(loadable)

    def is_integrated(self) -> bool:
        return False  # like a discrete GPU; Engine(zero_copy=True) maps buffers anyway

    def make_current(self) -> None:
        self._timeline.cuda("make_current")

    # -- cuDLA ---------------------------------------------------------------------------

    def create_device(self, core: int) -> int:
        if not isinstance(core, int) or not 0 <= core < len(self._timeline.cores):
            raise _reject("invalid_param", f"DLA core {core} does not exist")
        self._call_failures.check("create_device", core)
        with self._timeline.lock:
            target = self._timeline.cores[core]
            if target.handles >= MAX_HANDLES_PER_CORE:
                raise _reject("out_of_resources", f"core {core} has 16 device handles already")
            target.handles += 1
            handle = next(self._timeline.ids)
            self._timeline.devices[handle] = _Device(handle, target)
            return handle

    def destroy_device(self, device: int) -> None:
        self._timeline.advance_all()
        with self._timeline.lock:
            if device not in self._timeline.devices:
                self._timeline.invalid_releases += 1
            target = self._device(device)
            if target.tasks_in_flight and self._timeline.poisoned is None:
                raise _reject(
                    "invalid_param", f"destroy of device {device:#x} with tasks in flight"
                )
            if target.module is not None or target.registrations:
                raise _reject(
                    "invalid_param",
                    f"destroy of device {device:#x} with its module or memory still attached",
                )
            del self._timeline.devices[device]
            target.core.handles -= 1

    def load_module(self, device: int, loadable: bytes) -> int:
        target = self._device(device)
        self._call_failures.check("load_module", target.core.index)
        try:
            model = parse_loadable(loadable)
        except LoadableFormatError as exc:
            raise _reject("invalid_module", f"not an emulator loadable ({exc})") from None
        compute = self._compute_threads.module_compute(loadable, model)
        with self._timeline.lock:
            if target.module is not None:
                raise _reject("unsupported_operation", "one loadable per device handle")
            handle = next(self._timeline.ids)
            self._modules[handle] = _Module(handle, target, model, compute)
            self._memory.changed()
            target.module = handle
            if compute is not None:
                self._compute_threads.loaded(target.core.index)
            return handle

    def _module(self, module: int) -> _Module:
        try:
            return self._modules[module]
        except (KeyError, TypeError):
            raise _reject("invalid_module", f"module {module!r} is not loaded") from None

    def unload_module(self, module: int) -> None:
        self._timeline.advance_all()
        with self._timeline.lock:
            if module not in self._modules:
                self._timeline.invalid_releases += 1
            loaded = self._module(module)
            if loaded.device.tasks_in_flight and self._timeline.poisoned is None:
                raise _reject("invalid_param", f"unload of module {module:#x} with tasks in flight")
            del self._modules[module]
            self._memory.changed()
            loaded.device.module = None
            if loaded.compute is not None:
                self._compute_threads.unloaded(loaded.device.core.index)

    def module_tensors(
        self, module: int
    ) -> tuple[Sequence[TensorDescriptor], Sequence[TensorDescriptor]]:
        return self._module(module).model.descriptors

    def mem_register(self, device: int, ptr: int, nbytes: int) -> int:
        target = self._device(device)
        self._call_failures.check("mem_register", target.core.index)
        if ptr % REGISTRATION_ALIGNMENT:
            raise _reject("invalid_address", f"pointer {ptr:#x} is not 32-byte aligned")
        if nbytes <= 0:
            raise _reject("invalid_address", f"size {nbytes} to register")
        try:
            self._memory.device_range(ptr, nbytes, "mem_register")
        except CudaCallError:
            raise _reject(
                "invalid_address", f"[{ptr:#x}, +{nbytes}) is not inside one CUDA allocation"
            ) from None
        with self._timeline.lock:
            if any(raw == ptr for raw, _ in target.registrations.values()):
                raise _reject("memory_registered", f"{ptr:#x} is registered already")
            registered = ptr | _REGISTERED_TAG
            self._memory.changed()
            target.registrations[registered] = (ptr, nbytes)
            return registered

    def mem_unregister(self, device: int, registered: int) -> None:
        self._timeline.advance_all()
        target = self._device(device)
        with self._timeline.lock:
            if registered not in target.registrations:
                self._timeline.invalid_releases += 1
                raise _reject("invalid_address", f"{registered!r} is not registered here")
            # A lost context never runs the tasks queued behind the fault: they hold
            # nothing, and the handles can go (as with the stand-in).
            if target.tasks_in_flight and self._timeline.poisoned is None:
                raise _reject("invalid_param", "unregister while tasks are in flight")
            self._memory.changed()
            del target.registrations[registered]

    def make_task(self, module: int, inputs: Sequence[int], outputs: Sequence[int]) -> _Task:
        self._module(module)
        for ptr in (*inputs, *outputs):
            if type(ptr) is not int:
                raise TypeError(f"tensor pointers must be Python ints, got {type(ptr).__name__}")
        return _Task(module, tuple(inputs), tuple(outputs))

    def submit_task(self, device: int, task: _Task, stream: int) -> None:
        target = self._device(device)
        timeline, failures = self._timeline, self._call_failures
        if failures.armed:
            failures.check("submit_task", target.core.index)
        if timeline.poisoned is not None:
            raise EmulatedCudlaError(cudla.Status(6), "the CUDA context is poisoned")
        if not isinstance(task, _Task):
            raise _reject("invalid_param", f"{task!r} is not a task of this runtime")
        resolved = task.resolved
        if resolved is None or resolved[0] != self._memory.generation or resolved[1] != device:
            loaded = self._module(task.module)
            resolved = task.resolved = task.resolve(target, loaded, self._memory)
        _, _, model, runner = resolved
        fifo = timeline.stream(stream, "submit_task")
        effect = self._faults.task_effect(target, model, runner)  # type: ignore[arg-type]
        operation = _Operation(effect, target)
        computed = type(runner) is ComputeTask
        if computed:
            effect.compute, effect.stream = runner, stream  # type: ignore[assignment]
            # A failed or hung task writes no outputs: nothing to compute then.
            if not effect.status:
                operation.computing = self._compute_threads
        with timeline.lock:
            target.tasks_in_flight += 1
            if target.core.gate is not None:
                target.core.gate._arrived()
        timeline.push(fifo, operation)
        if computed and operation.computing is not None:
            self._compute_threads.put(target.core.index, fifo, operation, runner)  # type: ignore[arg-type]

    def get_last_error(self, device: int) -> int:
        # No advancing here: as on a DLA, a status is known once its stream was
        # synchronized or its event observed (cudla.h says to check after that).
        target = self._device(device)
        with self._timeline.lock:
            status, target.last_error = target.last_error, 0
            return status

    def set_task_timeout(self, device: int, milliseconds: int) -> None:
        target = self._device(device)
        if not 0 < milliseconds <= 1_000_000:
            raise _reject("invalid_param", f"task timeout {milliseconds} ms is not in (0, 1000 s]")
        target.timeout = milliseconds / 1000.0

    def close(self) -> None:
        """Pending operations are simply dropped; compute threads end."""
        self._compute_threads.stop()


# The calls each part serves as they are, and those that enqueue stream work (with
# the position of their stream argument), which the graphs record while it captures.
_TIMELINE_CALLS = (
    "create_stream",
    "destroy_stream",
    "synchronize_stream",
    "create_event",
    "destroy_event",
    "elapsed_time",
    "query_event",
)
_MEMORY_CALLS = (
    "malloc",
    "free",
    "malloc_async",
    "free_async",
    "host_alloc",
    "host_register",
    "host_free",
    "pointer_device",
    "read_device",
)
_RECORDED_TIMELINE = {"record_event": 1}
_RECORDED_MEMORY = {"copy_to_device": 3, "copy_to_host": 3}
_RECORDED_CONVERSION = {"pack": 5, "unpack": 4, "preprocess": 6, "wait_event": 0}
