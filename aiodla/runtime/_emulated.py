"""The emulated runtime: cuDLA hybrid mode and the CUDA calls, in Python and numpy.

For machines with no DLA and no GPU (laptops, CI). It is *strict*: every misuse the
real library rejects raises the ``cudla.Status`` the real one would, so engine bugs
show up here before they reach a Jetson.

Model:

- A stream is a FIFO worker thread. Operations run in enqueue order.
- Each DLA core is a serial resource shared by its streams, with its own exact
  timeline: a task starts at ``max(core free, stream reached it, enqueued, released)``
  and ends exactly ``latency`` seconds later on that timeline, however late the worker
  thread's sleep wakes. So measured throughput can be held against ``cores / latency``.
- Copies are instantaneous unless ``copy_bandwidth`` (bytes per second) is set.
- Events mark stream positions; ``query_event`` is true once the worker passed them.
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
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from cuda.bindings import cudla

from .._errors import ConfigurationError, LoadableFormatError
from .._tensors import TensorDescriptor
from ..emulator._format import EmulatorModel, parse_loadable
from ..emulator._ops import run_model
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
    """Holds a core's tasks before they start, until the test releases them."""

    def __init__(self, runtime: EmulatedRuntime, core: int) -> None:
        self._runtime = runtime
        self.core = core
        self._released = threading.Event()
        self._condition = threading.Condition()
        self._held = 0

    @property
    def held(self) -> int:
        """Tasks now waiting at the gate."""
        return self._held

    def wait_for_held(self, count: int = 1, timeout: float = 10.0) -> bool:
        """Block until ``count`` tasks wait at the gate; False on timeout."""
        with self._condition:
            return self._condition.wait_for(lambda: self._held >= count, timeout)

    def release(self) -> None:
        """Let held and future tasks of this core run; the gate is then gone."""
        self._runtime._remove_gate(self)
        self._released.set()

    def _pass(self, stop: threading.Event) -> None:
        with self._condition:
            self._held += 1
            self._condition.notify_all()
        try:
            while not self._released.wait(0.05):
                if stop.is_set():
                    return
        finally:
            with self._condition:
                self._held -= 1

    def __enter__(self) -> TaskGate:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@dataclasses.dataclass(eq=False)
class _Core:
    index: int
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    free_at: float = 0.0
    busy_time: float = 0.0
    tasks_started: int = 0
    tasks_completed: int = 0
    hung: bool = False
    failures: collections.deque[int] = dataclasses.field(default_factory=collections.deque)
    gate: TaskGate | None = None
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


@dataclasses.dataclass(eq=False)
class _Event:
    handle: int
    recorded: int = 0
    completed: int = 0


class _Stream:
    """A FIFO worker thread with its own position on the emulated timeline."""

    def __init__(self, runtime: EmulatedRuntime, handle: int) -> None:
        self.handle = handle
        self.clock = 0.0
        self.pending = 0
        self._runtime = runtime
        self._queue: queue.SimpleQueue[Callable[[_Stream], None] | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name=f"aiodla-emulated-stream-{handle}", daemon=True
        )
        self._thread.start()

    def enqueue(self, operation: Callable[[_Stream], None]) -> None:
        with self._idle:
            self.pending += 1
        self._queue.put(operation)

    def _run(self) -> None:
        while True:
            operation = self._queue.get()
            if operation is None:
                return
            try:
                if not self._runtime._stop.is_set():
                    operation(self)
            finally:
                with self._idle:
                    self.pending -= 1
                    if not self.pending:
                        self._idle.notify_all()

    def synchronize(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: not self.pending or self._runtime._stop.is_set())

    def stop(self) -> None:
        self._queue.put(None)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


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

    def __init__(
        self,
        cores: int = 2,
        *,
        copy_bandwidth: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(cores, int) or cores < 1:
            raise ConfigurationError(f"{cores=} must be an int >= 1")
        if copy_bandwidth is not None and not copy_bandwidth > 0:
            raise ConfigurationError(f"{copy_bandwidth=} must be > 0 bytes per second")
        self.copy_bandwidth = copy_bandwidth
        self._clock = clock
        self._cores = [_Core(index) for index in range(cores)]
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._ids = itertools.count(0x1000)
        self._devices: dict[int, _Device] = {}
        self._modules: dict[int, _Module] = {}
        self._streams: dict[int, _Stream] = {}
        self._events: dict[int, _Event] = {}
        self._device_memory: dict[int, np.ndarray[Any, Any]] = {}
        self._device_starts: list[int] = []
        self._next_address = 0x7F00_0000_0000
        self._host_memory: dict[int, HostBuffer] = {}
        self._poisoned: CudaCallError | None = None
        self._call_failures: list[_CallFailure] = []
        self._call_counts: collections.Counter[str] = collections.Counter()

    # -- test controls -------------------------------------------------------------------

    def fail_next_task(self, core: int, status: int = 0x40000001) -> None:
        """The next task to start on ``core`` fails with ``status`` (a cudlaStatus)."""
        self._core(core).failures.append(int(cudla.Status(int(status))))

    def hang_core(self, core: int, hung: bool = True) -> None:
        """Tasks on ``core`` hang until the device's task timeout, then fail with
        ``ERROR_DLA_ERR_ENGINE_TIMEOUT``; ``hung=False`` ends that for later tasks."""
        self._core(core).hung = hung

    def hold(self, core: int) -> TaskGate:
        """Hold every task of ``core`` before it starts, until the gate is released."""
        target = self._core(core)
        with self._lock:
            if target.gate is not None:
                return target.gate
            target.gate = TaskGate(self, core)
            return target.gate

    def _remove_gate(self, gate: TaskGate) -> None:
        with self._lock:
            if self._cores[gate.core].gate is gate:
                self._cores[gate.core].gate = None

    def poison(self, code: int = _EXTERNAL_DEVICE) -> None:
        """Poison the CUDA context: from now every CUDA call raises a sticky error."""
        self._poisoned = CudaCallError("(context)", code)

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
        if not hasattr(self, call):
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
        """Seconds of task time the core's timeline has accumulated."""
        return self._core(core).busy_time

    def core_tasks(self, core: int) -> int:
        """Tasks completed on ``core``."""
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

    def _new_handle(self) -> int:
        return next(self._ids)

    def _device(self, device: int) -> _Device:
        try:
            return self._devices[device]
        except KeyError:
            raise _reject("invalid_device", f"device handle {device:#x} is not live") from None

    def _stream(self, stream: int) -> _Stream:
        try:
            return self._streams[stream]
        except KeyError:
            raise CudaCallError("stream", _INVALID_HANDLE) from None

    def _device_range(self, ptr: int, nbytes: int, call: str) -> np.ndarray[Any, Any]:
        """The bytes ``[ptr, ptr + nbytes)`` of one live device allocation."""
        with self._lock:
            index = bisect.bisect_right(self._device_starts, ptr) - 1
            if index >= 0:
                start = self._device_starts[index]
                memory = self._device_memory[start]
                if ptr + nbytes <= start + memory.nbytes:
                    return memory[ptr - start : ptr - start + nbytes]
        raise CudaCallError(call, _INVALID_VALUE)

    # -- discovery -----------------------------------------------------------------------

    def version(self) -> int:
        return 1_002_001

    def device_count(self) -> int:
        return len(self._cores)

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
            handle = self._new_handle()
            self._devices[handle] = _Device(handle, target)
            return handle

    def destroy_device(self, device: int) -> None:
        with self._lock:
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
            handle = self._new_handle()
            self._modules[handle] = _Module(handle, target, model)
            target.module = handle
            return handle

    def _module(self, module: int) -> _Module:
        try:
            return self._modules[module]
        except KeyError:
            raise _reject("invalid_module", f"module {module:#x} is not loaded") from None

    def unload_module(self, module: int) -> None:
        with self._lock:
            loaded = self._module(module)
            if loaded.device.tasks_in_flight:
                raise _reject("invalid_param", f"unload of module {module:#x} with tasks in flight")
            del self._modules[module]
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
            target.registrations[registered] = (ptr, nbytes)
            return registered

    def mem_unregister(self, device: int, registered: int) -> None:
        target = self._device(device)
        with self._lock:
            if registered not in target.registrations:
                raise _reject("invalid_address", f"{registered:#x} is not registered here")
            if target.tasks_in_flight:
                raise _reject("invalid_param", "unregister while tasks are in flight")
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
            raise _reject_cuda()
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
        views_in = [self._registered_view(target, p, s) for p, s in zip(task.inputs, model.inputs)]
        views_out = [
            self._registered_view(target, p, s) for p, s in zip(task.outputs, model.outputs)
        ]
        queue_ = self._stream(stream)
        enqueued = self._clock()
        with self._lock:
            target.tasks_in_flight += 1

        def run_task(on: _Stream) -> None:
            self._run_task(target, model, views_in, views_out, on, enqueued)

        queue_.enqueue(run_task)

    def _registered_view(self, device: _Device, registered: int, spec: Any) -> np.ndarray[Any, Any]:
        if type(registered) is not int:
            raise _reject("invalid_address", f"tensor pointer {registered!r} is not an int")
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

    def _run_task(
        self,
        device: _Device,
        model: EmulatorModel,
        inputs: list[np.ndarray[Any, Any]],
        outputs: list[np.ndarray[Any, Any]],
        stream: _Stream,
        enqueued: float,
    ) -> None:
        core = device.core
        gate = core.gate
        released = 0.0
        if gate is not None:
            gate._pass(self._stop)
            released = self._clock()
        with core.lock:
            start = max(core.free_at, stream.clock, enqueued, released)
            status = core.failures.popleft() if core.failures else 0
            duration = model.latency
            if core.hung:
                duration, status = device.timeout, _STATUS_VALUES["engine_timeout"]
            end = start + duration
            core.free_at = end
            core.busy_time += duration
            core.tasks_started += 1
        if not status:
            run_model(model, inputs, outputs)
        delay = end - self._clock()
        if delay > 0:
            self._stop.wait(delay)
        stream.clock = end
        with self._lock:
            if status:
                device.last_error = status
            device.tasks_in_flight -= 1
            core.tasks_completed += 1

    def get_last_error(self, device: int) -> int:
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
            handle = self._new_handle()
            self._streams[handle] = _Stream(self, handle)
            return handle

    def destroy_stream(self, stream: int) -> None:
        # As cudaStreamDestroy: returns at once; queued work still runs to completion.
        with self._lock:
            target = self._streams.pop(stream, None)
        if target is None:
            raise CudaCallError("destroy_stream", _INVALID_HANDLE)
        target.stop()

    def synchronize_stream(self, stream: int) -> None:
        self._cuda("synchronize_stream")
        self._stream(stream).synchronize()
        if self._poisoned is not None:
            raise CudaCallError("synchronize_stream", self._poisoned.code)

    def create_event(self) -> int:
        self._cuda("create_event")
        with self._lock:
            handle = self._new_handle()
            self._events[handle] = _Event(handle)
            return handle

    def destroy_event(self, event: int) -> None:
        with self._lock:
            if self._events.pop(event, None) is None:
                raise CudaCallError("destroy_event", _INVALID_HANDLE)

    def record_event(self, event: int, stream: int) -> None:
        self._cuda("record_event")
        target = self._events.get(event)
        if target is None:
            raise CudaCallError("record_event", _INVALID_HANDLE)
        target.recorded += 1
        generation = target.recorded

        def complete(on: _Stream) -> None:
            target.completed = generation

        self._stream(stream).enqueue(complete)

    def query_event(self, event: int) -> bool:
        if self._poisoned is not None:
            raise CudaCallError("query_event", self._poisoned.code)
        target = self._events.get(event)
        if target is None:
            raise CudaCallError("query_event", _INVALID_HANDLE)
        return target.completed >= target.recorded

    def malloc(self, nbytes: int) -> int:
        self._cuda("malloc")
        if nbytes <= 0:
            raise CudaCallError("malloc", _INVALID_VALUE)
        with self._lock:
            address = self._next_address
            self._next_address += -(-nbytes // _DEVICE_ALIGNMENT) * _DEVICE_ALIGNMENT + _DEVICE_ALIGNMENT
            self._device_memory[address] = np.zeros(nbytes, dtype=np.uint8)
            bisect.insort(self._device_starts, address)
            return address

    def free(self, ptr: int) -> None:
        with self._lock:
            if ptr not in self._device_memory:
                raise CudaCallError("free", _INVALID_VALUE)
            for device in self._devices.values():
                if any(raw == ptr for raw, _ in device.registrations.values()):
                    raise CudaCallError("free", _INVALID_VALUE)
            del self._device_memory[ptr]
            self._device_starts.remove(ptr)

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
                raise CudaCallError("host_free", _INVALID_VALUE)

    def _host(self, buffer: HostBuffer, nbytes: int, call: str) -> np.ndarray[Any, Any]:
        if self._host_memory.get(buffer.ptr) is not buffer or nbytes > buffer.nbytes:
            raise CudaCallError(call, _INVALID_VALUE)
        return buffer.array[:nbytes]

    def _copy(self, dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any], stream: int) -> None:
        nbytes = dst.nbytes
        enqueued = self._clock()
        bandwidth = self.copy_bandwidth

        def copy(on: _Stream) -> None:
            on.clock = max(on.clock, enqueued)
            if bandwidth:
                on.clock += nbytes / bandwidth
                delay = on.clock - self._clock()
                if delay > 0:
                    self._stop.wait(delay)
            np.copyto(dst, src)

        self._stream(stream).enqueue(copy)

    def copy_to_device(self, dst: int, src: HostBuffer, nbytes: int, stream: int) -> None:
        self._cuda("copy_to_device")
        self._copy(
            self._device_range(dst, nbytes, "copy_to_device"),
            self._host(src, nbytes, "copy_to_device"),
            stream,
        )

    def copy_to_host(self, dst: HostBuffer, src: int, nbytes: int, stream: int) -> None:
        self._cuda("copy_to_host")
        self._copy(
            self._host(dst, nbytes, "copy_to_host"),
            self._device_range(src, nbytes, "copy_to_host"),
            stream,
        )

    def close(self) -> None:
        """Stop every stream worker; tasks sleeping on the timeline end at once."""
        self._stop.set()
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.stop()
        for stream in streams:
            stream.join(1.0)


def _reject_cuda() -> EmulatedCudlaError:
    return EmulatedCudlaError(cudla.Status(6), "the CUDA context is poisoned")


_CUDLA_CALLS = frozenset(
    {
        "create_device", "destroy_device", "load_module", "unload_module",
        "module_tensors", "mem_register", "mem_unregister", "submit_task",
        "get_last_error", "set_task_timeout",
    }
)
