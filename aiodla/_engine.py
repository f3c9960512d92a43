"""The engine: lifecycle, ``infer``, and the futures of many concurrent requests.

One request, through the modules in the order it passes them::

    _engine        Engine.infer: validate the input, Scheduler.admit, await the future
    _flow          Flow.transition, the dispatcher's assign: a slot of the core that
    _dispatch        holds least for a lone engine (by priority, weight and the depth
                     rule across the engines of shared cores), paired with the first
    _scheduler       waiting request (FIFO)
    _local_device  LocalDevice.write_inputs, .submit: copies, task, event on the stream
    runtime        the cuDLA and CUDA calls (or the emulated runtime's)
    _poller        its thread sees the event: one call_soon_threadsafe per batch
    _flow          Flow.on_completions: LocalDevice.account, Dispatcher.task_ended
                   (fault policy), LocalDevice.read_outputs, Dispatcher.release,
                   Scheduler.finish, the future resolved

The engine owns the lifecycle (open, close, death), the public calls and the
statistics; it decides nothing about a request and calls no runtime. Only the event
loop's thread touches futures and scheduler state; the poller thread reads events and
schedules callbacks, nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from ._batching import Batcher, Item, open_batcher
from ._data_path import release_sources
from ._device import CompletionSource, DeviceLayer, NotOpen
from ._device_arrays import DeviceSource, is_device_array
from ._errors import (
    AiodlaError,
    ConfigurationError,
    EngineClosedError,
    EngineDeadError,
    InputValueError,
    QueueFullError,
)
from ._flow import Flow
from ._isolation import open_remote
from ._life import EngineState, Life
from ._local_device import open_local_device
from ._observation import engine_statistics
from ._offload import drive
from ._options import EngineKeywords, EngineOptions, check_timeout
from ._preprocess import ImagePreprocess, video_frame_pixels
from ._scheduler import Request
from ._shared_cores import Cores, shared_cores
from ._statistics import (
    EngineHealth,
    EngineStatistics,
)
from ._tensors import TensorSpec, inputs_in_order
from ._trace import TraceFile, engine_trace
from ._video_frame import VideoFrame
from .runtime._protocol import Runtime

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Engine", "EngineState"]

logger = logging.getLogger("aiodla")


ModelSource = str | os.PathLike[str] | bytes | bytearray | memoryview


class Engine:
    """Concurrent inference on DLA cores, shared by any number of coroutines.

    ``model`` is a loadable: a path, or its bytes. ``runtime`` is ``"auto"`` (the real
    cuDLA when present, else the emulated runtime for emulator loadables), ``"cuda"``,
    ``"emulated"``, or a :class:`~aiodla.runtime.Runtime` (which the engine does not
    close). Every other keyword is typed by :class:`EngineKeywords`: see EngineOptions.

    Use it as an async context manager::

        async with Engine("model.bin", cores=[0, 1]) as engine:
            y = await engine.infer(x)
    """

    def __init__(
        self,
        model: ModelSource,
        *,
        runtime: str | Runtime = "auto",
        **options: Unpack[EngineKeywords],
    ) -> None:
        if not isinstance(model, (str, os.PathLike, bytes, bytearray, memoryview)):
            raise ConfigurationError(
                f"model must be a path or the loadable's bytes, got {type(model).__name__}"
            )
        keywords, self._shared = shared_cores(dict(options), runtime)
        self._options = EngineOptions.from_keywords(keywords)
        # The cores it runs on: the shared ones, or (a lone engine) a private Cores,
        # opened and closed with it (as an HTTP client makes its own pool).
        self._dla = Cores.private(self._options.cores) if self._shared is None else self._shared
        self._model = model
        self._runtime_choice = runtime
        self._life = Life()  # the one record of its life: the flow reads it, only this writes
        self._device: DeviceLayer = NotOpen()
        self._flow: Flow | None = None
        self._batcher: Batcher | None = None  # with batch=: single items' assembly
        self._input_names: frozenset[str] = frozenset()
        self._closed = asyncio.Event()
        self._open_done = asyncio.Event()
        self._closing: asyncio.Future[None] | None = None
        self._trace: TraceFile | None = None  # Engine(trace=path): from open to close

    # -- public facts ---------------------------------------------------------------------

    @property
    def options(self) -> EngineOptions:
        return self._options

    @property
    def state(self) -> EngineState:
        return self._life.state

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        """The model's input tensors (known once the engine is open)."""
        return self._device.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        """The model's output tensors (known once the engine is open)."""
        return self._device.outputs

    @property
    def runtime(self) -> Runtime:
        """The runtime in use, chosen at open (before that, EngineClosedError says so)."""
        return self._device.runtime

    @property
    def stated_service_time(self) -> float | None:
        """Seconds a task as an emulator loadable states it (once open); None: learned."""
        return self._device.stated_service_time

    @property
    def shared_cores(self) -> Cores | None:
        """The :class:`aiodla.Cores` the engine shares with others, if any."""
        return self._shared

    @property
    def dead(self) -> bool:
        """True once the device broke the engine (see :class:`EngineDeadError`)."""
        return self._life.dead_cause is not None

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
        life = self._life
        if life.state is EngineState.CLOSED:
            raise EngineClosedError("Cannot reopen an engine once it has been closed.")
        if life.state is not EngineState.NEW:
            raise AiodlaError(f"the engine is {life.state.value}; open it once")
        life.state = EngineState.OPENING
        options = self._options
        isolated = options.process_isolation is not None
        opened: list[DeviceLayer] = []
        dla = self._dla
        loop = asyncio.get_running_loop()
        try:  # (an opening leaves nothing open when it raises)
            trace = TraceFile.of(options, self._model)  # (a bad path fails here, first)
            if dla.is_private:
                await dla.open()
            # (closing the shared cores waits for this open)
            dla.attach(self, None if isolated else self._die)
            choice = self._runtime_choice  # (its own cores': its device layer makes it)
            if not dla.is_private:
                choice = await dla.runtime_for(self._model, options)
            # Its lanes share the physical cores' records, which the Cores holds.
            if isolated:
                remote = await open_remote(self._model, choice, options, dla.records)
                opened.append(remote)
                cores: DeviceLayer = remote

                def from_worker(flow: Flow) -> CompletionSource:
                    return remote.start(loop, flow, self._die)

                completions: Callable[[Flow], CompletionSource] = from_worker

            else:
                local = await open_local_device(self._model, choice, options, dla.records)
                opened.append(local)
                cores = local
                completions = dla.poller_share(local.runtime, local.lanes, options.priority)
            postprocess = cores.postprocess  # (matched to the model once, as it opened)
            self._batcher = open_batcher(
                options.batch,
                cores,
                self.infer,
                options.casting,
                max_queue=options.max_queue,
                latency_window=options.latency_window,
                postprocess=postprocess,
                preprocess=options.preprocess,
            )
        except BaseException:
            await _release(opened)
            dla.detach(self)
            if dla.is_private:
                await dla.aclose()
            life.state = EngineState.CLOSED
            self._closed.set()
            self._open_done.set()
            raise
        self._device = cores
        self._input_names = frozenset(s.name for s in cores.inputs)
        life.state = EngineState.OPEN
        self._flow = Flow(options, cores, life, loop, self._die, dla.dispatcher, completions)
        self._trace = trace and trace.start(self._flow)
        self._open_done.set()
        logger.debug("aiodla: opened %r", self)

    # -- closing ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop admitting, let in-flight work finish (within ``close_timeout``), then
        release every handle in reverse order of creation. Idempotent.

        Queued requests fail with :class:`EngineClosedError` at once; in-flight ones that
        do not finish in time fail with it too. A core whose task never finished (hung)
        keeps its memory and device handles, since the DLA may still write there.

        Cancellation: closing runs in its own task; cancelling ``aclose`` stops the
        wait, not the close, and a later ``aclose`` waits for the same close.
        """
        life = self._life
        if life.state is EngineState.NEW:
            life.state = EngineState.CLOSED
            self._closed.set()
            return
        if life.state is EngineState.OPENING:
            await asyncio.shield(self._open_done.wait())
        if self._closing is None:
            if life.state is EngineState.CLOSED:  # the open failed and cleaned up
                return
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        self._life.state = EngineState.CLOSING
        flow = self._flow
        assert flow is not None  # (open: it was built when the engine opened)
        flow.cancel_probes()
        batcher = self._batcher
        if batcher is not None:  # its waiting items fail; its tasks end as requests do
            batcher.close()
        flow.fail_waiting(EngineClosedError("the engine was closed while the request waited"))
        slots = self._device.slots
        if not self.dead:
            await flow.drain(self._options.close_timeout)
        hung = tuple(sorted({s.core.core for s in slots if s not in s.core.idle}))
        flow.fail_running(EngineClosedError("the engine was closed before the DLA finished"))
        if batcher is not None:
            await batcher.finished()
        poller = flow.poller
        poller.stop()
        await anyio.to_thread.run_sync(poller.join)
        dla = self._dla
        if dla.is_private:  # its poller thread ends before the handles it queries go
            dla.detach(self)
            await dla.aclose()
        if hung and not self.dead:
            logger.warning(
                "aiodla: core(s) %s still had tasks running at close; their memory "
                "and device handles are released when those tasks end",
                hung,
            )
        await anyio.to_thread.run_sync(self._device.release, () if self.dead else hung)
        self._life.state = EngineState.CLOSED  # a late poller wake-up is ignored from here
        # The engine's count of busy slots ends with it; a hung core keeps its memory,
        # not its requests.
        for slot in slots:
            if slot not in slot.core.idle:
                flow.dispatcher.release(flow.client, slot)
        flow.leave()
        dla.detach(self)
        await _closed_with(self._trace, flow, self._closed)
        logger.debug("aiodla: closed %r", self)

    def __del__(self, _warn: Any = warnings.warn) -> None:
        life = getattr(self, "_life", None)
        if life is None or life.state in (EngineState.NEW, EngineState.CLOSED):
            return
        self._device.abandon()  # a worker process is killed and reaped at once
        dla = getattr(self, "_dla", None)
        if dla is not None and dla.is_private:
            dla.abandon()  # its poller thread stops
        _warn(
            f"unclosed engine {self!r}; use 'async with' or 'await engine.aclose()'",
            ResourceWarning,
            source=self,
        )

    async def wait_closed(self) -> None:
        """Wait until the engine is closed (by ``aclose``, or after a failed open).

        Cancellation: cancelling the wait has no effect on the engine.
        """
        await self._closed.wait()

    def _die(self, cause: BaseException) -> None:
        """The device broke: fail every waiting and in-flight request, refuse new ones."""
        life = self._life
        if life.dead_cause is not None or life.state is EngineState.CLOSED:
            return
        life.dead_cause = cause
        if life.state is EngineState.OPEN:
            life.state = EngineState.DEAD
        logger.error("aiodla: engine dead: %s; restart the process to use the DLA again", cause)
        if self._flow is not None:
            self._flow.fail_all()
        if self._shared is not None:  # one CUDA context under the shared cores
            self._shared.context_lost(self, cause)

    # -- requests ---------------------------------------------------------------------------

    def check_inputs(self, inputs: Any) -> None:
        """Raise :class:`InputError` if ``inputs`` would be refused by :meth:`infer`,
        exactly as ``infer`` would (names, shapes, dtypes, NaN into integers)."""
        if not self._device.inputs:
            raise EngineClosedError("the engine is not open: its inputs are not known yet")
        release_sources([a for a in self._validated(inputs) if isinstance(a, DeviceSource)])

    async def infer(
        self,
        inputs: Any,
        *,
        timeout: float | None = None,
        wait: bool = True,
        output: str = "host",
    ) -> Any:
        """Run the model on ``inputs`` and return its output.

        ``inputs`` is an array for a single-input model, or a mapping of input name to
        array. Arrays have the tensor's logical NCHW shape; their dtype must cast
        safely to the tensor's (float arrays into integer tensors need a scale). With
        device conversion (``Engine(convert=...)``), an array may also live on the GPU:
        any object that exports DLPack on a CUDA device or ``__cuda_array_interface__``
        (a torch CUDA tensor, a CuPy array), read where it lies, in any strides. The
        result is a fresh array for a single-output model, else a dict name → array;
        ``output="device"`` returns :class:`DeviceTensor` instead: GPU memory that
        ``torch.from_dlpack`` and ``cupy.from_dlpack`` take without a copy (host
        memory with the same interface on a runtime without GPU memory).

        Bad input raises :class:`InputError` before anything is queued. ``timeout``
        (seconds) bounds the whole call with :class:`RequestTimeoutError`. When the queue
        holds ``max_queue`` requests, ``infer`` waits its turn; with ``wait=False`` it
        raises :class:`QueueFullError` instead, as :meth:`infer_nowait` does.

        Cancellation: cancelling the call (or a timeout, ``asyncio.timeout``, an anyio
        cancel scope) while the request is queued removes it: it never reaches the DLA.
        Once submitted, a task cannot be recalled: the result is dropped, and the slot
        returns to the pool only when the DLA has finished with it.
        """
        admitted = self._admit(inputs, timeout, wait, output)
        if isinstance(admitted, Item):
            return await admitted.result()
        return await drive(*admitted)

    def infer_nowait(
        self, inputs: Any, *, timeout: float | None = None, output: str = "host"
    ) -> asyncio.Future[Any]:
        """Admit a request now or raise :class:`QueueFullError` at once; return a future
        of its result (like ``asyncio.Queue.put_nowait``, it never waits).

        Call it from the engine's event loop. Bad input raises :class:`InputError` here,
        before anything is queued.

        Cancellation: cancelling the returned future is cancelling the request, as for
        :meth:`infer`: removed if still queued, its result dropped once submitted.
        """
        admitted = self._admit(inputs, timeout, False, output)
        if isinstance(admitted, Item):
            item = asyncio.get_running_loop().create_task(admitted.result())
            item.add_done_callback(admitted.on_done)
            return item
        flow, request = admitted
        task = asyncio.get_running_loop().create_task(drive(flow, request))

        # Cancelled before its first step, the task never runs the coroutine that would
        # count the cancellation: count it here (a second count is a no-op).
        def count_a_cancel(done: asyncio.Task[Any]) -> None:
            if done.cancelled():
                flow.abandon(request)

        task.add_done_callback(count_a_cancel)
        return task

    def _admit(
        self, inputs: Any, timeout: float | None, wait: bool, output: str
    ) -> tuple[Flow, Request] | Item:
        flow = _serving(self._life, self._flow)
        loop = asyncio.get_running_loop()
        if loop is not flow.loop:
            raise AiodlaError(
                "the engine belongs to another event loop than this call's; from another "
                "thread or loop, submit to the engine's own loop: "
                "asyncio.run_coroutine_threadsafe(engine.infer(x), engine_loop)"
            )
        if timeout is not None:
            check_timeout(timeout)
        if output != "host":
            _check_device_output(output, self._device, flow.postprocess)
        batcher = self._batcher
        if batcher is not None and (item := batcher.item(inputs)) is not None:
            return batcher.admit(item, timeout, wait, output)
        cores = self._device
        arrays = _validated(
            cores.inputs,
            self._input_names,
            inputs,
            self._options.casting,
            cores.import_device,
            cores.preprocessing,
        )
        if len(arrays) == 1 and type(arrays[0]) is np.ndarray:
            sources: tuple[DeviceSource, ...] = ()  # (the common case, with no search)
        else:
            sources = tuple([a for a in arrays if isinstance(a, DeviceSource)])
        scheduler = flow.scheduler
        limit = self._options.max_queue
        if not wait and scheduler.queued >= limit and not flow.client.idle_slots:
            scheduler.reject()
            release_sources(sources)
            raise QueueFullError(
                f"the admission queue is full ({scheduler.queued} requests waiting, "
                f"max_queue={limit})"
            )
        request = Request(
            arrays, loop.create_future(), time.monotonic(), sources, output == "device"
        )
        return flow, flow.admit(request, timeout)

    def frame_buffers(self, count: int, shape: Any, dtype: Any = np.uint8) -> list[Any]:
        """Pinned arrays the engine owns, to fill with frames in place: ``infer`` on one
        skips the staging copy (with ``isolation="process"``: shared memory that the
        worker maps and pins, and the frame crosses by reference).
        :mod:`aiodla._frame_buffers` says until when they hold."""
        state = self._life.state
        if state is not EngineState.OPEN:
            raise EngineClosedError(f"the engine is {state.value}: open it first")
        return self._device.frame_buffers(count, shape, dtype)

    def _validated(self, inputs: Any) -> tuple[Any, ...]:
        cores = self._device
        return _validated(
            cores.inputs,
            self._input_names,
            inputs,
            self._options.casting,
            cores.import_device,
            cores.preprocessing,
        )

    # -- observation ---------------------------------------------------------------------------

    trace = engine_trace
    """A timeline of the requests ending in an ``async with`` block: see ``TraceRecorder``."""

    def statistics(self) -> EngineStatistics:
        """A snapshot of counts, per-core figures, latency percentiles and histograms."""
        life = self._life.state
        state = "dead" if self.dead and life is not EngineState.CLOSED else life.value
        return engine_statistics(state, self._flow, self._device, self._options, self._batcher)

    def health(self) -> EngineHealth:
        """``ok``; ``degraded`` with a core out of rotation; ``restarting`` while a worker
        process is replaced; ``dead`` once the device broke it; ``closed`` when not serving."""
        return self._life.health(self._device)

    def __repr__(self) -> str:
        state = "dead" if self.dead else self._life.state.value
        cores = self._device.lanes
        flow = self._flow
        if not cores or flow is None:
            return f"<Engine {state}>"
        busy = sum(len(c.slots) - len(c.idle) for c in cores)
        idle = sum(len(c.idle) for c in cores)
        scheduler = flow.scheduler
        return (
            f"<Engine {state} [cores {len(cores)}: {busy} busy slots, {idle} idle | "
            f"{scheduler.in_progress} in flight, {scheduler.queued} queued]>"
        )


def _serving(life: Life, flow: Flow | None) -> Flow:
    """The open engine's flow; else the error a request gets, raised."""
    if life.dead_cause is not None:
        raise EngineDeadError(f"the engine is dead: {life.dead_cause}") from life.dead_cause
    if life.state is not EngineState.OPEN or flow is None:
        if life.state in (EngineState.NEW, EngineState.OPENING):
            raise EngineClosedError(
                "the engine is not open; use 'async with Engine(...)' or 'await engine.open()'"
            )
        raise EngineClosedError("the engine is closed")
    return flow


ImportDevice = Callable[[TensorSpec, Any], DeviceSource]


def _validated(
    specs: tuple[TensorSpec, ...],
    names: frozenset[str],
    inputs: Any,
    casting: Any,
    import_device: ImportDevice,
    preprocessing: tuple[ImagePreprocess | None, ...] = (),
) -> tuple[Any, ...]:
    """The arrays of ``inputs`` in the model's input order, each checked by its spec:
    numpy arrays, :class:`DeviceSource` for device arrays, camera frames for inputs with
    pre-processing (``preprocessing``). On an error, the device arrays taken so far are
    released."""
    if type(inputs) is np.ndarray and len(specs) == 1:  # the common case: one host array
        spec, pre = specs[0], preprocessing[0] if preprocessing else None
        if pre is not None:  # a camera frame (in an engine frame buffer, say)
            return (pre.check_frame(inputs, spec),)  # as the loop below checks it
        if inputs.dtype == spec.numpy_dtype and inputs.shape == spec.shape:
            return (inputs,)  # valid as it stands
        return (spec.check_array(inputs, casting=casting),)
    taken: list[Any] = []
    try:
        values = inputs_in_order(specs, names, inputs)
        for spec, value, pre in zip(
            specs, values, preprocessing or (None,) * len(specs), strict=True
        ):
            planes = None
            if type(value) is VideoFrame:
                value, planes = video_frame_pixels(value, spec, pre)
            if pre is not None:
                if type(value) is not np.ndarray and is_device_array(value):
                    # read in place by the pre-processing kernel, on the slot's stream
                    taken.append(import_device(spec, value))
                    if planes is not None and taken[-1].shape != planes:
                        raise InputValueError(
                            f"input {spec.name!r}: the VideoFrame's device array has shape "
                            f"{taken[-1].shape}, and its size says {planes}"
                        )
                else:
                    taken.append(pre.check_frame(value, spec))
            elif type(value) is not np.ndarray and is_device_array(value):
                taken.append(import_device(spec, value))
            else:
                taken.append(spec.check_array(value, casting=casting))
    except BaseException:
        release_sources([t for t in taken if isinstance(t, DeviceSource)])
        raise
    return tuple(taken)


async def _closed_with(trace: TraceFile | None, flow: Flow, closed: asyncio.Event) -> None:
    """Write the engine's own trace, if it keeps one (every request has ended: the
    trace is whole), then mark the engine closed, whatever the write did."""
    try:
        if trace is not None:
            await trace.finish(flow)
    finally:
        closed.set()


async def _release(layers: list[DeviceLayer]) -> None:
    """Release what an open that failed made, in a thread of its own that a
    cancellation cannot stop."""
    for layer in layers:
        await asyncio.shield(asyncio.ensure_future(anyio.to_thread.run_sync(layer.release)))


def _check_device_output(output: object, cores: DeviceLayer, postprocess: Any) -> None:
    if output != "device":
        raise ConfigurationError(f"output={output!r} must be 'host' or 'device'")
    cores.check_device_output(postprocess is not None)
