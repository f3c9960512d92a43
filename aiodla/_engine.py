"""The engine: many concurrent ``await engine.infer(x)`` over DLA cores and stream rings.

Life of a request (DESIGN.md): validate the input; wait in the FIFO line; get a slot
(least-loaded core); pack into the slot's pinned buffer; enqueue copy-in, task,
copy-out and an event on the slot's stream; the poller sees the event and wakes the
loop; the loop checks the core's DLA status, unpacks fresh output arrays, returns the
slot (which starts the next waiter) and resolves the future.

Only the event loop's thread touches futures and scheduler state. The poller thread
reads events and schedules callbacks, nothing else.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import anyio
import numpy as np

from ._descriptors import TensorDescriptor
from ._errors import (
    AiodlaError,
    ConfigurationError,
    DeviceError,
    EngineClosedError,
    EngineDeadError,
    InputTypeError,
    InputValueError,
    ModelError,
    QueueFullError,
    RequestTimeoutError,
    TaskError,
    status_name,
)
from ._options import EngineOptions
from ._poller import Poller
from ._resources import ResourceStack
from ._scheduler import CoreState, Request, RequestState, Scheduler, Slot, TensorBinding
from ._statistics import (
    CoreStatistics,
    EngineHealth,
    EngineStatistics,
    HistogramRecorder,
    LatencyWindow,
    StageTimes,
)
from ._tensors import TensorSpec, specs_by_name
from .emulator._format import is_emulator_loadable, parse_loadable
from .runtime._protocol import CudaCallError, Runtime, cudla_status
from .runtime._select import select_runtime

__all__ = ["Engine", "EngineState"]

logger = logging.getLogger("aiodla")

# Until a core has completed tasks, poll as if one task took this long.
DEFAULT_SERVICE_TIME = 0.001
# How EngineStatistics.failures names the causes of failed requests.
FAILURE_REASONS = ("task", "device", "closed", "dead", "other")


class EngineState(enum.Enum):
    NEW = "new"
    OPENING = "opening"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class _Stage(enum.Enum):
    """What a request's coroutine must do next, when the loop hands work back to it."""

    PACK = "pack"
    UNPACK = "unpack"


ModelSource = str | os.PathLike[str] | bytes | bytearray | memoryview


class Engine:
    """Concurrent inference on DLA cores, shared by any number of coroutines.

    ``model`` is a loadable: a path, or its bytes. ``runtime`` is ``"auto"`` (the real
    cuDLA when present, else the emulated runtime for emulator loadables),
    ``"cuda"``, ``"emulated"``, or a :class:`~aiodla.runtime.Runtime` instance (which
    the engine then does not close). Other keywords are :class:`EngineOptions`.

    Use it as an async context manager::

        async with Engine("model.bin", cores=[0, 1]) as engine:
            y = await engine.infer(x)
    """

    def __init__(
        self,
        model: ModelSource,
        *,
        cores: Sequence[int] = (0, 1),
        streams_per_core: int = 2,
        runtime: str | Runtime = "auto",
        max_queue: int = 1024,
        task_timeout: float | None = None,
        close_timeout: float = 10.0,
        scales: Mapping[str, float] | None = None,
        offload_bytes: int | None = None,
        latency_window: int = 4096,
        max_consecutive_faults: int | None = None,
        probe_interval: float = 1.0,
        stage_times: bool = False,
    ) -> None:
        if not isinstance(model, (str, os.PathLike, bytes, bytearray, memoryview)):
            raise ConfigurationError(
                f"model must be a path or the loadable's bytes, got {type(model).__name__}"
            )
        extra = {} if offload_bytes is None else {"offload_bytes": offload_bytes}
        self._options = EngineOptions(
            cores=tuple(cores) if not isinstance(cores, int) else cores,  # type: ignore[arg-type]
            streams_per_core=streams_per_core,
            max_queue=max_queue,
            task_timeout=task_timeout,
            close_timeout=close_timeout,
            scales=dict(scales or {}),
            latency_window=latency_window,
            max_consecutive_faults=max_consecutive_faults,
            probe_interval=probe_interval,
            stage_times=stage_times,
            **extra,
        )
        self._model = model
        self._runtime_choice = runtime
        self._state = EngineState.NEW
        self._dead_cause: BaseException | None = None
        self._runtime: Runtime | None = None
        self._owns_runtime = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._resources = ResourceStack()
        self._cores: list[CoreState] = []
        self._slots: list[Slot] = []
        self._scheduler = Scheduler([])
        self._poller: Poller | None = None
        self._inputs: tuple[TensorSpec, ...] = ()
        self._outputs: tuple[TensorSpec, ...] = ()
        self._input_names: frozenset[str] = frozenset()
        self._offload_pack = False
        self._offload_unpack = False
        self._closed = asyncio.Event()
        self._open_done = asyncio.Event()
        self._closing: asyncio.Future[None] | None = None
        self._drained: asyncio.Event | None = None
        window = self._options.latency_window
        self._latency = LatencyWindow(window)
        self._queue_wait = LatencyWindow(window)
        self._latency_histogram = HistogramRecorder()
        self._queue_wait_histogram = HistogramRecorder()
        self._stage_windows = (
            (LatencyWindow(window), LatencyWindow(window), LatencyWindow(window))
            if self._options.stage_times
            else None
        )
        self._failures: dict[str, int] = dict.fromkeys(FAILURE_REASONS, 0)
        self._submitted = 0
        self._completed = 0
        self._failed = 0
        self._cancelled = 0
        self._timed_out = 0
        self._rejected = 0

    # -- public facts ---------------------------------------------------------------------

    @property
    def options(self) -> EngineOptions:
        return self._options

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        """The model's input tensors (known once the engine is open)."""
        return self._inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        """The model's output tensors (known once the engine is open)."""
        return self._outputs

    @property
    def runtime(self) -> Runtime | None:
        """The runtime in use (None before opening)."""
        return self._runtime

    @property
    def dead(self) -> bool:
        """True once the device broke the engine (see :class:`EngineDeadError`)."""
        return self._dead_cause is not None

    # -- opening ----------------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Open devices, modules, slots and the poller on every core.

        Blocking device work runs in a worker thread. If anything fails, everything
        created so far is released (in reverse order) and the error says what failed
        and where.

        Cancellation: the opening thread finishes what it started, then everything is
        released and the cancellation propagates; the engine ends closed.
        """
        if self._state is EngineState.CLOSED:
            raise EngineClosedError("Cannot reopen an engine once it has been closed.")
        if self._state is not EngineState.NEW:
            raise AiodlaError(f"the engine is {self._state.value}; open it once")
        self._state = EngineState.OPENING
        self._loop = asyncio.get_running_loop()
        try:
            await anyio.to_thread.run_sync(self._open_blocking)
            # The loop thread enqueues device work: the device must be current here too.
            self._call("make_current", self._runtime.make_current)  # type: ignore[union-attr]
        except BaseException:
            # Release in a thread of its own that a second cancellation cannot stop.
            await asyncio.shield(
                asyncio.ensure_future(anyio.to_thread.run_sync(self._release_blocking, ()))
            )
            self._state = EngineState.CLOSED
            self._closed.set()
            self._open_done.set()
            raise
        self._poller = Poller(
            self._runtime,  # type: ignore[arg-type]
            self._loop,
            self._on_completions,
            self._on_poller_failure,
            pause=getattr(self._runtime, "poll_pause", 0.0),
        )
        self._poller.start()
        self._state = EngineState.OPEN
        self._open_done.set()
        logger.debug("aiodla: opened %r", self)

    def _read_model(self) -> bytes:
        model = self._model
        if isinstance(model, (bytes, bytearray, memoryview)):
            data = bytes(model)
        else:
            try:
                with open(model, "rb") as file:
                    data = file.read()
            except OSError as exc:
                raise ModelError(f"cannot read model {os.fspath(model)!r}: {exc.strerror}") from exc
        if not data:
            raise ModelError("the model is empty (0 bytes)")
        return data

    def _open_blocking(self) -> None:
        data = self._read_model()
        runtime, owned = select_runtime(self._runtime_choice, data)
        self._runtime, self._owns_runtime = runtime, owned
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
        stated = parse_loadable(data).latency if is_emulator_loadable(data) else None
        reference: tuple[tuple[TensorDescriptor, ...], tuple[TensorDescriptor, ...]] | None = None
        for core_number in options.cores:
            core = CoreState(
                core_number,
                service_time=DEFAULT_SERVICE_TIME if stated is None else stated,
                learn_service_time=stated is None,
            )
            if options.stage_times:
                core.dla_times = LatencyWindow(options.latency_window)
                core.dla_histogram = HistogramRecorder()
            self._cores.append(core)
            where = f"core {core_number}"
            core.device = self._create(
                where, core_number, runtime.create_device, runtime.destroy_device, core_number
            )
            if options.task_timeout is not None:
                self._call(
                    f"core {core_number}: set_task_timeout",
                    runtime.set_task_timeout,
                    core.device,
                    max(1, round(options.task_timeout * 1000)),
                )
            core.module = self._create(
                where, core_number, runtime.load_module, runtime.unload_module, core.device, data
            )
            descriptors = self._call(
                f"core {core_number}: module_tensors", runtime.module_tensors, core.module
            )
            found = (tuple(descriptors[0]), tuple(descriptors[1]))
            if reference is None:
                reference = found
                self._set_specs(found)
            elif found != reference:
                raise ModelError(
                    f"core {core_number} reports other tensor descriptors than core "
                    f"{options.cores[0]}; the same loadable must describe the same tensors"
                )
            for index in range(options.streams_per_core):
                self._open_slot(core, index)
        self._scheduler = Scheduler(self._cores)

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
        self._inputs = tuple(s.with_scale(scales.get(s.name)) for s in inputs)
        self._outputs = tuple(s.with_scale(scales.get(s.name)) for s in outputs)
        self._input_names = frozenset(s.name for s in inputs)
        limit = self._options.offload_bytes
        self._offload_pack = sum(s.size for s in self._inputs) > limit
        self._offload_unpack = sum(s.size for s in self._outputs) > limit

    def _open_slot(self, core: CoreState, index: int) -> None:
        runtime = self._runtime
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
        bindings = []
        for spec in (*self._inputs, *self._outputs):
            what = f"{where} tensor {spec.name!r}"
            pointer = self._create(what, core.core, runtime.malloc, runtime.free, spec.size)
            registered = self._call(
                f"{what}: mem_register", runtime.mem_register, core.device, pointer, spec.size
            )
            self._resources.push(
                f"{what}: registration", core.core, runtime.mem_unregister, core.device, registered
            )
            host = self._create(what, core.core, runtime.host_alloc, runtime.host_free, spec.size)
            bindings.append(TensorBinding(spec, pointer, registered, host, spec.bind(host.array)))
        inputs, outputs = bindings[: len(self._inputs)], bindings[len(self._inputs) :]
        task = self._call(
            f"{where}: make_task",
            runtime.make_task,
            core.module,
            [b.registered for b in inputs],
            [b.registered for b in outputs],
        )
        slot = Slot(core, index, stream, event, task, inputs, outputs, timing=timing)
        core.slots.append(slot)
        core.idle.append(slot)
        self._slots.append(slot)

    def _call(self, what: str, call: Any, *args: Any) -> Any:
        """Run one device call while opening; failures name the call and where."""
        try:
            return call(*args)
        except AiodlaError:
            raise
        except CudaCallError as exc:
            raise DeviceError(
                f"opening the engine: {what} failed: {exc}", cuda_error=exc.code
            ) from exc
        except Exception as exc:
            status = cudla_status(exc)
            if status is None:
                raise
            detail = getattr(exc, "detail", None)  # the emulated runtime says what it caught
            raise DeviceError(
                f"opening the engine: {what} failed: {status_name(status)}"
                + (f" ({detail})" if detail else ""),
                status=status,
            ) from exc

    def _create(self, where: str, owner: int, create: Any, release: Any, *args: Any) -> Any:
        """Create one handle and remember how to release it."""
        what = f"{where}: {create.__name__}"
        handle = self._call(what, create, *args)
        self._resources.push(what, owner, release, handle)
        return handle

    def _release_blocking(self, keep: tuple[int, ...]) -> None:
        if self._runtime is not None and len(self._resources):
            try:
                self._runtime.make_current()
            except Exception as exc:  # a poisoned context: release what still can be
                logger.warning("aiodla: making the device current to close failed: %s", exc)
        failures = self._resources.release_all(keep)
        if failures:
            logger.warning("aiodla: %d release(s) failed while closing", len(failures))
        if self._owns_runtime and self._runtime is not None and not keep:
            self._runtime.close()

    # -- closing ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop admitting, let in-flight work finish (within ``close_timeout``), then
        release every handle in reverse order of creation. Idempotent.

        Queued requests fail with :class:`EngineClosedError` at once; in-flight ones that
        do not finish in time fail with it too. A core whose task never finished (hung)
        keeps its memory and device handle, since the DLA may still write there.

        Cancellation: closing runs in its own task; cancelling ``aclose`` stops the
        wait, not the close, and a later ``aclose`` waits for the same close.
        """
        if self._state is EngineState.NEW:
            self._state = EngineState.CLOSED
            self._closed.set()
            return
        if self._state is EngineState.OPENING:
            await asyncio.shield(self._open_done.wait())
        if self._closing is None:
            if self._state is EngineState.CLOSED:  # the open failed and cleaned up
                return
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    def _cancel_probes(self) -> None:
        for core in self._cores:
            if core.probe is not None:
                core.probe.cancel()
                core.probe = None

    async def _close(self) -> None:
        self._state = EngineState.CLOSING
        self._cancel_probes()
        for request in self._scheduler.drain():
            self._finish(
                request, error=EngineClosedError("the engine was closed while the request waited")
            )
        if not self.dead and self._scheduler.idle_slots < len(self._slots):
            self._drained = asyncio.Event()
            with anyio.move_on_after(self._options.close_timeout):
                await self._drained.wait()
        hung = tuple(sorted({s.core.core for s in self._slots if s not in s.core.idle}))
        for slot in self._slots:
            running = slot.request
            if running is not None and running.state is not RequestState.DONE:
                self._finish(
                    running,
                    error=EngineClosedError(
                        "the engine was closed before the DLA finished the request"
                    ),
                )
        poller = self._poller
        if poller is not None:
            poller.stop()
            await anyio.to_thread.run_sync(poller.join)
        if hung and not self.dead:
            logger.warning(
                "aiodla: core(s) %s still had tasks running at close; their memory "
                "and device handles are left allocated",
                hung,
            )
        await anyio.to_thread.run_sync(self._release_blocking, () if self.dead else hung)
        self._state = EngineState.CLOSED
        self._closed.set()
        logger.debug("aiodla: closed %r", self)

    def __del__(self, _warn: Any = warnings.warn) -> None:
        state = getattr(self, "_state", EngineState.CLOSED)
        if state in (EngineState.NEW, EngineState.CLOSED):
            return
        if self._poller is not None:
            self._poller.stop()
        _warn(
            f"unclosed engine {self!r}; use 'async with' or 'await engine.aclose()'",
            ResourceWarning,
            source=self,
        )

    # -- requests ---------------------------------------------------------------------------

    def _check_serving(self) -> asyncio.AbstractEventLoop:
        if self._dead_cause is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead_cause}") from self._dead_cause
        if self._state is not EngineState.OPEN:
            if self._state in (EngineState.NEW, EngineState.OPENING):
                raise EngineClosedError(
                    "the engine is not open; use 'async with Engine(...)' or 'await engine.open()'"
                )
            raise EngineClosedError("the engine is closed")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            raise AiodlaError("the engine belongs to another event loop than this call's")
        return loop

    def _prepare(self, inputs: Any) -> tuple[np.ndarray[Any, Any], ...]:
        specs = self._inputs
        if type(inputs) is np.ndarray and len(specs) == 1:
            spec = specs[0]
            if inputs.dtype == spec.numpy_dtype and inputs.shape == spec.shape:
                return (inputs,)  # the common case, valid as it stands
            return (spec.check_array(inputs),)
        if isinstance(inputs, Mapping):
            names = set(inputs)
            if names != self._input_names:
                missing = sorted(self._input_names - names)
                extra = sorted(map(str, names - self._input_names))
                parts = []
                if missing:
                    parts.append(f"missing {missing}")
                if extra:
                    parts.append(f"unknown {extra}")
                raise InputValueError(
                    f"inputs: {', '.join(parts)}; the model takes {[s.name for s in specs]}"
                )
            return tuple(spec.check_array(inputs[spec.name]) for spec in specs)
        if len(specs) != 1:
            raise InputTypeError(
                f"the model has {len(specs)} inputs {[s.name for s in specs]}: pass a "
                "mapping of name to array"
            )
        return (specs[0].check_array(inputs),)

    def check_inputs(self, inputs: Any) -> None:
        """Raise :class:`InputError` if ``inputs`` would be refused by :meth:`infer`,
        exactly as ``infer`` would (names, shapes, dtypes, NaN into integers)."""
        if not self._inputs:
            raise EngineClosedError("the engine is not open: its inputs are not known yet")
        self._prepare(inputs)

    async def wait_closed(self) -> None:
        """Wait until the engine is closed (by ``aclose``, or after a failed open).

        Cancellation: cancelling the wait has no effect on the engine.
        """
        await self._closed.wait()

    def _validate_timeout(self, timeout: float | None) -> None:
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or math.isnan(timeout)
            or timeout < 0
        ):
            raise ConfigurationError(f"timeout={timeout!r} must be seconds >= 0, or None")

    async def infer(self, inputs: Any, *, timeout: float | None = None, wait: bool = True) -> Any:
        """Run the model on ``inputs`` and return its output.

        ``inputs`` is an array for a single-input model, or a mapping of input name to
        array. Arrays have the tensor's logical NCHW shape; their dtype must cast
        safely to the tensor's (float arrays into integer tensors need a scale). The
        result is a fresh array for a single-output model, else a dict name → array.

        Bad input raises :class:`InputError` before anything is queued. ``timeout``
        (seconds) bounds the whole call with :class:`RequestTimeoutError`. When the queue
        holds ``max_queue`` requests, ``infer`` waits its turn; with ``wait=False`` it
        raises :class:`QueueFullError` instead.

        Cancellation: cancelling the call (or a timeout, ``asyncio.timeout``, an anyio
        cancel scope) while the request is queued removes it: it never reaches the DLA.
        Once submitted, a task cannot be recalled: the result is dropped, and the slot
        returns to the pool only when the DLA has finished with it.
        """
        loop = self._check_serving()
        arrays = self._prepare(inputs)
        if timeout is not None:
            self._validate_timeout(timeout)
        scheduler = self._scheduler
        if not wait and scheduler.waiting >= self._options.max_queue and not scheduler.idle_slots:
            self._rejected += 1
            raise QueueFullError(
                f"the admission queue is full ({scheduler.waiting} requests waiting, "
                f"max_queue={self._options.max_queue})"
            )
        request = Request(arrays, loop.create_future(), time.monotonic())
        self._submitted += 1
        if timeout is not None:
            request.deadline = loop.time() + timeout
            request.timer = loop.call_at(request.deadline, self._expire, request)
        scheduler.enqueue(request)
        if scheduler.idle_slots:
            self._transition()
        try:
            outcome = await request.future
            if outcome is _Stage.PACK:
                outcome = await self._pack_off_loop(request)
            if outcome is _Stage.UNPACK:
                outcome = await self._unpack_off_loop(request)
            return outcome
        except asyncio.CancelledError:
            self._abandon(request)
            raise
        finally:
            if request.timer is not None:
                request.timer.cancel()

    async def infer_nowait(self, inputs: Any, *, timeout: float | None = None) -> Any:
        """:meth:`infer` that raises :class:`QueueFullError` instead of waiting for room.

        Cancellation: as :meth:`infer`.
        """
        return await self.infer(inputs, timeout=timeout, wait=False)

    # -- the state transition -----------------------------------------------------------------

    def _transition(self) -> None:
        """Give idle slots to waiting requests; called after every submit, completion,
        cancellation and release."""
        if self._state is not EngineState.OPEN:
            return
        next_assignment = self._scheduler.next_assignment
        while (assignment := next_assignment()) is not None:
            self._start(*assignment)

    def _start(self, request: Request, slot: Slot) -> None:
        slot.request = request
        request.slot = slot
        now = time.monotonic()
        waited = now - request.started
        self._queue_wait.add(waited)
        self._queue_wait_histogram.add(waited)
        if request.deadline is not None and self._loop.time() >= request.deadline:  # type: ignore[union-attr]
            self._release(slot)
            self._finish(request, timed_out=True)
            return
        if self._offload_pack:
            request.state = RequestState.PACKING
            request.future.set_result(_Stage.PACK)
            return
        try:
            for binding, array in zip(slot.inputs, request.arrays, strict=True):
                binding.bound.write(array, checked=True)
        except Exception as exc:  # validated already: a failure here is a bug, kept local
            self._release(slot)
            self._finish(request, error=AiodlaError(f"packing the input failed: {exc}"))
            return
        self._enqueue(slot, request, now)

    def _enqueue(self, slot: Slot, request: Request | None, now: float | None = None) -> None:
        runtime = self._runtime
        assert runtime is not None
        stream = slot.stream
        core = slot.core
        timing = slot.timing
        try:
            if timing is not None:
                runtime.record_event(timing[0], stream)
            for binding in slot.inputs:
                runtime.copy_to_device(binding.device_ptr, binding.host, binding.spec.size, stream)
            if timing is not None:
                runtime.record_event(timing[1], stream)
            runtime.submit_task(core.device, slot.task, stream)
            if timing is not None:
                runtime.record_event(timing[2], stream)
            for binding in slot.outputs:
                runtime.copy_to_host(binding.host, binding.device_ptr, binding.spec.size, stream)
            runtime.record_event(slot.event, stream)
        except Exception as exc:
            self._enqueue_failed(slot, request, exc)
            return
        if now is None:
            now = time.monotonic()
        slot.submitted_at = now
        core.expected_free = max(now, core.expected_free) + core.service_time
        slot.expected_done = core.expected_free
        if request is not None:
            request.state = RequestState.IN_FLIGHT
        self._poller.watch(slot)  # type: ignore[union-attr]

    def _enqueue_failed(self, slot: Slot, request: Request | None, exc: Exception) -> None:
        if isinstance(exc, CudaCallError) and exc.sticky:
            self._die(exc)
            return
        status = cudla_status(exc)
        where = f"core {slot.core.core}"
        if status is not None:
            error: AiodlaError = DeviceError(
                f"{where}: submitting the request failed: {status_name(status)}", status=status
            )
        elif isinstance(exc, CudaCallError):
            error = DeviceError(
                f"{where}: submitting the request failed: {exc}", cuda_error=exc.code
            )
        else:
            error = AiodlaError(f"{where}: submitting the request failed: {exc!r}")
        error.__cause__ = exc
        if request is not None:
            self._finish(request, error=error)
        else:
            logger.warning("aiodla: %s", error)
        if slot.probing:  # the probe never ran: try again later
            slot.probing = False
            self._schedule_probe(slot.core)
        # Some copies may be queued on the stream already: the slot is reusable only
        # after they ran, so mark the stream's end and let the poller return the slot.
        slot.request = None
        try:
            self._runtime.record_event(slot.event, slot.stream)  # type: ignore[union-attr]
        except Exception as record_error:
            logger.error("aiodla: %r retired: %s", slot, record_error)
            return
        slot.submitted_at = slot.expected_done = time.monotonic()
        self._poller.watch(slot)  # type: ignore[union-attr]

    # -- completions (loop thread, one call per poller sweep) -----------------------------------

    def _on_completions(self, finished: list[tuple[Slot, int]]) -> None:
        """Slots the poller saw done, each with its core's cuDLA status read then."""
        if self._state is EngineState.CLOSED:
            return  # a late wake-up after close: nothing is left to touch
        try:
            self._handle_completions(finished)
        finally:
            # After the callers this batch woke took their step (see _after_batch).
            self._loop.call_soon(self._after_batch)  # type: ignore[union-attr]

    def _after_batch(self) -> None:
        """The loop is free again: take what finished meanwhile at once if several
        tasks should have, else hand polling back (see the poller's module docstring)."""
        poller = self._poller
        if poller is None or self._state is EngineState.CLOSED:
            return
        try:
            finished = poller.harvest()
        except Exception as exc:  # as from the poller's own sweep: the engine is dead
            self._die(exc)
            return
        if finished:
            self._on_completions(finished)  # which schedules _after_batch again
        else:
            poller.consumed()

    def _handle_completions(self, finished: list[tuple[Slot, int]]) -> None:
        now = time.monotonic()
        for slot, status in finished:
            core = slot.core
            request = slot.request
            if request is not None or slot.probing:  # a task ran (not a recycled slot)
                self._account_task(slot, status, now)
            if slot.probing:
                slot.probing = False
                self._release(slot)
                self._probe_done(core, status)
                continue
            if request is None or request.future.done():
                self._release(slot)
                continue
            if status:
                self._release(slot)
                self._finish(
                    request,
                    error=TaskError(
                        f"the DLA task failed on core {core.core}: {status_name(status)}",
                        status=status,
                        core=core.core,
                    ),
                )
                continue
            if self._offload_unpack:
                request.state = RequestState.UNPACKING
                request.future.set_result(_Stage.UNPACK)
                continue
            outputs = self._unpack(slot)
            self._release(slot)
            self._finish(request, result=outputs, now=now)
        self._transition()

    def _account_task(self, slot: Slot, status: int, now: float) -> None:
        """Count one finished DLA task: busy time, stage times, the fault policy."""
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
        if not status:
            core.completed += 1
            core.consecutive_failures = 0
            if core.learn_service_time and spanned:
                core.observed.append(elapsed)
                core.service_time = min(core.observed)
            return
        core.failed += 1
        core.consecutive_failures += 1
        logger.warning(
            "aiodla: a DLA task failed on core %d: %s (%d in a row)",
            core.core,
            status_name(status),
            core.consecutive_failures,
        )
        limit = self._options.max_consecutive_faults
        if (
            limit is not None
            and core.in_rotation
            and core.consecutive_failures >= limit
            and any(other.in_rotation for other in self._cores if other is not core)
        ):
            core.in_rotation = False
            logger.warning(
                "aiodla: core %d is out of rotation after %d consecutive faults; "
                "probing it every %g s",
                core.core,
                core.consecutive_failures,
                self._options.probe_interval,
            )
            self._schedule_probe(core)

    def _record_stages(self, slot: Slot) -> None:
        assert slot.timing is not None
        assert self._stage_windows is not None
        runtime = self._runtime
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
        for window, seconds in zip(self._stage_windows, stages, strict=True):
            window.add(seconds)
        core = slot.core
        if core.dla_times is not None and core.dla_histogram is not None:
            core.dla_times.add(stages[1])
            core.dla_histogram.add(stages[1])

    # -- the fault policy: probing a core out of rotation ------------------------------------

    def _schedule_probe(self, core: CoreState) -> None:
        assert self._loop is not None
        core.probe = self._loop.call_later(self._options.probe_interval, self._probe, core)

    def _probe(self, core: CoreState) -> None:
        """Run one task on a core out of rotation; success brings it back."""
        core.probe = None
        if self._state is not EngineState.OPEN or self.dead or core.in_rotation:
            return
        if not core.idle:  # its slots are still busy (a hung task): try again later
            self._schedule_probe(core)
            return
        slot = self._scheduler.take(core)
        slot.probing = True
        for binding in slot.inputs:
            binding.bound.write(np.zeros(binding.spec.shape, binding.spec.numpy_dtype))
        logger.info("aiodla: probing core %d", core.core)
        self._enqueue(slot, None)

    def _probe_done(self, core: CoreState, status: int) -> None:
        if status:
            self._schedule_probe(core)
            return
        core.in_rotation = True
        core.consecutive_failures = 0
        logger.warning("aiodla: core %d is back in rotation (a probe task succeeded)", core.core)

    def _unpack(self, slot: Slot) -> Any:
        outputs = slot.outputs
        if len(outputs) == 1:
            return outputs[0].bound.read()
        return {b.spec.name: b.bound.read() for b in outputs}

    def _release(self, slot: Slot) -> None:
        """Return ``slot`` to the pool (the caller runs the transition afterwards)."""
        request = slot.request
        if request is not None:
            request.slot = None
        self._scheduler.release(slot)
        if self._drained is not None and self._scheduler.idle_slots == len(self._slots):
            self._drained.set()

    def _finish(
        self,
        request: Request,
        *,
        result: Any = None,
        error: BaseException | None = None,
        timed_out: bool = False,
        now: float | None = None,
    ) -> BaseException | None:
        """Deliver the request's one outcome, count it, and return the error delivered."""
        if request.state is RequestState.DONE:
            return None
        request.state = RequestState.DONE
        request.arrays = ()
        future = request.future
        if timed_out:
            self._timed_out += 1
            error = RequestTimeoutError("the request's timeout passed before its result was ready")
        elif error is not None:
            self._failed += 1
            self._failures[_failure_reason(error)] += 1
        else:
            self._completed += 1
            latency = (time.monotonic() if now is None else now) - request.started
            self._latency.add(latency)
            self._latency_histogram.add(latency)
        if not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        return error

    def _expire(self, request: Request) -> None:
        request.timer = None
        if request.state is RequestState.QUEUED:
            self._scheduler.discard(request)
            self._finish(request, timed_out=True)
        elif request.state is RequestState.IN_FLIGHT:
            self._finish(request, timed_out=True)
        # A request packing or unpacking in a worker thread checks its deadline itself.

    def _abandon(self, request: Request) -> None:
        """The request's coroutine was cancelled: drop it, pass on a slot it holds."""
        state = request.state
        if state is RequestState.DONE:
            return
        slot = request.slot
        if state in (RequestState.PACKING, RequestState.UNPACKING) and slot is not None:
            self._release(slot)
        request.state = RequestState.DONE
        if state is RequestState.QUEUED:
            self._scheduler.discard(request)
        request.arrays = ()
        self._cancelled += 1
        self._transition()

    # -- large tensors: pack and unpack in a worker thread ---------------------------------------

    async def _pack_off_loop(self, request: Request) -> Any:
        slot = request.slot
        assert slot is not None

        def pack() -> None:
            for binding, array in zip(slot.inputs, request.arrays, strict=True):
                binding.bound.write(array, checked=True)

        try:
            await anyio.to_thread.run_sync(pack)
        except asyncio.CancelledError:
            raise  # _abandon passes the slot on
        except Exception as exc:
            self._release(slot)
            error = self._finish(request, error=AiodlaError(f"packing the input failed: {exc}"))
            self._transition()
            raise error from exc  # type: ignore[misc]
        loop = self._loop
        assert loop is not None
        if (
            self._state is not EngineState.OPEN
            or self._dead_cause is not None
            or (request.deadline is not None and loop.time() >= request.deadline)
        ):
            self._release(slot)
            if self._state is EngineState.OPEN and self._dead_cause is None:
                error = self._finish(request, timed_out=True)
            else:
                error = self._finish(request, error=self._not_serving_error())
            self._transition()
            raise error  # type: ignore[misc]
        request.future = loop.create_future()
        self._enqueue(slot, request)
        return await request.future

    async def _unpack_off_loop(self, request: Request) -> Any:
        slot = request.slot
        assert slot is not None
        try:
            result = await anyio.to_thread.run_sync(self._unpack, slot)
        except asyncio.CancelledError:
            raise  # _abandon passes the slot on
        self._release(slot)
        self._finish(request, result=result)
        self._transition()
        return result

    def _not_serving_error(self) -> AiodlaError:
        if self._dead_cause is not None:
            error = EngineDeadError(f"the engine is dead: {self._dead_cause}")
            error.__cause__ = self._dead_cause
            return error
        return EngineClosedError("the engine was closed")

    # -- death ---------------------------------------------------------------------------------

    def _on_poller_failure(self, cause: BaseException) -> None:
        self._die(cause)

    def _die(self, cause: BaseException) -> None:
        """The device broke: fail every waiting and in-flight request, refuse new ones."""
        if self._dead_cause is not None or self._state is EngineState.CLOSED:
            return
        self._dead_cause = cause
        logger.error("aiodla: engine dead: %s; restart the process to use the DLA again", cause)
        self._cancel_probes()
        for waiting in self._scheduler.drain():
            self._finish(waiting, error=self._not_serving_error())
        for slot in self._slots:
            running = slot.request
            if running is not None and running.state is not RequestState.DONE:
                self._finish(running, error=self._not_serving_error())
        if self._drained is not None:
            self._drained.set()

    # -- observation ---------------------------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        """A snapshot of counts, per-core figures, latency percentiles and histograms."""
        now = time.monotonic()
        cores = tuple(
            CoreStatistics(
                core=core.core,
                completed=core.completed,
                failed=core.failed,
                in_flight=core.outstanding,
                busy_slots=len(core.slots) - len(core.idle),
                idle_slots=len(core.idle),
                busy_time=core.busy_time,
                busy_fraction=core.busy_window.fraction(now),
                in_rotation=core.in_rotation,
                consecutive_failures=core.consecutive_failures,
                dla_time=None if core.dla_times is None else core.dla_times.summary(),
                dla_histogram=None if core.dla_histogram is None else core.dla_histogram.snapshot(),
            )
            for core in self._cores
        )
        stages = None
        if self._stage_windows is not None:
            copy_in, dla, copy_out = (window.summary() for window in self._stage_windows)
            stages = StageTimes(copy_in, dla, copy_out)
        state = "dead" if self.dead and self._state is not EngineState.CLOSED else self._state.value
        return EngineStatistics(
            state=state,
            submitted=self._submitted,
            completed=self._completed,
            failed=self._failed,
            cancelled=self._cancelled,
            timed_out=self._timed_out,
            rejected=self._rejected,
            queued=self._scheduler.waiting,
            in_flight=sum(core.outstanding for core in self._cores),
            cores=cores,
            latency=self._latency.summary(),
            queue_wait=self._queue_wait.summary(),
            latency_histogram=self._latency_histogram.snapshot(),
            queue_wait_histogram=self._queue_wait_histogram.snapshot(),
            failures=MappingProxyType(dict(self._failures)),
            stages=stages,
        )

    def health(self) -> EngineHealth:
        """``ok``; ``degraded`` with a core out of rotation; ``dead`` once the device
        broke the engine (restart the process); ``closed`` when not serving."""
        if self._dead_cause is not None:
            return EngineHealth("dead", f"the device broke the engine: {self._dead_cause}")
        if self._state is not EngineState.OPEN:
            return EngineHealth("closed", f"the engine is {self._state.value}")
        out = tuple(core.core for core in self._cores if not core.in_rotation)
        if out:
            serving = [core.core for core in self._cores if core.in_rotation]
            return EngineHealth(
                "degraded",
                f"core(s) {list(out)} out of rotation after repeated task faults; "
                f"core(s) {serving} serve every request",
                out,
            )
        return EngineHealth("ok", f"serving on core(s) {[core.core for core in self._cores]}")

    def __repr__(self) -> str:
        state = "dead" if self.dead else self._state.value
        if not self._cores:
            return f"<Engine {state}>"
        busy = sum(len(c.slots) - len(c.idle) for c in self._cores)
        idle = sum(len(c.idle) for c in self._cores)
        in_flight = sum(c.outstanding for c in self._cores)
        return (
            f"<Engine {state} [cores {len(self._cores)}: {busy} busy slots, {idle} idle | "
            f"{in_flight} in flight, {self._scheduler.waiting} queued]>"
        )


def _failure_reason(error: BaseException) -> str:
    """The ``EngineStatistics.failures`` key for an error a request failed with."""
    if isinstance(error, TaskError):
        return "task"
    if isinstance(error, DeviceError):
        return "device"
    if isinstance(error, EngineClosedError):
        return "closed"
    if isinstance(error, EngineDeadError):
        return "dead"
    return "other"
