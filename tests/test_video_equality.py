"""Decoded frames as the decoder gives them (FFmpeg's I420, NVDEC's NV12) through
``ImagePreprocess`` against the path a user takes today: decode to BGR on the host
(FFmpeg's own conversion, as ``frame.to_ndarray(format="bgr24")`` or OpenCV's
``VideoCapture`` does it), then ``ImagePreprocess(source="bgr")``.

The rounding, as the camera guide states it: every element of the model input is
within 3 pixel levels (``3 * scale / std[k]`` after normalization) of the BGR path's,
and on average within about 1.1: FFmpeg's BT.601 conversion (libswscale) rounds with
tables of its own, while aiodla's is exactly OpenCV's ``COLOR_YUV2RGB_NV12`` /
``COLOR_YUV2RGB_I420`` (so against OpenCV's conversion of the same planes the two
agree exactly). One exception: a luma sample below the limited range's black (Y < 16,
which encoders may overshoot to at sharp edges) is clamped to 16 first, as OpenCV
does, where FFmpeg extrapolates, so such a pixel differs by up to 3 + 1.164 * (16 - Y)
levels. Clips are H.264 and H.265, encoded here with PyAV.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

from aiodla import Engine, ImagePreprocess, TensorSpec, VideoFrame
from aiodla.emulator import make_loadable

av = pytest.importorskip("av")

#: The stated bound, in pixel levels before normalization, and the mean it stays under.
LEVELS = 3
MEAN_LEVELS = 1.2
IMAGES = TensorSpec("images", (1, 3, 192, 320), "float32", "nchw")


def clip(codec: str, width: int, height: int, frames: int = 6, noise: bool = True) -> bytes:
    """A clip of gradients, a moving disc and (``noise``) a band of noise: smooth ramps,
    hard edges, saturated colour and, with the noise, samples the encoder overshoots
    below black; encoded by PyAV."""
    if codec not in av.codecs_available:  # wheels bundle them; a local FFmpeg may not
        pytest.skip(f"PyAV's FFmpeg here has no {codec} encoder")
    buffer = io.BytesIO()
    rows, columns = np.mgrid[0:height, 0:width]
    rng = np.random.default_rng(0)
    with av.open(buffer, "w", format="matroska") as container:
        stream = container.add_stream(codec, rate=30)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if codec == "libx265":
            stream.options = {"preset": "ultrafast", "x265-params": "log-level=none"}
        else:
            stream.options = {"preset": "ultrafast", "crf": "18"}
        for k in range(frames):
            image = np.empty((height, width, 3), np.uint8)
            image[..., 0] = columns * 255 // width
            image[..., 1] = rows * 255 // height
            image[..., 2] = (columns + rows + 16 * k) % 256
            disc = (rows - height // 2) ** 2 + (columns - 40 - 12 * k) ** 2 < (height // 4) ** 2
            image[disc] = (30, 200, 250)
            if noise:
                band = rng.integers(0, 256, (height // 8, width, 3), np.uint8)
                image[: height // 8] = band
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="bgr24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def decoded(data: bytes) -> list[Any]:
    with av.open(io.BytesIO(data)) as container:
        return list(container.decode(video=0))


def planes(frame: Any, source: str) -> np.ndarray[Any, Any]:
    """The frame's planes as the decoder gives them: FFmpeg's own I420, or NV12 (what
    NVDEC gives; here FFmpeg's repacking of the same samples, no colour conversion)."""
    if source == "i420":
        assert frame.format.name == "yuv420p"
        array = frame.to_ndarray()
    else:
        array = frame.reformat(format="nv12").to_ndarray()
    assert array.shape == (frame.height * 3 // 2, frame.width)
    return np.asarray(array)


def preprocess(source: Any) -> ImagePreprocess:
    return ImagePreprocess(
        source=source, order="rgb", resize="letterbox", mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
    )  # fmt: skip


def levels(got: Any, want: Any, pre: ImagePreprocess) -> np.ndarray[Any, Any]:
    """|got - want| in pixel levels: the normalization undone (scale / std[k] a level)."""
    level = np.float32(pre.scale) / np.array(pre.std, np.float32).reshape(1, 3, 1, 1)
    return np.abs(np.asarray(got, np.float64) - want) / level


@pytest.mark.parametrize(("codec", "size"), [("libx264", (640, 360)), ("libx265", (352, 288))])
@pytest.mark.parametrize("source", ["i420", "nv12"])
def test_each_pixel_within_the_stated_rounding(
    codec: str, size: tuple[int, int], source: str
) -> None:
    """Pixel by pixel (no resize: a resized element lies between its samples' errors)."""
    width, height = size
    full = TensorSpec("full", (1, 3, height, width), "float32", "nchw")
    pre = ImagePreprocess(source=source, order="rgb", resize=None)  # type: ignore[arg-type]
    bgr = ImagePreprocess(source="bgr", order="rgb", resize=None)
    frames = decoded(clip(codec, width, height))
    assert len(frames) == 6
    worst, means = 0.0, []
    for frame in frames:
        image = planes(frame, source)
        error = levels(
            pre.apply(image, full), bgr.apply(frame.to_ndarray(format="bgr24"), full), pre
        )
        # the bound per pixel: 3 levels, more below black (see the module docstring)
        luma = image[:height].astype(np.float64)
        bound = LEVELS + 1.1644 * np.maximum(16 - luma, 0) + 1e-3
        assert (error.max(axis=1)[0] <= bound).all(), float((error.max(axis=1)[0] - bound).max())
        worst = max(worst, float(error.max()))
        means.append(float(error.mean()))
    assert np.mean(means) <= MEAN_LEVELS, means
    assert worst >= 1  # the paths differ at all: a path compared with itself would not


@pytest.mark.parametrize("source", ["i420", "nv12"])
def test_letterboxed_into_the_model_within_the_stated_rounding(source: str) -> None:
    pre, bgr = preprocess(source), preprocess("bgr")
    frames = decoded(clip("libx264", 640, 360, noise=False))
    for frame in frames:
        image = planes(frame, source)
        assert image[: frame.height].min() >= 16  # no sample below black in this clip
        got = pre.apply(image, IMAGES)
        want = bgr.apply(frame.to_ndarray(format="bgr24"), IMAGES)  # the user's path today
        error = levels(got, want, pre)
        assert error.max() <= LEVELS + 1e-3 and error.mean() <= MEAN_LEVELS


@pytest.mark.parametrize("source", ["i420", "nv12"])
def test_against_opencvs_conversion_of_the_same_planes_exactly(source: str) -> None:
    cv2 = pytest.importorskip("cv2", exc_type=ImportError)
    codes = {"i420": cv2.COLOR_YUV2BGR_I420, "nv12": cv2.COLOR_YUV2BGR_NV12}
    pre, bgr = preprocess(source), preprocess("bgr")
    for frame in decoded(clip("libx264", 320, 240, frames=3)):
        image = planes(frame, source)
        got = pre.apply(image, IMAGES)
        assert np.array_equal(got, bgr.apply(cv2.cvtColor(image, codes[source]), IMAGES))


@pytest.mark.asyncio
@pytest.mark.parametrize("convert", ["host", "device"])
async def test_video_frames_through_the_engine(convert: Any) -> None:
    """The same through an engine (the emulated runtime; ``convert="device"`` is the
    kernel's step): a decoded frame as a VideoFrame against its BGR conversion."""
    model = make_loadable([IMAGES], [IMAGES.__class__("out", IMAGES.shape, "float32", "nchw")],
                          "affine", 0.0005, scale=1.0, bias=0.0)  # fmt: skip
    frames = decoded(clip("libx264", 640, 360, frames=3, noise=False))
    pre, bgr = preprocess("i420"), preprocess("bgr")
    async with (
        Engine(model, runtime="emulated", convert=convert, preprocess={"images": pre}) as engine,
        Engine(model, runtime="emulated", convert=convert, preprocess={"images": bgr}) as today,
    ):
        for index, frame in enumerate(frames):
            video = VideoFrame(
                array=planes(frame, "i420"), format="i420", width=frame.width,
                height=frame.height, source="clip.mkv", index=index, pts=frame.time,
                captured_at=0.0, on_device=False,
            )  # fmt: skip
            got = await engine.infer(video)
            want = await today.infer(frame.to_ndarray(format="bgr24"))
            assert levels(got, want, pre).max() <= LEVELS + 1e-3
