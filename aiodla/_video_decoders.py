"""The decoders a video source can use, what each must do, and which one ``"auto"`` takes.

A decoder opens an :class:`~aiodla._video_address.Address` into a :class:`DecodedStream`
whose :meth:`~DecodedStream.pictures` yields each decoded picture in the decoder's own
planar layout (NV12 or I420: converting between the two on the CPU costs more than the
engine's whole path for a frame). It runs on the source's reader thread, never on the
event loop. Three exist:

- ``"ffmpeg"``: PyAV (``pip install aiodla[video]``), CPU decoding, everywhere;
- ``"gstreamer"``: GStreamer through PyGObject: ``nvv4l2decoder`` and ``nvvidconv`` on
  a Jetson (its video engines, NV12 out), the software decoders elsewhere; the only
  one that reads a Jetson's CSI cameras (``nvarguscamerasrc``);
- ``"nvdec"``: PyNvVideoCodec (``pip install aiodla[nvdec]``) on NVIDIA GPUs with the
  Video Codec SDK; pictures stay in device memory.

``"auto"`` takes, in order: ``nvdec`` where PyNvVideoCodec imports and a GPU is present
(not for USB or CSI cameras, which it cannot read); ``gstreamer`` on a Jetson (where
``nvv4l2decoder`` exists) and for CSI cameras; ``ffmpeg`` where PyAV imports; else
``gstreamer`` where PyGObject imports.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
from collections.abc import Iterator
from typing import Any, Literal, Protocol

import numpy as np

from ._errors import ConfigurationError, VideoSourceError
from ._video_address import Address

__all__ = [
    "DECODERS",
    "ISOLATIONS",
    "DecodeTrouble",
    "DecodedStream",
    "Decoder",
    "DecoderName",
    "Isolation",
    "OpenOptions",
    "Picture",
    "available_decoders",
    "choose_decoder",
    "decoder_for",
    "keep_the_cxx_unwinder",
    "output_format",
]

logger = logging.getLogger("aiodla")

DecoderName = Literal["ffmpeg", "gstreamer", "nvdec"]
DECODERS: tuple[DecoderName, ...] = ("ffmpeg", "gstreamer", "nvdec")
#: Where a source's decoder runs: on its reader thread, or in a process of its own.
Isolation = Literal["thread", "process"]
ISOLATIONS: tuple[Isolation, ...] = ("thread", "process")

#: The codecs every decoder takes (FFmpeg's names). USB cameras add MJPEG and raw YUYV.
CODECS = ("h264", "hevc")
CAMERA_CODECS = ("mjpeg", "rawvideo")


@dataclasses.dataclass(frozen=True)
class OpenOptions:
    """What a decoder needs to know to open a source."""

    transport: Literal["tcp", "udp"]
    stall_timeout: float  # seconds without a picture before the stream counts as lost
    gpu: int  # nvdec's device


class Picture(Protocol):
    """One decoded picture, still where the decoder put it."""

    format: Literal["nv12", "i420"]
    color_range: Literal["limited", "full"]  # the YUV levels: 16..235 or 0..255
    width: int
    height: int
    pts: float | None
    on_device: bool
    #: CPU seconds spent on this picture where the reader thread's clock does not see
    #: them: a decoding process's (``isolation="process"``); 0.0 for a decoder that
    #: runs on the reader thread.
    cpu_elsewhere: float

    def write_into(self, out: np.ndarray[Any, Any]) -> None:
        """Copy a host picture into ``out`` (``(height * 3 // 2, width)`` uint8) in the
        layout :class:`aiodla.VideoFrame` states."""

    def device_array(self) -> Any:
        """A device picture as an array exposing the CUDA array interface; it keeps the
        decoder's memory alive while it lives."""


@dataclasses.dataclass(frozen=True)
class DecodeTrouble:
    """A packet the decoder could not decode: counted, and the stream goes on from the
    next keyframe."""

    message: str
    cpu_elsewhere: float = 0.0  # as a Picture's: a decoding process's CPU for it


class DecodedStream(Protocol):
    codec: str  # FFmpeg's name of the stream's codec

    def pictures(self) -> Iterator[Picture | DecodeTrouble]:
        """Decoded pictures in presentation order, until the stream ends (a file's
        end, a live stream that stopped). Raises VideoSourceError when the stream
        breaks or stalls (``stall_timeout`` without a picture)."""
        ...

    def close(self) -> None: ...


class Decoder(Protocol):
    name: DecoderName

    def open(self, address: Address, options: OpenOptions) -> DecodedStream:
        """Open the source; VideoSourceError (``retryable`` as the cause says) when it
        cannot be."""
        ...


_MODULES: dict[DecoderName, str] = {
    "ffmpeg": "aiodla._video_ffmpeg",
    "gstreamer": "aiodla._video_gstreamer",
    "nvdec": "aiodla._video_nvdec",
}

#: What each decoder imports, and the extra or package that brings it.
_NEEDS: dict[DecoderName, tuple[str, str]] = {
    "ffmpeg": ("av", "pip install 'aiodla[video]'"),
    "gstreamer": (
        "gi",
        "PyGObject with GStreamer: on Debian or JetPack apt-get install python3-gi "
        "gir1.2-gstreamer-1.0 gir1.2-gst-plugins-base-1.0 (the system Python's), or in "
        "a virtual environment pip install 'aiodla[gstreamer]'",
    ),
    "nvdec": (
        "PyNvVideoCodec",
        "pip install 'aiodla[nvdec]' on a machine with an NVIDIA GPU and driver",
    ),
}


@functools.cache
def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def missing(name: DecoderName) -> str | None:
    """Why decoder ``name`` cannot run here, or None when it can (as far as a look
    without opening anything tells)."""
    module, how = _NEEDS[name]
    if not _importable(module):
        return f"{module} is not installed ({how})"
    if name == "nvdec" and not _gpu_present():
        return "no NVIDIA GPU is visible (NVDEC needs one)"
    if name == "gstreamer":
        return _gstreamer_missing()
    return None


def available_decoders() -> dict[DecoderName, str | None]:
    """Each decoder, mapped to None where it can run here, else to why not."""
    return {name: missing(name) for name in DECODERS}


def choose_decoder(requested: str, address: Address) -> DecoderName:
    """The decoder for ``address``: ``requested`` itself (checked), or ``"auto"``'s
    choice (see the module docstring). VideoSourceError when none can read it."""
    if requested != "auto" and requested not in DECODERS:
        raise ConfigurationError(f"decoder={requested!r} must be 'auto' or one of {DECODERS}")
    if requested != "auto":
        name: DecoderName = requested  # type: ignore[assignment]
        why = missing(name) or _cannot_read(name, address)
        if why is not None:
            raise VideoSourceError(
                f"video source {address.name!r}: decoder {name!r} cannot run: {why}",
                source=address.name,
                reason="decoder",
                retryable=False,
            )
        return name
    order: list[DecoderName] = ["nvdec"]
    if address.kind == "csi" or _on_jetson():
        order.append("gstreamer")
    order += ["ffmpeg", "gstreamer"]
    reasons = []
    for name in order:
        why = missing(name) or _cannot_read(name, address)
        if why is None:
            return name
        reasons.append(f"{name}: {why}")
    raise VideoSourceError(
        f"video source {address.name!r}: no decoder here can read it "
        f"({'; '.join(dict.fromkeys(reasons))})",
        source=address.name,
        reason="decoder",
        retryable=False,
    )


def output_format(name: DecoderName, address: Address) -> Literal["nv12", "i420"]:
    """The layout decoder ``name`` gives for ``address``: NV12 from NVDEC and from a
    Jetson's GStreamer pipelines (``nvvidconv``), I420 from FFmpeg and GStreamer's
    software decoders (a camera's YUYV or 4:2:2 MJPEG made I420 first)."""
    if name == "nvdec" or (name == "gstreamer" and (_on_jetson() or address.kind == "csi")):
        return "nv12"
    return "i420"


def decoder_for(name: DecoderName) -> Decoder:
    """An instance of decoder ``name`` (its module imported now, not at aiodla's import)."""
    module = importlib.import_module(_MODULES[name])
    decoder: Decoder = module.decoder()
    return decoder


def _cannot_read(name: DecoderName, address: Address) -> str | None:
    if address.kind == "csi" and name != "gstreamer":
        return "CSI cameras are read through GStreamer's nvarguscamerasrc only"
    if address.kind == "v4l2" and name == "nvdec":
        return "USB cameras give MJPEG or raw frames, which NVDEC does not read"
    return None


@functools.cache
def _gpu_present() -> bool:
    import os

    return any(
        os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvhost-ctrl-gpu", "/dev/nvgpu/igpu0")
    )


@functools.cache
def _on_jetson() -> bool:
    import os

    return os.path.exists("/etc/nv_tegra_release")


@functools.cache
def keep_the_cxx_unwinder() -> None:
    """Load libgcc_s into the process's global symbol scope, before GStreamer.

    Debian's libgstreamer links libunwind, whose ``_Unwind_*`` functions then come
    first in the global scope; C++ code loaded afterwards (pybind11 modules such as
    matplotlib's ``ft2font``) unwinds its exceptions through them, and the process
    aborts. With libgcc_s there first, the C++ runtime's own unwinder is the one found.
    """
    import contextlib
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # not glibc's toolchain: nothing to keep
            ctypes.CDLL("libgcc_s.so.1", mode=ctypes.RTLD_GLOBAL)


@functools.cache
def _gstreamer_missing() -> str | None:
    keep_the_cxx_unwinder()
    try:
        import gi

        gi.require_version("Gst", "1.0")
        gi.require_version("GstApp", "1.0")
        from gi.repository import Gst, GstApp  # noqa: F401
    except (ImportError, ValueError) as exc:
        return (
            f"GStreamer's Python bindings do not load ({exc}; Debian: apt-get install "
            "gir1.2-gstreamer-1.0 gir1.2-gst-plugins-base-1.0)"
        )
    Gst.init(None)
    if Gst.ElementFactory.find("appsink") is None:
        return "GStreamer has no appsink (install gstreamer1.0-plugins-base)"
    return None
