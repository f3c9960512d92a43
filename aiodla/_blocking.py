"""The blocking API: :class:`BlockingEngine`, an :class:`~aiodla.Engine` for programs
that cannot ``await`` (a ``cv2.VideoCapture`` loop, a Flask handler, plain threads).

The engine and its event loop live in one background thread, started by anyio's
blocking portal (:func:`anyio.from_thread.start_blocking_portal`); every call from
any thread is carried into that loop by the portal, so the engine's own rule (only
its loop's thread touches futures and scheduler state) holds whatever thread calls.
Nothing here decides about a request: admission, queueing, cancellation and close
are the async engine's, with its error classes.

A forked child inherits the engine's object but not its loop thread (``fork`` copies
only the calling thread), nor a DLA context it may use: every call there raises at
once, naming the process that owns the engine, where a request would wait forever for
a loop that does not run. ``close`` there lets the child's copy go without touching
the parent's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

from ._engine import Engine, ModelSource
from ._errors import AiodlaError, EngineClosedError
from ._options import EngineKeywords
from ._statistics import EngineHealth, EngineStatistics
from ._tensors import TensorSpec
from .runtime._protocol import Runtime

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["BlockingEngine"]

_T = TypeVar("_T")


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


@dataclasses.dataclass(frozen=True)
class _Running:
    """The loop thread of an open engine: the portal that owns it, and its loop."""

    portal: BlockingPortal
    loop: asyncio.AbstractEventLoop
    thread: int  # the loop thread's ident
    pid: int  # the process the loop thread runs in

    def check_process(self) -> None:
        """Raise in a process forked from the one that runs the loop thread."""
        if os.getpid() != self.pid:
            raise AiodlaError(
                f"this BlockingEngine was opened in process {self.pid}; a forked child "
                f"(process {os.getpid()}) has no copy of its event-loop thread or of the "
                "DLA context, so it cannot run requests: open a new BlockingEngine in "
                "the child, or start the child with the 'spawn' method"
            )


class BlockingEngine:
    """:class:`~aiodla.Engine` for synchronous code: ``infer`` blocks the calling thread.

    ``model`` and every keyword are the async engine's, forwarded unchanged. Use it as
    a plain context manager::

        with aiodla.BlockingEngine("model.bin", cores=[0, 1]) as engine:
            y = engine.infer(x)                 # from any number of threads at once
            future = engine.infer_future(x)     # a concurrent.futures.Future

    The engine runs on an event loop in one background thread (anyio's blocking
    portal). ``infer`` and ``infer_future`` may be called from many threads at once.
    Errors are the async engine's classes (:class:`~aiodla.InputError`,
    :class:`~aiodla.QueueFullError`, :class:`~aiodla.EngineClosedError`, ...).

    The blocking calls (opening, ``infer``, closing) refuse to run on a thread whose
    event loop is running, which they would block (and deadlock, on the engine's own
    loop): async code uses :class:`~aiodla.Engine`. ``infer_future`` never blocks and
    may be called anywhere; ``asyncio.wrap_future`` awaits its result.

    An open engine belongs to its process: in a child made by ``os.fork`` (or
    ``multiprocessing``'s ``fork`` start method) its calls raise
    :class:`~aiodla.AiodlaError` at once; ``close`` there only drops the child's copy.
    """

    def __init__(
        self,
        model: ModelSource,
        *,
        runtime: str | Runtime = "auto",
        **options: Unpack[EngineKeywords],
    ) -> None:
        # Built here so a bad option fails at the call that gave it, as Engine's does.
        self._engine = Engine(model, runtime=runtime, **options)
        self._lock = threading.Lock()  # guards _state, _running, _inbox, _wake_pending
        self._inbox: list[tuple[Future[Any], Any, float | None, str]] = []
        self._wake_pending = False
        self._state = _State.NEW
        self._running: _Running | None = None  # while open
        self._pending: set[asyncio.Task[Any]] = set()  # requests' tasks, loop only
        self._stack = contextlib.ExitStack()

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> BlockingEngine:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Also after KeyboardInterrupt: the loop thread is not the interrupted one, so
        # it drains and closes the engine as for a normal exit.
        self.close()

    def open(self) -> None:
        """Start the loop thread and open the engine on it (as ``Engine.open``)."""
        _refuse_in_event_loop("opening a BlockingEngine")
        running = self._running
        if running is not None:
            running.check_process()
        with self._lock:
            if self._state is _State.CLOSED:
                raise EngineClosedError("Cannot reopen an engine once it has been closed.")
            if self._state is _State.OPEN:
                raise AiodlaError("the engine is open; open it once")
            portal = self._stack.enter_context(start_blocking_portal())
            try:
                portal.call(self._engine.open)
            except BaseException:
                self._state = _State.CLOSED
                self._stack.close()
                raise
            loop, thread = portal.call(_loop_and_thread)
            self._running = _Running(portal, loop, thread, os.getpid())
            self._state = _State.OPEN

    def close(self) -> None:
        """Stop admitting, drain in-flight work as ``Engine.aclose`` does (within
        ``close_timeout``), then end the loop thread. Idempotent.

        Requests that are queued or still running when the drain ends fail with
        :class:`~aiodla.EngineClosedError`, in their own threads.

        In a forked child it only drops the child's copy: the engine, its loop thread
        and its DLA handles are the parent's, which closes them.
        """
        _refuse_in_event_loop("closing a BlockingEngine")
        self._close()

    def _close(self) -> None:
        running = self._running
        if running is not None and os.getpid() != running.pid:
            # The child's copy of a lock another thread held at the fork stays held:
            # touch neither it nor the portal, whose thread is not in this process.
            self._running = None
            self._state = _State.CLOSED
            return
        with self._lock:
            running, self._running = self._running, None
            self._state = _State.CLOSED
        if running is None:
            return
        try:
            running.portal.call(self._aclose)
        finally:
            self._stack.close()  # waits for the tasks of calls already carried over

    @property
    def closed(self) -> bool:
        return self._state is _State.CLOSED

    # -- requests ---------------------------------------------------------------------------

    def infer(self, inputs: Any, *, timeout: float | None = None, output: str = "host") -> Any:
        """Run the model on ``inputs`` and return its output, blocking this thread
        (arguments and results as :meth:`aiodla.Engine.infer`; a full queue waits).

        Interrupting the waiting thread (``KeyboardInterrupt``) leaves the request to
        finish on the engine's loop; its result is dropped.
        """
        _refuse_in_event_loop("BlockingEngine.infer")
        return self._start(inputs, timeout, output).result()

    def infer_future(
        self, inputs: Any, *, timeout: float | None = None, output: str = "host"
    ) -> Future[Any]:
        """Start a request and return a :class:`concurrent.futures.Future` of its
        result. A closed engine raises here; bad input and every later error are the
        future's ``exception()``, of the async engine's classes.

        Cancellation: cancelling the future cancels the request as cancelling
        ``await engine.infer(x)`` does: removed while queued; once submitted, its
        result is dropped and its slot returns when the DLA is done with it.
        """
        return self._start(inputs, timeout, output)

    def _start(self, inputs: Any, timeout: float | None, output: str) -> Future[Any]:
        # One hop into the loop and one back. The portal's own start_task_soon first
        # waits for the loop to spawn a task-group task, then wraps it in a cancel
        # scope: that cost twice the async engine's CPU per request, and
        # run_coroutine_threadsafe 1.5 to 1.8 times (benchmarks/bench_blocking.py).
        future: Future[Any] = Future()
        running = self._running
        if running is not None:
            running.check_process()  # (before the lock: a fork may have copied it held)
        # Under the lock, so that close() carries aclose into the loop after every
        # request that got through here: each reaches the loop before aclose does.
        with self._lock:
            running = self._running
            if running is None:
                raise EngineClosedError(self._not_open())
            self._inbox.append((future, inputs, timeout, output))
            # Requests that arrive before the loop takes them share one wake-up.
            if not self._wake_pending:
                self._wake_pending = True
                running.loop.call_soon_threadsafe(self._take_inbox, running.loop)
        return future

    def _take_inbox(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            batch, self._inbox = self._inbox, []
            self._wake_pending = False
        for future, inputs, timeout, output in batch:
            self._begin(loop, future, inputs, timeout, output)

    def _begin(
        self,
        loop: asyncio.AbstractEventLoop,
        future: Future[Any],
        inputs: Any,
        timeout: float | None,
        output: str,
    ) -> None:
        """On the loop: the request's task, tied to the caller's future both ways."""
        if future.cancelled():  # cancelled before it reached the loop: never admitted
            return
        task = loop.create_task(self._engine.infer(inputs, timeout=timeout, output=output))
        self._pending.add(task)
        task.add_done_callback(functools.partial(self._settle, future))
        future.add_done_callback(functools.partial(_cancel_task, loop, task))

    def _settle(self, future: Future[Any], task: asyncio.Task[Any]) -> None:
        self._pending.discard(task)
        if task.cancelled():
            future.cancel()
            return
        if not future.set_running_or_notify_cancel():  # the caller cancelled it
            return
        error = task.exception()
        if error is None:
            future.set_result(task.result())
        else:
            future.set_exception(error)

    async def _aclose(self) -> None:
        await self._engine.aclose()
        # aclose ended every request; let their tasks hand the outcomes to the callers'
        # futures before the loop stops (its shutdown would cancel them).
        if self._pending:
            await asyncio.wait(set(self._pending))

    def _not_open(self) -> str:
        if self._state is _State.NEW:
            return "the engine is not open; use 'with BlockingEngine(...)' or engine.open()"
        return "the engine is closed"

    # -- observation ------------------------------------------------------------------------

    def statistics(self) -> EngineStatistics:
        """As :meth:`aiodla.Engine.statistics`, taken on the engine's loop."""
        return self._on_loop(self._engine.statistics)

    def health(self) -> EngineHealth:
        """As :meth:`aiodla.Engine.health`."""
        return self._on_loop(self._engine.health)

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return self._engine.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return self._engine.outputs

    @property
    def engine(self) -> Engine:
        """The async engine underneath (its loop is the background thread's)."""
        return self._engine

    def _on_loop(self, function: Callable[[], _T]) -> _T:
        running = self._running
        if running is None:  # no loop runs: the engine's state is still
            return function()
        running.check_process()
        try:
            return running.portal.call(function)
        except RuntimeError:
            if self._running is None:  # closed between the look and the call
                return function()
            raise

    def __repr__(self) -> str:
        return f"<BlockingEngine {self._engine!r}>"

    def __del__(self, _warn: Any = warnings.warn) -> None:
        running = getattr(self, "_running", None)
        if running is None or os.getpid() != running.pid:  # (a fork's copy: the parent's)
            return
        _warn(
            f"unclosed {self!r}; use 'with BlockingEngine(...)' or engine.close()",
            ResourceWarning,
            source=self,
        )
        # Dropping the portal's context stops its loop and joins its thread anyway,
        # cancelling what runs there: close first, so the engine drains and releases
        # its handles. On the loop's own thread nothing can wait for the loop.
        if threading.get_ident() != running.thread:
            self._close()


def _loop_and_thread() -> tuple[asyncio.AbstractEventLoop, int]:
    return asyncio.get_running_loop(), threading.get_ident()


def _cancel_task(
    loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any], future: Future[Any]
) -> None:
    """A caller's future ended: when it was cancelled, cancel the request's task (on
    the loop: this runs in the cancelling thread)."""
    if future.cancelled():
        # A loop already gone (RuntimeError) took the task with it.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(task.cancel)


def _refuse_in_event_loop(what: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise AiodlaError(
        f"{what} would block this thread's running event loop (and deadlock if it is "
        "the engine's); in async code use 'async with aiodla.Engine(...)' and "
        "'await engine.infer(x)', or call from another thread (asyncio.to_thread)"
    )
