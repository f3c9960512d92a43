"""Full-range YUV, as a USB camera's MJPEG gives it (FFmpeg's ``yuvj420p``, and
``yuvj422p`` made 4:2:0): the frame says ``color_range="full"``, an engine reading full
range turns it into the colours FFmpeg's own conversion gives, and an engine reading
limited range refuses it with an error that says what to open instead (read as
limited range, the same planes are tens of levels off).

The clips are MJPEG encoded here with PyAV. Files are read as H.264 and H.265 only, so
the ffmpeg decoder is told to take MJPEG from a file too: the rest of the path is the
one a ``/dev/videoN`` camera's frames take."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from video_support import mjpeg_clip

from aiodla import ImagePreprocess, InputValueError, TensorSpec, VideoFrame, VideoSource
from aiodla.emulator import make_loadable
from aiodla.testing import EngineFactory

av = pytest.importorskip("av", reason="the video tests need PyAV (pip install 'aiodla[video]')")


SIZE = (64, 48)  # width, height
IMAGES = TensorSpec("images", (1, 3, SIZE[1], SIZE[0]), "float32", "nchw")
OUT = TensorSpec("out", (1, 3, SIZE[1], SIZE[0]), "float32", "nchw")


def ffmpeg_rgb(path: Path, as_420: bool) -> list[np.ndarray[Any, Any]]:
    """FFmpeg's own conversion of each picture to RGB, which reads yuvj as full range;
    ``as_420``: of its planes made 4:2:0 first, as the ffmpeg decoder makes them (a
    yuvj picture stays marked full range through the reformat)."""
    with av.open(str(path)) as container:
        return [
            (frame.reformat(format="yuv420p") if as_420 else frame).to_ndarray(format="rgb24")
            for frame in container.decode(video=0)
        ]


@pytest.fixture
def mjpeg_files(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiodla import _video_ffmpeg

    monkeypatch.setattr(_video_ffmpeg, "CODECS", (*_video_ffmpeg.CODECS, "mjpeg"))


def gstreamer_reads_mjpeg_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gstreamer decoder takes MJPEG from a file too (or the test skips)."""
    from aiodla._video_decoders import missing

    why = missing("gstreamer")
    if why is not None:
        pytest.skip(f"no gstreamer decoder here: {why}")
    from aiodla import _video_gstreamer

    monkeypatch.setattr(
        _video_gstreamer, "_CODECS", {**_video_gstreamer._CODECS, "image/jpeg": "mjpeg"}
    )


async def identity_engine(aiodla_engine: EngineFactory, color_range: str) -> Any:
    model = make_loadable([IMAGES], [OUT], "affine", 0.0005, scale=1.0, bias=0.0)
    pre = ImagePreprocess(
        source="i420", order="rgb", resize=None, scale=1.0, color_range=color_range
    )  # type: ignore[arg-type]
    return await aiodla_engine(model, preprocess={"images": pre}, cores=[0])


@pytest.mark.usefixtures("mjpeg_files")
@pytest.mark.parametrize("pix_fmt", ["yuvj420p", "yuvj422p"])
@pytest.mark.parametrize("decoder", ["ffmpeg", "gstreamer"])
@pytest.mark.asyncio
async def test_mjpeg_frames_are_full_range_and_read_as_such(
    tmp_path: Path,
    aiodla_engine: EngineFactory,
    monkeypatch: pytest.MonkeyPatch,
    pix_fmt: str,
    decoder: str,
) -> None:
    if decoder == "gstreamer":
        gstreamer_reads_mjpeg_files(monkeypatch)
    clip = mjpeg_clip(tmp_path / "clip.mkv", pix_fmt)
    full = await identity_engine(aiodla_engine, "full")
    async with VideoSource(clip, decoder, max_frames=8) as source:
        frames = [frame async for frame in source]
        assert source.statistics().codec == "mjpeg"
    references = ffmpeg_rgb(clip, as_420=decoder == "ffmpeg")
    assert len(frames) == len(references) == 6
    for frame, rgb in zip(frames, references, strict=True):
        assert (frame.format, frame.color_range) == ("i420", "full")
        got = (await full.infer(frame))[0].transpose(1, 2, 0)
        difference = np.abs(got - rgb.astype(np.float32))
        # The same planes read as limited range: what the frames were taken as before.
        as_limited = ImagePreprocess(source="i420", order="rgb", resize=None, scale=1.0)
        wrong = as_limited.apply(np.asarray(frame.array), IMAGES)[0].transpose(1, 2, 0)
        wrong_difference = np.abs(wrong - rgb.astype(np.float32))
        assert wrong_difference.max() > 20 and wrong_difference.mean() > 5
        if decoder == "ffmpeg":
            # The same planes as FFmpeg converts: its tables and chroma upsampling
            # against OpenCV's coefficients and nearest chroma, a few levels at most.
            assert difference.max() <= 3, difference.max()
            assert difference.mean() <= 1.0, difference.mean()
        else:
            # GStreamer decodes the JPEG and subsamples 4:2:2 chroma its own way: a
            # couple of levels on average from FFmpeg's picture, against 7 or 8 when
            # read as limited range.
            assert difference.mean() <= 2.5, difference.mean()


@pytest.mark.usefixtures("mjpeg_files")
@pytest.mark.asyncio
async def test_an_engine_reading_limited_range_refuses_a_full_range_frame(
    tmp_path: Path, aiodla_engine: EngineFactory
) -> None:
    clip = mjpeg_clip(tmp_path / "clip.mkv", "yuvj420p")
    limited = await identity_engine(aiodla_engine, "limited")
    async with VideoSource(clip, "ffmpeg") as source:
        frame = await anext(aiter(source))
    with pytest.raises(InputValueError, match=r"full range .* color_range='full'\)"):
        await limited.infer(frame)
    assert limited.statistics().submitted == 0


@pytest.mark.asyncio
async def test_a_limited_range_frame_is_refused_by_a_full_range_engine(
    aiodla_engine: EngineFactory,
) -> None:
    full = await identity_engine(aiodla_engine, "full")
    frame = VideoFrame(
        array=np.zeros((SIZE[1] * 3 // 2, SIZE[0]), np.uint8), format="i420",
        width=SIZE[0], height=SIZE[1], source="test", index=0, pts=None,
        captured_at=0.0, on_device=False,
    )  # fmt: skip
    assert frame.color_range == "limited"  # what a frame is unless it says otherwise
    with pytest.raises(InputValueError, match=r"limited range .* color_range='limited'\)"):
        await full.infer(frame)


def test_a_frame_with_an_unknown_range_is_refused() -> None:
    with pytest.raises(InputValueError, match="color_range='pc' must be one of"):
        VideoFrame(
            array=np.zeros((6, 4), np.uint8), format="i420", width=4, height=4,
            source="test", index=0, pts=None, captured_at=0.0, on_device=False,
            color_range="pc",  # type: ignore[arg-type]
        )  # fmt: skip
