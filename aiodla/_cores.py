"""The device layer: DLA cores, their rings of slots, and every runtime call the engine makes.

A *slot* is one (core, CUDA stream) pair with its own registered buffers, prebuilt task
and completion event. This module opens and releases cores and slots, writes inputs,
enqueues a slot's work on its stream, reads outputs and stage times, keeps each core's
busy time and service-time estimate, and turns runtime failures into aiodla errors.
It is the only module of the engine that calls the :class:`~aiodla.runtime.Runtime`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from ._core_setup import CoreSetup, device_error, is_sticky, read_model
from ._data_path import DevicePath, TensorBinding
from ._device_arrays import DeviceSource
from ._errors import InputTypeError
from ._frame_buffers import FrameBuffers
from ._slots import (
    DEFAULT_SERVICE_TIME,
    CompletionProbe,
    CoreState,
    Slot,
    completion_probe,
    new_core,
)
from ._statistics import EngineHealth, WorkerStatistics
from ._tensors import TensorSpec
from ._trace import TraceRecorder

if TYPE_CHECKING:
    from ._flow import CompletionSource, Flow
    from .runtime._protocol import Runtime

__all__ = [
    "DEFAULT_SERVICE_TIME",
    "CompletionProbe",
    "CoreSetup",
    "CoreState",
    "Cores",
    "Slot",
    "TensorBinding",
    "completion_probe",
    "device_error",
    "is_sticky",
    "new_core",
    "read_model",
]

logger = logging.getLogger("aiodla")


class Cores(CoreSetup):
    """The DLA cores of one engine, their slots, and the runtime that drives them.

    ``open`` and ``release`` block (the engine runs them in a worker thread); the rest
    runs on the event loop's thread, except :attr:`probe`'s calls, made by the poller.
    """

    trace: TraceRecorder | None = None  # engine.trace() installs one

    # -- what the engine asks of its device layer, which process mode answers too ---------

    async def start(
        self,
        model: str | os.PathLike[str] | bytes | bytearray | memoryview,
        runtime_choice: str | Runtime,
        flow: Flow,
        die: Callable[[BaseException], None],
    ) -> None:
        """Open the model for an engine: here, in a worker thread; then the loop
        thread is made ready to enqueue device work too. (``flow`` and ``die`` are
        for a device layer whose completions come from elsewhere.)"""
        await anyio.to_thread.run_sync(self.open_model, model, runtime_choice)
        self.make_current()

    @property
    def completions(self) -> CompletionSource | None:
        """Where completions come from, if not from a poller of this process's own."""
        return None

    @property
    def restarting(self) -> EngineHealth | None:
        """The engine's health while its device is being replaced, else None."""
        return None

    def worker_statistics(self) -> WorkerStatistics | None:
        """The worker process's figures (``isolation="process"``), else None."""
        return None

    # -- releasing (worker thread) ------------------------------------------------------------

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
        if self.trace is not None:
            self.trace.packed(slot.request)

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

    def frame_buffers(self, count: Any, shape: Any, dtype: Any) -> list[np.ndarray[Any, Any]]:
        """Arrays in this layer's pinned memory (:mod:`aiodla._frame_buffers`), mapped
        when kernels read staging in place; freed with everything else at release."""
        assert self.runtime is not None
        if self._frames is None:
            zero_copy = isinstance(self.path, DevicePath) and self.path.zero_copy
            self._frames = FrameBuffers(self.runtime, mapped=zero_copy)
            self._resources.push("frame buffers", None, self._frames.close)
            if isinstance(self.path, DevicePath):
                self.path.frame_buffers = self._frames
        return self._frames.create(count, shape, dtype)

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
        if not slot.keep and not slot.pooled:  # the common case: nothing was held
            return
        keep, slot.keep = slot.keep, ()
        for source in keep:
            source.release()
        if self.path is not None:
            self.path.recycle(slot)

    def submit(self, slot: Slot, now: float) -> None:
        """Enqueue the slot's copies in, its task, copies out and its event on its
        stream, and estimate when the core will be done with it. Raises what the runtime
        raised (see :meth:`retire` for the slot afterwards).

        The work before and after the task goes as two graphs, captured by the slot's
        first request of each kind (see ``aiodla._graphs``), unless stage times are
        measured."""
        runtime = self.runtime
        assert runtime is not None
        path = self.path
        assert path is not None
        request = slot.request
        device = request is not None and request.device_output
        graphs = self.graphs
        if slot.timing is not None or graphs is None:
            self._enqueue_each(slot, device)
        else:
            # A kind of request the slot has a graph of is launched here, with no call
            # in between: the common case, per request.
            stream = slot.stream
            kind = path.inputs_kind(slot)
            graph = slot.graphs_in.get(kind)
            kind_after = path.outputs_kind(device)
            graph_after = slot.graphs_out.get(kind_after)
            if graph is not None:
                runtime.launch_graph(graph, stream)
            else:
                graphs.enqueue_new(slot, slot.graphs_in, kind, path.enqueue_inputs, slot)
            runtime.submit_task(slot.core.device, slot.task, stream)
            if graph_after is not None:
                runtime.launch_graph(graph_after, stream)
            else:
                graphs.enqueue_new(
                    slot, slot.graphs_out, kind_after, self._enqueue_after, slot, device
                )
        core = slot.core
        slot.submitted_at = now
        slot.behind = 0.0
        core.expected_free = max(now, core.expected_free) + core.service_time
        slot.expected_done = core.expected_free
        if self.trace is not None:
            self.trace.submitted(request)

    def _enqueue_after(self, slot: Slot, device: bool) -> None:
        """The work after the task: outputs, then the event the poller waits for."""
        assert self.path is not None
        assert self.runtime is not None
        self.path.enqueue_outputs(slot, device)
        self.runtime.record_event(slot.event, slot.stream)

    def _enqueue_each(self, slot: Slot, device: bool) -> None:
        """Every call on its own, with the stage-timing events when they are measured."""
        runtime = self.runtime
        path = self.path
        assert runtime is not None
        assert path is not None
        stream = slot.stream
        timing = slot.timing
        if timing is not None:
            runtime.record_event(timing[0], stream)
        path.enqueue_inputs(slot)
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
        if slot.behind:
            _follow_the_core(slot)
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


def _follow_the_core(slot: Slot) -> None:
    """Move the estimates of the tasks queued behind ``slot`` on its core (and of the
    core's end) to where the evidence puts the core's timeline.

    Each submission's estimate is the core's previous one plus the service time, so a
    service time a little off the real one (a loadable's stated time, a stand-in's
    overhead) moves a saturated core's estimates ever further from its tasks. Too early,
    the poller queries every task several times and wakes the loop for each one
    (``benchmarks/bench_estimates.py``, stated 2 % short at 1 ms: 4.7 queries a request
    instead of 1.0, and twice the CPU); too late, the ring runs dry before the poller
    looks. Only the poller's evidence (``slot.behind``) moves them, and never past it: a
    task found still running after its estimate moves those behind it later by that
    much; one found done before its estimate, earlier by as much. The poller's lateness
    in seeing a task done moves nothing, so no error feeds on itself.
    """
    estimate, offset = slot.expected_done, slot.behind
    for other in slot.core.slots:
        if other.expected_done > estimate:
            other.expected_done += offset
    slot.core.expected_free += offset
