"""Detector post-processing on the GPU: the NVRTC kernels on the CPU tests' shared
vectors against the numpy path, then the engine on the CUDA runtime and the stand-in
(its ``detect`` op makes YOLOv5s' raw heads): Detections from the slot's stream equal
the numpy path's (host conversion) byte for byte, only the output buffer comes back,
``output="device"`` keeps them on the GPU, and a failed post-processing launch fails
that request alone."""

from __future__ import annotations

import asyncio
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodla import Detect, Detections, DeviceTensor, Engine, ImagePreprocess
from aiodla.emulator import make_loadable
from aiodla.emulator._detector import PRESETS
from aiodla.runtime._cuda import CudaRuntime
from aiodla.runtime._detect_kernels import DetectKernels, read_output

# The case table and head maker are the CPU tests' own, so both builds check the same.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from detect_reference import heads_for
from test_detect_kernels import CASES, dla_plan

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300), pytest.mark.usefixtures("real_gpu")]

INPUTS, HEADS, _ = PRESETS["yolov5s"]
LETTERBOX = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
YOLOV5 = Detect(head="yolov5")


def same(got: Detections, want: Detections) -> None:
    assert len(got) == len(want)
    assert np.asarray(got.boxes).tobytes() == np.asarray(want.boxes).tobytes()
    assert np.asarray(got.scores).tobytes() == np.asarray(want.scores).tobytes()
    assert np.asarray(got.classes).tolist() == np.asarray(want.classes).tolist()


def on_device(runtime: CudaRuntime, kernels: DetectKernels, packed: list[Any]) -> Detections:
    """The kernels' Detections for heads already in their DLA layout, through device
    buffers the runtime allocates (scratch and output filled with stale bytes)."""
    stream = runtime.create_stream()
    made: list[int] = []
    hosts = []
    try:
        pointers = []
        for raw in [*packed, np.full(kernels.work_bytes, 0x7F, np.uint8)]:
            host = runtime.host_alloc(raw.nbytes)
            hosts.append(host)
            host.array[:] = raw.reshape(-1).view(np.uint8)
            pointer = runtime.malloc(raw.nbytes)
            made.append(pointer)
            runtime.copy_to_device(pointer, host, raw.nbytes, stream)
            pointers.append(pointer)
        out = runtime.malloc(kernels.out_bytes)
        made.append(out)
        result = runtime.host_alloc(kernels.out_bytes)
        hosts.append(result)
        runtime.detect(kernels, pointers[:-1], pointers[-1], out, stream)
        runtime.copy_to_host(result, out, kernels.out_bytes, stream)
        runtime.synchronize_stream(stream)
        return read_output(result.array, kernels.layout)
    finally:
        for pointer in made:
            runtime.free(pointer)
        for host in hosts:
            runtime.host_free(host)
        runtime.destroy_stream(stream)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("ties", [False, True], ids=["continuous", "ties"])
def test_kernels_match_numpy(name: str, ties: bool) -> None:
    plan = dla_plan(*CASES[name])
    runtime = CudaRuntime(0)
    runtime.make_current()
    kernels = runtime.prepare_detect(plan)
    heads = heads_for(plan, np.random.default_rng(zlib.crc32(f"{name} {ties}".encode())), ties=ties)
    packed = [spec.pack(h) for spec, h in zip(plan.specs, heads, strict=True)]
    logical = [
        spec.unpack(p).astype(np.float32) for spec, p in zip(plan.specs, packed, strict=True)
    ]
    want = plan.run(logical)
    assert len(want) > 1
    same(on_device(runtime, kernels, packed), want)
    empty = [spec.pack(np.full(spec.shape, -20.0, np.float32)) for spec in plan.specs]
    assert len(on_device(runtime, kernels, empty)) == 0


def frame(seed: int, shape: tuple[int, int] = (1080, 1920)) -> Any:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), np.uint8)


@pytest.fixture(scope="module")
def model() -> bytes:
    return make_loadable(INPUTS, HEADS, "detect", 0.002)


@pytest.mark.asyncio
async def test_engine_on_the_stream_equals_the_numpy_path(model: bytes) -> None:
    frames = [frame(seed, size) for seed, size in enumerate([(1080, 1920), (480, 640)])]
    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "postprocess": YOLOV5}
    async with Engine(model, runtime=CudaRuntime(0), convert="host", **options) as host:
        assert host._device.path.detect is None
        want = [await host.infer(f) for f in frames]
    runtime = CudaRuntime(0)
    async with Engine(model, runtime=runtime, convert="device", **options) as engine:
        detect = engine._device.path.detect
        assert detect is not None
        for _ in range(2):  # the second round replays the captured graphs
            for camera, expected in zip(frames, want, strict=True):
                before = runtime.counts.bytes_to_host
                got = await engine.infer(camera)
                assert runtime.counts.bytes_to_host - before == detect.layout.size
                assert 20 <= len(got) <= 100
                same(got, expected)
        for camera, expected in zip(frames, want, strict=True):
            result = await engine.infer(camera, output="device")
            arrays = (result.boxes, result.scores, result.classes)
            assert all(isinstance(a, DeviceTensor) and a.device == 0 for a in arrays)
            same(Detections(*(a.to_host() for a in arrays)), expected)


@pytest.mark.asyncio
async def test_a_failed_launch_fails_that_request_only(model: bytes) -> None:
    # The launch's failure is injected, as the conversion kernels' test does (a real
    # non-sticky launch failure cannot be provoked on demand).
    runtime = CudaRuntime(0)
    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "postprocess": YOLOV5}
    async with Engine(model, runtime=runtime, convert="device", graphs=False, **options) as engine:
        detect = engine._device.path.detect
        assert detect is not None
        kernels = detect.program
        real = kernels.launch  # type: ignore[attr-defined]

        def failing(*args: Any) -> None:
            from aiodla.runtime._protocol import CudaCallError

            kernels.launch = real  # type: ignore[attr-defined]  # once
            raise CudaCallError("cuLaunchKernel (detector)", 1)

        kernels.launch = failing  # type: ignore[attr-defined]
        results = await asyncio.gather(
            *(engine.infer(frame(k, (480, 640))) for k in range(4)), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        assert len(failed) == 1 and "cuLaunchKernel" in str(failed[0])
        assert sum(isinstance(r, Detections) for r in results) == 3
        stats = engine.statistics()
        assert stats.completed + stats.failed == 4 and stats.failed == 1
        assert isinstance(await engine.infer(frame(0)), Detections)
