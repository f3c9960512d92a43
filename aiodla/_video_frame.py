"""One decoded video frame, in the decoder's own planar YUV layout.

A :class:`VideoFrame` is what a video source yields and what ``Engine.infer`` takes as
it takes an array. It carries the pixels exactly as the decoder gave them (NV12 or
I420): converting between the two on the CPU would cost more than the engine's whole
path for the frame, so the engine's pre-processing reads either layout instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

from ._errors import InputValueError

VideoFormat = Literal["nv12", "i420"]
ColorRange = Literal["limited", "full"]

_FORMATS: tuple[str, ...] = ("nv12", "i420")
_RANGES: tuple[str, ...] = ("limited", "full")


@dataclasses.dataclass(frozen=True, slots=True)
class VideoFrame:
    """A decoded frame of a video source.

    ``array`` holds the whole picture in one ``(height * 3 // 2, width)`` uint8 array:

    - ``format == "nv12"``: the Y plane (``height`` rows of ``width`` bytes), then
      ``height // 2`` rows of interleaved chroma, ``U V U V ...`` (``width // 2`` pairs
      a row).
    - ``format == "i420"``: the Y plane, then the U plane, then the V plane; each chroma
      plane is ``height // 2`` by ``width // 2`` and is packed contiguously, so together
      the two fill the last ``height // 2`` rows (U in the first ``height // 4`` rows'
      worth of bytes, V in the rest).

    ``array`` is a host NumPy array (``on_device`` false) or, for a decoder that keeps
    frames on the GPU, a device array exposing DLPack or ``__cuda_array_interface__``
    (``on_device`` true). A host frame from a source opened with an engine lives in one
    of that engine's frame buffers; the source does not refill that buffer while a
    request reads it.

    Attributes:
        array: The pixels, laid out as above.
        format: ``"nv12"`` or ``"i420"``.
        width: The picture's width in pixels (even).
        height: The picture's height in pixels (even).
        source: The source's name: its URI with any credentials removed.
        index: The 0-based index of this frame among the frames decoded from the source.
        pts: The stream's presentation time of the frame, in seconds, or ``None`` where
            the stream gives none.
        captured_at: The wall-clock time (``time.time()``) at which it was decoded.
        on_device: Whether ``array`` is in device memory.
        color_range: The YUV levels: ``"limited"`` (16..235; H.264 and H.265 cameras)
            or ``"full"`` (0..255, as JPEG codes them: a USB camera's MJPEG). The
            engine's ``ImagePreprocess(color_range=...)`` must be the same.
    """

    array: Any
    format: VideoFormat
    width: int
    height: int
    source: str
    index: int
    pts: float | None
    captured_at: float
    on_device: bool
    color_range: ColorRange = "limited"

    def __post_init__(self) -> None:
        if self.format not in _FORMATS:
            raise InputValueError(f"VideoFrame format={self.format!r} must be one of {_FORMATS}")
        if self.color_range not in _RANGES:
            raise InputValueError(
                f"VideoFrame color_range={self.color_range!r} must be one of {_RANGES}"
            )
        if self.width <= 0 or self.height <= 0 or self.width % 2 or self.height % 2:
            raise InputValueError(
                f"VideoFrame {self.width}x{self.height} must have a positive, even width "
                "and height (chroma is subsampled by two both ways)"
            )
        if isinstance(self.array, np.ndarray):
            if self.on_device:
                raise InputValueError("VideoFrame on_device=True holds a host NumPy array")
            expected = (self.height * 3 // 2, self.width)
            if self.array.dtype != np.uint8 or self.array.shape != expected:
                raise InputValueError(
                    f"VideoFrame {self.format} {self.width}x{self.height} needs a uint8 "
                    f"array of shape {expected}, got {self.array.dtype} "
                    f"{self.array.shape}"
                )

    def planes(self) -> tuple[np.ndarray, ...]:
        """Views of a host frame's planes: ``(y, uv)`` for NV12, where ``uv`` is
        ``(height // 2, width // 2, 2)``, and ``(y, u, v)`` for I420, each chroma plane
        ``(height // 2, width // 2)``. No copy is made of a C-contiguous array."""
        if not isinstance(self.array, np.ndarray):
            raise InputValueError(
                "VideoFrame.planes() reads host frames; this one is on the device"
            )
        y = self.array[: self.height]
        chroma = self.array[self.height :]
        half_h, half_w = self.height // 2, self.width // 2
        if self.format == "nv12":
            return y, chroma.reshape(half_h, half_w, 2)
        # The chroma rows must be contiguous for I420's packed planes to be viewed
        # in place; a frame built from a strided array gets a copy here instead.
        flat = np.ascontiguousarray(chroma).reshape(-1)
        size = half_h * half_w
        return y, flat[:size].reshape(half_h, half_w), flat[size:].reshape(half_h, half_w)
