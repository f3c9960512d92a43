"""One request's path on the event loop's thread: from its slot to its future.

The engine admits a request; from there the flow starts it on the slot the dispatcher
gives it (through the device layer), takes the completions the device layer reports
(telling the dispatcher's fault policy each task's status), runs the probe tasks the
dispatcher starts, ends each request exactly once and hands the outcome to its future,
or to its coroutine for the steps it does itself (``_offload`` drives that coroutine).

Only the event loop's thread runs this code.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio

from ._core_record import forget
from ._data_path import release_sources
from ._device import CompletionSource, DeviceLayer, device_error, is_sticky
from ._dispatch import Dispatcher
from ._errors import AiodlaError, PostprocessError, RequestTimeoutError, TaskError, status_name
from ._life import EngineState, Life
from ._offload import pack, unpack
from ._options import EngineOptions
from ._scheduler import Outcome, Request, RequestState, Scheduler
from ._slots import CoreLane, Slot
from ._statistics import Durations, failure_reason
from ._trace import TraceRecorder

__all__ = ["Flow"]

logger = logging.getLogger("aiodla")


class Flow:
    """The loop-thread side of an open engine: starts, completions, outcomes.

    Built when the engine opens, over its device layer (``device``) and its loop; it
    reads the engine's :class:`~aiodla._life.Life` (work starts only while it is OPEN;
    after CLOSED a late completion is ignored) and never writes it. ``poller`` is where
    completions come from (``completions`` makes it for the flow): the one poller of
    the :class:`aiodla.Cores` the engine is on, or the worker's supervisor with process
    isolation. ``dispatcher``: that ``Cores``' dispatcher (a lone engine's own cores
    have one too), which decides who starts next; :meth:`transition` is its
    ``assign``.
    """

    def __init__(
        self,
        options: EngineOptions,
        device: DeviceLayer,
        life: Life,
        loop: asyncio.AbstractEventLoop,
        die: Callable[[BaseException], None],
        dispatcher: Dispatcher,
        completions: Callable[[Flow], CompletionSource],
    ) -> None:
        self._options = options
        self.device = device
        self.life = life
        self.loop = loop
        self._die = die
        self.postprocess = device.postprocess  # Engine(postprocess=...), else None
        self.scheduler = Scheduler()
        self.lanes = device.lanes  # its lane on each core (the dispatcher reads them)
        # A step runs in a worker thread when it would move more than ``offload_bytes``
        # on the host: a thread hop costs the loop less than copying megabytes, more
        # than a step with no copy. Packing is weighed per request (a device array or a
        # frame read in place from a frame buffer costs the host nothing);
        # ``offload_pack`` False skips the weighing where no request can pass the limit.
        self._offload_limit = limit = options.offload_bytes
        self.offload_pack = sum(s.size for s in device.inputs) > limit or any(device.preprocessing)
        # With the heads decoded on the stream the host reads back only the kept boxes.
        self.offload_unpack = (
            not device.detects_on_stream and sum(s.size for s in device.outputs) > limit
        )
        window = options.latency_window
        self.latency = Durations(window)
        self.queue_wait = Durations(window)
        self.trace: TraceRecorder | None = None  # engine.trace() installs one
        # Set once every slot is idle again while the engine closes (``drain``).
        self._drained = asyncio.Event()
        self._draining = False
        self.dispatcher = dispatcher
        # Give idle slots to waiting requests: called after every admission, completion,
        # cancellation and release. The one decision, the dispatcher's, bound here (a
        # call of the flow's own in between would cost every request one more call).
        self.transition: Callable[[], None] = dispatcher.assign
        self.client = dispatcher.join(
            self,
            options.priority,
            options.weight,
            max_faults=options.max_consecutive_faults,
            probe_interval=options.probe_interval,
        )
        # It reports from now on.
        self.poller = completions(self)

    def leave(self) -> None:
        """The engine is closed: its share of the cores goes to the others."""
        self.dispatcher.leave(self.client)

    def cancel_probes(self) -> None:
        self.dispatcher.cancel_probes(self.client)

    def fail_waiting(self, error: AiodlaError) -> None:
        for request in self.scheduler.drain(failure_reason(error)):
            _let_go(request)
            if not request.future.done():  # (a cancelled caller's future is done)
                request.future.set_exception(error)

    def fail_running(self, error: AiodlaError) -> None:
        for slot in self.device.slots:
            running = slot.request
            if running is not None and running.state is not RequestState.DONE:
                self.finish(running, error=error)

    def worker_lost(self) -> None:
        """The worker process that ran the cores was lost: no request starts on them
        until :meth:`worker_replaced`."""
        self.dispatcher.suspend(self.client)

    def worker_replaced(self) -> None:
        """A new worker process serves: the cores are back, their estimates fresh."""
        self.dispatcher.resume(self.client)
        for core in self.device.lanes:
            forget(core)
        self.transition()

    def fail_all(self) -> None:
        """The engine died: fail every waiting and running request with why."""
        self.cancel_probes()
        self.fail_waiting(self.life.not_serving_error())
        self.fail_running(self.life.not_serving_error())
        self._drained.set()

    async def drain(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, until every slot is idle again."""
        self._draining = True
        if self.client.idle_slots < len(self.device.slots):
            with anyio.move_on_after(timeout):
                await self._drained.wait()

    def admit(self, request: Request, timeout: float | None) -> Request:
        """Put a validated request in line, with its deadline, and start it if a slot
        is idle."""
        if timeout is not None:
            request.deadline = self.loop.time() + timeout
            request.timer = self.loop.call_at(request.deadline, self._expire, request)
        self.scheduler.admit(request)
        if self.client.idle_slots:
            self.transition()
        return request

    # -- starting a request ---------------------------------------------------------------

    def start(self, request: Request, slot: Slot) -> None:
        """Start ``request`` on the slot it was given (or end it, past its deadline)."""
        now = time.monotonic()
        waited = now - request.started
        self.queue_wait.add(waited)
        if request.deadline is not None and self.loop.time() >= request.deadline:
            self.release(slot)
            self.finish(request, timed_out=True)
            return
        if self.trace is not None:
            self.trace.assigned(request, slot, now)
        # From now on the slot holds the request's device arrays: released with it,
        # once no kernel of it can read them.
        slot.keep, request.sources = request.sources, ()
        # Staged here unless that moves more than offload_bytes on the host: then in a
        # worker thread (PACKING, off the loop).
        limit = self._offload_limit if self.offload_pack else None
        try:
            staged = self.device.write_inputs(slot, request.arrays, limit)
        except Exception as exc:  # validated already: a failure here is a bug, kept local
            self.release(slot)
            self.finish(request, error=AiodlaError(f"packing the input failed: {exc}"))
            return
        if not staged:
            self._step(request, pack(self, request, slot))
            return
        self.submit(slot, request, now)

    def submit(self, slot: Slot, request: Request | None, now: float | None = None) -> None:
        """Enqueue the slot's work. A failed submission fails its request; the slot goes
        back to the pool once what reached its stream ran (see :meth:`fail_submission`)."""
        device = self.device
        try:
            now = time.monotonic() if now is None else now
            device.submit(slot, now)
        except Exception as exc:
            # Some copies may be queued on the stream already: the slot is reusable only
            # after they ran, so mark the stream's end and let the poller return the slot.
            # A slot whose end could not be marked is lost to the pool.
            if self.fail_submission(slot, exc) and device.retire(slot, time.monotonic()):
                self.poller.watch(slot)
            return
        if request is not None:
            self.scheduler.advance(request, RequestState.IN_FLIGHT)
        self.poller.watch(slot)

    def fail_submission(self, slot: Slot, exc: BaseException) -> bool:
        """The slot's submission failed: its request fails with a
        :class:`~aiodla.DeviceError` naming the call, a probe is tried again later; a
        sticky CUDA error kills the engine instead (False then)."""
        if is_sticky(exc):
            self._die(exc)
            return False
        doing = f"core {slot.core.core}: submitting the request"
        error = device_error(doing, exc) or AiodlaError(f"{doing} failed: {exc!r}")
        if error is not exc:
            error.__cause__ = exc
        request = slot.request
        if request is not None:
            self.dispatcher.lost_slot(request)
            self.finish(request, error=error)
        else:  # (by its text: a kept record would keep the error's traceback, its frames)
            logger.warning("aiodla: %s", str(error))
        if slot.probing:  # the probe never ran: try again later
            slot.probing = False
            self.dispatcher.probe_later(self.client, slot.core)
        return True

    # -- completions (loop thread, one call per poller sweep) -----------------------------------

    def on_completions(self, finished: list[tuple[Slot, int]]) -> None:
        """Slots the poller saw done, each with its core's cuDLA status read then."""
        if self.life.state is EngineState.CLOSED:
            return  # a late wake-up after close: nothing is left to touch
        try:
            now = time.monotonic()
            dispatcher = self.dispatcher
            take_compute_failure = self.device.take_compute_failure
            for slot, status in finished:
                core = slot.core
                request = slot.request
                # The emulated runtime's compute function failed on this slot's task: the
                # request fails, the core is not blamed (the DLA part of the task ran).
                failure = None if take_compute_failure is None else take_compute_failure(slot)
                if request is not None or slot.probing:  # a task ran (not a retired slot)
                    self.device.account(slot, status, now)
                    if status:
                        self._task_failed(core, status)
                    elif core.consecutive_failures:  # a success ends a run of failures
                        dispatcher.task_ended(self.client, core, 0)
                if slot.probing:
                    slot.probing = False
                    self.release(slot)
                    if dispatcher.probe_ended(self.client, core, status):
                        logger.warning(
                            "aiodla: core %d is back in rotation (a probe task succeeded)",
                            core.core,
                        )
                    continue
                if request is None or request.future.done():  # none, or ended meanwhile
                    self.release(slot)
                    continue
                if self.trace is not None:
                    self.trace.completed(request, slot)
                if status:
                    self.release(slot)
                    message = f"the DLA task failed on core {core.core}: {status_name(status)}"
                    self.finish(request, error=TaskError(message, status=status, core=core.core))
                    continue
                if failure is not None:
                    self.release(slot)
                    self.finish(request, error=failure)
                    continue
                if self.offload_unpack and not slot.pooled:  # (pool memory: nothing to unpack)
                    self.scheduler.advance(request, RequestState.UNPACKING)
                    self._step(request, unpack(self, request, slot))  # off the loop
                    continue
                try:
                    outputs = self.device.read_outputs(slot)
                except PostprocessError as exc:  # this request's outputs only: it fails alone
                    self.release(slot)
                    self.finish(request, error=exc)
                    continue
                self.release(slot)
                self.finish(request, result=outputs, now=now)
            self.transition()
        finally:
            # After the callers this batch woke took their step (see _after_batch).
            self.loop.call_soon(self._after_batch)

    def _after_batch(self) -> None:
        """The loop is free again: take what finished meanwhile at once if several
        tasks should have, else hand polling back (see the poller's module docstring)."""
        if self.life.state is EngineState.CLOSED:
            return
        try:
            finished = self.poller.harvest()
        except Exception as exc:  # as from the poller's own sweep: the engine is dead
            self._die(exc)
            return
        if finished:
            self.on_completions(finished)  # which schedules _after_batch again
        else:
            self.poller.consumed()

    def read_results(self, slot: Slot) -> Any:
        """A slot's results as the engine returns them (post-processed by the device
        layer when the engine has a ``postprocess``, whose errors come as
        PostprocessError)."""
        return self.device.read_outputs(slot)

    def _task_failed(self, core: CoreLane, status: int) -> None:
        """A DLA task failed: say so, and apply the fault policy."""
        logger.warning(
            "aiodla: a DLA task failed on core %d: %s (%d in a row)",
            core.core,
            status_name(status),
            core.consecutive_failures + 1,
        )
        if self.dispatcher.task_ended(self.client, core, status):
            logger.warning(
                "aiodla: core %d is out of rotation after %d consecutive faults; "
                "probing it every %g s",
                core.core,
                core.consecutive_failures,
                self._options.probe_interval,
            )

    def probe(self, slot: Slot) -> None:
        """Run one task on a core out of rotation, on the slot the dispatcher took for
        it (its probe was due); success brings the core back."""
        core = slot.core
        slot.probing = True
        self.device.write_zeros(slot)
        logger.info("aiodla: probing core %d", core.core)
        self.submit(slot, None)

    # -- ending requests -----------------------------------------------------------------------

    def release(self, slot: Slot) -> None:
        """Return ``slot`` to the pool (the caller runs the transition afterwards)."""
        self.device.recycle(slot)
        client = self.client
        self.dispatcher.release(client, slot)
        if self._draining and client.idle_slots == len(self.device.slots):
            self._drained.set()

    def finish(
        self,
        request: Request,
        *,
        result: Any = None,
        error: BaseException | None = None,
        timed_out: bool = False,
        now: float | None = None,
    ) -> BaseException | None:
        """Decide the request's one outcome, count it, deliver it; return the error."""
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
        future = request.future
        if not future.done():  # (a cancelled caller's future is done)
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        return error

    def give_back(self, request: Request) -> None:
        """A step off the loop is over: the slot it held (if the request still holds
        one: a close may have taken it back) returns to the pool."""
        slot = request.slot
        if slot is not None:
            self.release(slot)
        self.transition()

    def _step(self, request: Request, step: Coroutine[Any, Any, None]) -> None:
        """Run one of the request's steps off the loop (``_offload``) as a task of its
        own; the request keeps it, so that its caller's cancellation reaches it."""
        request.step = self.loop.create_task(step)

    def _expire(self, request: Request) -> None:
        request.timer = None
        if request.state in (RequestState.QUEUED, RequestState.IN_FLIGHT):
            self.finish(request, timed_out=True)
        # A request packing or unpacking in a worker thread checks its deadline itself.

    def abandon(self, request: Request) -> None:
        """The request's caller was cancelled: count it as cancelled (what its caller
        saw). A step of its own that still runs is cancelled too: it gives back its slot
        at once when its thread has not started, else when the thread is done."""
        state = request.state
        step = request.step
        if step is not None and not step.done():
            step.cancel()
        if state is RequestState.DONE:
            self.scheduler.recount_as_cancelled(request)
        else:
            self.scheduler.finish(request, Outcome.CANCELLED)
        _let_go(request)
        self.transition()


def _let_go(request: Request) -> None:
    """Release the device arrays of a request that ended before a slot took them."""
    sources, request.sources = request.sources, ()
    release_sources(sources)
