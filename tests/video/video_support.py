"""Helpers of the video-source tests: PyAV's own decode to compare with, waits."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodla import VideoFrame
from aiodla.testing._video import rtsp_server_python

FPS = 30
SIZE = (160, 120)


def reference_frames(path: Path) -> list[tuple[float | None, np.ndarray[Any, Any]]]:
    """PyAV's own decode of ``path``: (presentation time, I420 picture as one array)."""
    av = pytest.importorskip("av")
    out = []
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            assert frame.format.name == "yuv420p"
            y, u, v = (
                np.frombuffer(p, np.uint8).reshape(-1, p.line_size)[:h, :w]
                for p, w, h in zip(
                    frame.planes,
                    (frame.width, frame.width // 2, frame.width // 2),
                    (frame.height, frame.height // 2, frame.height // 2),
                    strict=True,
                )
            )
            packed = np.concatenate([y.reshape(-1), u.reshape(-1), v.reshape(-1)])
            out.append((frame.time, packed.reshape(frame.height * 3 // 2, frame.width)))
    return out


def host_pixels(frame: VideoFrame) -> np.ndarray[Any, Any]:
    return np.asarray(frame.array)


def rtsp_or_skip() -> str:
    python = rtsp_server_python()
    if python is None:
        pytest.skip(
            "no gst-rtsp-server here (Debian: apt-get install python3-gi "
            "gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-good gstreamer1.0-plugins-bad)"
        )
    return python


async def take(source: Any, count: int, timeout: float = 20.0) -> list[VideoFrame]:
    frames: list[VideoFrame] = []

    async def read() -> None:
        async for frame in source:
            frames.append(frame)
            if len(frames) == count:
                return

    await asyncio.wait_for(read(), timeout)
    return frames


async def wait_for(predicate: Any, timeout: float = 10.0, what: str = "condition") -> float:
    """Poll ``predicate`` on the loop until it holds; the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def mjpeg_clip(path: Path, pix_fmt: str, frames: int = 6, size: tuple[int, int] = (64, 48)) -> Path:
    """An MJPEG clip (``pix_fmt``: ``yuvj420p`` or ``yuvj422p``, full-range YUV as a USB
    camera's) of ``size`` (width, height), made with PyAV: smooth colour ramps that
    move (MJPEG's chroma is subsampled: sharp colour edges would measure two
    conversions' chroma upsampling, not their levels), black and white in every frame."""
    av = pytest.importorskip("av")
    width, height = size
    rows, columns = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mjpeg", rate=30)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        for k in range(frames):
            image = np.empty((height, width, 3), np.uint8)
            image[..., 0] = (columns * 255 // (width - 1) + 8 * k) % 256
            image[..., 1] = rows * 255 // (height - 1)
            image[..., 2] = 255 - columns * 255 // (width - 1)
            image[:4], image[-4:] = 0, 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
