"""A video source: one camera, stream or file, decoded off the event loop.

:class:`VideoSource` owns one source's life: open, decode, stall detection and
reconnect with back-off, all on its own reader thread, so a source that blocks (a
camera that stopped answering) never holds the event loop or any other source. The
thread hands each decoded frame to the loop with one ``call_soon_threadsafe``, and at
most ``max_frames`` frames are ever queued or on their way to the queue:

- a live source (a camera, a stream) runs at its own pace: when the application is
  behind, the newest frame wins and every frame pushed out unread counts as dropped
  (one the loop has not even taken in yet is dropped before it is written anywhere);
- a file is read at the application's pace: the reader waits for room, and no frame
  is dropped.

Who writes what. The reader thread writes the decoding side (``decoded``,
``decode_errors``, ``decode_cpu``, the stream's format); the loop thread writes the
delivery side (``delivered``, ``dropped``, the queue) and the state, which the thread
reports through the loop. So ``decoded == delivered + dropped + buffered + in transit``,
where *in transit* (at most ``max_frames``) are the frames between the two threads at
the moment of the snapshot (none once the source has ended).

Reconnect: an error, an unexpected end of a live stream, or no frame for
``stall_timeout`` seconds is a *loss*. With ``reconnect=True`` (the default) the thread
waits a capped exponential back-off with jitter (``reconnect_delay`` doubled per
failed attempt up to ``max_reconnect_delay``, each wait drawn from its upper half) and
opens the source again; the state says ``reconnecting`` with the reason meanwhile, and
the application's loop simply waits for the next frame. With ``reconnect=False`` the
first loss ends the iteration with that :class:`~aiodla.VideoSourceError`. What
reconnecting cannot fix (a missing file, refused credentials, a path the server does
not have, an unsupported codec) ends the source at once with the error.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import enum
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

from ._errors import AiodlaError, ConfigurationError
from ._frame_pool import Lender
from ._trace import active_recorder, data_address
from ._video_address import Address, parse_address
from ._video_decoders import (
    ISOLATIONS,
    DecoderName,
    Isolation,
    OpenOptions,
    choose_decoder,
    output_format,
)
from ._video_frame import VideoFrame
from ._video_reader import Reader, ReaderSettings

__all__ = ["VideoSource", "VideoSourceState", "VideoSourceStatistics"]

logger = logging.getLogger("aiodla")

#: Buffers a source may hold beyond its own frames (``2 * max_frames``: as many queued
#: as on their way to the queue, the one being filled among them) and one per slot of
#: the engine (a request holds its frame until it ends): the frame the application is
#: on, one it holds while it waits for the engine, and one waiting in a LatestFrameStream.
_SPARE_BUFFERS = 3
#: Seconds of recent frames the current frame rate covers.
_RATE_WINDOW = 2.0


class VideoSourceState(enum.Enum):
    CONNECTING = "connecting"  # opening, the first time
    STREAMING = "streaming"
    RECONNECTING = "reconnecting"  # lost; waiting to open again (``reason`` says why)
    ENDED = "ended"  # a file reached its end; frames still queued can be read
    FAILED = "failed"  # a loss that is not retried; reads end with the error
    CLOSED = "closed"  # you closed it


@dataclasses.dataclass(frozen=True)
class VideoSourceStatistics:
    """A snapshot of one source.

    ``decoded`` frames came out of the decoder; each is then ``delivered`` (handed to
    the application), ``dropped`` (pushed out of the queue by a newer frame, or still
    queued when the source closed), or still ``buffered``. ``decode_errors`` counts
    packets the decoder could not decode (the stream goes on from its next keyframe);
    ``reconnects`` counts successful re-openings after a loss. ``fps`` is the rate of
    decoded frames over the last two seconds; ``decode_cpu`` the reader thread's CPU
    seconds (with ``ffmpeg``, which decodes on that thread, the whole cost of decoding
    and writing frames into their buffers; with ``gstreamer`` and ``nvdec`` the
    decoding runs on threads of theirs, and this counts the copying out and the
    hand-over only), plus, with ``isolation="process"``, the whole CPU of the
    decoding process (every thread of it). ``isolation`` says where the decoder
    runs. ``unpooled`` frames went
    into plain arrays rather than the engine's frame buffers (see ``VideoSource``).
    """

    name: str
    decoder: str
    state: str
    reason: str | None
    codec: str | None
    format: str | None
    width: int
    height: int
    decoded: int
    delivered: int
    dropped: int
    buffered: int
    decode_errors: int
    reconnects: int
    fps: float
    decode_cpu: float
    unpooled: int
    isolation: str = "thread"


class VideoSource:
    """Frames of one video source, decoded off the event loop::

        async with aiodla.VideoSource("rtsp://cam1/stream", engine=engine) as camera:
            async for frame in camera:          # aiodla.VideoFrame
                boxes = await engine.infer(frame)

    ``uri``: a file (MP4, MKV, MOV, MPEG-TS; H.264 or H.265), ``rtsp://`` (or
    ``rtsps://``; credentials in the URI are used to connect and appear nowhere else),
    a USB camera ``/dev/videoN`` (MJPEG or YUYV), or ``csi://N`` for a Jetson's CSI
    camera (GStreamer only). ``decoder``: ``"auto"``, ``"ffmpeg"``, ``"gstreamer"`` or
    ``"nvdec"`` (see :mod:`aiodla._video_decoders`); a named decoder that cannot run
    here is a :class:`~aiodla.VideoSourceError` at once.

    ``engine``: host frames are then written straight into that engine's frame buffers
    (pinned memory; ``infer`` reads them in place). A buffer comes back to the source
    only once nothing holds its frame's array (a request holds it until it ends), so a
    frame is never overwritten under a reader. A source holds at most ``2 * max_frames
    + 3`` buffers plus one per slot of the engine (its cores times ``streams_per_core``),
    taken as needed: enough for its queue, a frame in each of the engine's slots and
    the frame your code is on. A frame decoded while all of them are held (your code
    keeps frames) goes into a plain array (counted as ``unpooled``) rather than wait.

    ``max_frames`` decoded frames wait for the application at most (newest wins, the
    rest count as dropped). ``transport``: RTSP over ``"tcp"`` or ``"udp"``.
    ``stall_timeout``: seconds without a frame after which a live source counts as
    lost. ``reconnect``, ``reconnect_delay``, ``max_reconnect_delay``: see the module
    docstring. ``repeat``: a file starts again at its end instead of ending.
    ``name``: what statistics, metrics and traces call it (default: the URI without
    credentials).

    ``isolation``: ``"thread"`` (the default) decodes on the source's reader thread,
    in this process; ``"process"`` decodes in a process of its own (a fresh one for
    each opening), which shares neither the interpreter's lock with your event loop
    nor its fate: a crash in a decoder's native code is then a reconnect, not the end
    of your program. Each picture then crosses once more (shared memory, or CUDA IPC
    for ``nvdec``'s device pictures; not on a Jetson, where ``nvdec`` does not run).
    Measured with sixteen 1080p streams on one GPU machine: the event loop's lag
    halved with ``nvdec`` in processes, but the decoding processes' CUDA contexts
    slowed the engine's GPU work, so there ``nvdec`` is better left on threads (see
    the camera guide). See :mod:`aiodla._video_process`.
    """

    def __init__(
        self,
        uri: Any,
        decoder: str = "auto",
        *,
        engine: Any = None,
        max_frames: int = 2,
        transport: Literal["tcp", "udp"] = "tcp",
        stall_timeout: float = 5.0,
        reconnect: bool = True,
        reconnect_delay: float = 0.1,
        max_reconnect_delay: float = 1.0,
        repeat: bool = False,
        gpu: int = 0,
        name: str | None = None,
        isolation: Isolation = "thread",
    ) -> None:
        self._address: Address = parse_address(uri)
        if not isinstance(max_frames, int) or isinstance(max_frames, bool) or max_frames < 1:
            raise ConfigurationError(f"{max_frames=} must be an int >= 1")
        if transport not in ("tcp", "udp"):
            raise ConfigurationError(f"{transport=} must be 'tcp' or 'udp'")
        for label, value in (
            ("stall_timeout", stall_timeout),
            ("reconnect_delay", reconnect_delay),
            ("max_reconnect_delay", max_reconnect_delay),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigurationError(f"{label}={value!r} must be seconds > 0")
        if max_reconnect_delay < reconnect_delay:
            raise ConfigurationError(f"{max_reconnect_delay=} must be >= {reconnect_delay=}")
        if isolation not in ISOLATIONS:
            raise ConfigurationError(f"isolation={isolation!r} must be one of {ISOLATIONS}")
        if engine is not None and not callable(getattr(engine, "frame_buffers", None)):
            raise ConfigurationError(
                f"engine must be an aiodla.Engine, got {type(engine).__name__}"
            )
        self._decoder_name: DecoderName = choose_decoder(decoder, self._address)
        self._name = self._address.name if name is None else str(name)
        self._max_frames = max_frames
        self._settings = ReaderSettings(
            address=self._address,
            name=self._name,
            decoder=self._decoder_name,
            isolation=isolation,
            options=OpenOptions(transport, float(stall_timeout), gpu),
            engine=engine,
            max_frames=max_frames,
            reconnect=bool(reconnect),
            delays=(float(reconnect_delay), float(max_reconnect_delay)),
            repeat=bool(repeat),
        )
        self._lender = Lender(0)  # sized by start(), once the engine's slots are known
        self._reader: Reader | None = None  # made by start()
        # Loop-thread state (see the module docstring for who writes what):
        self._state = VideoSourceState.CONNECTING
        self._reason: str | None = None
        self._error: BaseException | None = None  # what ends the reads, once failed
        self._queue: collections.deque[VideoFrame] = collections.deque()
        self._wake = asyncio.Event()
        self._opened: asyncio.Future[None] | None = None  # the first open's outcome
        self._finished: asyncio.Future[None] | None = None  # the reader thread is done
        self._delivered = 0
        self._dropped = 0
        self._reconnects = 0
        self._recent: collections.deque[float] = collections.deque()  # arrival times
        self._frame_listeners: list[Callable[[VideoFrame, float], None]] = []

    # -- public facts ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def decoder(self) -> str:
        """The decoder in use (``"auto"`` resolved)."""
        return self._decoder_name

    @property
    def live(self) -> bool:
        """A camera or stream, as opposed to a file (which ends, or repeats)."""
        return self._address.live

    @property
    def format(self) -> Literal["nv12", "i420"]:
        """The layout this source's frames come in (``VideoFrame.format``): what the
        engine's ``ImagePreprocess(source=...)`` must read."""
        return output_format(self._decoder_name, self._address)

    @property
    def state(self) -> VideoSourceState:
        return self._state

    def __repr__(self) -> str:
        return (
            f"<VideoSource {self._name!r} {self._decoder_name} {self._state.value}: "
            f"{self._delivered} delivered, {self._dropped} dropped>"
        )

    # -- life -------------------------------------------------------------------------------

    async def __aenter__(self) -> VideoSource:
        """Start reading; return once the source gave its first frame (or, with
        ``reconnect``, once a first attempt failed with something worth retrying).

        Raises :class:`~aiodla.VideoSourceError` for what retrying cannot fix, or for
        any failure when ``reconnect=False``.

        Cancellation: the source is closed (its thread stopped) before the
        cancellation propagates.
        """
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """As ``async with``: start the reader thread and wait for the first open."""
        if self._state is VideoSourceState.CLOSED:
            raise AiodlaError("Cannot reopen a video source once it has been closed.")
        if self._reader is not None:
            raise AiodlaError(f"video source {self._name!r} is already started")
        loop = asyncio.get_running_loop()
        self._opened = loop.create_future()
        self._finished = loop.create_future()
        self._lender = Lender(_buffers_held(self._settings.engine, self._max_frames))
        self._reader = Reader(self._settings, _Sink(self), loop, self._lender)
        self._reader.thread.start()
        logger.info("aiodla: video source %r decodes with %s", self._name, self._decoder_name)
        try:
            await asyncio.shield(self._opened)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Stop reading and wait for the reader thread to end. Idempotent.

        Frames still queued count as dropped; frames already handed out stay valid
        (their buffers come back when they are gone). A reader blocked in the network
        ends within ``stall_timeout``.

        Cancellation: the close itself happens at once; cancelling stops only the wait
        for the thread, which still ends on its own.
        """
        if self._state is not VideoSourceState.CLOSED:
            self._state = VideoSourceState.CLOSED
            self._reason = None
            if self._reader is not None:
                self._reader.stop.set()
                self._reader.leave(len(self._queue))
            self._dropped += len(self._queue)
            self._queue.clear()
            self._wake.set()
        if self._finished is not None and not self._finished.done():
            await asyncio.shield(self._finished)
        if self._reader is not None:
            # Its last act was to schedule _finished: what is left of the thread is its
            # return, so this join is over at once (and the thread is gone on return).
            self._reader.thread.join(timeout=1.0)

    def __del__(self, _warn: Any = warnings.warn) -> None:
        reader = getattr(self, "_reader", None)
        if reader is not None and reader.thread.is_alive() and not reader.stop.is_set():
            reader.stop.set()
            _warn(f"unclosed video source {self._name!r}", ResourceWarning, source=self)

    # -- frames out --------------------------------------------------------------------------

    def __aiter__(self) -> VideoSource:
        return self

    async def __anext__(self) -> VideoFrame:
        """The newest frame not yet handed out; waits for one. Iteration ends when a
        file ends (without ``repeat``) or the source is closed; a failed source raises
        its :class:`~aiodla.VideoSourceError` (or the engine's error).

        Cancellation: cancelling the wait takes nothing; the frame stays queued.
        """
        reader = self._reader
        if reader is None:
            raise AiodlaError(f"video source {self._name!r} is not started: use 'async with'")
        while not self._queue:
            if self._state is VideoSourceState.CLOSED or self._state is VideoSourceState.ENDED:
                raise StopAsyncIteration
            if self._state is VideoSourceState.FAILED:
                raise self._failure()
            self._wake.clear()
            await self._wake.wait()
        self._delivered += 1
        reader.leave(1)
        return self._queue.popleft()

    def _failure(self) -> BaseException:
        """A fresh copy of the error that ended the source, for each reader: raising
        the stored one would chain every reader's frames (and the frames they hold)
        onto it."""
        error = copy.copy(self._error)
        assert error is not None  # FAILED is only ever set with its error
        return error.with_traceback(None)

    # -- observation -------------------------------------------------------------------------

    def statistics(self) -> VideoSourceStatistics:
        """A snapshot of the source's counts and rates (from any thread: each figure
        is read whole, though two may be a frame apart)."""
        now = time.monotonic()
        # tuple() copies under the interpreter lock: a scrape from another thread may
        # read statistics while the loop appends.
        recent = [t for t in tuple(self._recent) if now - t <= _RATE_WINDOW]
        fps = 0.0
        if len(recent) >= 2:
            fps = (len(recent) - 1) / max(recent[-1] - recent[0], 1e-9)
        reader = self._reader
        return VideoSourceStatistics(
            name=self._name,
            decoder=self._decoder_name,
            state=self._state.value,
            reason=self._reason,
            codec=None if reader is None else reader.codec,
            format=None if reader is None else reader.format,
            width=0 if reader is None else reader.size[0],
            height=0 if reader is None else reader.size[1],
            decoded=0 if reader is None else reader.decoded,
            delivered=self._delivered,
            dropped=self._dropped + (0 if reader is None else reader.dropped_unsent),
            buffered=len(self._queue),
            decode_errors=0 if reader is None else reader.decode_errors,
            reconnects=self._reconnects,
            fps=fps,
            decode_cpu=0.0 if reader is None else reader.decode_cpu,
            unpooled=self._lender.unpooled,
            isolation=self._settings.isolation,
        )

    def add_frame_listener(self, listener: Callable[[VideoFrame, float], None]) -> None:
        """Call ``listener(frame, cpu_seconds)`` on the loop thread as each frame
        arrives, with the reader thread's CPU seconds for that frame (decoding and
        writing it; metrics and the timeline use this)."""
        self._frame_listeners.append(listener)

    # -- the loop side -------------------------------------------------------------------------

    def _arrive(self, frame: VideoFrame, cpu: float) -> None:
        reader = self._reader
        assert reader is not None  # only a started source's reader sends frames
        reader.arrived += 1
        if self._state is VideoSourceState.CLOSED:
            self._dropped += 1
            reader.leave(1)
            return
        recent = self._recent
        recent.append(time.monotonic())
        while len(recent) > 1 and recent[-1] - recent[0] > _RATE_WINDOW:
            recent.popleft()
        self._queue.append(frame)
        if len(self._queue) > self._max_frames:  # live only: a file's reader waits
            self._queue.popleft()
            self._dropped += 1
        for listener in self._frame_listeners:
            listener(frame, cpu)
        engine = self._settings.engine
        recorder = None if engine is None else active_recorder(engine)
        if recorder is not None:  # the engine's timeline: this frame, then its request
            end = time.monotonic() - max(0.0, time.time() - frame.captured_at)
            recorder.frame(self._name, frame.index, end - cpu, end, data_address(frame.array))
        self._wake.set()

    def _report(
        self, state: VideoSourceState, reason: str | None, error: BaseException | None = None
    ) -> None:
        opened = self._opened
        if self._state is VideoSourceState.CLOSED:
            if opened is not None and not opened.done():
                opened.set_result(None)
            return
        if state is VideoSourceState.STREAMING and self._state is VideoSourceState.RECONNECTING:
            self._reconnects += 1
            logger.info("aiodla: video source %r reconnected", self._name)
        elif (
            state is VideoSourceState.RECONNECTING
            and self._state is not VideoSourceState.RECONNECTING
        ):
            logger.warning("aiodla: video source %r lost (%s); reconnecting", self._name, reason)
        self._state = state
        self._reason = reason
        if error is not None:
            self._error = error
            logger.warning("aiodla: video source %r failed: %s", self._name, error)
        if opened is not None and not opened.done():
            if state is VideoSourceState.FAILED and error is not None:
                opened.set_exception(error)
                opened.exception()  # retrieved here; start() re-raises it
            elif state is not VideoSourceState.CONNECTING:
                opened.set_result(None)
        self._wake.set()

    def _thread_done(self) -> None:
        if self._opened is not None and not self._opened.done():
            self._opened.set_result(None)
        if self._finished is not None and not self._finished.done():
            self._finished.set_result(None)


def _buffers_held(engine: Any, max_frames: int) -> int:
    """The frame buffers a source given ``engine`` may hold at once (see
    ``_SPARE_BUFFERS``); 0 without an engine."""
    if engine is None:
        return 0
    slots: int = sum(core.busy_slots + core.idle_slots for core in engine.statistics().cores)
    return 2 * max_frames + slots + _SPARE_BUFFERS


class _Sink:
    """The reader's callbacks (see :class:`~aiodla._video_reader.Sink`), kept off the
    public class."""

    __slots__ = ("_source",)

    def __init__(self, source: VideoSource) -> None:
        self._source = source

    def arrive(self, frame: VideoFrame, cpu: float) -> None:
        self._source._arrive(frame, cpu)

    def connected(self) -> None:
        self._source._report(VideoSourceState.STREAMING, None)

    def lost(self, reason: str) -> None:
        self._source._report(VideoSourceState.RECONNECTING, reason)

    def ended(self) -> None:
        self._source._report(VideoSourceState.ENDED, "end of file")

    def failed(self, reason: str, error: BaseException) -> None:
        self._source._report(VideoSourceState.FAILED, reason, error)

    def finished(self) -> None:
        self._source._thread_done()
