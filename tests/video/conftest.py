"""Clips and an RTSP server the video-source tests share, made once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from video_support import FPS, SIZE, rtsp_or_skip

from aiodla.testing import RtspServer, encode_clip


@pytest.fixture(scope="session")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Short clips (2 s) in each container, and long ones (20 s) to stream."""
    pytest.importorskip("av", reason="the video tests need PyAV (pip install 'aiodla[video]')")
    root = tmp_path_factory.mktemp("clips")
    made = {
        "h264.mp4": encode_clip(root / "h264.mp4", "h264", frames=60, size=SIZE),
        "h265.mkv": encode_clip(root / "h265.mkv", "h265", frames=60, size=SIZE),
        "h264.mov": encode_clip(root / "h264.mov", "h264", frames=20, size=SIZE),
        "h265.ts": encode_clip(root / "h265.ts", "h265", frames=20, size=SIZE),
        "long264.mp4": encode_clip(root / "long264.mp4", "h264", frames=FPS * 20, size=SIZE),
        "long265.mkv": encode_clip(root / "long265.mkv", "h265", frames=FPS * 20, size=SIZE),
    }
    return made


@pytest.fixture(scope="session")
def rtsp(clips: dict[str, Path]) -> Iterator[RtspServer]:
    """One server for the tests that only read (each client gets its own pipeline)."""
    python = rtsp_or_skip()
    server = RtspServer(
        {"h264": (clips["long264.mp4"], "h264"), "h265": (clips["long265.mkv"], "h265")},
        python=python,
    )
    with server:
        yield server
