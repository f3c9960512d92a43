"""Decoded video frames into the engine, on the emulated runtime: ``engine.infer`` takes
a :class:`~aiodla.VideoFrame` as it takes an array (host frames, frames in the engine's
frame buffers, read without a staging copy, and device frames, read where they lie on
the slot's stream); a frame the engine cannot read is a clear input error that holds
nothing back.

On the emulated runtime a "device frame" is an array in the runtime's emulated device
memory (a handle into its bounds-checked buffers), shown through the CUDA array
interface or DLPack as a CUDA library would show it; the runtime's pre-processing step
reads it there, as the GPU kernel reads NVDEC's frames. tests/gpu/ runs the same on a
GPU with CuPy arrays.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from typing import Any

import numpy as np
import pytest

from aiodla import (
    DeviceTensor,
    Engine,
    ImagePreprocess,
    InputTypeError,
    InputValueError,
    RuntimeUnavailableError,
    TensorSpec,
    VideoFrame,
)
from aiodla.emulator import make_loadable
from aiodla.runtime import EmulatedRuntime

from support import all_idle, counts_add_up

pytestmark = pytest.mark.asyncio

IMAGES = TensorSpec("images", (1, 3, 48, 64), "float16", "chw16")
OUT = TensorSpec("out", (1, 3, 48, 64), "float32", "nchw")
PLANAR = ("nv12", "i420")


def identity_model() -> bytes:
    return make_loadable([IMAGES], [OUT], "affine", 0.0005, scale=1.0, bias=0.0)


def preprocess(source: Any) -> ImagePreprocess:
    return ImagePreprocess(source=source, order="rgb", resize="letterbox", mean=0.5, std=0.25)


def pixels(height: int, width: int, seed: int) -> np.ndarray[Any, Any]:
    """A planar (height*3/2) x width frame of random bytes (either format's layout)."""
    return np.random.default_rng(seed).integers(0, 256, (height * 3 // 2, width), np.uint8)


def video_frame(array: Any, source: Any, height: int, width: int, **changes: Any) -> VideoFrame:
    keywords: dict[str, Any] = {
        "array": array, "format": source, "width": width, "height": height,
        "source": "file:clip.mp4", "index": 0, "pts": 0.0, "captured_at": 0.0,
        "on_device": not isinstance(array, np.ndarray),
    }  # fmt: skip
    return VideoFrame(**(keywords | changes))


def expected(pre: ImagePreprocess, image: np.ndarray[Any, Any]) -> Any:
    """What the identity model returns: the pre-processed input, stored as the
    tensor's type and read back (numpy's path, apart from the engine's)."""
    return IMAGES.unpack(IMAGES.pack(pre.apply(image, IMAGES)))


class EmulatedDeviceFrame:
    """A frame in the emulated runtime's device memory with rows ``pitch`` bytes apart,
    shown through ``__cuda_array_interface__`` (as CuPy or a decoder's surface is)."""

    def __init__(
        self,
        runtime: EmulatedRuntime,
        image: np.ndarray[Any, Any],
        *,
        pitch: int | None = None,
        stream: int | None = None,
        strides: tuple[int, ...] | None = None,
        typestr: str = "|u1",
    ) -> None:
        rows = image.shape[0]
        row = image[0].nbytes
        self.pitch = pitch or row
        staging = runtime.host_alloc(rows * self.pitch)
        pitched = staging.array.reshape(rows, self.pitch)
        pitched[:, :row] = image.reshape(rows, row)
        self.pointer = runtime.malloc(rows * self.pitch)
        copy_stream = runtime.create_stream()
        runtime.copy_to_device(self.pointer, staging, rows * self.pitch, copy_stream)
        runtime.synchronize_stream(copy_stream)
        runtime.destroy_stream(copy_stream)
        runtime.host_free(staging)
        self.interface: dict[str, Any] = {
            "shape": image.shape,
            "typestr": typestr,
            "data": (self.pointer, False),
            "strides": strides or (self.pitch, *image.strides[1:]),
            "version": 3,
            "stream": stream,
        }

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self.interface


class DLPackFrame:
    """A device frame exported through DLPack (a DeviceTensor over emulated device
    memory), recording the stream each export was asked to order its work before."""

    def __init__(self, runtime: EmulatedRuntime, image: np.ndarray[Any, Any]) -> None:
        self.memory = EmulatedDeviceFrame(runtime, image)
        self.tensor = DeviceTensor(
            pointer=self.memory.pointer,
            shape=image.shape,
            dtype=image.dtype,
            device=runtime.device,
            to_host=lambda out: None,
        )
        self.streams: list[Any] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None) -> Any:
        self.streams.append(stream)
        return self.tensor.__dlpack__(stream=stream, max_version=max_version)


async def engine_for(pre: ImagePreprocess, runtime: Any, convert: Any = "device") -> Engine:
    return Engine(identity_model(), runtime=runtime, convert=convert, preprocess={"images": pre})


class TestHostFrames:
    @pytest.mark.parametrize("convert", ["host", "device"])
    @pytest.mark.parametrize("source", PLANAR)
    async def test_a_frame_is_its_array(self, convert: Any, source: str) -> None:
        pre = preprocess(source)
        images = [pixels(90, 160, 1), pixels(48, 64, 2), pixels(200, 100, 3)]  # any size
        async with await engine_for(pre, "emulated", convert) as engine:
            for image in images:
                height, width = image.shape[0] * 2 // 3, image.shape[1]
                result = await engine.infer(video_frame(image, source, height, width))
                np.testing.assert_array_equal(result, expected(pre, image))
                by_name = await engine.infer({"images": video_frame(image, source, height, width)})
                np.testing.assert_array_equal(by_name, result)

    @pytest.mark.parametrize("zero_copy", [False, True])
    async def test_a_frame_in_a_frame_buffer_is_not_staged(self, zero_copy: bool) -> None:
        """The frame's bytes go from the engine's frame buffer to the kernel: in place
        where staging is mapped, else by the one copy from the buffer; never through a
        copy into the slot's staging."""
        pre = preprocess("i420")
        runtime = EmulatedRuntime()
        async with Engine(
            identity_model(), runtime=runtime, convert="device", zero_copy=zero_copy,
            preprocess={"images": pre},
        ) as engine:  # fmt: skip
            (buffer,) = engine.frame_buffers(1, (135, 160))
            buffer[:] = pixels(90, 160, 4)
            frames = engine._device._frames  # type: ignore[attr-defined]
            assert frames is not None
            found = frames.find(buffer)
            assert found is not None
            pinned, offset = found
            reads: list[int] = []
            sources: list[Any] = []
            original_preprocess, original_copy = runtime.preprocess, runtime.copy_to_device

            def spy_preprocess(spec: Any, pointer: int, *rest: Any) -> None:
                reads.append(pointer)
                original_preprocess(spec, pointer, *rest)

            def spy_copy(dst: int, src: Any, nbytes: int, stream: int) -> None:
                sources.append(src)
                original_copy(dst, src, nbytes, stream)

            runtime.preprocess = spy_preprocess
            runtime.copy_to_device = spy_copy
            result = await engine.infer(video_frame(buffer, "i420", 90, 160))
            if zero_copy:
                assert reads == [pinned.device_ptr + offset] and not sources
            else:
                assert sources == [pinned]
        np.testing.assert_array_equal(result, expected(pre, np.array(buffer)))


class TestDeviceFrames:
    @pytest.mark.parametrize("source", PLANAR)
    async def test_read_where_it_lies(self, source: str) -> None:
        """A pitched device frame (rows 192 bytes apart, as a decoder's surface) is read
        in place: no byte crosses from the host; the result is the host frame's."""
        pre = preprocess(source)
        runtime = EmulatedRuntime()
        image = pixels(90, 160, 5)
        async with await engine_for(pre, runtime) as engine:
            device = EmulatedDeviceFrame(runtime, image, pitch=192)
            before = runtime.counts.bytes_to_device
            result = await engine.infer(video_frame(device, source, 90, 160))
            assert runtime.counts.bytes_to_device == before
            as_array = await engine.infer(device)  # the bare array, as any device array
            assert counts_add_up(engine.statistics()) and all_idle(engine)
        np.testing.assert_array_equal(result, expected(pre, image))
        np.testing.assert_array_equal(as_array, result)

    async def test_packed_device_frames_too(self) -> None:
        pre = ImagePreprocess(source="bgr", order="rgb", resize="stretch")
        runtime = EmulatedRuntime()
        image = np.random.default_rng(6).integers(0, 256, (70, 50, 3), np.uint8)
        async with await engine_for(pre, runtime) as engine:
            result = await engine.infer(EmulatedDeviceFrame(runtime, image, pitch=160))
        np.testing.assert_array_equal(result, expected(pre, image))

    async def test_dlpack_with_the_consumers_stream(self) -> None:
        """A DLPack producer is asked to order its work before the engine's ingest
        stream (the consumer's), which the slot's stream then waits for."""
        pre = preprocess("nv12")
        runtime = EmulatedRuntime()
        image = pixels(48, 64, 7)
        async with await engine_for(pre, runtime) as engine:
            frame = DLPackFrame(runtime, image)
            result = await engine.infer(video_frame(frame, "nv12", 48, 64))
            ingest = engine._device.path.ingest_stream  # type: ignore[attr-defined]
        assert ingest != 0 and frame.streams == [ingest]
        np.testing.assert_array_equal(result, expected(pre, image))

    async def test_the_producers_stream_is_waited_for(self) -> None:
        """An interface that names its stream: the slot's work waits for an event on it."""
        pre = preprocess("i420")
        runtime = EmulatedRuntime()
        image = pixels(48, 64, 8)
        async with await engine_for(pre, runtime) as engine:
            producer = runtime.create_stream()
            recorded: list[int] = []
            original = runtime.record_event

            def spy(event: int, stream: int) -> None:
                recorded.append(stream)
                original(event, stream)

            runtime.record_event = spy
            device = EmulatedDeviceFrame(runtime, image, stream=producer)
            result = await engine.infer(video_frame(device, "i420", 48, 64))
            assert producer in recorded
            runtime.record_event = original
            runtime.destroy_stream(producer)
        np.testing.assert_array_equal(result, expected(pre, image))


class TestRefusals:
    async def test_the_format_must_be_the_engines(self) -> None:
        async with await engine_for(preprocess("nv12"), "emulated") as engine:
            frame = video_frame(pixels(48, 64, 9), "i420", 48, 64)
            with pytest.raises(
                InputValueError,
                match=r"the frame is i420, and this engine pre-processes nv12 frames",
            ) as info:
                await engine.infer(frame)
            assert "ImagePreprocess(source='i420')" in str(info.value)
            assert counts_add_up(engine.statistics()) and all_idle(engine)
            assert engine.statistics().submitted == 0  # refused before anything queued

    async def test_an_input_without_preprocessing_takes_no_frames(self) -> None:
        model = make_loadable([IMAGES], [OUT], "affine", 0.0005, scale=1.0, bias=0.0)
        async with Engine(model, runtime="emulated") as engine:
            frame = video_frame(pixels(48, 64, 10), "nv12", 48, 64)
            with pytest.raises(
                InputTypeError, match="a VideoFrame goes to an input with an ImagePreprocess"
            ):
                await engine.infer(frame)

    async def test_inconsistent_planes(self) -> None:
        async with await engine_for(preprocess("nv12"), "emulated") as engine:
            frame = video_frame(pixels(48, 64, 11), "nv12", 48, 64)
            # a frame whose array was swapped after it was made (VideoFrame checks its own)
            object.__setattr__(frame, "array", pixels(40, 64, 11))
            with pytest.raises(
                InputValueError,
                match=r"nv12 VideoFrame of 64x48 holds planes of uint8 shape \(72, 64\), its array is uint8 \(60, 64\)",
            ):
                await engine.infer(frame)
            runtime = engine.runtime
            assert isinstance(runtime, EmulatedRuntime)
            device = EmulatedDeviceFrame(runtime, pixels(48, 64, 12))
            with pytest.raises(
                InputValueError, match=r"on_device=False, and its array is a EmulatedDeviceFrame"
            ):
                await engine.infer(video_frame(device, "nv12", 48, 64, on_device=False))
            # a device array of another size than the frame says: refused, and given back
            held = weakref.ref(device)
            frame = video_frame(device, "nv12", 40, 64)
            with pytest.raises(
                InputValueError,
                match=r"device array has shape \(72, 64\), and its size says \(60, 64\)",
            ):
                await engine.infer(frame)
            del frame, device
            gc.collect()
            assert held() is None
            assert counts_add_up(engine.statistics()) and all_idle(engine)

    @pytest.mark.parametrize(
        ("make", "error", "match"),
        [
            (lambda r: EmulatedDeviceFrame(r, pixels(48, 64, 0).view(np.int8), typestr="|i1"), InputTypeError, "nv12 frame must be uint8, got int8"),
            (lambda r: EmulatedDeviceFrame(r, pixels(48, 63, 0)[:, :63]), InputValueError, "even width, got 63"),
            (lambda r: EmulatedDeviceFrame(r, pixels(48, 64, 0)[:71]), InputValueError, r"got shape \(71, 64\)"),
            (lambda r: EmulatedDeviceFrame(r, pixels(2000, 64, 0)), InputValueError, "larger than max_frame"),
            (lambda r: EmulatedDeviceFrame(r, pixels(48, 64, 0), strides=(64, 2)), InputValueError, r"strides \(64, 2\) \(bytes\) are not a frame's"),
            (lambda r: EmulatedDeviceFrame(r, pixels(48, 64, 0), strides=(32, 1)), InputValueError, "rows at least 64 bytes apart"),
            (lambda r: EmulatedDeviceFrame(r, np.zeros((72, 64, 1), np.uint8)), InputValueError, r"one \(H\*3/2\) x W uint8 array .* got shape \(72, 64, 1\)"),
        ],
    )  # fmt: skip
    async def test_bad_device_frames(self, make: Any, error: type[Exception], match: str) -> None:
        runtime = EmulatedRuntime()
        async with await engine_for(preprocess("nv12"), runtime) as engine:
            device = make(runtime)
            held = weakref.ref(device)
            with pytest.raises(error, match=match) as info:
                await engine.infer(device)
            assert str(info.value).startswith("input 'images': ")
            del device, info
            gc.collect()
            assert held() is None  # nothing of a refused frame is held
            # the engine serves the next frame as ever
            image = pixels(48, 64, 13)
            good = EmulatedDeviceFrame(runtime, image)
            np.testing.assert_array_equal(
                await engine.infer(good), expected(preprocess("nv12"), image)
            )
            assert counts_add_up(engine.statistics()) and all_idle(engine)

    async def test_host_conversion_refuses_device_frames(self) -> None:
        runtime = EmulatedRuntime()
        async with await engine_for(preprocess("nv12"), runtime, convert="host") as engine:
            device = EmulatedDeviceFrame(runtime, pixels(48, 64, 14))
            with pytest.raises(InputTypeError, match="needs device conversion"):
                await engine.infer(video_frame(device, "nv12", 48, 64))

    async def test_without_the_kernel_device_frames_are_refused(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        class NoFusedKernel(EmulatedRuntime):
            def prepare_preprocess(self, targets: Any) -> None:
                raise RuntimeUnavailableError("no kernel for this frame format here")

        runtime = NoFusedKernel()
        with caplog.at_level(logging.WARNING, logger="aiodla"):
            async with await engine_for(preprocess("i420"), runtime) as engine:
                device = EmulatedDeviceFrame(runtime, pixels(48, 64, 15))
                with pytest.raises(
                    InputTypeError,
                    match="needs the GPU pre-processing kernel, which this engine could not prepare",
                ):
                    await engine.infer(device)
                image = pixels(48, 64, 15)  # a host frame is pre-processed on the host
                result = await engine.infer(video_frame(image, "i420", 48, 64))
        np.testing.assert_array_equal(result, expected(preprocess("i420"), image))

    async def test_many_frames_at_once(self) -> None:
        """Device and host frames of both sizes interleaved, all in flight together."""
        pre = preprocess("nv12")
        runtime = EmulatedRuntime()
        async with await engine_for(pre, runtime) as engine:
            images = [pixels(48 + 2 * k, 64 + 4 * k, 20 + k) for k in range(8)]
            values: list[Any] = []
            for k, image in enumerate(images):
                height, width = image.shape[0] * 2 // 3, image.shape[1]
                array = EmulatedDeviceFrame(runtime, image, pitch=width + 32) if k % 2 else image
                values.append(video_frame(array, "nv12", height, width))
            results = await asyncio.gather(*(engine.infer(v) for v in values))
            assert counts_add_up(engine.statistics()) and all_idle(engine)
        for image, result in zip(images, results, strict=True):
            np.testing.assert_array_equal(result, expected(pre, image))


class TestProcessIsolation:
    @pytest.mark.timeout(120)
    async def test_host_frames_cross_and_device_frames_are_refused(self) -> None:
        """With ``isolation="process"`` a VideoFrame in an engine frame buffer (shared
        memory there) goes to the worker as any frame does; a device frame cannot cross
        a process without CUDA IPC, and says so."""
        pre = preprocess("i420")
        async with Engine(
            identity_model(), runtime="emulated", convert="device", isolation="process",
            preprocess={"images": pre},
        ) as engine:  # fmt: skip
            (buffer,) = engine.frame_buffers(1, (135, 160))
            buffer[:] = pixels(90, 160, 30)
            result = await engine.infer(video_frame(buffer, "i420", 90, 160))
            np.testing.assert_array_equal(result, expected(pre, np.array(buffer)))
            device = EmulatedDeviceFrame(EmulatedRuntime(), pixels(48, 64, 31))
            with pytest.raises(InputTypeError, match="input 'images'"):
                await engine.infer(video_frame(device, "i420", 48, 64))
            assert counts_add_up(engine.statistics())
