"""VideoSource with the gstreamer decoder: the software decoders here, nvv4l2decoder on a
Jetson (skipped elsewhere, saying so)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from video_support import FPS, reference_frames, take, wait_for

from aiodla import VideoFrame, VideoSource, VideoSourceError
from aiodla._video_decoders import missing
from aiodla.testing import RtspServer

_why = missing("gstreamer")
pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.skipif(_why is not None, reason=f"no gstreamer decoder here: {_why}"),
]


async def read_all(uri: object) -> list[VideoFrame]:
    async with VideoSource(uri, "gstreamer", max_frames=4) as source:
        return [frame async for frame in source]


@pytest.mark.parametrize("clip", ["h264.mp4", "h265.mkv", "h265.ts"])
async def test_every_frame_in_order_equals_pyav_decode(clips: dict[str, Path], clip: str) -> None:
    expected = reference_frames(clips[clip])
    async with VideoSource(clips[clip], "gstreamer", max_frames=4) as source:
        frames = [frame async for frame in source]
    assert [f.index for f in frames] == list(range(len(expected)))
    for frame, (pts, pixels) in zip(frames, expected, strict=True):
        assert frame.format == VideoSource(clips[clip], "gstreamer").format == "i420"
        assert frame.pts == pytest.approx(pts, abs=1e-3)
        np.testing.assert_array_equal(frame.array, pixels)
    stats = source.statistics()
    assert (stats.decoder, stats.codec) == ("gstreamer", "h264" if "h264" in clip else "hevc")


async def test_rtsp_frames_in_order(rtsp: RtspServer, clips: dict[str, Path]) -> None:
    expected = {
        round(pts * FPS): pixels for pts, pixels in reference_frames(clips["long264.mp4"])[:60]
    }
    async with VideoSource(rtsp.url("h264"), "gstreamer", max_frames=64) as source:
        frames = await take(source, 20)
    assert [f.index for f in frames] == list(range(20))
    times = [f.pts or 0.0 for f in frames]
    assert all(f.pts is not None for f in frames) and times == sorted(times)
    # GStreamer's timestamps are the pipeline's running time, not the clip's: match the
    # pixels to the clip's frames by content instead.
    for frame in frames:
        assert any(np.array_equal(frame.array, p) for p in expected.values())


async def test_a_codec_it_does_not_take(tmp_path: Path) -> None:
    import av

    path = tmp_path / "vp9.mkv"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libvpx-vp9", rate=30)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(3):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i, np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    with pytest.raises(VideoSourceError, match="vp9, a codec aiodla does not read") as caught:
        await read_all(path)
    assert caught.value.reason == "unsupported codec"


async def test_refused_sources(tmp_path: Path, clips: dict[str, Path]) -> None:
    with pytest.raises(VideoSourceError, match="does not exist"):
        async with VideoSource(tmp_path / "nope.mp4", "gstreamer"):
            pass
    server = RtspServer({"cam": (clips["long264.mp4"], "h264")}, auth=("viewer", "right-pw"))
    with server:
        with pytest.raises(VideoSourceError, match="refused the credentials") as caught:
            await read_all(server.url("cam", user="viewer", password="no"))
        assert "viewer" not in str(caught.value)
        with pytest.raises(VideoSourceError, match="was not found"):
            await read_all(server.url("other", user="viewer", password="right-pw"))


async def test_reconnects_when_the_server_comes_back(clips: dict[str, Path]) -> None:
    server = RtspServer({"cam": (clips["long264.mp4"], "h264")})
    with server:
        async with VideoSource(server.url("cam"), "gstreamer", stall_timeout=1.0) as source:
            await take(source, 5)
            with server.down():
                await wait_for(lambda: source.statistics().state == "reconnecting", what="the loss")
            await take(source, 5)
            assert source.statistics().reconnects == 1


async def test_nvv4l2decoder_on_a_jetson(tmp_path: Path) -> None:
    """The Jetson route (nvv4l2decoder + nvvidconv, NV12 out) runs only where it exists."""
    from gi.repository import Gst

    if Gst.ElementFactory.find("nvv4l2decoder") is None:
        pytest.skip("no nvv4l2decoder here: a Jetson's decoder, verified only on one")
    from aiodla.testing import encode_clip

    frames = await read_all(encode_clip(tmp_path / "jetson.mp4", "h264", frames=10))
    assert len(frames) == 10
    assert all(f.format == "nv12" for f in frames)
