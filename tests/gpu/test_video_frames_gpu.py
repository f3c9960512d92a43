"""Decoded frames into the engine on a GPU (CudaRuntime, the stand-in, NVRTC kernels):
NV12 and I420 frames in device memory (CuPy arrays with pitched rows, as NVDEC's
surfaces are; through DLPack, the CUDA array interface and ``VideoFrame``) are read
where they lie on the slot's stream, with no byte copied from the host, and give the
bytes the same frames give from the host; a producer's stream named by the array
interface is waited for."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiodla import Detect, Detections, Engine, ImagePreprocess, VideoFrame
from aiodla.emulator import make_loadable
from aiodla.emulator._detector import PRESETS
from aiodla.runtime._cuda import CudaRuntime

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.asyncio,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("real_gpu"),
]

cp = pytest.importorskip("cupy")

INPUTS, HEADS, _ = PRESETS["yolov5s"]
YOLOV5 = Detect(head="yolov5")


def planar(seed: int, height: int = 1080, width: int = 1920) -> Any:
    return np.random.default_rng(seed).integers(0, 256, (height * 3 // 2, width), np.uint8)


def pitched(image: Any, pitch: int = 2048) -> Any:
    """``image`` on the device with rows ``pitch`` bytes apart (a decoder's surface)."""
    rows, width = image.shape
    surface = cp.zeros((rows, pitch), cp.uint8)
    surface[:, :width] = cp.asarray(image)
    return surface[:, :width]


class InterfaceOnly:
    """A device array shown only through ``__cuda_array_interface__``, naming the
    stream its producer wrote it on."""

    def __init__(self, array: Any, stream: Any) -> None:
        self.array = array
        self.interface = dict(array.__cuda_array_interface__, stream=stream.ptr)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self.interface


def same(got: Detections, want: Detections) -> None:
    assert np.asarray(got.boxes).tobytes() == np.asarray(want.boxes).tobytes()
    assert np.asarray(got.scores).tobytes() == np.asarray(want.scores).tobytes()
    assert np.asarray(got.classes).tolist() == np.asarray(want.classes).tolist()


@pytest.fixture(scope="module")
def model() -> bytes:
    return make_loadable(INPUTS, HEADS, "detect", 0.002)


@pytest.mark.parametrize("source", ["nv12", "i420"])
async def test_device_frames_equal_host_frames(model: bytes, source: Any) -> None:
    pre = ImagePreprocess(source=source, order="rgb", resize="letterbox")
    images = [planar(1), planar(2, 480, 640)]
    runtime = CudaRuntime(0)
    options: dict[str, Any] = {"preprocess": {"images": pre}, "postprocess": YOLOV5}
    async with Engine(model, runtime=runtime, convert="device", **options) as engine:
        want = [await engine.infer(image) for image in images]
        for _ in range(2):  # the second round after the host frames' graphs exist
            for image, expected in zip(images, want, strict=True):
                height, width = image.shape[0] * 2 // 3, image.shape[1]
                device = pitched(image)
                frame = VideoFrame(
                    array=device, format=source, width=width, height=height,
                    source="test", index=0, pts=None, captured_at=0.0, on_device=True,
                )  # fmt: skip
                before = runtime.counts.bytes_to_device
                same(await engine.infer(frame), expected)  # DLPack (CuPy's)
                same(await engine.infer(device), expected)  # the bare array
                assert runtime.counts.bytes_to_device == before  # nothing from the host
    async with Engine(model, runtime=CudaRuntime(0), convert="host", **options) as host:
        for image, expected in zip(images, want, strict=True):
            same(await host.infer(image), expected)  # numpy's path, the definition


async def test_the_producers_stream_is_waited_for(model: bytes) -> None:
    """The frame is written on a stream of its producer, behind a few milliseconds of
    other work there, and handed over at once, the interface naming that stream: the
    engine's read waits for the write (without the wait it would read zeros)."""
    pre = ImagePreprocess(source="i420", order="rgb", resize="letterbox")
    options: dict[str, Any] = {"preprocess": {"images": pre}, "postprocess": YOLOV5}
    images = [planar(seed) for seed in range(4)]
    sources = [cp.asarray(image) for image in images]
    busy = cp.ones((4096, 4096), cp.float32)
    cp.cuda.Device().synchronize()
    async with Engine(model, runtime=CudaRuntime(0), convert="device", **options) as engine:
        want = [await engine.infer(image) for image in images]
        producer = cp.cuda.Stream(non_blocking=True)
        for source, expected in zip(sources, want, strict=True):
            with producer:
                device = cp.zeros(source.shape, cp.uint8)
                for _ in range(5):  # milliseconds of work ahead of the frame's write
                    busy = busy @ busy / 4096
                device[...] = source
            got = await engine.infer(InterfaceOnly(device, producer))
            same(got, expected)
        producer.synchronize()
