"""A source opened with engine= draws its frames into that engine's timeline: a track
per source, a slice per decoded frame, a flow into the request that read it."""

from __future__ import annotations

from pathlib import Path

import pytest
from video_support import take

from aiodla import ImagePreprocess, TensorSpec, VideoSource
from aiodla.emulator import make_loadable
from aiodla.testing import EngineFactory

from trace_format import check_trace_format

pytest.importorskip("av", reason="the video tests need PyAV (pip install 'aiodla[video]')")

pytestmark = pytest.mark.asyncio


async def test_frames_and_their_requests_on_the_timeline(
    clips: dict[str, Path], aiodla_engine: EngineFactory
) -> None:
    images = TensorSpec("images", (1, 3, 48, 64), "float16", "chw16")
    out = TensorSpec("out", (1, 3, 48, 64), "float32", "nchw")
    model = make_loadable([images], [out], "affine", 0.0005, scale=1.0, bias=0.0)
    pre = ImagePreprocess(source="i420", order="rgb", resize="stretch")
    engine = await aiodla_engine(model, preprocess={"images": pre}, cores=[0])
    async with (
        engine.trace() as recorder,
        VideoSource(clips["h264.mp4"], "ffmpeg", engine=engine, name="cam-a") as a,
        VideoSource(clips["h265.mkv"], "ffmpeg", engine=engine, name="cam-b") as b,
    ):
        for source in (a, b):
            for frame in await take(source, 4):
                await engine.infer(frame)
        async with VideoSource(clips["h264.mov"], "ffmpeg", name="no-engine") as c:
            await take(c, 2)  # not given the engine: not on its timeline
    document = recorder.trace_events()
    check_trace_format(document)
    events = document["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    video = {tid: name for tid, name in tracks.items() if name.startswith("video: ")}
    assert sorted(video.values()) == ["video: cam-a", "video: cam-b"]
    decodes = [e for e in events if e["name"] == "decode"]
    assert {e["args"]["source"] for e in decodes} == {"cam-a", "cam-b"}
    assert all(e["tid"] in video for e in decodes)
    flows = [e for e in events if e.get("cat") == "frame"]
    starts = [e for e in flows if e["ph"] == "s"]
    assert len(starts) == 8  # every frame that went into infer, linked to its request
    assert len([e for e in flows if e["ph"] == "f"]) == 8
