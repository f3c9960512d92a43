"""The ``"gstreamer"`` decoder: GStreamer through PyGObject.

On a Jetson this is the route to its video engines: ``decodebin`` plugs
``nvv4l2decoder`` (NVDEC through V4L2; Orin has no Video Codec SDK), and ``nvvidconv``
copies the picture out of NVMM memory as NV12; CSI cameras come from
``nvarguscamerasrc`` the same way. Elsewhere ``decodebin`` plugs the software decoders
(``avdec_h264``, ``avdec_h265``: FFmpeg's), whose I420 passes ``videoconvert``
unchanged. Either way the pipeline ends in an ``appsink`` that this thread pulls from
with a timeout, so stopping and stall detection never wait on GStreamer.

Which codecs are taken is decided as the ffmpeg decoder decides it: ``decodebin``'s
``autoplug-continue`` sees each stream's caps before a decoder is plugged, and
anything but H.264 and H.265 (and a USB camera's MJPEG or raw frames) stops it there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from ._video_decoders import keep_the_cxx_unwinder

keep_the_cxx_unwinder()  # before GStreamer's libraries load: see its docstring
import gi  # noqa: E402

gi.require_version("Gst", "1.0")
gi.require_version("GstApp", "1.0")
gi.require_version("GstVideo", "1.0")
# GstApp is imported for its typelib: appsink's pull methods come with it.
from gi.repository import Gst, GstApp, GstVideo  # noqa: E402, F401

from ._errors import VideoSourceError  # noqa: E402
from ._video_address import Address  # noqa: E402
from ._video_decoders import DecodeTrouble, OpenOptions, Picture  # noqa: E402

__all__ = ["decoder"]

Gst.init(None)

_CODECS = {"video/x-h264": "h264", "video/x-h265": "hevc"}
_CAMERA_CODECS = {"image/jpeg": "mjpeg", "video/x-raw": "rawvideo"}
#: GstVideo's "0_255" range (a name Python cannot spell as an attribute).
_FULL_RANGE = getattr(GstVideo.VideoColorRange, "0_255")
_POLL = 100 * Gst.MSECOND  # how long one pull waits before looking at stop and stall


_VIDEO_DECODERS = Gst.ElementFactory.list_get_elements(
    Gst.ELEMENT_FACTORY_TYPE_DECODER | Gst.ELEMENT_FACTORY_TYPE_MEDIA_VIDEO, Gst.Rank.MARGINAL
)


def _decodes(caps: Any) -> bool:
    """Whether ``caps`` is what a video decoder takes (a codec, as opposed to a
    container, which a demuxer takes)."""
    return bool(Gst.ElementFactory.list_filter(_VIDEO_DECODERS, caps, Gst.PadDirection.SINK, False))


def _on_jetson() -> bool:
    return Gst.ElementFactory.find("nvvidconv") is not None


class _Picture:
    __slots__ = ("_sample", "color_range", "format", "height", "on_device", "pts", "width")
    cpu_elsewhere = 0.0  # its own decoding threads' CPU goes uncounted (see decode_cpu)

    def __init__(self, sample: Any, info: Any, fmt: Literal["nv12", "i420"]) -> None:
        self._sample = (sample, info)
        self.format: Literal["nv12", "i420"] = fmt
        # The caps' colorimetry says the levels: jpegdec's MJPEG pictures are full range
        # (videoconvert passes them on as they are), H.264 and H.265 limited.
        full = info.colorimetry.range == _FULL_RANGE
        self.color_range: Literal["limited", "full"] = "full" if full else "limited"
        self.width = info.width - info.width % 2
        self.height = info.height - info.height % 2
        pts = sample.get_buffer().pts
        self.pts = None if pts == Gst.CLOCK_TIME_NONE else pts / Gst.SECOND
        self.on_device = False

    def write_into(self, out: np.ndarray[Any, Any]) -> None:
        sample, info = self._sample
        buffer = sample.get_buffer()
        ok, mapped = buffer.map(Gst.MapFlags.READ)
        if not ok:
            raise RuntimeError("GStreamer could not map a decoded picture")
        try:
            data = np.frombuffer(mapped.data, np.uint8)
            width, height = self.width, self.height
            _plane(data, info.offset[0], info.stride[0], out[:height], width, height)
            chroma = out[height:].reshape(-1)
            if self.format == "nv12":
                target = chroma.reshape(height // 2, width)
                _plane(data, info.offset[1], info.stride[1], target, width, height // 2)
                return
            size = (width // 2) * (height // 2)
            for plane, at in ((1, 0), (2, size)):
                target = chroma[at : at + size].reshape(height // 2, width // 2)
                _plane(
                    data, info.offset[plane], info.stride[plane], target, width // 2, height // 2
                )
        finally:
            buffer.unmap(mapped)

    def device_array(self) -> Any:  # pragma: no cover - host pictures only
        raise TypeError("a GStreamer picture is on the host")


def _plane(
    data: np.ndarray[Any, Any],
    offset: int,
    stride: int,
    out: np.ndarray[Any, Any],
    width: int,
    height: int,
) -> None:
    rows = data[offset : offset + stride * height].reshape(height, stride)
    out[...] = rows[:, :width]


def _description(address: Address, live: bool) -> str:
    """The pipeline, with its source element named ``src`` (properties set apart, so no
    path or URI is ever quoted into the description)."""
    jetson = _on_jetson()
    out = (
        "nvvidconv ! video/x-raw,format=NV12"
        if jetson
        else "videoconvert ! video/x-raw,format=I420"
    )
    sink = "appsink name=sink sync=false " + (
        "max-buffers=2 drop=true" if live else "max-buffers=2 drop=false"
    )
    if address.kind == "csi":
        return f"nvarguscamerasrc name=src ! nvvidconv ! video/x-raw,format=NV12 ! {sink}"
    source = {
        "file": "filesrc name=src",
        "rtsp": "rtspsrc name=src latency=200",
        "v4l2": "v4l2src name=src",
    }[address.kind]
    return f"{source} ! decodebin name=dec ! {out} ! {sink}"


class _Stream:
    def __init__(self, address: Address, options: OpenOptions) -> None:
        self._address = address
        self._options = options
        self.codec = "unknown"
        self._refused: str | None = None
        if address.kind == "file" and not os.path.exists(address.uri):
            raise _error(address, "does not exist", "not found", False)
        pipeline: Any = Gst.parse_launch(_description(address, address.live))
        self._pipeline = pipeline
        src = pipeline.get_by_name("src")
        if address.kind == "file":
            src.set_property("location", address.uri)
        elif address.kind == "rtsp":
            src.set_property("location", address.uri)
            Gst.util_set_object_arg(src, "protocols", options.transport)
            src.set_property("tcp-timeout", int(options.stall_timeout * 1e6))
        elif address.kind == "v4l2":
            src.set_property("device", address.uri)
        elif address.kind == "csi":
            src.set_property("sensor-id", int(address.uri.rsplit("/", 1)[-1]))
        dec = pipeline.get_by_name("dec")
        if dec is not None:
            dec.connect("autoplug-continue", self._caps_seen)
        self._sink: Any = pipeline.get_by_name("sink")
        self._bus: Any = pipeline.get_bus()
        if pipeline.set_state(Gst.State.PLAYING) == Gst.StateChangeReturn.FAILURE:
            error = self._bus_error()
            pipeline.set_state(Gst.State.NULL)
            raise error or _error(address, "could not be opened", "lost", address.live)

    def _caps_seen(self, _bin: Any, _pad: Any, caps: Any) -> bool:
        """decodebin's question before plugging the next element: go on for the codecs
        aiodla takes, stop (and refuse) at any other video."""
        kind = caps.get_structure(0).get_name()
        taken = _CODECS | (_CAMERA_CODECS if self._address.kind == "v4l2" else {})
        if kind in taken:
            self.codec = taken[kind]
            return True
        if kind != "video/x-raw" and _decodes(caps):  # a video codec, not a container
            self._refused = kind.split("/", 1)[1].removeprefix("x-")
            return False
        return True

    def pictures(self) -> Iterator[Picture | DecodeTrouble]:
        address, stall = self._address, self._options.stall_timeout
        last = time.monotonic()
        while True:
            sample = self._sink.try_pull_sample(_POLL)
            if sample is not None:
                caps = sample.get_caps()
                info = GstVideo.VideoInfo.new_from_caps(caps)
                name = info.finfo.name.lower()
                last = time.monotonic()
                yield _Picture(sample, info, "nv12" if name == "nv12" else "i420")
                continue
            if self._sink.is_eos():
                return
            error = self._bus_error()
            if error is not None:
                raise error
            if time.monotonic() - last > stall and (address.live or self.codec == "unknown"):
                raise _error(address, f"gave no picture for {stall:g} s", "stalled", True)

    def _bus_error(self) -> VideoSourceError | None:
        address = self._address
        if self._refused is not None:
            return _error(
                address,
                f"is {self._refused}, a codec aiodla does not read (it reads H.264 and H.265)",
                "unsupported codec",
                False,
            )
        message = self._bus.pop_filtered(Gst.MessageType.ERROR)
        if message is None:
            return None
        error, _debug = message.parse_error()
        text = address.redact(error.message)
        if error.matches(Gst.ResourceError.quark(), Gst.ResourceError.NOT_AUTHORIZED):
            return _error(address, f"refused the credentials: {text}", "unauthorized", False)
        if error.matches(Gst.ResourceError.quark(), Gst.ResourceError.NOT_FOUND):
            return _error(address, f"was not found: {text}", "not found", False)
        if error.matches(Gst.StreamError.quark(), Gst.StreamError.CODEC_NOT_FOUND) or error.matches(
            Gst.CoreError.quark(), Gst.CoreError.MISSING_PLUGIN
        ):
            return _error(address, f"has no decoder here: {text}", "unsupported codec", False)
        if not address.live:
            return _error(address, f"cannot be read as a video: {text}", "unreadable", False)
        return _error(address, f"was lost: {text}", "lost", True)

    def close(self) -> None:
        self._pipeline.set_state(Gst.State.NULL)


def _error(address: Address, what: str, reason: str, retryable: bool) -> VideoSourceError:
    return VideoSourceError(
        f"video source {address.name!r} {what}",
        source=address.name,
        reason=reason,
        retryable=retryable,
    )


class GStreamerDecoder:
    name: Literal["gstreamer"] = "gstreamer"

    def open(self, address: Address, options: OpenOptions) -> _Stream:
        return _Stream(address, options)


def decoder() -> GStreamerDecoder:
    return GStreamerDecoder()
