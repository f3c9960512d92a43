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

Fault injection (for tests): :meth:`EmulatedRuntime.fail_next_task`,
:meth:`~EmulatedRuntime.hang_core`, :meth:`~EmulatedRuntime.hold`,
:meth:`~EmulatedRuntime.poison` and :meth:`~EmulatedRuntime.fail_call`.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from cuda.bindings import cudla

from .._errors import ConfigurationError, LoadableFormatError
from .._tensors import TensorDescriptor
from ..emulator._format import EmulatorModel, parse_loadable, stated_latency
from ..emulator._ops import ModelRunner
from ._protocol import CudaCallError, HostBuffer

__all__ = ["EmulatedCudlaError", "EmulatedRuntime", "TaskGate"]

MAX_HANDLES_PER_CORE = 16  # cudla.h: at most 16 device handles per DLA
DEFAULT_TASK_TIMEOUT = 30.0  # seconds, cuDLA's default
REGISTRATION_ALIGNMENT = 32
_DEVICE_ALIGNMENT = 256  # what cudaMalloc guarantees
_REGISTERED_TAG = 1 << 56  # registered addresses differ from raw ones, as on a Jetson
_EXTERNAL_DEVICE = 911  # cudaErrorExternalDevice
_MEMORY_ALLOCATION = 2
_INVALID_VALUE = 1
_INVALID_HANDLE = 400
_NOT_READY = 600


def _status(name: str) -> Any:
    # Look members up by value: cuda-bindings 13.3 and 13.5 spell the names differently.
    return cudla.Status(_STATUS_VALUES[name])


_STATUS_VALUES = {
    "invalid_param": 1,
    "out_of_resources": 2,
    "invalid_address": 4,
    "invalid_device": 8,
    "invalid_attribute": 9,
    "memory_registered": 11,
    "invalid_module": 12,
    "unsupported_operation": 13,
    "engine_timeout": 0x40000006,
}


class EmulatedCudlaError(cudla.CudlaError):  # type: ignore[misc]
    """``cudla.CudlaError`` with a sentence saying what the emulator caught."""

    def __init__(self, status: Any, detail: str) -> None:
        super().__init__(int(status))
        self.detail = detail

    def __str__(self) -> str:
        return f"{super().__str__()}: {self.detail}"


def _reject(name: str, detail: str) -> EmulatedCudlaError:
    return EmulatedCudlaError(_status(name), detail)


class TaskGate:
    """Holds a core's tasks before they start, until the test releases them.

    ``held`` counts the tasks submitted to the core while the gate stood. Tests use it
    to reach "a task is in flight on the DLA" without sleeping.
    """

    def __init__(self, runtime: EmulatedRuntime, core: int) -> None:
        self._runtime = runtime
        self.core = core
        self._released = False
        self._condition = threading.Condition()
        self._held = 0

    @property
    def held(self) -> int:
        """Tasks waiting at the gate."""
        return self._held

    @property
    def released(self) -> bool:
        return self._released

    def wait_for_held(self, count: int = 1, timeout: float = 10.0) -> bool:
        """Block until ``count`` tasks wait at the gate; False on timeout."""
        with self._condition:
            return self._condition.wait_for(lambda: self._held >= count, timeout)

    def release(self) -> None:
        """Let the held tasks (and later ones) start now; the gate is then gone."""
        if not self._released:
            self._released = True
            self._runtime._release_gate(self)

    def _arrived(self) -> None:
        with self._condition:
            self._held += 1
            self._condition.notify_all()

    def __enter__(self) -> TaskGate:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@dataclasses.dataclass(eq=False)
class _Core:
    index: int
    free_at: float = 0.0
    busy_time: float = 0.0
    tasks_started: int = 0
    tasks_completed: int = 0
    hung: bool = False
    failures: collections.deque[int] = dataclasses.field(default_factory=collections.deque)
    gate: TaskGate | None = None
    # Streams stopped at a task of this held core, in the order those tasks came.
    blocked: collections.deque[_Stream] = dataclasses.field(default_factory=collections.deque)
    handles: int = 0


@dataclasses.dataclass(eq=False)
class _Device:
    handle: int
    core: _Core
    module: int | None = None
    registrations: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    last_error: int = 0
    tasks_in_flight: int = 0
    timeout: float = DEFAULT_TASK_TIMEOUT


@dataclasses.dataclass(eq=False)
class _Module:
    handle: int
    device: _Device
    model: EmulatorModel


@dataclasses.dataclass(eq=False)
class _Task:
    module: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    # What submit_task resolved last time, valid while no memory or module changed
    # (the runtime's ``_generation``): validation is then a comparison, not a search.
    resolved: tuple[int, int, EmulatorModel, ModelRunner] | None = None


@dataclasses.dataclass(eq=False)
class _Event:
    handle: int
    timing: bool = False
    recorded: int = 0
    completed: int = 0
    stream: _Stream | None = None
    time: float = 0.0  # the emulated time the stream reached the last completed record


class _Operation:
    """One stream operation: the virtual time it completes at, and its effect.

    ``at`` is None while the operation waits behind a task of a held core. A task's
    operation also carries ``device`` (its core) and the ``model`` it runs.
    """

    __slots__ = ("at", "device", "effect")

    def __init__(self, effect: Callable[[], None], device: _Device | None = None) -> None:
        self.at: float | None = None
        self.effect = effect
        self.device = device


class _Stream:
    """A FIFO of operations with its own position on the emulated timeline."""

    __slots__ = ("clock", "handle", "operations", "unplaced")

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.clock = 0.0  # when the last placed operation completes
        self.operations: collections.deque[_Operation] = collections.deque()
        # The tail of ``operations`` not on the timeline yet: a held task and what
        # follows it. Usually empty.
        self.unplaced: collections.deque[tuple[_Operation, float]] = collections.deque()


@dataclasses.dataclass(eq=False)
class _CallFailure:
    call: str
    after: int
    error: BaseException
    core: int | None


class EmulatedRuntime:
    """cuDLA hybrid mode and the CUDA calls aiodla needs, emulated on the CPU.

    ``cores``: how many DLA cores exist (Orin has 2). ``copy_bandwidth``: bytes per
    second of host/device copies, instantaneous when None. ``clock``: the time source.
    """

    name = "emulated"
    # Seconds the poller pauses between sweeps near a completion. Emulated events are
    # cheap to query but each sweep takes the GIL from the event loop.
    poll_pause = 100e-6

    def __init__(
        self,
        cores: int = 2,
        *,
        copy_bandwidth: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(cores, int) or isinstance(cores, bool) or cores < 1:
            raise ConfigurationError(f"{cores=} must be an int >= 1")
        if copy_bandwidth is not None and not copy_bandwidth > 0:
            raise ConfigurationError(f"{copy_bandwidth=} must be > 0 bytes per second")
        self.copy_bandwidth = copy_bandwidth
        self._clock = clock
        self._cores = [_Core(index) for index in range(cores)]
        self._lock = threading.RLock()
        self._placed = threading.Condition(self._lock)  # a held core was released
        self._ids = itertools.count(0x1000)
        self._devices: dict[int, _Device] = {}
        self._modules: dict[int, _Module] = {}
        self._streams: dict[int, _Stream] = {}
        self._retired: list[_Stream] = []  # destroyed streams whose work still runs
        self._events: dict[int, _Event] = {}
        self._device_memory: dict[int, np.ndarray[Any, Any]] = {}
        self._device_starts: list[int] = []
        self._next_address = 0x7F00_0000_0000
        self._host_memory: dict[int, HostBuffer] = {}
        self._poisoned: CudaCallError | None = None
        self._call_failures: list[_CallFailure] = []
        self._generation = 0  # bumped by every change to memory, registrations, modules
        self._ranges: dict[tuple[int, int], np.ndarray[Any, Any]] = {}
        self.device_time = 0.0
        """CPU seconds spent doing the emulated device's work (copies, tasks)."""
        self.invalid_releases = 0
        """Releases of handles that were not live (a double release, say): tests check 0."""

    # -- test controls -------------------------------------------------------------------

    def fail_next_task(self, core: int, status: int = 0x40000001) -> None:
        """The next task submitted to ``core`` fails with ``status`` (a cudlaStatus);
        its outputs are not written."""
        self._core(core).failures.append(int(cudla.Status(int(status))))

    def hang_core(self, core: int, hung: bool = True) -> None:
        """Tasks submitted to ``core`` from now hang until the device's task timeout,
        then fail with ``ERROR_DLA_ERR_ENGINE_TIMEOUT``; ``hung=False`` ends that."""
        self._core(core).hung = hung

    def hold(self, core: int) -> TaskGate:
        """Hold every task submitted to ``core`` before it starts, until released."""
        target = self._core(core)
        with self._lock:
            if target.gate is None:
                target.gate = TaskGate(self, core)
            return target.gate

    def _release_gate(self, gate: TaskGate) -> None:
        with self._lock:
            core = self._cores[gate.core]
            if core.gate is gate:
                core.gate = None
            now = self._clock()
            while core.blocked:
                self._place(core.blocked.popleft(), now)
            self._placed.notify_all()

    def poison(self, code: int = _EXTERNAL_DEVICE) -> None:
        """Poison the CUDA context: from now every CUDA call raises a sticky error, and
        the work queued on the device is lost. Releasing a CUDA handle then raises too,
        but the handle counts as released (the process's end reclaims it)."""
        with self._lock:
            self._poisoned = CudaCallError("(context)", code)
            for stream in (*self._streams.values(), *self._retired):
                stream.operations.clear()
                stream.unplaced.clear()
            for device in self._devices.values():
                device.tasks_in_flight = 0
            for core in self._cores:
                core.blocked.clear()
            self._placed.notify_all()

    def _released(self, call: str) -> None:
        """After a successful release: in a poisoned context, say it failed anyway."""
        if self._poisoned is not None:
            raise CudaCallError(call, self._poisoned.code)

    def _bad_release(self, call: str) -> None:
        """A release of a handle that is not live: a double release, or a stray one."""
        self.invalid_releases += 1
        raise CudaCallError(call, _INVALID_HANDLE if call.startswith("destroy") else _INVALID_VALUE)

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
        if isinstance(error, int):
            error = (
                EmulatedCudlaError(cudla.Status(error), f"injected failure of {call}")
                if call in _CUDLA_CALLS
                else CudaCallError(call, error)
            )
        self._call_failures.append(_CallFailure(call, after, error, core))

    def live_handles(self) -> dict[str, int]:
        """How many of each kind of handle are alive (all zero after a clean close)."""
        with self._lock:
            return {
                "devices": len(self._devices),
                "modules": len(self._modules),
                "registrations": sum(len(d.registrations) for d in self._devices.values()),
                "streams": len(self._streams),
                "events": len(self._events),
                "device_memory": len(self._device_memory),
                "host_memory": len(self._host_memory),
            }

    def core_busy_time(self, core: int) -> float:
        """Seconds of task time on the core's timeline."""
        return self._core(core).busy_time

    def core_tasks(self, core: int) -> int:
        """Tasks that finished on ``core`` (as observed so far)."""
        return self._core(core).tasks_completed

    # -- helpers -------------------------------------------------------------------------

    def _core(self, core: int) -> _Core:
        if not isinstance(core, int) or not 0 <= core < len(self._cores):
            raise ConfigurationError(f"{core=} is not one of the {len(self._cores)} cores")
        return self._cores[core]

    def _check_injected(self, call: str, core: int | None = None) -> None:
        if not self._call_failures:
            return
        with self._lock:
            for failure in self._call_failures:
                if failure.call != call or (failure.core is not None and failure.core != core):
                    continue
                if failure.after > 0:
                    failure.after -= 1
                    return
                self._call_failures.remove(failure)
                raise failure.error

    def _cuda(self, call: str) -> None:
        """Every CUDA call starts here: a poisoned context fails them all."""
        if self._poisoned is not None:
            raise CudaCallError(call, self._poisoned.code)
        self._check_injected(call)

    def _device(self, device: int) -> _Device:
        try:
            return self._devices[device]
        except (KeyError, TypeError):
            raise _reject("invalid_device", f"device handle {device!r} is not live") from None

    def _stream(self, stream: int, call: str) -> _Stream:
        try:
            return self._streams[stream]
        except (KeyError, TypeError):
            raise CudaCallError(call, _INVALID_HANDLE) from None

    def _device_range(self, ptr: int, nbytes: int, call: str) -> np.ndarray[Any, Any]:
        """The bytes ``[ptr, ptr + nbytes)`` of one live device allocation."""
        cached = self._ranges.get((ptr, nbytes))
        if cached is not None:
            return cached
        with self._lock:
            index = bisect.bisect_right(self._device_starts, ptr) - 1
            if index >= 0 and nbytes > 0:
                start = self._device_starts[index]
                memory = self._device_memory[start]
                if ptr + nbytes <= start + memory.nbytes:
                    view = memory[ptr - start : ptr - start + nbytes]
                    self._ranges[(ptr, nbytes)] = view
                    return view
        raise CudaCallError(call, _INVALID_VALUE)

    def _changed(self) -> None:
        """Memory, a registration or a module changed: cached lookups are stale."""
        self._generation += 1
        self._ranges.clear()

    # -- the timeline ----------------------------------------------------------------------

    def _push(self, stream: _Stream, operation: _Operation, duration: float = 0.0) -> None:
        """Append an operation and place it on the timeline unless a held task is ahead."""
        with self._lock:
            stream.operations.append(operation)
            stream.unplaced.append((operation, duration))
            if len(stream.unplaced) == 1:
                self._place(stream, self._clock())

    def _place(self, stream: _Stream, now: float) -> None:
        """Stamp the stream's unplaced operations with completion times, in order,
        until one is a task of a held core (that stream then waits for the gate)."""
        unplaced = stream.unplaced
        while unplaced:
            operation, duration = unplaced[0]
            device = operation.device
            if device is None:
                stream.clock = max(stream.clock, now) + duration
            else:
                if device.core.gate is not None:
                    device.core.blocked.append(stream)
                    return
                self._start_task(operation, device, stream, now)
            operation.at = stream.clock
            unplaced.popleft()

    def _start_task(
        self, operation: _Operation, device: _Device, stream: _Stream, now: float
    ) -> None:
        core = device.core
        start = max(core.free_at, stream.clock, now)
        effect = operation.effect
        assert isinstance(effect, _TaskEffect)
        duration = device.timeout if effect.hung else effect.duration
        core.tasks_started += 1
        core.busy_time += duration
        core.free_at = stream.clock = start + duration

    def _advance(self, stream: _Stream, now: float) -> None:
        """Apply the effects of the stream's operations whose time has come."""
        operations = stream.operations
        if not operations or operations[0].at is None or operations[0].at > now:
            return
        with self._lock:
            began = time.thread_time()
            while operations and operations[0].at is not None and operations[0].at <= now:
                operations.popleft().effect()
            self.device_time += time.thread_time() - began

    def _advance_all(self) -> None:
        now = self._clock()
        with self._lock:
            for stream in (*self._streams.values(), *self._retired):
                self._advance(stream, now)
            self._retired = [s for s in self._retired if s.operations]

    # -- discovery -----------------------------------------------------------------------

    def version(self) -> int:
        return 1_002_001

    def device_count(self) -> int:
        return len(self._cores)

    def stated_service_time(self, loadable: bytes) -> float | None:
        return stated_latency(loadable)

    def make_current(self) -> None:
        self._cuda("make_current")

    # -- cuDLA ---------------------------------------------------------------------------

    def create_device(self, core: int) -> int:
        if not isinstance(core, int) or not 0 <= core < len(self._cores):
            raise _reject("invalid_param", f"DLA core {core} does not exist")
        self._check_injected("create_device", core)
        with self._lock:
            target = self._cores[core]
            if target.handles >= MAX_HANDLES_PER_CORE:
                raise _reject("out_of_resources", f"core {core} has 16 device handles already")
            target.handles += 1
            handle = next(self._ids)
            self._devices[handle] = _Device(handle, target)
            return handle

    def destroy_device(self, device: int) -> None:
        self._advance_all()
        with self._lock:
            if device not in self._devices:
                self.invalid_releases += 1
            target = self._device(device)
            if target.tasks_in_flight:
                raise _reject(
                    "invalid_param", f"destroy of device {device:#x} with tasks in flight"
                )
            if target.module is not None or target.registrations:
                raise _reject(
                    "invalid_param",
                    f"destroy of device {device:#x} with its module or memory still attached",
                )
            del self._devices[device]
            target.core.handles -= 1

    def load_module(self, device: int, loadable: bytes) -> int:
        target = self._device(device)
        self._check_injected("load_module", target.core.index)
        try:
            model = parse_loadable(loadable)
        except LoadableFormatError as exc:
            raise _reject("invalid_module", f"not an emulator loadable ({exc})") from None
        with self._lock:
            if target.module is not None:
                raise _reject("unsupported_operation", "one loadable per device handle")
            handle = next(self._ids)
            self._modules[handle] = _Module(handle, target, model)
            self._changed()
            target.module = handle
            return handle

    def _module(self, module: int) -> _Module:
        try:
            return self._modules[module]
        except (KeyError, TypeError):
            raise _reject("invalid_module", f"module {module!r} is not loaded") from None

    def unload_module(self, module: int) -> None:
        self._advance_all()
        with self._lock:
            if module not in self._modules:
                self.invalid_releases += 1
            loaded = self._module(module)
            if loaded.device.tasks_in_flight:
                raise _reject("invalid_param", f"unload of module {module:#x} with tasks in flight")
            del self._modules[module]
            self._changed()
            loaded.device.module = None

    def module_tensors(
        self, module: int
    ) -> tuple[Sequence[TensorDescriptor], Sequence[TensorDescriptor]]:
        return self._module(module).model.descriptors

    def mem_register(self, device: int, ptr: int, nbytes: int) -> int:
        target = self._device(device)
        self._check_injected("mem_register", target.core.index)
        if ptr % REGISTRATION_ALIGNMENT:
            raise _reject("invalid_address", f"pointer {ptr:#x} is not 32-byte aligned")
        if nbytes <= 0:
            raise _reject("invalid_address", f"size {nbytes} to register")
        try:
            self._device_range(ptr, nbytes, "mem_register")
        except CudaCallError:
            raise _reject(
                "invalid_address", f"[{ptr:#x}, +{nbytes}) is not inside one CUDA allocation"
            ) from None
        with self._lock:
            if any(raw == ptr for raw, _ in target.registrations.values()):
                raise _reject("memory_registered", f"{ptr:#x} is registered already")
            registered = ptr | _REGISTERED_TAG
            self._changed()
            target.registrations[registered] = (ptr, nbytes)
            return registered

    def mem_unregister(self, device: int, registered: int) -> None:
        self._advance_all()
        target = self._device(device)
        with self._lock:
            if registered not in target.registrations:
                self.invalid_releases += 1
                raise _reject("invalid_address", f"{registered!r} is not registered here")
            if target.tasks_in_flight:
                raise _reject("invalid_param", "unregister while tasks are in flight")
            self._changed()
            del target.registrations[registered]

    def make_task(self, module: int, inputs: Sequence[int], outputs: Sequence[int]) -> _Task:
        self._module(module)
        for ptr in (*inputs, *outputs):
            if type(ptr) is not int:
                raise TypeError(f"tensor pointers must be Python ints, got {type(ptr).__name__}")
        return _Task(module, tuple(inputs), tuple(outputs))

    def submit_task(self, device: int, task: _Task, stream: int) -> None:
        target = self._device(device)
        self._check_injected("submit_task", target.core.index)
        if self._poisoned is not None:
            raise EmulatedCudlaError(cudla.Status(6), "the CUDA context is poisoned")
        if not isinstance(task, _Task):
            raise _reject("invalid_param", f"{task!r} is not a task of this runtime")
        resolved = task.resolved
        if resolved is None or resolved[0] != self._generation or resolved[1] != device:
            resolved = task.resolved = self._resolve_task(target, task)
        _, _, model, runner = resolved
        queue = self._stream(stream, "submit_task")
        effect = _TaskEffect(self, target, model, runner)
        # Faults belong to the task as it is submitted, whenever it starts.
        core = target.core
        if core.hung:
            effect.hung, effect.status = True, _STATUS_VALUES["engine_timeout"]
        elif core.failures:
            effect.status = core.failures.popleft()
        with self._lock:
            target.tasks_in_flight += 1
            if target.core.gate is not None:
                target.core.gate._arrived()
        self._push(queue, _Operation(effect, target))

    def _resolve_task(
        self, target: _Device, task: _Task
    ) -> tuple[int, int, EmulatorModel, ModelRunner]:
        """Validate the task against the device as cuDLA would; its tensors' buffers."""
        loaded = self._module(task.module)
        if loaded.device is not target:
            raise _reject("invalid_module", "the task's module is loaded on another device")
        model = loaded.model
        if len(task.inputs) != len(model.inputs) or len(task.outputs) != len(model.outputs):
            raise _reject(
                "invalid_param",
                f"task has {len(task.inputs)} inputs/{len(task.outputs)} outputs, the module "
                f"{len(model.inputs)}/{len(model.outputs)}",
            )
        views_in = [
            self._registered_view(target, p, s)
            for p, s in zip(task.inputs, model.inputs, strict=True)
        ]
        views_out = [
            self._registered_view(target, p, s)
            for p, s in zip(task.outputs, model.outputs, strict=True)
        ]
        return self._generation, target.handle, model, ModelRunner(model, views_in, views_out)

    def _registered_view(self, device: _Device, registered: int, spec: Any) -> np.ndarray[Any, Any]:
        entry = device.registrations.get(registered)
        if entry is None:
            raise _reject(
                "invalid_address", f"tensor {spec.name!r}: {registered:#x} is not registered"
            )
        raw, nbytes = entry
        if nbytes < spec.size:
            raise _reject(
                "invalid_param",
                f"tensor {spec.name!r} needs {spec.size} bytes, registration has {nbytes}",
            )
        return self._device_range(raw, spec.size, "submit_task")

    def get_last_error(self, device: int) -> int:
        # No advancing here: as on a DLA, a status is known once its stream was
        # synchronized or its event observed (cudla.h says to check after that).
        target = self._device(device)
        with self._lock:
            status, target.last_error = target.last_error, 0
            return status

    def set_task_timeout(self, device: int, milliseconds: int) -> None:
        target = self._device(device)
        if not 0 < milliseconds <= 1_000_000:
            raise _reject("invalid_param", f"task timeout {milliseconds} ms is not in (0, 1000 s]")
        target.timeout = milliseconds / 1000.0

    # -- CUDA ----------------------------------------------------------------------------

    def create_stream(self) -> int:
        self._cuda("create_stream")
        with self._lock:
            handle = next(self._ids)
            self._streams[handle] = _Stream(handle)
            return handle

    def destroy_stream(self, stream: int) -> None:
        # As cudaStreamDestroy: returns at once; queued work still completes.
        with self._lock:
            target = self._streams.pop(stream, None)
            if target is None:
                self._bad_release("destroy_stream")
            elif target.operations:
                self._retired.append(target)
        self._released("destroy_stream")

    def synchronize_stream(self, stream: int) -> None:
        self._cuda("synchronize_stream")
        target = self._stream(stream, "synchronize_stream")
        while True:
            with self._lock:
                if not target.operations:
                    break
                last = target.operations[-1].at
                if last is None:  # behind a held task: wait for its gate
                    self._placed.wait(0.05)
                    continue
            delay = last - self._clock()
            if delay > 0:
                time.sleep(delay)
            self._advance(target, self._clock())
        if self._poisoned is not None:
            raise CudaCallError("synchronize_stream", self._poisoned.code)

    def create_event(self, timing: bool = False) -> int:
        self._cuda("create_event")
        with self._lock:
            handle = next(self._ids)
            self._events[handle] = _Event(handle, timing)
            return handle

    def destroy_event(self, event: int) -> None:
        with self._lock:
            if self._events.pop(event, None) is None:
                self._bad_release("destroy_event")
        self._released("destroy_event")

    def elapsed_time(self, start: int, end: int) -> float:
        self._cuda("elapsed_time")
        first, last = self._events.get(start), self._events.get(end)
        if first is None or last is None or not (first.timing and last.timing):
            raise CudaCallError("elapsed_time", _INVALID_HANDLE)
        if (
            first.completed < first.recorded
            or last.completed < last.recorded
            or not (first.recorded and last.recorded)
        ):
            raise CudaCallError("elapsed_time", _NOT_READY)
        return last.time - first.time

    def record_event(self, event: int, stream: int) -> None:
        self._cuda("record_event")
        target = self._events.get(event)
        if target is None:
            raise CudaCallError("record_event", _INVALID_HANDLE)
        queue = self._stream(stream, "record_event")
        with self._lock:
            target.recorded += 1
            target.stream = queue
            generation = target.recorded

        operation = _Operation(lambda: None)

        def complete() -> None:
            if generation > target.completed:
                target.completed = generation
                target.time = operation.at or 0.0

        operation.effect = complete
        self._push(queue, operation)

    def query_event(self, event: int) -> bool:
        if self._poisoned is not None:
            raise CudaCallError("query_event", self._poisoned.code)
        target = self._events.get(event)
        if target is None:
            raise CudaCallError("query_event", _INVALID_HANDLE)
        if target.completed >= target.recorded:
            return True
        stream = target.stream
        if stream is not None:
            self._advance(stream, self._clock())
        return target.completed >= target.recorded

    def malloc(self, nbytes: int) -> int:
        self._cuda("malloc")
        if nbytes <= 0:
            raise CudaCallError("malloc", _INVALID_VALUE)
        with self._lock:
            address = self._next_address
            span = -(-nbytes // _DEVICE_ALIGNMENT) * _DEVICE_ALIGNMENT
            self._next_address += span + _DEVICE_ALIGNMENT  # a gap: overruns never alias
            self._device_memory[address] = np.zeros(nbytes, dtype=np.uint8)
            self._changed()
            bisect.insort(self._device_starts, address)
            return address

    def free(self, ptr: int) -> None:
        with self._lock:
            if ptr not in self._device_memory:
                self._bad_release("free")
            for device in self._devices.values():
                if any(raw == ptr for raw, _ in device.registrations.values()):
                    raise CudaCallError("free", _INVALID_VALUE)
            self._changed()
            del self._device_memory[ptr]
            self._device_starts.remove(ptr)
        self._released("free")

    def host_alloc(self, nbytes: int) -> HostBuffer:
        self._cuda("host_alloc")
        if nbytes <= 0:
            raise CudaCallError("host_alloc", _INVALID_VALUE)
        # 64-byte aligned, as pinned pages are, so vectorized packing sees aligned rows.
        backing = np.zeros(nbytes + 64, dtype=np.uint8)
        skip = -backing.ctypes.data % 64
        array = backing[skip : skip + nbytes]
        buffer = HostBuffer(int(array.ctypes.data), array)
        with self._lock:
            self._host_memory[buffer.ptr] = buffer
        return buffer

    def host_free(self, buffer: HostBuffer) -> None:
        with self._lock:
            if self._host_memory.pop(buffer.ptr, None) is None:
                self._bad_release("host_free")
        self._released("host_free")

    def _host(self, buffer: HostBuffer, nbytes: int, call: str) -> np.ndarray[Any, Any]:
        if self._host_memory.get(buffer.ptr) is not buffer or not 0 < nbytes <= buffer.nbytes:
            raise CudaCallError(call, _INVALID_VALUE)
        return buffer.array[:nbytes]

    def _copy(
        self, dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any], stream: int, call: str
    ) -> None:
        queue = self._stream(stream, call)
        duration = dst.nbytes / self.copy_bandwidth if self.copy_bandwidth else 0.0
        self._push(queue, _Operation(functools.partial(np.copyto, dst, src)), duration)

    def copy_to_device(self, dst: int, src: HostBuffer, nbytes: int, stream: int) -> None:
        self._cuda("copy_to_device")
        target = self._device_range(dst, nbytes, "copy_to_device")
        self._copy(target, self._host(src, nbytes, "copy_to_device"), stream, "copy_to_device")

    def copy_to_host(self, dst: HostBuffer, src: int, nbytes: int, stream: int) -> None:
        self._cuda("copy_to_host")
        source = self._device_range(src, nbytes, "copy_to_host")
        self._copy(self._host(dst, nbytes, "copy_to_host"), source, stream, "copy_to_host")

    def close(self) -> None:
        """Nothing runs in the background; pending operations are simply dropped."""
        with self._lock:
            self._placed.notify_all()


class _TaskEffect:
    """A task's effect: compute its outputs (unless it failed), latch its status."""

    __slots__ = ("device", "duration", "hung", "runner", "runtime", "status")

    def __init__(
        self, runtime: EmulatedRuntime, device: _Device, model: EmulatorModel, runner: ModelRunner
    ) -> None:
        self.runtime = runtime
        self.device = device
        self.runner = runner
        self.duration = model.latency
        self.status = 0
        self.hung = False

    def __call__(self) -> None:
        device = self.device
        if not self.status and self.runtime._poisoned is None:
            self.runner()
        if self.status:
            device.last_error = self.status
        device.tasks_in_flight -= 1
        device.core.tasks_completed += 1


_CUDLA_CALLS = frozenset(
    {
        "create_device",
        "destroy_device",
        "load_module",
        "unload_module",
        "module_tensors",
        "mem_register",
        "mem_unregister",
        "submit_task",
        "get_last_error",
        "set_task_timeout",
    }
)
