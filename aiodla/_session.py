"""Per-stream sessions: one camera (or any live source) sharing an engine, newest frame wins.

A live source produces frames at its own pace. Queueing every frame for the engine
turns any excess of offered load over capacity into a backlog whose latency grows
without end. :class:`LatestFrameStream` holds the policy every such application needs:

- at most one request of the stream is in flight on the engine;
- at most one frame waits behind it: a newer frame replaces the waiting one, which
  counts as *dropped* (latest frame wins);
- results come back in frame order, since frames start one at a time in the order
  they were offered;
- at most ``max_buffered`` results wait to be read; while that many wait, no new frame
  starts (the waiting one keeps being replaced), so a slow reader also turns into
  dropped frames, never into a backlog.

So a frame's latency is at most the rest of the previous frame's run plus its own
run, whatever the offered load, and the engine's queue holds at most one request per
stream.

Counts always add up: ``submitted == completed + failed + dropped + cancelled +
pending + in_flight`` (see :class:`StreamStatistics`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import itertools
import time
import warnings
from typing import Any

import numpy as np

from ._engine import Engine, EngineState
from ._errors import (
    AiodlaError,
    ConfigurationError,
    EngineClosedError,
    EngineDeadError,
    StreamClosedError,
)
from ._options import check_timeout
from ._statistics import LatencySummary, LatencyWindow

__all__ = [
    "FrameResult",
    "LatestFrameStream",
    "StreamClosedError",
    "StreamState",
    "StreamStatistics",
]

_names = itertools.count()


class StreamState(enum.Enum):
    OPEN = "open"
    BROKEN = "broken"  # its engine closed or died under it; reads end with that error
    CLOSED = "closed"


@dataclasses.dataclass(frozen=True)
class FrameResult:
    """The answer to one frame.

    ``index`` is the frame's number in the order frames were submitted, from 0 (a
    dropped frame's number never comes back). ``output`` is what
    :meth:`Engine.infer` returned, or None when ``error`` says why the frame failed
    (a :class:`TaskError`, a :class:`RequestTimeoutError`, ...). ``latency`` is the
    seconds from ``submit`` to the result. ``context`` is what was passed to ``submit``.
    """

    index: int
    output: Any
    error: AiodlaError | None
    latency: float
    context: Any = None


@dataclasses.dataclass(frozen=True)
class StreamStatistics:
    """A snapshot of one stream.

    Every submitted frame is, at any moment, exactly one of: ``completed``, ``failed``
    (answered with an error), ``dropped`` (replaced by a newer frame before it started,
    or still waiting when the stream closed), ``cancelled`` (in flight when the stream
    closed; its result was discarded), ``pending`` (0 or 1) or ``in_flight`` (0 or 1).
    ``buffered`` answered frames wait for ``receive``.

    ``elapsed`` runs from the first frame to now (to the close, once closed);
    ``fps`` is completed frames per second over it, ``offered_fps`` submitted frames
    per second. ``latency`` covers completed frames (the most recent ``latency_window``).
    """

    name: str
    state: str
    submitted: int
    completed: int
    failed: int
    dropped: int
    cancelled: int
    pending: int
    in_flight: int
    buffered: int
    elapsed: float
    fps: float
    offered_fps: float
    latency: LatencySummary


@dataclasses.dataclass
class _Frame:
    index: int
    data: Any
    context: Any
    submitted_at: float


class LatestFrameStream:
    """One live source's session with an :class:`Engine`: newest frame wins.

    Offer frames with :meth:`submit` (it never waits) and read answers in frame order
    with :meth:`receive` or ``async for``::

        async with Engine(model) as engine, LatestFrameStream(engine, name="cam0") as cam:
            ...                       # a camera task calls cam.submit(frame) per frame
            async for result in cam:  # result.index, result.output, result.latency
                ...

    ``timeout`` (seconds) bounds each frame's inference, as ``Engine.infer(timeout=)``;
    a frame that times out is answered with a :class:`RequestTimeoutError`.
    ``max_buffered`` answers may wait to be read before the stream stops starting new
    frames. ``latency_window`` is how many recent frames the latency percentiles cover.

    All methods must be called on the engine's event-loop thread; a capture thread
    hands frames over with ``loop.call_soon_threadsafe(stream.submit, frame)``. Close
    streams before their engine. A frame array is read when its inference starts, not
    when it is submitted: do not reuse its buffer until it is answered or dropped.

    :meth:`frame_buffer` does that bookkeeping: it hands out the buffer of the stream's
    ring (three of the engine's frame buffers, :meth:`Engine.frame_buffers`, so
    ``infer`` skips the staging copy) to fill next, never the one in flight nor the one
    waiting; fill it (``cap.read(image=buffer)``) and ``submit`` it::

        buffer = cam.frame_buffer((1080, 1920, 3))
        ok, _ = capture.read(image=buffer)
        cam.submit(buffer)
    """

    def __init__(
        self,
        engine: Engine,
        *,
        name: str | None = None,
        timeout: float | None = None,
        max_buffered: int = 2,
        latency_window: int = 1024,
    ) -> None:
        if not isinstance(engine, Engine):
            raise ConfigurationError(
                f"engine must be an aiodla.Engine, got {type(engine).__name__}"
            )
        check_timeout(timeout)
        if not _positive_int(max_buffered):
            raise ConfigurationError(f"{max_buffered=} must be an int >= 1")
        if not _positive_int(latency_window):
            raise ConfigurationError(f"{latency_window=} must be an int >= 1")
        self._engine = engine
        self._name = f"stream-{next(_names)}" if name is None else str(name)
        self._timeout = timeout
        self._max_buffered = max_buffered
        self._state = StreamState.OPEN
        self._broken: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._worker: asyncio.Task[None] | None = None
        # The stream's mutable state, touched only on the loop thread:
        self._pending: _Frame | None = None  # the newest frame not yet started
        self._in_flight: _Frame | None = None  # the frame inside engine.infer now
        self._results: collections.deque[FrameResult] = collections.deque()  # answered, unread
        self._wake_worker = asyncio.Event()  # a frame arrived, a result was read, or closing
        self._wake_readers = asyncio.Event()  # a result arrived, or the stream ended
        self._latency = LatencyWindow(latency_window)
        self._next_index = 0
        self._completed = 0
        self._failed = 0
        self._dropped = 0
        self._cancelled = 0
        self._first_at: float | None = None
        self._ended_at: float | None = None
        self._rings: dict[tuple[tuple[int, ...], str], list[Any]] = {}  # see frame_buffer

    # -- public facts ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def state(self) -> StreamState:
        return self._state

    # -- context management -------------------------------------------------------------

    async def __aenter__(self) -> LatestFrameStream:
        """The stream itself; a closed stream cannot be entered again.

        Cancellation: it does not wait, so there is nothing to cancel.
        """
        if self._state is StreamState.CLOSED:
            raise StreamClosedError("Cannot reopen a stream once it has been closed.")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Close the stream, as :meth:`aclose`.

        Cancellation: as :meth:`aclose`.
        """
        await self.aclose()

    async def aclose(self) -> None:
        """Close the stream. Idempotent.

        New frames are refused with :class:`StreamClosedError`; a frame still pending
        counts as dropped; the frame in flight is cancelled (counted as cancelled: the
        engine drops its result, and its slot returns when the DLA is done with it).
        Answers already buffered can still be read; after them, ``receive`` raises
        :class:`StreamClosedError` and ``async for`` ends.

        Cancellation: the close itself happens at once, before the first wait; the call
        then waits for the stream's worker task to finish. Cancelling ``aclose`` stops
        that wait only; the worker still finishes on its own, and a later ``aclose``
        waits for it again.
        """
        if self._state is not StreamState.CLOSED:
            self._state = StreamState.CLOSED
            self._end()
        worker = self._worker
        if worker is not None and not worker.done():
            await asyncio.wait((worker,))

    def _end(self) -> None:
        """Stop serving: drop the pending frame, cancel the worker, wake the readers."""
        if self._ended_at is None:
            self._ended_at = time.monotonic()
        self._rings.clear()  # the engine frees buffers nobody holds any more
        if self._pending is not None:
            self._pending = None
            self._dropped += 1
        worker = self._worker
        # The worker ends itself when it is the one breaking the stream.
        if worker is not None and not worker.done() and worker is not asyncio.current_task():
            worker.cancel()
        self._wake_worker.set()
        self._wake_readers.set()

    def _break(self, cause: BaseException) -> None:
        """The engine ended under the stream: readers get ``cause`` after the buffer."""
        if self._state is StreamState.OPEN:
            self._state = StreamState.BROKEN
            self._broken = cause
            self._end()

    def __del__(self, _warn: Any = warnings.warn) -> None:
        worker = getattr(self, "_worker", None)
        if worker is not None and not worker.done() and self._state is StreamState.OPEN:
            _warn(
                f"unclosed stream {self!r}; use 'async with' or 'await stream.aclose()'",
                ResourceWarning,
                source=self,
            )

    # -- frames in ----------------------------------------------------------------------------

    def frame_buffer(self, shape: Any, dtype: Any = "uint8") -> Any:
        """The frame buffer to fill next: one of a ring of three of the engine's frame
        buffers of this ``shape`` and ``dtype`` (made on the first call), neither the
        frame in flight nor the one waiting (a view of either counts as it), so filling
        it never changes a frame the engine still has to read. Fill it and
        :meth:`submit` it; called again before that, it may return the same buffer.

        A FrameResult's ``context`` that is one of these buffers is reused for a later
        frame: copy what you keep. StreamClosedError once the stream is closed;
        EngineClosedError when its engine is; ConfigurationError as
        :meth:`Engine.frame_buffers` for a bad shape or dtype.
        """
        if self._state is StreamState.CLOSED:
            raise StreamClosedError(f"the stream {self._name!r} is closed")
        key = (tuple(shape) if isinstance(shape, (tuple, list)) else (shape,), str(dtype))
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = self._engine.frame_buffers(_RING, shape, dtype)
        busy = [f.data for f in (self._in_flight, self._pending) if f is not None]
        for buffer in ring:
            if not any(_shares(buffer, frame) for frame in busy):
                return buffer
        raise AssertionError("a ring of three always has a free buffer")  # pragma: no cover

    def submit(self, frame: Any, *, context: Any = None) -> int:
        """Offer ``frame`` (what :meth:`Engine.infer` takes) and return its index.

        Never waits. If the stream has nothing in flight the frame starts at once;
        otherwise it waits behind the frame in flight, replacing (and dropping) any
        frame that was waiting there. ``context`` comes back in the frame's
        :class:`FrameResult`. Bad input raises :class:`InputError` before anything is
        queued; a closed stream raises :class:`StreamClosedError`; an engine that is
        closed or dead raises :class:`EngineClosedError` / :class:`EngineDeadError`
        (and the stream's readers end with that error).
        """
        loop = self._check_open()
        self._check_frame(frame)
        now = time.monotonic()
        if self._first_at is None:
            self._first_at = now
        index = self._next_index
        self._next_index += 1
        if self._pending is not None:
            self._dropped += 1
        self._pending = _Frame(index, frame, context, now)
        self._wake_worker.set()
        if self._worker is None:
            self._worker = loop.create_task(self._serve(), name=f"aiodla stream {self._name}")
        return index

    def _check_open(self) -> asyncio.AbstractEventLoop:
        if self._state is StreamState.CLOSED:
            raise StreamClosedError(f"the stream {self._name!r} is closed")
        if self._broken is not None:
            raise self._broken_error()
        engine = self._engine
        if engine.dead or engine.state is not EngineState.OPEN:
            error: AiodlaError
            if engine.dead:
                error = EngineDeadError("the stream's engine is dead")
            else:
                error = EngineClosedError(f"the stream's engine is {engine.state.value}, not open")
            if engine.dead or engine.state in (EngineState.CLOSING, EngineState.CLOSED):
                self._break(error)  # it will never serve again: end the readers too
            raise error
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if self._loop is None:
            self._loop = loop
        if loop is None or loop is not self._loop:
            raise AiodlaError(
                "submit() must be called on the stream's event-loop thread; from another "
                "thread use loop.call_soon_threadsafe(stream.submit, frame)"
            )
        return loop

    def _check_frame(self, frame: Any) -> None:
        self._engine.check_inputs(frame)

    # -- the worker: one frame at a time ------------------------------------------------------

    async def _serve(self) -> None:
        try:
            while True:
                frame = self._pending
                if frame is None or len(self._results) >= self._max_buffered:
                    self._wake_worker.clear()
                    await self._wake_worker.wait()
                    continue
                self._pending = None
                self._in_flight = frame
                try:
                    output = await self._engine.infer(frame.data, timeout=self._timeout)
                except asyncio.CancelledError:
                    self._in_flight = None
                    self._cancelled += 1
                    raise
                except (EngineClosedError, EngineDeadError) as exc:
                    self._in_flight = None
                    self._failed += 1
                    self._break(exc)
                    return
                except AiodlaError as exc:  # this frame failed; the stream goes on
                    self._failed += 1
                    result = FrameResult(
                        frame.index, None, exc, time.monotonic() - frame.submitted_at, frame.context
                    )
                else:
                    latency = time.monotonic() - frame.submitted_at
                    self._completed += 1
                    self._latency.add(latency)
                    result = FrameResult(frame.index, output, None, latency, frame.context)
                self._in_flight = None
                self._results.append(result)
                self._wake_readers.set()
        except BaseException as exc:
            if not isinstance(exc, (Exception, asyncio.CancelledError)):
                raise  # KeyboardInterrupt, SystemExit: not the stream's to handle
            if self._in_flight is not None:  # not one of the engine's errors: a bug
                self._in_flight = None
                self._failed += 1
            if self._state is StreamState.OPEN:
                # Cancelled by someone else than aclose (the loop shutting down), or a
                # bug: end the stream so no reader waits for ever.
                cause = (
                    exc
                    if isinstance(exc, Exception)
                    else StreamClosedError(
                        f"the worker task of stream {self._name!r} was cancelled"
                    )
                )
                self._break(cause)
            if isinstance(exc, asyncio.CancelledError):
                raise
            # Anything else is delivered to the readers; re-raising would only leave a
            # "Task exception was never retrieved" for nobody.

    # -- answers out ----------------------------------------------------------------------------

    async def receive(self) -> FrameResult:
        """The next answer, in frame order; waits until there is one.

        When the stream was closed and every buffered answer was read, raises
        :class:`StreamClosedError`; when its engine was closed or died under it, raises
        :class:`EngineClosedError` / :class:`EngineDeadError` (with the engine's error
        as ``__cause__``).

        Cancellation: cancelling the wait takes nothing: the next answer stays for the
        next call.
        """
        while not self._results:
            if self._state is StreamState.CLOSED:
                raise StreamClosedError(f"the stream {self._name!r} is closed")
            if self._broken is not None:
                raise self._broken_error()
            self._wake_readers.clear()
            await self._wake_readers.wait()
        result = self._results.popleft()
        self._wake_worker.set()
        return result

    def _broken_error(self) -> AiodlaError:
        cause = self._broken
        error: AiodlaError
        if isinstance(cause, EngineDeadError):
            error = EngineDeadError(f"the stream {self._name!r} ended: {cause}")
        elif isinstance(cause, EngineClosedError):
            error = EngineClosedError(f"the stream {self._name!r} ended: {cause}")
        elif isinstance(cause, StreamClosedError):
            error = StreamClosedError(str(cause))
        else:
            error = AiodlaError(f"the stream {self._name!r} failed: {cause!r}")
        error.__cause__ = cause
        return error

    def __aiter__(self) -> LatestFrameStream:
        return self

    async def __anext__(self) -> FrameResult:
        """The next answer; iteration ends once the stream is closed and read out.

        Cancellation: as :meth:`receive`.
        """
        try:
            return await self.receive()
        except StreamClosedError:
            raise StopAsyncIteration from None

    # -- observation --------------------------------------------------------------------------

    def statistics(self) -> StreamStatistics:
        """A snapshot of the stream's counts, rates and latency percentiles."""
        if self._first_at is None:
            elapsed = 0.0
        else:
            end = time.monotonic() if self._ended_at is None else self._ended_at
            elapsed = max(0.0, end - self._first_at)
        return StreamStatistics(
            name=self._name,
            state=self._state.value,
            submitted=self._next_index,
            completed=self._completed,
            failed=self._failed,
            dropped=self._dropped,
            cancelled=self._cancelled,
            pending=int(self._pending is not None),
            in_flight=int(self._in_flight is not None),
            buffered=len(self._results),
            elapsed=elapsed,
            fps=self._completed / elapsed if elapsed > 0 else 0.0,
            offered_fps=self._next_index / elapsed if elapsed > 0 else 0.0,
            latency=self._latency.summary(),
        )

    def __repr__(self) -> str:
        return (
            f"<LatestFrameStream {self._name!r} {self._state.value}: {self._next_index} frames, "
            f"{self._completed} completed, {self._dropped} dropped, "
            f"{int(self._in_flight is not None)} in flight, "
            f"{int(self._pending is not None)} pending>"
        )


#: Frame buffers in a stream's ring: one in flight, one waiting, one being filled.
_RING = 3


def _shares(buffer: Any, frame: Any) -> bool:
    """Whether ``frame`` (any value ``submit`` took) may read ``buffer``'s memory."""
    return isinstance(frame, np.ndarray) and bool(np.may_share_memory(buffer, frame))


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
