"""The emulated runtime's compute threads: the user's own computation (``compute=``).

One thread per DLA core that has a module with a compute function: it takes the
core's tasks in submission order, applies the stream operations ahead of each (the
copies of its inputs) as their time comes, runs the function and writes the outputs,
then lets the stream go on (see ``_emulated`` for the whole model and
``aiodla.emulator._compute`` for the function's contract). The runtime holds a
:class:`ComputeThreads`; it works on the runtime's timeline.

Every task ends: whatever the function raises fails that task alone, and a function
still running when the task's timeout passes (``set_task_timeout``, cuDLA's 30 s by
default) ends the task with the DLA's timeout status, as a hung DLA task ends. Its
thread is then left to return in its own time, its outputs discarded, and a fresh
thread takes over the core's queued tasks.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from .._errors import ComputeError, ConfigurationError, ModelError
from ..emulator._compute import (
    ComputeFunction,
    ComputeTask,
    check_compute,
    describe,
    import_compute,
)
from ._faults import _STATUS_VALUES

if TYPE_CHECKING:
    from ..emulator._format import EmulatorModel
    from ._timeline import Timeline, _Operation, _Stream

__all__ = ["ComputeThreads", "compute_function", "untrusted_reference"]


def untrusted_reference(reference: str) -> str:
    """Why a loadable's compute reference is not imported without the user's word."""
    return (
        f"the model names the compute function {reference!r}: opening it would import "
        "and run that Python code, and a model file is data, so aiodla does so only when "
        "told to: pass trust_compute=True (Engine, EmulatedRuntime; --trust-compute on "
        "the command line) if you trust this file, or a compute= function of your own"
    )


def compute_function(compute: ComputeFunction | str | None) -> ComputeFunction | None:
    """A compute function from what ``compute=`` takes: a callable, or a reference."""
    if compute is None:
        return None
    if isinstance(compute, str):
        return import_compute(compute)
    if not callable(compute):
        raise ConfigurationError(
            f"compute={compute!r} must be a callable or a reference 'module:function'"
        )
    return compute


class ComputeThreads:
    """Compute functions for the emulated runtime's modules, and the threads that
    run them: one per core that has a module with a compute function loaded.

    ``compute``: the function for every module (the runtime's ``compute=``);
    ``trust_compute``: whether a loadable's own compute reference may be imported.
    """

    def __init__(
        self, timeline: Timeline, compute: ComputeFunction | str | None, trust_compute: bool
    ) -> None:
        self._timeline = timeline
        self._compute = compute_function(compute)
        self.trust_compute = trust_compute
        self._bound: dict[bytes, ComputeFunction] = {}
        self._workers: dict[int, _ComputeWorker] = {}  # by core index
        self._closing = False

    def bind_compute(self, loadable: bytes, compute: ComputeFunction | str | None) -> None:
        """See :meth:`EmulatedRuntime.bind_compute`."""
        function = compute_function(compute)
        with self._timeline.lock:
            if function is None:
                self._bound.pop(bytes(loadable), None)
            else:
                self._bound[bytes(loadable)] = function

    def module_compute(self, loadable: bytes, model: EmulatorModel) -> ComputeFunction | None:
        """The compute function of a module being loaded, checked against its model:
        bound to the loadable, else the runtime's, else the loadable's ONNX network, else
        its reference (only when trusted: importing it runs code that a file chose)."""
        compute = self._bound.get(bytes(loadable), self._compute)
        if compute is None and model.onnx is not None:
            # data that onnxruntime interprets, not code a file chose: no trust needed
            from ..emulator._onnx import OnnxCompute

            compute = OnnxCompute(model.onnx, external_data=False)
        if compute is None and model.compute is not None:
            if not self.trust_compute:
                raise ModelError(untrusted_reference(model.compute))
            compute = import_compute(model.compute)
        if compute is not None:
            check_compute(compute, model.inputs, model.outputs)
        return compute

    def loaded(self, core: int) -> None:
        """A module with a compute function was loaded on ``core`` (lock held)."""
        worker = self._workers.get(core)
        if worker is None:
            worker = self._workers[core] = _ComputeWorker(self, core)
        worker.modules += 1

    def unloaded(self, core: int) -> None:
        """One was unloaded (lock held): no thread outlives the engines that need it."""
        worker = self._workers[core]
        worker.modules -= 1
        if not worker.modules:
            del self._workers[core]
            worker.stop()

    def put(self, core: int, stream: _Stream, operation: _Operation, task: ComputeTask) -> None:
        """Queue a submitted task's computation on its core's thread."""
        with self._timeline.lock:  # the core's worker may be replaced meanwhile (a timeout)
            self._workers[core].put(stream, operation, task)

    def stop(self) -> None:
        timeline = self._timeline
        with timeline.lock:
            self._closing = True
            workers, self._workers = list(self._workers.values()), {}
            timeline.placed.notify_all()
        for worker in workers:
            worker.stop()

    def take_compute_failure(self, stream: int) -> BaseException | None:
        """See :meth:`EmulatedRuntime.take_compute_failure`."""
        return self._timeline.compute_failures.pop(stream, None)

    def reach(self, stream: _Stream, operation: _Operation) -> bool:
        """Compute thread: apply the stream's operations ahead of ``operation`` as
        their time comes, until it is next and placed; False when it never will be
        (the context was poisoned, the runtime closed)."""
        timeline = self._timeline
        while True:
            with timeline.lock:
                operations = stream.operations
                if self._closing or timeline.poisoned is not None or not operations:
                    return False
                if operation.effect.status:  # type: ignore[attr-defined]
                    return False  # ended by its timeout before its turn came
                head = operations[0]
                if head is operation and head.at is not None:
                    return True
                if head.at is None or head.computing is not None:  # held, or computing
                    timeline.placed.wait(0.05)
                    continue
                delay = head.at - timeline.clock()
            if delay > 0:
                time.sleep(min(delay, 0.01))
            timeline.advance(stream, timeline.clock())

    def computed(self, operation: _Operation, failure: BaseException | None) -> None:
        """Compute thread: the outputs are written (or ``failure`` says why not)."""
        with self._timeline.lock:
            effect = operation.effect
            effect.failure = failure  # type: ignore[attr-defined]
            operation.computing = None
            self._timeline.placed.notify_all()

    def expired(self, operation: _Operation, now: float) -> bool:
        """(Lock held) End a computing task whose timeout has passed since it started:
        no outputs, the DLA's timeout status; a thread stuck in its function is
        replaced. Not while its outputs are being stored: it ends in a moment anyway."""
        effect: Any = operation.effect
        device = operation.device
        if operation.at is None or device is None:
            return False
        if now < operation.at - effect.duration + device.timeout:
            return False
        core = device.core.index
        worker = self._workers.get(core)
        if worker is not None and worker.running is operation:
            if worker.writing:
                return False
            self._workers[core] = worker.replaced()
        effect.status = _STATUS_VALUES["engine_timeout"]
        operation.computing = None
        self._timeline.placed.notify_all()
        return True


class _ComputeWorker:
    """One DLA core's compute thread: runs the compute functions of the core's tasks
    in the order they were submitted (the order the core runs them)."""

    def __init__(self, threads: ComputeThreads, core: int) -> None:
        self.modules = 0  # modules with a compute function loaded on this core
        # Under the runtime's lock: the task whose function runs now, whether its
        # outputs are being stored, and whether a fresh worker took this one's place.
        self.running: _Operation | None = None
        self.writing = False
        self.abandoned = False
        self._core = core
        self._threads = threads
        self._lock = threads._timeline.lock
        self._jobs: queue.SimpleQueue[tuple[_Stream, _Operation, ComputeTask] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(
            target=self._run, name=f"aiodla-emulated-compute-{core}", daemon=True
        )
        self._thread.start()

    def put(self, stream: _Stream, operation: _Operation, task: ComputeTask) -> None:
        self._jobs.put((stream, operation, task))

    def stop(self) -> None:
        """End the thread after the jobs queued before (it is not waited for: a
        compute function that never returns must not hang a close)."""
        self._jobs.put(None)

    def replaced(self) -> _ComputeWorker:
        """(Lock held) A fresh worker for this core, with the jobs queued here; this
        one's thread, stuck in a function, ends when the function returns."""
        fresh = _ComputeWorker(self._threads, self._core)
        fresh.modules, self.abandoned = self.modules, True
        while True:
            try:
                fresh._jobs.put(self._jobs.get_nowait())
            except queue.Empty:
                return fresh

    def _run(self) -> None:
        threads, lock = self._threads, self._lock
        while not self.abandoned and (job := self._jobs.get()) is not None:
            stream, operation, task = job
            if not threads.reach(stream, operation):
                continue
            with lock:
                if operation.effect.status:  # type: ignore[attr-defined]
                    continue  # ended by its timeout in the meantime
                self.running = operation
            try:
                outcome = task.compute()
            except BaseException as exc:  # reading its inputs failed: that task's alone
                outcome = ComputeError(f"compute function {describe(task.function)}: {exc!r}")
                outcome.__cause__ = exc
            with lock:
                self.running = None
                if operation.effect.status:  # type: ignore[attr-defined]
                    continue  # ended by its timeout: the outputs go nowhere
                self.writing = True
            failure = outcome if isinstance(outcome, ComputeError) else self._write(task, outcome)
            with lock:
                self.writing = False
                threads.computed(operation, failure)

    @staticmethod
    def _write(task: ComputeTask, outputs: Any) -> ComputeError | None:
        try:
            task.write(outputs)
        except Exception as exc:  # still that task's failure alone
            failure = ComputeError(
                f"compute function {describe(task.function)}: its outputs could not "
                f"be stored ({exc})"
            )
            failure.__cause__ = exc
            return failure
        return None
