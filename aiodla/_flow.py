"""One request's path on the event loop's thread: from its slot to its future.

The engine admits a request; from there the flow starts it on the slot the scheduler
gives it (through the device layer), takes the poller's completions, applies the fault
policy's probes, ends each request exactly once and hands the outcome to its future, or
to its coroutine for the steps it does itself (packing or unpacking large tensors in a
worker thread).

Only the event loop's thread runs this code.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio

from ._cores import Cores, CoreState, Slot
from ._data_path import release_sources
from ._errors import (
    AiodlaError,
    EngineClosedError,
    EngineDeadError,
    PostprocessError,
    RequestTimeoutError,
    TaskError,
    status_name,
)
from ._options import EngineOptions
from ._poller import Poller
from ._postprocess import Postprocess, read_results
from ._scheduler import Outcome, Request, RequestState, Scheduler
from ._statistics import HistogramRecorder, LatencyWindow, failure_reason
from ._submit_failures import SubmitFailures
from ._trace import TraceRecorder

__all__ = ["EngineState", "Flow"]

logger = logging.getLogger("aiodla")


class CompletionSource(Protocol):
    """What tells the flow which slots finished: the poller in-process, the worker's
    supervisor with ``isolation="process"``."""

    def watch(self, slot: Slot) -> None: ...
    def harvest(self, at_least: int | None = None) -> list[tuple[Slot, int]]: ...
    def consumed(self) -> None: ...
    def stop(self) -> None: ...
    def abandon(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...


class EngineState(enum.Enum):
    NEW = "new"
    OPENING = "opening"
    OPEN = "open"
    DEAD = "dead"  # the device broke it while open; closing it is still up to you
    CLOSING = "closing"
    CLOSED = "closed"


class Flow(SubmitFailures):
    """The loop-thread side of an open engine: starts, completions, outcomes.

    State (loop thread only): ``state``, the engine's one record of its life (work is
    started only while it is OPEN; after CLOSED a late poller wake-up is ignored);
    ``dead_cause``
    once the device broke it; ``drained`` is set when every slot is idle again, while
    the engine waits for that at close.
    """

    def __init__(
        self, options: EngineOptions, cores: Cores, die: Callable[[BaseException], None]
    ) -> None:
        self._options = options
        self.cores = cores
        self._die_callback = die
        self.scheduler = Scheduler([])
        self.poller: CompletionSource | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.state = EngineState.NEW
        self.dead_cause: BaseException | None = None
        self.drained: asyncio.Event | None = None
        self.offload_pack = self.offload_unpack = False
        self.postprocess: Postprocess | None = None  # set at open (Engine(postprocess=))
        window = options.latency_window
        self.latency = LatencyWindow(window)
        self.queue_wait = LatencyWindow(window)
        self.latency_histogram = HistogramRecorder()
        self.queue_wait_histogram = HistogramRecorder()
        self.trace: TraceRecorder | None = None  # engine.trace() installs one

    def start_serving(
        self, loop: asyncio.AbstractEventLoop, completions: CompletionSource | None = None
    ) -> None:
        """The cores are open: schedule over them; ``completions`` or a new poller report."""
        cores = self.cores
        self.loop = loop
        self.scheduler = Scheduler(cores.cores, self._options.max_consecutive_faults)
        limit = self._options.offload_bytes
        self.offload_pack = sum(s.size for s in cores.inputs) > limit or any(cores.frames)
        self.offload_unpack = sum(s.size for s in cores.outputs) > limit
        self.poller = completions or _poller(cores, loop, self.on_completions, self._die_callback)
        self.state = EngineState.OPEN

    def cancel_probes(self) -> None:
        for core in self.cores.cores:
            if core.probe is not None:
                core.probe.cancel()
                core.probe = None

    def fail_waiting(self, error: AiodlaError) -> None:
        for request in self.scheduler.drain(failure_reason(error)):
            _let_go(request)
            if not request.future.done():  # (a cancelled caller's future is done)
                request.future.set_exception(error)

    def fail_running(self, error: AiodlaError) -> None:
        for slot in self.cores.slots:
            running = slot.request
            if running is not None and running.state is not RequestState.DONE:
                self._finish(running, error=error)

    def admit(self, request: Request, timeout: float | None) -> Request:
        """Put a validated request in line, with its deadline, and start it if a slot
        is idle."""
        if timeout is not None:
            loop = self.loop
            assert loop is not None
            request.deadline = loop.time() + timeout
            request.timer = loop.call_at(request.deadline, self._expire, request)
        scheduler = self.scheduler
        scheduler.admit(request)
        if scheduler.idle_slots:
            self.transition()
        return request

    async def drive(self, request: Request) -> Any:
        """Await the request's outcome, doing the steps the loop hands back to it."""
        try:
            value = await request.future
            while request.state is not RequestState.DONE:
                if request.state is RequestState.PACKING:
                    value = await self._pack_off_loop(request)
                else:
                    value = await self._unpack_off_loop(request)
            if request.late is not None:
                return self._take_late(request)
            return value
        except asyncio.CancelledError:
            self.abandon(request)
            raise
        finally:
            if request.timer is not None:
                request.timer.cancel()

    # -- the state transition -----------------------------------------------------------------

    def transition(self) -> None:
        """Give idle slots to waiting requests; called after every submit, completion,
        cancellation and release."""
        if self.state is not EngineState.OPEN:
            return
        next_assignment = self.scheduler.next_assignment
        while (assignment := next_assignment()) is not None:
            self._start(*assignment)

    def _start(self, request: Request, slot: Slot) -> None:
        now = time.monotonic()
        waited = now - request.started
        self.queue_wait.add(waited)
        self.queue_wait_histogram.add(waited)
        if request.deadline is not None and self.loop.time() >= request.deadline:  # type: ignore[union-attr]
            self.release(slot)
            self._finish(request, timed_out=True)
            return
        if self.trace is not None:
            self.trace.assigned(request, slot, now)
        # From now on the slot holds the request's device arrays: released with it,
        # once no kernel of it can read them.
        slot.keep, request.sources = request.sources, ()
        if self.offload_pack and len(slot.keep) < len(request.arrays):  # device arrays: no work
            request.future.set_result(None)  # its coroutine packs (PACKING) off the loop
            return
        try:
            self.cores.write_inputs(slot, request.arrays)
        except Exception as exc:  # validated already: a failure here is a bug, kept local
            self.release(slot)
            self._finish(request, error=AiodlaError(f"packing the input failed: {exc}"))
            return
        self._submit(slot, request, now)

    def _submit(self, slot: Slot, request: Request | None, now: float | None = None) -> None:
        try:
            now = time.monotonic() if now is None else now
            self.cores.submit(slot, now)
        except Exception as exc:
            self._submit_failed(slot, request, exc)
            return
        if request is not None:
            request.state = RequestState.IN_FLIGHT  # (Scheduler.advance, inlined: hot path)
        self.poller.watch(slot)  # type: ignore[union-attr]

    # -- completions (loop thread, one call per poller sweep) -----------------------------------

    def on_completions(self, finished: list[tuple[Slot, int]]) -> None:
        """Slots the poller saw done, each with its core's cuDLA status read then."""
        if self.state is EngineState.CLOSED:
            return  # a late wake-up after close: nothing is left to touch
        try:
            self._handle_completions(finished)
        finally:
            # After the callers this batch woke took their step (see _after_batch).
            self.loop.call_soon(self._after_batch)  # type: ignore[union-attr]

    def _after_batch(self) -> None:
        """The loop is free again: take what finished meanwhile at once if several
        tasks should have, else hand polling back (see the poller's module docstring)."""
        poller = self.poller
        if poller is None or self.state is EngineState.CLOSED:
            return
        try:
            finished = poller.harvest()
        except Exception as exc:  # as from the poller's own sweep: the engine is dead
            self._die_callback(exc)
            return
        if finished:
            self.on_completions(finished)  # which schedules _after_batch again
        else:
            poller.consumed()

    def _handle_completions(self, finished: list[tuple[Slot, int]]) -> None:
        now = time.monotonic()
        scheduler = self.scheduler
        take_compute_failure = self.cores.take_compute_failure
        for slot, status in finished:
            core = slot.core
            request = slot.request
            # The emulated runtime's compute function failed on this slot's task: the
            # request fails, the core is not blamed (the DLA part of the task ran).
            failure = None if take_compute_failure is None else take_compute_failure(slot)
            if request is not None or slot.probing:  # a task ran (not a retired slot)
                self.cores.account(slot, status, now)
                if status:
                    self._task_failed(core, status)
                else:
                    core.consecutive_failures = 0  # the fault policy's whole answer
            if slot.probing:
                slot.probing = False
                self.release(slot)
                if scheduler.probe_ended(core, status):
                    logger.warning(
                        "aiodla: core %d is back in rotation (a probe task succeeded)", core.core
                    )
                else:
                    self._schedule_probe(core)
                continue
            if request is None or request.future.done():  # none, or ended meanwhile
                self.release(slot)
                continue
            if self.trace is not None:
                self.trace.completed(request, slot)
            if status:
                self.release(slot)
                message = f"the DLA task failed on core {core.core}: {status_name(status)}"
                self._finish(request, error=TaskError(message, status=status, core=core.core))
                continue
            if failure is not None:
                self.release(slot)
                self._finish(request, error=failure)
                continue
            if self.offload_unpack and not slot.pooled:  # (pool memory: nothing to unpack)
                scheduler.advance(request, RequestState.UNPACKING)
                request.future.set_result(None)  # its coroutine unpacks off the loop
                continue
            try:
                outputs = read_results(self.cores, self.postprocess, slot)
            except PostprocessError as exc:  # this request's outputs only: it fails alone
                self.release(slot)
                self._finish(request, error=exc)
                continue
            self.release(slot)
            self._finish(request, result=outputs, now=now)
        self.transition()

    def _task_failed(self, core: CoreState, status: int) -> None:
        """A DLA task failed: say so, and apply the fault policy."""
        logger.warning(
            "aiodla: a DLA task failed on core %d: %s (%d in a row)",
            core.core,
            status_name(status),
            core.consecutive_failures + 1,
        )
        if self.scheduler.task_ended(core, status):
            logger.warning(
                "aiodla: core %d is out of rotation after %d consecutive faults; "
                "probing it every %g s",
                core.core,
                core.consecutive_failures,
                self._options.probe_interval,
            )
            self._schedule_probe(core)

    # -- the fault policy: probing a core out of rotation ------------------------------------

    def _schedule_probe(self, core: CoreState) -> None:
        assert self.loop is not None
        core.probe = self.loop.call_later(self._options.probe_interval, self._probe, core)

    def _probe(self, core: CoreState) -> None:
        """Run one task on a core out of rotation; success brings it back."""
        core.probe = None
        if self.state is not EngineState.OPEN or core.in_rotation:
            return
        if not core.idle:  # its slots are still busy (a hung task): try again later
            self._schedule_probe(core)
            return
        slot = self.scheduler.take(core)
        slot.probing = True
        self.cores.write_zeros(slot)
        logger.info("aiodla: probing core %d", core.core)
        self._submit(slot, None)

    # -- ending requests -----------------------------------------------------------------------

    def release(self, slot: Slot) -> None:
        """Return ``slot`` to the pool (the caller runs the transition afterwards)."""
        self.cores.recycle(slot)
        self.scheduler.release(slot)
        if self.drained is not None and self.scheduler.idle_slots == len(self.cores.slots):
            self.drained.set()

    def _finish(
        self,
        request: Request,
        *,
        result: Any = None,
        error: BaseException | None = None,
        timed_out: bool = False,
        now: float | None = None,
    ) -> BaseException | None:
        """Decide the request's one outcome, count it, deliver it; return the error."""
        state = request.state  # before finish() ends it: a coroutine's own step or not
        if timed_out:
            error = RequestTimeoutError("the request's timeout passed before its result was ready")
            outcome, reason = Outcome.TIMED_OUT, None
        elif error is not None:
            outcome, reason = Outcome.FAILED, failure_reason(error)
        else:
            outcome, reason = Outcome.COMPLETED, None
        if not self.scheduler.finish(request, outcome, reason):
            return None
        if request.sources:
            _let_go(request)
        if outcome is Outcome.COMPLETED:
            latency = (time.monotonic() if now is None else now) - request.started
            self.latency.add(latency)
            self.latency_histogram.add(latency)
        future = request.future
        if not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        elif state is RequestState.PACKING or state is RequestState.UNPACKING:
            # Its coroutine is doing a step of its own and takes the outcome after it.
            request.late = (result, error)
        return error

    def _take_late(self, request: Request) -> Any:
        """Deliver an outcome decided while the request's coroutine did a step, and give
        back the slot that step held."""
        if request.slot is not None:
            self.release(request.slot)
            self.transition()
        assert request.late is not None
        result, error = request.late
        if error is not None:
            raise error
        return result

    def _expire(self, request: Request) -> None:
        request.timer = None
        if request.state in (RequestState.QUEUED, RequestState.IN_FLIGHT):
            self._finish(request, timed_out=True)
        # A request packing or unpacking in a worker thread checks its deadline itself.

    def abandon(self, request: Request) -> None:
        """The request's coroutine was cancelled: count it as cancelled (what its caller
        saw), and pass on a slot that its own step held."""
        state = request.state
        slot = request.slot
        if slot is not None and (
            state in (RequestState.PACKING, RequestState.UNPACKING) or request.late is not None
        ):
            self.release(slot)
        if state is RequestState.DONE:
            self.scheduler.recount_as_cancelled(request)
        else:
            self.scheduler.finish(request, Outcome.CANCELLED)
        _let_go(request)
        self.transition()

    # -- large tensors: pack and unpack in a worker thread ---------------------------------------

    async def _pack_off_loop(self, request: Request) -> Any:
        slot = request.slot
        assert slot is not None
        try:
            await anyio.to_thread.run_sync(self.cores.write_inputs, slot, request.arrays)
        except Exception as exc:
            if request.state is RequestState.DONE:
                return self._take_late(request)
            self.release(slot)
            error = self._finish(request, error=AiodlaError(f"packing the input failed: {exc}"))
            self.transition()
            raise error from exc  # type: ignore[misc]
        if request.state is RequestState.DONE:
            return self._take_late(request)
        loop = self.loop
        assert loop is not None
        serving = self.state is EngineState.OPEN
        if not serving or (request.deadline is not None and loop.time() >= request.deadline):
            self.release(slot)
            if serving:
                error = self._finish(request, timed_out=True)
            else:
                error = self._finish(request, error=self.not_serving_error())
            self.transition()
            raise error  # type: ignore[misc]
        request.future = loop.create_future()
        self._submit(slot, request)
        return await request.future

    async def _unpack_off_loop(self, request: Request) -> Any:
        slot = request.slot
        assert slot is not None
        try:
            result = await anyio.to_thread.run_sync(
                read_results, self.cores, self.postprocess, slot
            )
        except PostprocessError as exc:
            if request.state is RequestState.DONE:
                return self._take_late(request)
            self.release(slot)
            self._finish(request, error=exc)
            self.transition()
            raise
        if request.state is RequestState.DONE:
            return self._take_late(request)
        self.release(slot)
        self._finish(request, result=result)
        self.transition()
        return result

    def not_serving_error(self) -> AiodlaError:
        if self.dead_cause is not None:
            error: AiodlaError = EngineDeadError(f"the engine is dead: {self.dead_cause}")
            error.__cause__ = self.dead_cause
            return error
        return EngineClosedError("the engine was closed")


def _poller(
    cores: Cores,
    loop: asyncio.AbstractEventLoop,
    deliver: Callable[[list[tuple[Slot, int]]], None],
    fail: Callable[[BaseException], None],
) -> Poller:
    """The in-process completion source (``isolation="process"`` passes the worker's)."""
    poller = Poller(cores.probe, loop, deliver, fail, pause=cores.poll_pause)
    poller.start()
    return poller


def _let_go(request: Request) -> None:
    """Release the device arrays of a request that ended before a slot took them."""
    sources, request.sources = request.sources, ()
    release_sources(sources)
