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

Layers: ``_timeline`` places operations and serves the stream and event calls;
``_faults`` adds fault injection over it (:meth:`EmulatedRuntime.fail_next_task`,
:meth:`~EmulatedRuntime.hang_core`, :meth:`~EmulatedRuntime.hold`,
:meth:`~EmulatedRuntime.poison`, :meth:`~EmulatedRuntime.fail_call`);
``_compute_threads`` runs compute functions (:meth:`~EmulatedRuntime.bind_compute`,
:meth:`~EmulatedRuntime.take_compute_failure`); ``_emulated_graphs`` records a
capturing stream's calls and makes them again at each graph launch; this module adds
the cuDLA calls and memory, and owns the state they all share.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from cuda.bindings import cudla

from .._descriptors import TensorDescriptor
from .._errors import ConfigurationError, LoadableFormatError
from ..emulator._compute import ComputeFunction, ComputeTask
from ..emulator._format import EmulatorModel, parse_loadable, stated_latency
from ..emulator._ops import ModelRunner
from ._compute_threads import ComputeThreads, _ComputeWorker, compute_function
from ._emulated_conversion import EmulatedConversion
from ._emulated_graphs import EmulatedGraphs, records_stream_work
from ._faults import EmulatedCudlaError, TaskGate, _CallFailure, _reject
from ._protocol import CudaCallError, HostBuffer, TransferCounts
from ._timeline import (
    _INVALID_VALUE,
    _Core,
    _Device,
    _Event,
    _Operation,
    _Stream,
)

__all__ = ["EmulatedCudlaError", "EmulatedRuntime", "TaskGate"]

MAX_HANDLES_PER_CORE = 16  # cudla.h: at most 16 device handles per DLA
REGISTRATION_ALIGNMENT = 32
_REGISTERED_TAG = 1 << 56  # registered addresses differ from raw ones, as on a Jetson
_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation
_HOST_MEMORY_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


def _zeros(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.zeros(nbytes, dtype=np.uint8)


def _allocate(call: str, nbytes: int, padding: int = 0) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``nbytes`` (+ ``padding``) of zeroed host memory; when the host has none, the
    error the real ``cudaMalloc`` / ``cudaHostAlloc`` gives (the engine then names the
    tensor it was for)."""
    try:
        return _zeros(nbytes + padding)
    except MemoryError:
        raise CudaCallError(
            call, _MEMORY_ALLOCATION, detail=f"{nbytes} bytes asked for, more than is free"
        ) from None


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
    # (the runtime's ``_generation``): validation is then a comparison, not a search.
    resolved: tuple[int, int, EmulatorModel, ModelRunner | ComputeTask] | None = None


def _host_register(
    runtime: EmulatedRuntime, array: np.ndarray[Any, np.dtype[np.uint8]], mapped: bool = False
) -> HostBuffer:
    """``EmulatedRuntime.host_register``: page-lock memory the caller allocated
    (``cudaHostRegister``): the staging that ``isolation="process"`` shares between two
    processes; ``mapped``, with a device address as well (``cudaHostRegisterMapped``).
    Released with ``host_free``, which leaves the memory to its owner."""
    runtime._cuda("host_register")
    if array.nbytes <= 0:
        raise CudaCallError("host_register", _INVALID_VALUE)
    with runtime._lock:
        pointer = int(array.ctypes.data)
        if pointer in runtime._host_memory:  # registering twice is an error in CUDA
            raise CudaCallError("host_register", _HOST_MEMORY_ALREADY_REGISTERED)
        buffer = HostBuffer(pointer, array, runtime._map(array) if mapped else 0)
        runtime._host_memory[buffer.ptr] = buffer
    return buffer


@records_stream_work(
    copy_to_device=3,
    copy_to_host=3,
    pack=5,
    unpack=4,
    preprocess=6,
    record_event=1,
    wait_event=0,
)
class EmulatedRuntime(EmulatedGraphs, EmulatedConversion, ComputeThreads):
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
        compute: ComputeFunction | str | None = None,
        trust_compute: bool = False,
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
        self._ids: Iterator[int] = itertools.count(0x1000)
        self._devices: dict[int, _Device] = {}
        self._modules: dict[int, _Module] = {}
        self._streams: dict[int, _Stream] = {}
        self._retired: list[_Stream] = []  # destroyed streams whose work still runs
        self._events: dict[int, _Event] = {}
        self._recordings = {}  # streams capturing (see _emulated_graphs)
        self._graphs = {}
        self._device_memory: dict[int, np.ndarray[Any, Any]] = {}
        self._device_starts: list[int] = []
        self._next_address = 0x7F00_0000_0000
        self._host_memory: dict[int, HostBuffer] = {}
        self._poisoned: CudaCallError | None = None
        self._call_failures: list[_CallFailure] = []
        self._generation = 0  # bumped by every change to memory, registrations, modules
        self._ranges: dict[tuple[int, int], np.ndarray[Any, Any]] = {}
        self._compute = compute_function(compute)
        self.trust_compute = trust_compute
        self._bound_computes: dict[bytes, ComputeFunction] = {}
        self._compute_failures: dict[int, BaseException] = {}  # by stream handle
        self._workers: dict[int, _ComputeWorker] = {}  # by core index
        self._closing = False
        self.counts = TransferCounts()
        self._conversions: set[tuple[str, Any, np.dtype[Any]]] = set()
        self._frames: dict[Any, Any] = {}  # pre-processing prepared, by tensor
        self.device_time = 0.0
        """CPU seconds spent doing the emulated device's work (copies, tasks)."""
        self.invalid_releases = 0
        """Releases of handles that were not live (a double release, say): tests check 0."""

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
                "graphs": len(self._graphs),
            }

    def _device(self, device: int) -> _Device:
        try:
            return self._devices[device]
        except (KeyError, TypeError):
            raise _reject("invalid_device", f"device handle {device!r} is not live") from None

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
            if target.tasks_in_flight and self._poisoned is None:
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
        compute = self._module_compute(loadable, model)
        with self._lock:
            if target.module is not None:
                raise _reject("unsupported_operation", "one loadable per device handle")
            handle = next(self._ids)
            self._modules[handle] = _Module(handle, target, model, compute)
            self._changed()
            target.module = handle
            if compute is not None:
                self._compute_loaded(target.core.index)
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
            if loaded.device.tasks_in_flight and self._poisoned is None:
                raise _reject("invalid_param", f"unload of module {module:#x} with tasks in flight")
            del self._modules[module]
            self._changed()
            loaded.device.module = None
            if loaded.compute is not None:
                self._compute_unloaded(loaded.device.core.index)

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
            # A lost context never runs the tasks queued behind the fault: they hold
            # nothing, and the handles can go (as with the stand-in).
            if target.tasks_in_flight and self._poisoned is None:
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
        fifo = self._stream(stream, "submit_task")
        effect = self._task_effect(target, model, runner)  # type: ignore[arg-type]
        operation = _Operation(effect, target)
        computed = type(runner) is ComputeTask
        if computed:
            effect.compute, effect.stream = runner, stream  # type: ignore[assignment]
            # A failed or hung task writes no outputs: nothing to compute then.
            operation.computing = not effect.status
        with self._lock:
            target.tasks_in_flight += 1
            if target.core.gate is not None:
                target.core.gate._arrived()
        self._push(fifo, operation)
        if computed and operation.computing:
            with self._lock:  # the core's worker may be replaced meanwhile (a timeout)
                self._workers[target.core.index].put(fifo, operation, effect.compute)  # type: ignore[arg-type]

    def _resolve_task(
        self, target: _Device, task: _Task
    ) -> tuple[int, int, EmulatorModel, ModelRunner | ComputeTask]:
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
        runner: ModelRunner | ComputeTask
        if loaded.compute is not None:
            runner = ComputeTask(loaded.compute, model.inputs, model.outputs, views_in, views_out)
        else:
            runner = ModelRunner(model, views_in, views_out)
        return self._generation, target.handle, model, runner

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

    def malloc(self, nbytes: int) -> int:
        self._cuda("malloc")
        if nbytes <= 0:
            raise CudaCallError("malloc", _INVALID_VALUE)
        with self._lock:
            self.counts.allocations += 1
            return self._map(_allocate("malloc", nbytes))

    def free(self, ptr: int) -> None:
        with self._lock:
            if ptr not in self._device_memory:
                self._bad_release("free")
            for device in self._devices.values():
                if any(raw == ptr for raw, _ in device.registrations.values()):
                    raise CudaCallError("free", _INVALID_VALUE)
            self._unmap(ptr)
        self._released("free")

    def host_alloc(self, nbytes: int, mapped: bool = False) -> HostBuffer:
        self._cuda("host_alloc")
        if nbytes <= 0:
            raise CudaCallError("host_alloc", _INVALID_VALUE)
        # 64-byte aligned, as pinned pages are, so vectorized packing sees aligned rows.
        backing = _allocate("host_alloc", nbytes, padding=64)
        skip = -backing.ctypes.data % 64
        array = backing[skip : skip + nbytes]
        with self._lock:
            # Mapped: the same bytes also have a device address, as cudaHostAllocMapped
            # memory has, so conversions read and write them in place.
            buffer = HostBuffer(int(array.ctypes.data), array, self._map(array) if mapped else 0)
            self._host_memory[buffer.ptr] = buffer
            self.counts.allocations += 1
        return buffer

    host_register = _host_register  # (defined beside the class: it is long enough)

    def host_free(self, buffer: HostBuffer) -> None:
        with self._lock:
            if self._host_memory.pop(buffer.ptr, None) is None:
                self._bad_release("host_free")
            elif buffer.device_ptr:
                self._unmap(buffer.device_ptr)
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
        self.counts.copies_to_device += 1
        self.counts.bytes_to_device += nbytes
        target = self._device_range(dst, nbytes, "copy_to_device")
        self._copy(target, self._host(src, nbytes, "copy_to_device"), stream, "copy_to_device")

    def copy_to_host(self, dst: HostBuffer, src: int, nbytes: int, stream: int) -> None:
        self._cuda("copy_to_host")
        self.counts.copies_to_host += 1
        self.counts.bytes_to_host += nbytes
        source = self._device_range(src, nbytes, "copy_to_host")
        self._copy(self._host(dst, nbytes, "copy_to_host"), source, stream, "copy_to_host")

    def close(self) -> None:
        """Pending operations are simply dropped; compute threads end."""
        self._stop_compute_threads()
