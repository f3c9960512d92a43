"""Supervision of the worker process: spawn, control channel, heartbeat, replacement.

The supervisor is the application side of ``isolation="process"``. It spawns the
worker (a fresh interpreter, never a fork of a process with CUDA state), sends it the
model, and from then on is, for the flow, what the poller is in-process: slots go out
in batches (one message per loop iteration), completions come back in batches, read by
the event loop itself from the channel.

When the worker is lost (its CUDA context broke and it said so, it died, or it stopped
answering heartbeats) the requests in flight on it fail with :class:`WorkerLostError`
(the cause and the exit status), queued requests stay queued, and a new worker is
started, at once the first time and then with back-off; more than ``max_restarts``
losses within ``restart_window`` seconds make the engine dead, as in-process.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import logging
import signal
import subprocess
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import anyio

from .._device import CompletionSink
from .._errors import WorkerLostError
from .._options import EngineOptions, ProcessIsolation
from .._scheduler import RequestState
from .._slots import CoreLane, Slot
from ._channel import Channel
from ._launch import EXIT_GRACE, Handshake, HungUp, Worker, open_lost, reap
from ._process import _kill, _spawn, _wait
from ._shared_frames import SharedFrame, send_frames
from ._worker import CONTEXT_LOST_EXIT

__all__ = ["Served", "Supervisor", "WorkerState", "inject_fault", "launch_worker"]

logger = logging.getLogger("aiodla")

# Opening a model in a fresh interpreter (imports, the runtime, the module, the slots)
# takes about a second here; a worker silent for this long while opening is hung.
OPEN_TIMEOUT = 60.0
# Back-off before a replacement: none after a worker that served (completed a task),
# then doubling with each worker in a row lost before it completed one (a crash loop).
FIRST_BACKOFF = 0.1
# A test control's round trip: the worker answers between two messages, in well under
# a millisecond; this long without an answer means it is not going to.
CONTROL_TIMEOUT = 10.0
MAX_BACKOFF = 2.0


async def launch_worker(loop: asyncio.AbstractEventLoop, open_message: tuple[Any, ...]) -> Worker:
    """Start a worker and have it open the model; its failure to is raised here (a
    :class:`WorkerLostError` when it ended or did not answer within ``OPEN_TIMEOUT``)."""
    process, sock = _spawn()
    handshake = Handshake(loop)
    channel = Channel(sock, loop, handshake.on_messages, handshake.on_hang_up)
    channel.send(open_message)
    try:
        with anyio.fail_after(OPEN_TIMEOUT):
            ready = await handshake.ready
    except BaseException as exc:
        channel.close()
        status = await reap(process, kill=not isinstance(exc, HungUp))
        lost = open_lost(process.pid, status, exc, handshake.said, OPEN_TIMEOUT)
        if lost is None:
            raise
        raise lost from None
    return Worker(process, channel, ready, channel.fds.pop(0))


class Served(Protocol):
    """What the supervisor serves: the application's side of the worker's cores."""

    lanes: list[CoreLane]
    slots: list[Slot]

    def bind_worker(self, ready: dict[str, Any], fd: int) -> None: ...
    def shared_frames(self) -> list[SharedFrame]: ...
    def submission(self, slot: Slot) -> Any: ...
    def record_failure(self, slot: Slot, failure: BaseException) -> None: ...
    def record_stages(self, slot: Slot, stages: tuple[float, float, float]) -> None: ...


class WorkerState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    RESTARTING = "restarting"
    FAILED = "failed"  # past max_restarts: the engine is dead
    STOPPED = "stopped"


class Supervisor:
    """One engine's worker process, replaced as often as the policy allows.

    State (loop thread only): ``state``; ``_channel`` and ``_process``, the current
    worker's; ``_pending``, slot numbers to send with the next batch; ``_unproven``,
    workers lost in a row before they completed a task (the back-off); ``_losses``, when
    recent workers were lost (the restart policy's window); ``restart_times``, how long
    each replacement took, from the loss to the new worker ready.
    """

    def __init__(
        self,
        options: EngineOptions,
        open_message: tuple[Any, ...],
        worker: Worker,
        cores: Served,
        sink: CompletionSink,
        die: Callable[[BaseException], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._options = options
        # Its settings (the engine opens a supervisor only with process isolation).
        self._settings = options.process_isolation or ProcessIsolation()
        self._die = die
        self._open_message = open_message
        self._served = cores
        self._sink = sink
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self.state = WorkerState.SERVING
        self.last_loss: WorkerLostError | None = None
        self.restart_times: list[float] = []
        self.exit_status: int | None = None  # the last worker's, once it ended
        self._losses: collections.deque[float] = collections.deque()
        self._unproven = 0  # workers lost in a row before completing any task
        self._pending: list[Any] = []  # Served.submission of each slot
        self._heartbeat: asyncio.TimerHandle | None = None
        self._recovery: asyncio.Task[None] | None = None
        self._failed_in_flight = False  # this loss's in-flight requests are failed
        self._injections: dict[int, asyncio.Future[None]] = {}
        self._tokens = itertools.count()
        # aiodla.testing's controls, told of each submission before it is sent (a
        # fault meant for "the next task, wherever it goes" is armed there first).
        self.submit_hook: Callable[[int], None] | None = None
        # ... and asked, before a serving worker is told to close, to read its counters.
        self.close_hook: Callable[[], None] | None = None
        self._adopt(worker)

    def _adopt(self, worker: Worker) -> None:
        """Serve through ``worker`` (ready: it opened the model, and the cores are
        bound to its staging) from now on."""
        self._process, self.pid = worker.process, worker.process.pid
        self._channel = worker.channel
        self._said: str | None = None  # the worker's own last words on why it goes
        self._proven = False  # the current worker has completed a task
        # Weakly: the loop's reader must not keep an engine dropped unclosed alive (it
        # could never warn, and its worker would run as long as the loop).
        worker.channel.receive_with(_weakly(self._on_messages), _weakly(self._on_hang_up))
        # The engine's frame buffers, mapped by this worker before its first submission.
        send_frames(worker.channel, self._served.shared_frames())
        self._asked_at: float | None = None  # when the unanswered ping was sent
        self._schedule_heartbeat()

    # -- the channel ---------------------------------------------------------------------------

    def _on_messages(self, messages: list[Any]) -> None:
        self._asked_at = None  # any message answers the heartbeat
        slots = self._served.slots
        done: list[tuple[Slot, int]] = []
        for message in messages:
            kind = message[0]
            if kind == "done":
                for number, status, failure, stages, ran in message[1]:
                    slot = slots[number]
                    if not ran:  # as in-process: the request fails, nothing is counted
                        # (its slot is retired: the completion below only returns it)
                        self._sink.fail_submission(slot, failure)
                    elif failure is not None:
                        self._served.record_failure(slot, failure)
                    if stages is not None:
                        self._served.record_stages(slot, stages)
                    done.append((slot, status))
            elif kind == "lost":
                self._said = message[1]  # the hang-up follows
            elif kind == "injected":
                waiter = self._injections.pop(message[1], None)
                if waiter is not None and not waiter.done():
                    if message[2] is None:
                        waiter.set_result(None)
                    else:
                        waiter.set_exception(message[2])
        if done:
            self._proven = True
            self._sink.on_completions(done)

    def _on_hang_up(self, why: str) -> None:
        self._lose(self._said)

    # -- what the flow calls on its completion source ------------------------------------------

    def watch(self, slot: Slot) -> None:
        """The slot was submitted: send it to the worker with this loop iteration's
        batch (the worker's poller watches it there)."""
        if self.state is not WorkerState.SERVING:
            # The worker is lost: the slot is failed with the others in flight (now,
            # if that already happened).
            if self._failed_in_flight and self.last_loss is not None:
                self._loop.call_soon(self._fail_in_flight, self.last_loss)
            return
        if self.submit_hook is not None:
            self.submit_hook(slot.core.core)
        pending = self._pending
        pending.append(self._served.submission(slot))
        # Alone in the worker (light load), nothing can join its batch: it goes now,
        # not on the loop's next turn.
        if sum(len(c.slots) - len(c.idle) for c in self._served.lanes) <= 1:
            self._send_pending()
        elif len(pending) == 1:
            self._loop.call_soon(self._send_pending)

    def share_frames(self, frames: list[SharedFrame]) -> None:
        """New frame buffers: the serving worker maps them before any request that
        reads one (the channel keeps order); without one, the next worker maps them
        as it is adopted. From another thread (a camera reader's), through the loop,
        which alone writes the channel."""
        if threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self.share_frames, frames)
        elif self.state is WorkerState.SERVING:
            send_frames(self._channel, frames)

    def _send_pending(self) -> None:
        pending, self._pending = self._pending, []
        if pending and self.state is WorkerState.SERVING:
            self._channel.send(("submit", pending))

    def harvest(self, at_least: int | None = None) -> list[tuple[Slot, int]]:
        """Nothing to sweep here: completions arrive on the channel."""
        return []

    def consumed(self) -> None:
        """The worker's poller goes on as soon as its batch is sent."""

    def stop(self) -> None:
        """Tell the worker to close (the engine drained it already); from another
        thread (an engine collected unclosed), kill it instead."""
        loop = self._loop
        if threading.get_ident() != self._loop_thread or not loop.is_running():
            self.abandon()  # an engine collected unclosed: no loop to talk through
            return
        if self.state is WorkerState.SERVING and self.close_hook is not None:
            self.close_hook()  # its last round trips, while the worker still serves
        previous, self.state = self.state, WorkerState.STOPPED
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._recovery is not None:
            self._recovery.cancel()
        channel = self._channel
        if not channel.closed:
            if previous is WorkerState.SERVING:
                self._send_pending()
                channel.send(("close",))
                channel.flush_blocking(1.0)
            channel.close()

    def abandon(self) -> None:
        """An engine collected unclosed (its finalizer, on any thread): kill the worker
        and reap it, and let the socket go, with no round trip."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        _let_go(self._channel, self._loop, self._loop_thread, self._process)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the worker to exit (in a thread): it releases every handle first."""
        process = self._process
        limit = self._options.close_timeout + EXIT_GRACE if timeout is None else timeout
        try:
            self.exit_status = _wait(process, limit)
        except subprocess.TimeoutExpired:
            logger.warning("aiodla: the worker (pid %d) did not exit; killing it", process.pid)
            _kill(process)
            self.exit_status = _wait(process)
        if self.exit_status:
            logger.warning(
                "aiodla: the worker (pid %d) exited with status %d", process.pid, self.exit_status
            )

    def shut_down(self) -> None:
        """The engine's last step (in a thread): no worker is left behind."""
        process = self._process
        if process.poll() is None:
            _kill(process)
        self.exit_status = _wait(process)

    # -- losing a worker, and replacing it ------------------------------------------------

    def _schedule_heartbeat(self) -> None:
        interval = self._settings.heartbeat_timeout / 4
        self._heartbeat = self._loop.call_later(interval, _weakly(self._beat))

    def _beat(self) -> None:
        """Ping the worker; a ping unanswered for ``heartbeat_timeout`` means it hangs.
        Timed from the ping, not from the last message: a loop of ours that was held
        up finds the answer waiting, and reads it before judging."""
        channel = self._channel
        if self.state is not WorkerState.SERVING:
            return
        timeout = self._settings.heartbeat_timeout
        asked = self._asked_at
        if asked is not None and time.monotonic() - asked > timeout:
            channel.read_now()
            if channel.closed:
                return  # it hung up meanwhile: that loss is being handled
            if self._asked_at is not None:
                silent = time.monotonic() - asked
                self._lose(
                    f"it stopped answering (a heartbeat unanswered for {silent:.2f} s, "
                    f"heartbeat_timeout={timeout:g} s)",
                    kill=True,
                )
                return
        if self._asked_at is None:
            self._asked_at = time.monotonic()
            channel.send(("ping", self._asked_at))
        self._schedule_heartbeat()

    def _lose(self, cause: str | None, kill: bool = False) -> None:
        """The worker is lost: stop using it at once; fail, restart in a task.
        ``cause`` None: it just ended (its exit status will say how)."""
        if self.state is not WorkerState.SERVING:
            return
        self.state = WorkerState.RESTARTING
        lost_at = time.monotonic()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        self._channel.close()
        self._pending.clear()
        waiters, self._injections = self._injections, {}
        for waiter in waiters.values():  # a control the lost worker never confirmed
            if not waiter.done():
                waiter.set_exception(WorkerLostError(f"the worker was lost: {cause or 'it ended'}"))
        self._failed_in_flight = False
        self._unproven = 0 if self._proven else self._unproven + 1
        # No request is started until a new worker serves; they wait in the queue.
        self._sink.worker_lost()
        self._recovery = self._loop.create_task(self._recover(cause, kill, lost_at))

    async def _recover(self, cause: str | None, kill: bool, lost_at: float) -> None:
        pid = self._process.pid
        status = await reap(self._process, kill)
        self.exit_status = status
        if cause is None:
            cause = _ended(status)
        error = WorkerLostError(
            f"the worker process (pid {pid}) was lost: {cause} (exit status {status})",
            cause=cause,
            exit_status=status,
        )
        self.last_loss = error
        logger.error("aiodla: %s; queued requests wait for a new worker", error)
        self._fail_in_flight(error)
        options = self._settings
        while True:
            now = time.monotonic()
            losses = self._losses
            while losses and now - losses[0] > options.restart_window:
                losses.popleft()
            losses.append(now)
            if len(losses) > options.max_restarts:
                self.state = WorkerState.FAILED
                logger.error(
                    "aiodla: %d worker(s) lost within %g s (max_restarts=%d): the engine is dead",
                    len(losses),
                    options.restart_window,
                    options.max_restarts,
                )
                self._die(error)
                return
            if self._unproven:
                await asyncio.sleep(min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** (self._unproven - 1)))
            try:
                worker = await launch_worker(self._loop, self._open_message)
            except Exception as exc:
                logger.error("aiodla: a new worker failed to start: %s", exc)
                self._unproven += 1
                continue
            self._served.bind_worker(worker.ready, worker.staging_fd)
            self._adopt(worker)
            break
        self.state = WorkerState.SERVING
        self.restart_times.append(time.monotonic() - lost_at)
        logger.warning("aiodla: a new worker (pid %s) serves", self.pid)
        self._sink.worker_replaced()

    def _fail_in_flight(self, error: WorkerLostError) -> None:
        """Fail the requests the lost worker held and give their slots back."""
        self._failed_in_flight = True
        sink = self._sink
        slots = self._served.slots
        # A request packing or unpacking in a worker thread keeps its slot until that
        # thread is done with the staging; its coroutine then gives the slot back.
        held = {id(slot) for slot in slots if _in_a_thread(slot)}
        sink.fail_running(error)
        for slot in slots:
            slot.probing = False
            if slot not in slot.core.idle and id(slot) not in held:
                sink.release(slot)

    def control(
        self,
        gate: int | None,
        name: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        wait: bool = True,
    ) -> Any:
        """A test control of aiodla.testing on the worker's runtime (``gate`` None) or
        on one of its gates. It is sent after the submissions queued so far, as
        in-process it acts after them. With ``wait``, block until the worker applied it
        and return its result (or raise its error): a blocking round trip, so that it
        has acted before the test's next line."""
        channel = self._channel
        if self.state is not WorkerState.SERVING:
            raise WorkerLostError(f"no worker serves now ({self.state.value})")
        if threading.get_ident() != self._loop_thread:
            raise RuntimeError("call the controls of a process-mode engine from its loop's thread")
        self._send_pending()
        if not wait:
            channel.send(("control", None, gate, name, args, kwargs or {}))
            return None
        token = next(self._tokens)
        try:
            reply = channel.call_blocking(
                ("control", token, gate, name, args, kwargs or {}),
                lambda message: message[0] == "controlled" and message[1] == token,
                CONTROL_TIMEOUT,
            )
        except EOFError as exc:
            raise WorkerLostError(f"the worker was lost: {exc}") from None
        _, _, result, error = reply
        if error is not None:
            raise error
        return result

    async def inject(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Call the test control ``name`` on the worker's runtime, and wait until it
        has been applied (see :func:`inject_fault`)."""
        if self.state is not WorkerState.SERVING:
            raise WorkerLostError(f"no worker serves now ({self.state.value})")
        token = next(self._tokens)
        waiter = self._injections[token] = self._loop.create_future()
        self._channel.send(("inject", token, name, args, kwargs))
        await waiter


def _in_a_thread(slot: Slot) -> bool:
    request = slot.request
    return request is not None and request.state in (RequestState.PACKING, RequestState.UNPACKING)


def _ended(status: int | None) -> str:
    """How a worker that said nothing ended, in words."""
    if status is not None and status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"it was killed by {name}"
    if status == CONTEXT_LOST_EXIT:
        return "its CUDA context was lost"
    return "it exited unexpectedly"


async def inject_fault(engine: Any, name: str, *args: Any, **kwargs: Any) -> None:
    """Test control: call ``name`` (``fail_next_task``, ``hang_core``, ``poison``,
    ``fail_call``) with these arguments on the emulated runtime inside the worker of an
    ``isolation="process"`` engine, and return once it is armed there."""
    supervisor = getattr(engine._device, "supervisor", None)  # the engine's device layer
    if supervisor is None:
        raise TypeError("inject_fault needs an open engine with isolation='process'")
    await supervisor.inject(name, *args, **kwargs)


def _let_go(
    channel: Channel | None,
    loop: asyncio.AbstractEventLoop | None,
    loop_thread: int | None,
    process: subprocess.Popen[bytes] | None,
) -> None:
    """Close ``channel`` (through the loop when this is its running thread, which also
    stops the loop's watch of it) and kill and reap ``process``: no zombie is left."""
    if channel is not None and not channel.closed:
        on_loop = threading.get_ident() == loop_thread
        if on_loop and loop is not None and loop.is_running():
            channel.close()
        else:
            channel.abandon()
    if process is not None:
        _kill(process)
        _wait(process)


def _weakly(method: Callable[..., None]) -> Callable[..., None]:
    """``method``, held weakly: a no-op once its object is gone."""
    reference = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        target = reference()
        if target is not None:
            target(*args)

    return call
