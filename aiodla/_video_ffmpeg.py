"""The ``"ffmpeg"`` decoder: PyAV, CPU decoding of files, RTSP streams and USB cameras.

Pictures are taken in the planes FFmpeg decoded them into: its H.264 and H.265
decoders give I420 (``yuv420p``), which is copied plane by plane into the frame's
buffer, once, with no colour conversion. Only what has no 4:2:0 layout (a USB camera's
YUYV or 4:2:2 MJPEG, 10-bit H.265) is converted to I420 first, on this thread, its
levels kept. A picture's YUV range goes with it: MJPEG's ``yuvj`` formats (and any
picture FFmpeg marks so) are full range, 0..255, which the engine's pre-processing
reads with ``ImagePreprocess(color_range="full")``; the rest limited.

Errors are classified once, here: what retrying cannot fix (a missing file, 401, 404,
no video stream, a codec aiodla does not take) is ``retryable=False``; anything else
that ends a stream is a loss the source may reconnect from. A packet the decoder
cannot decode (truncated, corrupted) is reported as :class:`DecodeTrouble` and the
stream goes on from its next keyframe: FFmpeg is asked to report such packets
(``err_detect=explode``) rather than conceal them into damaged pictures.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Literal

import av
import numpy as np

from ._errors import VideoSourceError
from ._video_address import Address
from ._video_decoders import CAMERA_CODECS, CODECS, DecodeTrouble, OpenOptions, Picture

__all__ = ["decoder"]

_I420 = ("yuv420p", "yuvj420p")  # yuvj: full range (MJPEG); the planes are the same
#: FFmpeg's AVCOL_RANGE_JPEG: full range, whatever the pixel format's name says.
_FULL_RANGE = 2


class _Picture:
    __slots__ = ("_frame", "color_range", "format", "height", "on_device", "pts", "width")
    cpu_elsewhere = 0.0  # decoded on the reader thread, whose clock counts it

    def __init__(self, frame: av.VideoFrame) -> None:
        full = frame.format.name.startswith("yuvj") or frame.color_range == _FULL_RANGE
        if frame.format.name not in (*_I420, "nv12"):
            # The layout only: PyAV keeps the picture's levels (a yuvj422p picture
            # stays full range), which the frame then says.
            frame = frame.reformat(format="yuv420p")
        self._frame = frame
        self.color_range: Literal["limited", "full"] = "full" if full else "limited"
        self.format: Literal["nv12", "i420"] = "nv12" if frame.format.name == "nv12" else "i420"
        self.width = frame.width - frame.width % 2
        self.height = frame.height - frame.height % 2
        self.pts: float | None = None if frame.time is None else float(frame.time)
        self.on_device = False

    def write_into(self, out: np.ndarray[Any, Any]) -> None:
        width, height = self.width, self.height
        planes = self._frame.planes
        _copy_plane(planes[0], out[:height], width, height)
        chroma = out[height:].reshape(-1)
        if self.format == "nv12":
            _copy_plane(planes[1], chroma.reshape(height // 2, width), width, height // 2)
            return
        size = (width // 2) * (height // 2)
        for plane, at in ((planes[1], 0), (planes[2], size)):
            target = chroma[at : at + size].reshape(height // 2, width // 2)
            _copy_plane(plane, target, width // 2, height // 2)

    def device_array(self) -> Any:  # pragma: no cover - host pictures only
        raise TypeError("an FFmpeg picture is on the host")


def _copy_plane(plane: Any, out: np.ndarray[Any, Any], width: int, height: int) -> None:
    """One plane's rows into ``out``: FFmpeg pads each row to ``line_size`` bytes."""
    rows = np.frombuffer(plane, np.uint8, count=plane.line_size * height)
    out[...] = rows.reshape(height, plane.line_size)[:, :width]


class _Stream:
    def __init__(self, address: Address, options: OpenOptions) -> None:
        self._address = address
        self._options = options
        opts: dict[str, str] = {}
        kwargs: dict[str, Any] = {}
        if address.kind == "rtsp":
            opts["rtsp_transport"] = options.transport
            kwargs["timeout"] = (options.stall_timeout, options.stall_timeout)
        elif address.kind == "v4l2":
            kwargs["format"] = "v4l2"
            kwargs["timeout"] = (options.stall_timeout, options.stall_timeout)
        elif address.kind == "csi":
            raise _error(address, "CSI cameras are read through GStreamer only", "decoder", False)
        began = time.monotonic()
        try:
            self._container: Any = av.open(address.uri, options=opts, **kwargs)
        except av.error.FFmpegError as exc:
            # PyAV's timeout interrupts FFmpeg, which then reports whatever it was
            # doing (often "invalid data"): the time spent says it was the timeout.
            stalled = time.monotonic() - began >= options.stall_timeout
            raise _classify(address, exc, opening=True, stalled=stalled) from None
        except OSError as exc:  # raised by the file system before FFmpeg saw the path
            raise _classify(address, exc, opening=True) from None
        try:
            if not self._container.streams.video:
                raise _error(address, "has no video stream", "no video", False)
            self._video = self._container.streams.video[0]
            self.codec: str = self._video.codec_context.name
            if self.codec not in CODECS + (CAMERA_CODECS if address.kind == "v4l2" else ()):
                taken = "H.264 and H.265" + (", MJPEG and YUYV" if address.kind == "v4l2" else "")
                raise _error(
                    address,
                    f"is {self.codec}, a codec aiodla does not read (it reads {taken})",
                    "unsupported codec",
                    False,
                )
            # Report damaged packets instead of concealing them (see the docstring).
            self._video.codec_context.options = {"err_detect": "explode"}
            # Decode on the reader thread alone: cameras run side by side on their own
            # threads already, no picture waits in a frame-threading pipeline, and the
            # reader's CPU time is then the decoding's whole cost (decode_cpu).
            self._video.codec_context.thread_count = 1
        except BaseException:
            self._container.close()
            raise

    def pictures(self) -> Iterator[Picture | DecodeTrouble]:
        address, stall = self._address, self._options.stall_timeout
        live = address.live
        last = time.monotonic()
        waiting_for_key = False
        codec = self._video.codec_context
        try:
            for packet in self._container.demux(self._video):
                if live and time.monotonic() - last > stall:
                    raise _error(address, f"gave no picture for {stall:g} s", "stalled", True)
                if waiting_for_key:
                    if not packet.is_keyframe:
                        continue
                    waiting_for_key = False
                try:
                    # The demuxer's last, empty packet flushes the decoder's delayed pictures.
                    frames = codec.decode(packet)
                except av.error.FFmpegError as exc:
                    if isinstance(exc, av.error.InvalidDataError) or not live:
                        waiting_for_key = True
                        yield DecodeTrouble(address.redact(str(exc)))
                        continue
                    raise _classify(address, exc, opening=False) from None
                for frame in frames:
                    last = time.monotonic()
                    yield _Picture(frame)
        except av.error.FFmpegError as exc:
            stalled = time.monotonic() - last >= stall
            raise _classify(address, exc, opening=False, stalled=stalled) from None
        except OSError as exc:
            raise _classify(address, exc, opening=False) from None

    def close(self) -> None:
        self._container.close()


def _error(address: Address, what: str, reason: str, retryable: bool) -> VideoSourceError:
    return VideoSourceError(
        f"video source {address.name!r} {what}",
        source=address.name,
        reason=reason,
        retryable=retryable,
    )


def _classify(
    address: Address, exc: BaseException, *, opening: bool, stalled: bool = False
) -> VideoSourceError:
    """FFmpeg's error as a VideoSourceError, its message rid of the credentials."""
    message = address.redact(str(exc))
    if isinstance(exc, (av.error.HTTPUnauthorizedError, av.error.HTTPForbiddenError)):
        return _error(address, f"refused the credentials: {message}", "unauthorized", False)
    if isinstance(exc, av.error.HTTPNotFoundError):
        return _error(address, f"was not found on the server: {message}", "not found", False)
    if not address.live and opening:
        if isinstance(exc, FileNotFoundError):
            return _error(address, "does not exist", "not found", False)
        return _error(address, f"cannot be read as a video: {message}", "unreadable", False)
    if isinstance(exc, FileNotFoundError) and address.kind == "v4l2":
        return _error(address, "does not exist (no such camera)", "not found", False)
    if stalled or isinstance(exc, (av.error.ExitError, TimeoutError)):
        return _error(address, "stalled (no answer within stall_timeout)", "stalled", True)
    return _error(address, f"was lost: {message}", "lost", True)


class FFmpegDecoder:
    name: Literal["ffmpeg"] = "ffmpeg"

    def open(self, address: Address, options: OpenOptions) -> _Stream:
        return _Stream(address, options)


def decoder() -> FFmpegDecoder:
    return FFmpegDecoder()
