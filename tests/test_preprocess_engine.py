"""Camera frames into the engine (``Engine(preprocess=...)``): each input named there
takes raw frames of any size, pre-processed as its ImagePreprocess says, on either
conversion path; bad frames and bad settings are clear errors."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import numpy as np
import pytest

from aiodla import (
    ConfigurationError,
    Engine,
    ImagePreprocess,
    InputTypeError,
    InputValueError,
    LatestFrameStream,
    RuntimeUnavailableError,
    TensorSpec,
)
from aiodla.emulator import make_loadable
from aiodla.runtime import EmulatedRuntime

from support import counts_add_up

pytestmark = pytest.mark.asyncio

IMAGES = TensorSpec("images", (1, 3, 48, 64), "float16", "chw16")
OUT = TensorSpec("out", (1, 3, 48, 64), "float32", "nchw")
QIMAGES = TensorSpec("images", (1, 3, 48, 64), "int8", "chw32")
QOUT = TensorSpec("out", (1, 3, 48, 64), "int8", "nchw")
LETTERBOX = ImagePreprocess(
    source="bgr", order="rgb", resize="letterbox", mean=(0.485, 0.456, 0.406), std=0.25
)


def identity_model(spec: TensorSpec = IMAGES, out: TensorSpec = OUT) -> bytes:
    return make_loadable([spec], [out], "affine", 0.0005, scale=1.0, bias=0.0)


def frame(height: int, width: int, seed: int = 0, channels: int = 3) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (height, width, channels)).astype(np.uint8)


def expected(pre: ImagePreprocess, spec: TensorSpec, image: np.ndarray[Any, Any]) -> Any:
    """What an identity model returns: the pre-processed input, stored as the tensor's
    type and read back (independent of the engine's paths)."""
    return spec.unpack(spec.pack(pre.apply(image, spec)))


class TestFramesIn:
    @pytest.mark.parametrize("convert", ["host", "device"])
    async def test_frames_of_several_sizes(self, convert: str) -> None:
        frames = [frame(108, 192, 1), frame(200, 100, 2), frame(48, 64, 3), frame(31, 57, 4)]
        async with Engine(
            identity_model(), runtime="emulated", convert=convert, preprocess={"images": LETTERBOX}
        ) as engine:
            results = await asyncio.gather(*(engine.infer(f) for f in frames))
        for image, result in zip(frames, results, strict=True):
            np.testing.assert_array_equal(result, expected(LETTERBOX, IMAGES, image))

    @pytest.mark.parametrize("convert", ["host", "device"])
    async def test_quantized_input(self, convert: str) -> None:
        pre = ImagePreprocess(source="nv12", order="bgr", resize="stretch")
        nv12 = frame(60 * 3 // 2, 80, 5, channels=1)[..., 0]
        scales = {"images": 1 / 127, "out": 1 / 127}
        model = identity_model(QIMAGES, QOUT)
        async with Engine(
            model, runtime="emulated", convert=convert, preprocess={"images": pre}, scales=scales
        ) as engine:
            result = await engine.infer(nv12)
        # The same model fed the pre-processed input itself gives the same answer.
        spec = dataclasses.replace(QIMAGES, scale=1 / 127)
        async with Engine(model, runtime="emulated", scales=scales) as plain:
            want = await plain.infer(pre.apply(nv12, spec))
        assert result.tobytes() == want.tobytes()
        assert np.count_nonzero(want) > want.size // 2

    async def test_a_stream_of_camera_frames(self) -> None:
        frames = [frame(72, 96, seed) for seed in range(6)]
        async with (
            Engine(
                identity_model(), runtime="emulated", preprocess={"images": LETTERBOX}
            ) as engine,
            LatestFrameStream(engine) as stream,
        ):
            for image in frames:
                stream.submit(image)
                result = await stream.receive()
                np.testing.assert_array_equal(result.output, expected(LETTERBOX, IMAGES, image))

    async def test_no_allocation_per_frame(self) -> None:
        runtime = EmulatedRuntime()
        async with Engine(
            identity_model(), runtime=runtime, convert="device", preprocess={"images": LETTERBOX}
        ) as engine:
            opened = runtime.counts.allocations
            await asyncio.gather(*(engine.infer(frame(90, 120, s)) for s in range(10)))
            assert runtime.counts.allocations == opened


class TestBadFrames:
    @pytest.mark.parametrize(
        ("value", "error", "words"),
        [
            (np.zeros((48, 64, 3), np.float32), InputTypeError, "uint8"),
            (np.zeros((48, 64, 4), np.uint8), InputValueError, "'images'"),
            (np.zeros((2000, 64, 3), np.uint8), InputValueError, "max_frame"),
        ],
    )
    async def test_refused_before_queueing(
        self, value: Any, error: type[Exception], words: str
    ) -> None:
        async with Engine(
            identity_model(), runtime="emulated", preprocess={"images": LETTERBOX}
        ) as engine:
            with pytest.raises(error, match=words):
                await engine.infer(value)
            stats = engine.statistics()
            assert stats.submitted == 0 and counts_add_up(stats)
            good = frame(48, 64)
            np.testing.assert_array_equal(
                await engine.infer(good), expected(LETTERBOX, IMAGES, good)
            )

    async def test_a_device_frame_needs_device_conversion(self) -> None:
        """Host conversion pre-processes on the host: a frame in device memory is refused
        (tests/test_video_frames_engine.py reads them with device conversion)."""

        class DeviceFrame:
            __cuda_array_interface__ = {  # noqa: RUF012
                "shape": (48, 64, 3),
                "typestr": "|u1",
                "data": (0x1000, False),
                "version": 3,
            }

        async with Engine(
            identity_model(), runtime="emulated", convert="host", preprocess={"images": LETTERBOX}
        ) as engine:
            with pytest.raises(InputTypeError, match="needs device conversion"):
                await engine.infer(DeviceFrame())


class TestSettings:
    async def test_an_unknown_input_name(self) -> None:
        engine = Engine(identity_model(), runtime="emulated", preprocess={"img": LETTERBOX})
        with pytest.raises(ConfigurationError, match="'img'"):
            await engine.open()

    async def test_a_tensor_it_cannot_feed(self) -> None:
        four = TensorSpec("images", (1, 4, 8, 8), "float16", "chw16")
        model = make_loadable([four], [dataclasses.replace(four, name="y")], "affine", 0.001)
        engine = Engine(model, runtime="emulated", preprocess={"images": LETTERBOX})
        with pytest.raises(ConfigurationError, match="'images'"):
            await engine.open()

    async def test_not_an_image_preprocess(self) -> None:
        with pytest.raises(ConfigurationError, match="ImagePreprocess"):
            Engine(identity_model(), runtime="emulated", preprocess={"images": "letterbox"})


class TestFusedOnTheStream:
    """With device conversion, the frame's own bytes go to the device and one
    pre-processing step on the slot's stream makes the model input of them."""

    async def test_only_the_frame_is_copied(self) -> None:
        runtime = EmulatedRuntime()
        image = frame(108, 192, 9)
        async with Engine(
            identity_model(), runtime=runtime, convert="device", preprocess={"images": LETTERBOX}
        ) as engine:
            before = dataclasses.replace(runtime.counts)
            result = await engine.infer(image)
            assert runtime.counts.bytes_to_device - before.bytes_to_device == image.nbytes
            assert runtime.counts.conversions - before.conversions == 2  # fused in, unpack
        np.testing.assert_array_equal(result, expected(LETTERBOX, IMAGES, image))

    @pytest.mark.parametrize("source", ["nv12", "i420"])
    async def test_planar_frames_and_zero_copy(self, source: Any) -> None:
        pre = ImagePreprocess(source=source, order="rgb", resize="letterbox")
        planar = frame(90 * 3 // 2, 160, 11, channels=1)[..., 0]
        async with Engine(
            identity_model(),
            runtime="emulated",
            convert="device",
            zero_copy=True,
            preprocess={"images": pre},
        ) as engine:
            result = await engine.infer(planar)
        np.testing.assert_array_equal(result, expected(pre, IMAGES, planar))

    async def test_without_the_kernel_the_host_pre_processes(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        class NoFusedKernel(EmulatedRuntime):
            def prepare_preprocess(self, targets: Any) -> None:
                raise RuntimeUnavailableError("no kernel for this frame format here")

        runtime = NoFusedKernel()
        image = frame(60, 80, 12)
        with caplog.at_level(logging.WARNING, logger="aiodla"):
            async with Engine(
                identity_model(),
                runtime=runtime,
                convert="device",
                preprocess={"images": LETTERBOX},
            ) as engine:
                before = dataclasses.replace(runtime.counts)
                result = await engine.infer(image)
                # the float32 model input was copied, not the frame
                copied = runtime.counts.bytes_to_device - before.bytes_to_device
                assert copied == 4 * int(np.prod(IMAGES.shape))
        assert "pre-processing camera frames on the host" in caplog.text
        np.testing.assert_array_equal(result, expected(LETTERBOX, IMAGES, image))


class TestFrameLayouts:
    """Frames that are views: a region of interest, a flip, every other column, a
    decoder's pitch-aligned NV12 buffer; and a camera turned to portrait."""

    @pytest.mark.parametrize("convert", ["host", "device"])
    async def test_views_of_frames(self, convert: str) -> None:
        big = frame(120, 200, 13)
        views = [big[10:90, 20:150], big[::-1], big[:, ::2], big[5:65, 7:107][:, ::-1]]
        pitched = frame(90, 192, 14, channels=1)[..., 0]  # planar rows padded to 192 bytes
        async with Engine(
            identity_model(), runtime="emulated", convert=convert, preprocess={"images": LETTERBOX}
        ) as engine:
            for view in views:
                result = await engine.infer(view)
                np.testing.assert_array_equal(result, expected(LETTERBOX, IMAGES, view))
        for source in ("nv12", "i420"):
            planar = ImagePreprocess(source=source, order="rgb", resize="letterbox")
            async with Engine(
                identity_model(), runtime="emulated", convert=convert, preprocess={"images": planar}
            ) as engine:
                result = await engine.infer(pitched[:, :160])
            np.testing.assert_array_equal(result, expected(planar, IMAGES, pitched[:, :160]))

    async def test_a_portrait_frame_fits_a_landscape_max_frame(self) -> None:
        pre = ImagePreprocess(source="bgr", order="rgb", resize="letterbox", max_frame=(60, 100))
        portrait = frame(100, 60, 15)
        async with Engine(
            identity_model(), runtime="emulated", convert="device", preprocess={"images": pre}
        ) as engine:
            result = await engine.infer(portrait)
            np.testing.assert_array_equal(result, expected(pre, IMAGES, portrait))
            with pytest.raises(InputValueError, match="max_frame"):
                await engine.infer(frame(101, 60, 16))
