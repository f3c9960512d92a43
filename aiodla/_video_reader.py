"""A video source's reader thread: open, decode, hand frames to the loop, reconnect.

One :class:`Reader` per :class:`~aiodla.VideoSource`, on a thread of its own: a source
that blocks in the network or the decoder holds nothing but this thread. It writes the
decoding side of the source's figures (``decoded``, ``decode_errors``, ``decode_cpu``,
the stream's codec, format and size) and tells the loop everything else through
:class:`Sink` callbacks scheduled with ``call_soon_threadsafe``; the loop writes only
``arrived``, and gives a file's reader room back with :meth:`Reader.leave`.

Reconnecting lives here: a loss (an error, a live stream's end, ``stall_timeout``
without a picture) is reported, then the reader waits a capped exponential back-off
with jitter (``reconnect_delay`` doubled per failed attempt up to
``max_reconnect_delay``, each wait drawn from its upper half, so many cameras lost at
once do not come back in step) and opens the source again. What retrying cannot fix,
or any loss with ``reconnect=False``, ends the reader with the error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ._errors import EngineClosedError, VideoSourceError
from ._frame_pool import FramePool, Lender, pool_for
from ._video_address import Address
from ._video_decoders import (
    DecodedStream,
    Decoder,
    DecoderName,
    DecodeTrouble,
    Isolation,
    OpenOptions,
    Picture,
    decoder_for,
)
from ._video_frame import VideoFrame

__all__ = ["Reader", "ReaderSettings", "Sink"]


class Sink(Protocol):
    """What the reader tells the loop; each called on the loop thread."""

    def arrive(self, frame: VideoFrame, cpu: float) -> None: ...
    def connected(self) -> None: ...
    def lost(self, reason: str) -> None: ...
    def ended(self) -> None: ...
    def failed(self, reason: str, error: BaseException) -> None: ...
    def finished(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class ReaderSettings:
    address: Address
    name: str
    decoder: DecoderName
    isolation: Isolation
    options: OpenOptions
    engine: Any
    max_frames: int
    reconnect: bool
    delays: tuple[float, float]  # reconnect_delay, max_reconnect_delay
    repeat: bool


class Reader:
    """The reader thread of one source (see the module docstring)."""

    def __init__(
        self, settings: ReaderSettings, sink: Sink, loop: asyncio.AbstractEventLoop, lender: Lender
    ) -> None:
        self._settings = settings
        self._sink = sink
        self._loop = loop
        self._lender = lender
        self.stop = threading.Event()
        self.sent = 0  # frames handed to the loop; sent - arrived are in transit
        self.arrived = 0  # written by the loop thread as each frame arrives
        self.dropped_unsent = 0  # live frames dropped while the loop was behind
        # A file's reader takes a room before sending a frame; the loop gives it back
        # when the frame leaves the queue (Reader.leave).
        self._rooms = threading.Semaphore(settings.max_frames)
        self.decoded = 0
        self.decode_errors = 0
        self.decode_cpu = 0.0
        self.codec: str | None = None
        self.format: str | None = None
        self.size = (0, 0)
        self.thread = threading.Thread(
            target=self._read, name=f"aiodla video {settings.name}", daemon=True
        )

    def leave(self, count: int) -> None:
        """``count`` frames left the loop's queue: room for a file's reader."""
        if not self._settings.address.live:
            for _ in range(count):
                self._rooms.release()

    def _call_loop(self, callback: Callable[..., None], *args: Any) -> bool:
        loop = self._loop
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed under us: nobody is left to read
            self.stop.set()
            return False
        return True

    def _read(self) -> None:
        try:
            self._read_until_done()
        except BaseException as exc:  # a bug, or the engine closed: end the reads with it
            # The traceback's frames hold the buffer being written; kept, it would pin
            # the engine's memory for as long as the source lives.
            exc = exc.with_traceback(None)
            if not self.stop.is_set():
                self._call_loop(self._sink.failed, type(exc).__name__, exc)
        finally:
            self._call_loop(self._sink.finished)

    def _read_until_done(self) -> None:
        decoder: Decoder
        if self._settings.isolation == "process":  # a process for each opening
            from ._video_process import ProcessDecoder  # (sockets, and CUDA for NVDEC)

            decoder = ProcessDecoder(self._settings.decoder, self.stop)
        else:
            decoder = decoder_for(self._settings.decoder)
        settings = self._settings
        address = settings.address
        attempt = 0
        while not self.stop.is_set():
            loss: VideoSourceError
            try:
                stream = decoder.open(address, settings.options)
            except VideoSourceError as exc:
                loss = exc
            else:
                self.codec = stream.codec
                decoded_before = self.decoded
                try:
                    self._decode(stream)
                except VideoSourceError as exc:
                    loss = exc
                else:
                    if self.stop.is_set():
                        return
                    if not address.live:
                        if settings.repeat and self.decoded > decoded_before:
                            continue
                        self._call_loop(self._sink.ended)
                        return
                    loss = VideoSourceError(
                        f"video source {address.name!r} ended unexpectedly",
                        source=address.name,
                        reason="lost",
                        retryable=True,
                    )
                finally:
                    stream.close()
                if self.decoded > decoded_before:  # it worked for a while: start over
                    attempt = 0
            if self.stop.is_set():
                return
            if not loss.retryable or not settings.reconnect:
                self._call_loop(self._sink.failed, loss.reason, loss)
                return
            self._call_loop(self._sink.lost, loss.reason)
            delay = min(settings.delays[1], settings.delays[0] * 2**attempt)
            attempt += 1
            self.stop.wait(random.uniform(delay / 2, delay))

    def _decode(self, stream: DecodedStream) -> None:
        """Decode until the stream ends or breaks."""
        pool: FramePool | None = None
        pool_shape: tuple[int, int] | None = None
        cpu = time.thread_time()
        connected = False
        for item in stream.pictures():
            if self.stop.is_set():
                return
            if isinstance(item, DecodeTrouble):
                self.decode_errors += 1
                self.decode_cpu += item.cpu_elsewhere
                continue
            if not self._room():
                self.decoded += 1
                self.dropped_unsent += 1
                self.decode_cpu += item.cpu_elsewhere  # decoded all the same
                continue
            picture: Picture = item
            shape = (picture.height * 3 // 2, picture.width)
            if picture.on_device:
                array = picture.device_array()
            else:
                if self._settings.engine is not None and shape != pool_shape:
                    pool, pool_shape = self._pool(shape), shape
                array = self._lender.lend(pool, shape, picture.write_into)
            now_cpu = time.thread_time()
            spent, cpu = now_cpu - cpu + picture.cpu_elsewhere, now_cpu
            self.decode_cpu += spent
            frame = VideoFrame(
                array=array,
                format=picture.format,
                width=picture.width,
                height=picture.height,
                source=self._settings.name,
                index=self.decoded,
                pts=picture.pts,
                captured_at=time.time(),
                on_device=picture.on_device,
                color_range=picture.color_range,
            )
            self.decoded += 1
            self.format = picture.format
            self.size = (picture.width, picture.height)
            self.codec = stream.codec  # some decoders know it only once decoding
            if not connected:  # a source counts as (re)connected once frames flow
                connected = self._call_loop(self._sink.connected)
            self.sent += 1
            if not self._call_loop(self._sink.arrive, frame, spent):
                return
        self.decode_cpu += time.thread_time() - cpu

    def _room(self) -> bool:
        """Whether this frame may go to the loop: a live source's when fewer than
        ``max_frames`` are in transit (else it is dropped here, never written); a
        file's once there is room (waiting for it)."""
        if self._settings.address.live:
            return self.sent - self.arrived < self._settings.max_frames
        while not self._rooms.acquire(timeout=0.1):
            if self.stop.is_set():
                return False
        return True

    def _pool(self, shape: tuple[int, int]) -> FramePool:
        engine = self._settings.engine

        def allocate(count: int) -> list[np.ndarray[Any, Any]]:
            # Frame buffers are the engine's loop-thread state: allocate there.
            future: concurrent.futures.Future[list[np.ndarray[Any, Any]]] = (
                concurrent.futures.Future()
            )

            def run() -> None:
                try:
                    future.set_result(engine.frame_buffers(count, shape))
                except BaseException as exc:
                    future.set_exception(exc)

            if not self._call_loop(run):
                raise EngineClosedError("the event loop closed")
            while True:
                try:
                    return future.result(timeout=0.1)
                except concurrent.futures.TimeoutError:
                    if self.stop.is_set():
                        raise EngineClosedError("the video source closed") from None

        return pool_for(engine, shape, allocate)
