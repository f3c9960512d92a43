"""The device layer in this process: DLA cores, their rings of slots, and every runtime
call the engine makes.

A *slot* is one (core, CUDA stream) pair with its own registered buffers, prebuilt task
and completion event. :class:`LocalDevice` is what :func:`open_local_device` opened (see
``_core_setup``): it writes inputs, enqueues a slot's work on its stream, reads outputs
and stage times, keeps each core's busy time and service-time estimate, and releases
every handle at the end. It is the only module of the engine that calls the
:class:`~aiodla.runtime.Runtime` on the request path.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import numpy as np

from ._core_record import CoreRecord, expect
from ._core_setup import Opened, open_model, read_model
from ._device import device_error, is_sticky
from ._device_arrays import DeviceSource
from ._errors import ConfigurationError
from ._frame_buffers import FrameBuffers
from ._options import EngineOptions
from ._poller import Poller
from ._slots import (
    DEFAULT_SERVICE_TIME,
    CompletionProbe,
    CoreLane,
    Slot,
    account,
    completion_probe,
    new_core,
    record_stages,
)
from ._statistics import EngineHealth, LatencyWindow, WorkerStatistics
from ._tensors import TensorSpec
from ._trace import TraceRecorder
from .runtime._protocol import Runtime

__all__ = [
    "DEFAULT_SERVICE_TIME",
    "CompletionProbe",
    "CoreLane",
    "LocalDevice",
    "Slot",
    "completion_probe",
    "device_error",
    "is_sticky",
    "new_core",
    "open_local_device",
    "read_model",
    "release_runtime",
]

logger = logging.getLogger("aiodla")

ModelSource = str | os.PathLike[str] | bytes | bytearray | memoryview

# Tasks still running at close are looked at after this long, then twice as long each
# time up to the most: a task of milliseconds frees its core's handles at once, one
# that never ends (a hung core) costs a query a second.
LATE_RELEASE_FIRST = 0.001
LATE_RELEASE_MOST = 1.0


async def open_local_device(
    model: ModelSource,
    runtime_choice: str | Runtime,
    options: EngineOptions,
    records: Mapping[int, CoreRecord] | None = None,
) -> LocalDevice:
    """Open the model in this process, in a worker thread; then the loop's thread is
    made ready to enqueue device work too. Nothing is left open when it raises, even
    when it is cancelled once the thread has opened everything."""
    opened: list[LocalDevice] = []

    # The thread gets what it opens, not the engine: a worker thread may hold its last
    # job's callable until its next, and an engine dropped unclosed must be collected.
    def open_here() -> None:
        opened.append(LocalDevice.open(read_model(model), runtime_choice, options, records))

    try:
        await anyio.to_thread.run_sync(open_here)
        cores = opened[0]
        cores.make_current()
    except BaseException:
        for cores in opened:  # in a thread of its own that a cancellation cannot stop
            await asyncio.shield(asyncio.ensure_future(anyio.to_thread.run_sync(cores.release)))
        raise
    return cores


def release_runtime(runtime: Runtime) -> None:
    """Close a runtime that shared cores made, once no engine uses it (blocking)."""
    runtime.close()


class LocalDevice:
    """The DLA cores of one engine in this process, their slots, and the runtime that
    drives them (a :class:`~aiodla._device.DeviceLayer`).

    ``open`` and ``release`` block (the engine runs them in a worker thread); the rest
    runs on the event loop's thread, except :attr:`probe`'s calls, made by the poller.
    """

    trace: TraceRecorder | None = None  # engine.trace() installs one

    def __init__(self, options: EngineOptions, opened: Opened) -> None:
        self._options = options
        self._runtime = opened.runtime
        self._owns_runtime = opened.owns_runtime
        self._resources = opened.resources
        self.lanes = opened.lanes
        self.slots = opened.slots
        self.inputs = opened.inputs
        self.outputs = opened.outputs
        self.preprocessing = opened.preprocessing
        self.path = opened.path
        # Captures and launches the slots' graphs; None when Engine(graphs=False).
        self.graphs = opened.graphs
        self.take_compute_failure = opened.take_compute_failure
        self.stated_service_time = opened.stated_service_time
        self.postprocess = opened.postprocess
        self.stage_windows: tuple[LatencyWindow, ...] | None = (
            tuple(LatencyWindow(options.latency_window) for _ in range(3))
            if options.stage_times
            else None
        )
        self._frames: FrameBuffers | None = None  # made by the first frame_buffers()

    @classmethod
    def open(
        cls,
        model: bytes,
        runtime_choice: str | Runtime,
        options: EngineOptions,
        records: Mapping[int, CoreRecord] | None = None,
    ) -> LocalDevice:
        """Open ``model`` on the runtime chosen (blocking), its lanes on the physical
        cores whose ``records`` they share (None: records of its own)."""
        return cls(options, open_model(model, runtime_choice, options, records))

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    def poller(
        self,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[list[tuple[Slot, int]]], None],
        fail: Callable[[BaseException], None],
    ) -> Poller:
        """A poller of these slots' events, not started, for the worker process (which
        delivers on its own thread); in the engine's process the poller is its
        :class:`aiodla.Cores`'."""
        runtime = self._runtime
        return Poller(completion_probe(runtime), loop, deliver, fail, pause=runtime.poll_pause)

    def health(self) -> EngineHealth | None:
        """Nothing beyond the cores' own: in-process, a broken device kills the engine."""
        return None

    def statistics(self) -> WorkerStatistics | None:
        """No worker process here."""
        return None

    # -- releasing (worker thread) ------------------------------------------------------------

    def release(self, keep: tuple[int, ...] = ()) -> None:
        """Release every handle in reverse order of creation, except those of the cores
        in ``keep``, whose tasks still run and may write their memory: a thread gives
        each such core's handles back once its tasks ended (a hung core's never end,
        and it keeps them). Then the runtime, if this engine made it, once nothing is
        kept."""
        runtime = self._runtime
        if len(self._resources):
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
        if keep:
            running = {
                core.core: [slot for slot in core.slots if slot not in core.idle]
                for core in self.lanes
                if core.core in keep
            }
            threading.Thread(
                target=self._release_when_done, args=(running,), name="aiodla-release", daemon=True
            ).start()
        elif self._owns_runtime:
            runtime.close()

    def _release_when_done(self, running: dict[int, list[Slot]]) -> None:
        """Give each core's handles back once the tasks that ran on it at close ended
        (their events read done), looking less often the longer they take."""
        runtime = self._runtime
        pause = LATE_RELEASE_FIRST
        try:
            runtime.make_current()
            while running:
                for core in [
                    c
                    for c, slots in running.items()
                    if all(runtime.query_event(slot.event) for slot in slots)
                ]:
                    for slot in self.slots:
                        if slot.core.core == core:
                            self.recycle(slot)
                    del running[core]
                    failures = self._resources.release_all(tuple(running))
                    if failures:
                        logger.warning("aiodla: %d late release(s) failed", len(failures))
                if running:
                    time.sleep(pause)
                    pause = min(2 * pause, LATE_RELEASE_MOST)
        except Exception as exc:  # a broken device: what is left stays allocated
            logger.warning("aiodla: core(s) %s keep their handles: %s", sorted(running), exc)
            return
        if self._owns_runtime:
            runtime.close()

    def abandon(self) -> None:
        """The engine was collected unclosed: nothing runs here (the poller thread is
        its :class:`aiodla.Cores`')."""

    def make_current(self) -> None:
        """Make the device current on the calling thread (the loop's, after opening)."""
        try:
            self._runtime.make_current()
        except Exception as exc:
            error = device_error("opening the engine: make_current", exc)
            if error is None or error is exc:
                raise
            raise error from exc

    # -- one slot's work (loop thread) -------------------------------------------------------

    @property
    def detects_on_stream(self) -> bool:
        return self.path.detect is not None

    def write_inputs(self, slot: Slot, arrays: Sequence[Any], limit: int | None = None) -> bool:
        """Stage validated inputs for the slot: packed into its pinned buffers (host
        conversion), or their bytes copied (device conversion; device arrays stay).
        Nothing is staged, and False returned, when that would move more than ``limit``
        bytes on the host."""
        if not self.path.write_inputs(slot, arrays, limit):
            return False
        if self.trace is not None:
            self.trace.packed(slot.request)
        return True

    def write_zeros(self, slot: Slot) -> None:
        """Zeros into every input: the input of a probe task."""
        self.path.write_zeros(slot)

    def read_outputs(self, slot: Slot) -> Any:
        """The slot's results as the engine returns them: fresh arrays of its outputs
        (or :class:`DeviceTensor` for a request that asked for device outputs), one or
        a dict name -> output; with a ``postprocess``, its :class:`~aiodla.Detections`
        (decoded on the slot's stream already, or here: PostprocessError if it fails)."""
        request = slot.request
        device = request is not None and request.device_output
        results = self.path.read_outputs(slot, device)
        postprocess = self.postprocess
        if postprocess is not None and self.path.detect is None:  # on the host
            return postprocess.run(results, request.arrays if request is not None else ())
        if len(results) == 1:
            return results[0]
        return {b.spec.name: r for b, r in zip(slot.outputs, results, strict=True)}

    def frame_buffers(self, count: Any, shape: Any, dtype: Any) -> list[np.ndarray[Any, Any]]:
        """Arrays in this layer's pinned memory (:mod:`aiodla._frame_buffers`), mapped
        when kernels read staging in place; freed with everything else at release."""
        frames = self._frames
        if frames is None:  # made on the first call: most engines take no frames
            frames = self._frames = FrameBuffers(self._runtime, mapped=self.path.zero_copy)
            self._resources.push("frame buffers", None, frames.close)
            self.path.use_frame_buffers(frames)
        return frames.create(count, shape, dtype)

    def import_device(self, spec: TensorSpec, value: Any) -> DeviceSource:
        """A device array as input ``spec`` (see :meth:`DevicePath.import_array`)."""
        return self.path.import_array(spec, value)

    def check_device_output(self, postprocess: bool = False) -> None:
        """Refuse ``output="device"`` where outputs would stay on the host (with a
        ``postprocess``: where it does not run on the slots' streams)."""
        if self._runtime.has_device_memory and not self.path.converts_on_device:
            raise ConfigurationError(
                "output='device' needs device conversion; this engine converts on the "
                "host (Engine(convert='device') converts on the GPU)"
            )
        if postprocess and self.path.detect is None:
            raise ConfigurationError(
                "output='device' with postprocess=: this engine post-processes on the "
                "host (host conversion, or a runtime that cannot run it on the device); "
                "Engine(convert='device') runs it on the slots' streams"
            )

    def recycle(self, slot: Slot) -> None:
        """The slot's work is over: give back what its request held on the device."""
        if not slot.keep and not slot.pooled:  # the common case: nothing was held
            return
        keep, slot.keep = slot.keep, ()
        for source in keep:
            source.release()
        self.path.recycle(slot)

    def submit(self, slot: Slot, now: float) -> None:
        """Enqueue the slot's copies in, its task, copies out and its event on its
        stream, and estimate when the core will be done with it. Raises what the runtime
        raised (see :meth:`retire` for the slot afterwards).

        The work before and after the task goes as two graphs, captured by the slot's
        first request of each kind (see ``aiodla._graphs``), unless stage times are
        measured."""
        runtime = self._runtime
        path = self.path
        request = slot.request
        device = request is not None and request.device_output
        graphs = self.graphs
        if slot.timing is not None or graphs is None:
            self._enqueue_each(slot, device)
        else:
            # A kind of request the slot has a graph of is launched here, with no call
            # in between: the common case, per request.
            stream = slot.stream
            kind, kind_after = path.graph_kinds(slot, device)
            graph = slot.graphs_in.get(kind)
            graph_after = slot.graphs_out.get(kind_after)
            if graph is not None:
                graphs.runtime.launch_graph(graph, stream)
            else:
                graphs.enqueue_new(slot, slot.graphs_in, kind, path.enqueue_inputs, slot)
            runtime.submit_task(slot.core.device, slot.task, stream)
            if graph_after is not None:
                graphs.runtime.launch_graph(graph_after, stream)
            else:
                graphs.enqueue_new(
                    slot, slot.graphs_out, kind_after, self._enqueue_after, slot, device
                )
        expect(slot, now)
        if self.trace is not None:
            self.trace.submitted(request)

    def _enqueue_after(self, slot: Slot, device: bool) -> None:
        """The work after the task: outputs, then the event the poller waits for."""
        self.path.enqueue_outputs(slot, device)
        self._runtime.record_event(slot.event, slot.stream)

    def _enqueue_each(self, slot: Slot, device: bool) -> None:
        """Every call on its own, with the stage-timing events when they are measured."""
        runtime = self._runtime
        stream = slot.stream
        timing = slot.timing
        if timing is not None:
            runtime.record_event(timing[0], stream)
        self.path.enqueue_inputs(slot)
        if timing is not None:
            runtime.record_event(timing[1], stream)
        runtime.submit_task(slot.core.device, slot.task, stream)
        if timing is not None:
            runtime.record_event(timing[2], stream)
        self._enqueue_after(slot, device)

    def retire(self, slot: Slot, now: float) -> bool:
        """After a failed :meth:`submit`: mark the end of what reached the stream, so the
        slot returns to the pool only after it ran. False when even that fails (the slot
        is lost to the pool)."""
        try:
            self._runtime.record_event(slot.event, slot.stream)
        except Exception as exc:
            # By its text: a kept record would keep the error, whose traceback holds the
            # frames that submitted the request, and so the request.
            logger.error("aiodla: %r retired: %s", slot, str(exc))
            return False
        slot.submitted_at = slot.expected_done = now
        return True

    def account(self, slot: Slot, status: int, now: float) -> None:
        """Count one finished DLA task: the core's figures, and its stage times when
        they are measured."""
        account(slot, status, now)
        if slot.timing is not None:
            self._record_stages(slot, slot.timing)

    def _record_stages(self, slot: Slot, timing: tuple[int, int, int]) -> None:
        elapsed = self._runtime.elapsed_time
        before_copy, before_task, after_task = timing
        try:
            stages = (
                elapsed(before_copy, before_task),
                elapsed(before_task, after_task),
                elapsed(after_task, slot.event),
            )
        except Exception as exc:  # a timing read is never worth failing a request
            logger.debug("aiodla: stage times unavailable: %s", exc)
            return
        record_stages(slot, stages, self.stage_windows)
