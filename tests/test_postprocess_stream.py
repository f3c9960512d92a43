"""Post-processing on the slot's stream (device conversion), on the emulated runtime,
whose stream operation runs the numpy definition where the CUDA runtime launches its
kernels: the engine drives both through the same calls. Detections equal the numpy
path on the host; only the output buffer comes back; nothing of it runs on the host;
``output="device"`` keeps the arrays in device memory; a failure on the device fails
that request alone; every buffer is released at close."""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import numpy as np
import pytest

from aiodla import (
    ConfigurationError,
    Detect,
    Detections,
    DeviceTensor,
    EmulatedRuntime,
    Engine,
    ImagePreprocess,
    PostprocessError,
    RuntimeUnavailableError,
)
from aiodla._detect import DetectPlan
from aiodla.emulator import make_loadable
from aiodla.emulator._detector import PRESETS
from aiodla.runtime._detect_output import (
    FAILED,
    output_layout,
    read_count,
    read_output,
    write_output,
)

from support import counts_add_up

INPUTS, HEADS, _ = PRESETS["yolov5s"]
LETTERBOX = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
YOLOV5 = Detect(head="yolov5")
SIZES = ((1080, 1920), (480, 640), (720, 540))


@pytest.fixture(scope="module")
def model() -> bytes:
    return make_loadable(INPUTS, HEADS, "detect", 0.002)


def frame(seed: int, shape: tuple[int, int] = (1080, 1920)) -> Any:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), np.uint8)


def same(got: Detections, want: Detections) -> None:
    assert len(got) == len(want) > 10
    assert (got.outside, got.not_finite) == (want.outside, want.not_finite)
    assert np.asarray(got.boxes).tobytes() == np.asarray(want.boxes).tobytes()
    assert np.asarray(got.scores).tobytes() == np.asarray(want.scores).tobytes()
    assert np.asarray(got.classes).tolist() == np.asarray(want.classes).tolist()


class DeviceMemoryRuntime(EmulatedRuntime):
    """The emulated runtime with its "device" memory treated as a GPU's: outputs stay
    there (``output="device"``), as on the CUDA runtime."""

    has_device_memory = True


async def reference(model: bytes, frames: list[Any]) -> list[Detections]:
    """The numpy path on the host: host conversion, Detect after the unpack."""
    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "convert": "host"}
    async with Engine(model, postprocess=YOLOV5, **options) as engine:
        assert engine._device.path.detect is None
        return [await engine.infer(f) for f in frames]


@pytest.mark.asyncio
async def test_equal_to_the_host_path_copying_back_only_the_kept(
    model: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    frames = [frame(seed, size) for seed, size in enumerate(SIZES)]
    want = await reference(model, frames)
    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "convert": "device"}
    async with Engine(model, postprocess=YOLOV5, **options) as engine:
        detect = engine._device.path.detect
        assert detect is not None
        post = engine._flow.postprocess
        assert post is not None

        def on_the_host(*args: Any) -> Any:
            raise AssertionError("post-processed on the host")

        monkeypatch.setattr(post, "run", on_the_host)
        counts = engine.runtime.counts  # type: ignore[union-attr]
        for _ in range(2):  # the second round replays the slots' captured graphs
            for camera, expected in zip(frames, want, strict=True):
                before = (counts.bytes_to_host, counts.copies_to_host, counts.conversions)
                got = await engine.infer(camera)
                same(got, expected)
                after = (counts.bytes_to_host, counts.copies_to_host, counts.conversions)
                # one copy of the output buffer; one conversion: the frame's, no unpack
                assert (after[0] - before[0], after[1] - before[1]) == (detect.layout.size, 1)
                assert after[2] - before[2] == 1
        assert counts_add_up(engine.statistics())


@pytest.mark.asyncio
async def test_the_device_does_the_work(model: bytes) -> None:
    """The decode and NMS are the emulated device's work (``device_time``), done when
    the stream reaches them, not the host's."""
    runtime = EmulatedRuntime()
    calls: list[str] = []
    real = DetectPlan.run

    def spy(self: DetectPlan, *args: Any) -> Detections:
        calls.append("run")
        return real(self, *args)

    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "convert": "device"}
    async with Engine(model, runtime=runtime, postprocess=YOLOV5, **options) as engine:
        await engine.infer(frame(0))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(DetectPlan, "run", spy)
            before = runtime.device_time
            runtime.detect(  # the stream operation itself, as the engine enqueues it
                engine._device.path.detect.program,  # type: ignore[union-attr]
                [b.device_ptr for b in engine._device.slots[0].outputs],
                *_slot_buffers(engine),
                engine._device.slots[0].stream,
            )
            assert calls == []  # queued, not run
            runtime.synchronize_stream(engine._device.slots[0].stream)
            assert calls == ["run"] and runtime.device_time > before


def _slot_buffers(engine: Engine) -> tuple[int, int]:
    detect = engine._device.path.detect
    assert detect is not None
    buffers = detect._buffers[id(engine._device.slots[0])]
    return buffers.work, buffers.out


@pytest.mark.asyncio
async def test_a_failure_on_the_device_fails_its_request_alone(
    model: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = DetectPlan.run
    calls = 0

    def flaky(self: DetectPlan, *args: Any) -> Detections:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise FloatingPointError("a device fault in the decode")
        return real(self, *args)

    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "convert": "device"}
    async with Engine(model, postprocess=YOLOV5, **options) as engine:
        monkeypatch.setattr(DetectPlan, "run", flaky)
        results = await asyncio.gather(
            *(engine.infer(frame(k, (480, 640))) for k in range(6)), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        assert len(failed) == 1 and isinstance(failed[0], PostprocessError)
        assert "post-processing of this request failed" in str(failed[0])
        assert all(isinstance(r, Detections) for r in results if r is not failed[0])
        stats = engine.statistics()
        assert counts_add_up(stats)
        assert (stats.completed, stats.failed, stats.failures["postprocess"]) == (5, 1, 1)
        assert isinstance(await engine.infer(frame(0)), Detections)  # it goes on serving


@pytest.mark.asyncio
async def test_a_failure_reading_the_output_fails_its_request_alone(
    model: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever fails while the host reads a request's detections back (here: wrapping
    them as host-backed device arrays) is that request's PostprocessError: its slot
    goes back and the engine serves on, where another exception left the request
    unanswered and its slot taken."""
    import aiodla._postprocess_stream as stream

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("a wrapping that fails")

    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "convert": "device"}
    async with Engine(
        model, postprocess=YOLOV5, cores=[0], streams_per_core=1, **options
    ) as engine:
        monkeypatch.setattr(stream, "DeviceTensor", broken)
        with pytest.raises(PostprocessError, match="a wrapping that fails"):
            await asyncio.wait_for(engine.infer(frame(0, (480, 640)), output="device"), 20)
        monkeypatch.undo()
        got = await asyncio.wait_for(engine.infer(frame(0, (480, 640))), 20)  # the one slot
        assert isinstance(got, Detections)
        stats = engine.statistics()
        assert counts_add_up(stats) and stats.failures["postprocess"] == 1
        assert stats.cores[0].busy_slots == 0


@pytest.mark.asyncio
async def test_device_output_keeps_the_arrays_on_the_device(model: bytes) -> None:
    frames = [frame(seed, size) for seed, size in enumerate(SIZES)]
    want = await reference(model, frames)
    runtime = DeviceMemoryRuntime()
    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "convert": "device"}
    async with Engine(model, runtime=runtime, postprocess=YOLOV5, **options) as engine:
        await engine.infer(frames[0])
        in_use = runtime.live_handles()["device_memory"]
        for camera, expected in zip(frames, want, strict=True):
            got = await engine.infer(camera, output="device")
            arrays = (got.boxes, got.scores, got.classes)
            assert all(isinstance(a, DeviceTensor) and a.device == 0 for a in arrays)
            n = len(expected)
            assert [a.shape for a in arrays] == [(n, 4), (n,), (n,)]
            host = Detections(
                *(a.to_host() for a in arrays), outside=got.outside, not_finite=got.not_finite
            )
            same(host, expected)  # mapped into the frame on the device
            assert runtime.live_handles()["device_memory"] == in_use + 1  # one allocation
            del arrays, host
            boxes = got.boxes
            del got
            await asyncio.sleep(0)  # the loop's callbacks let the finished future go
            gc.collect()
            assert runtime.live_handles()["device_memory"] == in_use + 1  # boxes hold it
            del boxes
            gc.collect()
            assert runtime.live_handles()["device_memory"] == in_use  # the last one freed it
        host_results = await engine.infer(frames[0])
        assert isinstance(host_results.boxes, np.ndarray)
        same(host_results, want[0])


@pytest.mark.asyncio
async def test_device_output_on_a_runtime_without_device_memory(model: bytes) -> None:
    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "convert": "device"}
    async with Engine(model, postprocess=YOLOV5, **options) as engine:
        got = await engine.infer(frame(1), output="device")
        assert isinstance(got.boxes, DeviceTensor) and got.boxes.device is None
        arrays = (np.asarray(a) for a in (got.boxes, got.scores, got.classes))
        same(Detections(*arrays, outside=got.outside, not_finite=got.not_finite),
             await engine.infer(frame(1)))  # fmt: skip


@pytest.mark.asyncio
async def test_device_output_refused_where_detections_are_made_on_the_host(model: bytes) -> None:
    async with Engine(model, postprocess=YOLOV5, convert="host") as engine:
        with pytest.raises(ConfigurationError, match="post-processes on the host"):
            await engine.infer(np.zeros((1, 3, 640, 640), np.float32), output="device")
        assert counts_add_up(engine.statistics())


@pytest.mark.asyncio
async def test_a_runtime_that_cannot_leaves_it_on_the_host(
    model: bytes, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = EmulatedRuntime()

    def cannot(plan: Any) -> Any:
        raise RuntimeUnavailableError("no NVRTC here")

    monkeypatch.setattr(runtime, "prepare_detect", cannot)
    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "convert": "device"}
    with caplog.at_level(logging.WARNING, logger="aiodla"):
        async with Engine(model, runtime=runtime, postprocess=YOLOV5, **options) as engine:
            assert engine._device.path.detect is None
            got = await engine.infer(frame(2))
    assert "post-processing detections on the host: no NVRTC here" in caplog.text
    same(got, (await reference(model, [frame(2)]))[0])


@pytest.mark.asyncio
async def test_every_buffer_is_released_at_close(model: bytes) -> None:
    runtime = EmulatedRuntime()
    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "convert": "device"}
    async with Engine(
        model, runtime=runtime, postprocess=YOLOV5, streams_per_core=3, **options
    ) as engine:
        detect = engine._device.path.detect
        assert detect is not None and len(detect._buffers) == 6  # 2 cores x 3 slots
        await engine.infer(frame(3))
    assert all(count == 0 for count in runtime.live_handles().values())
    assert runtime.invalid_releases == 0


def padding_heads() -> list[Any]:
    """YOLOv5s heads holding two objects, one cell apart at stride 8 (anchor 10 x 13,
    height logit 1.25: 31.4 pixels high): the better one (score 0.96) at model rows
    108.3..139.7, the other (0.935) at 112.6..144.0, IoU 0.76. A 1920 x 1080 frame
    letterboxed into 640 x 640 fills rows 140..500: the better box lies wholly in the
    padding, the other reaches 4 rows into the picture."""
    heads = []
    for spec in HEADS:
        values = np.zeros(spec.shape, np.float16)
        values[0, 4::85] = -8.0  # no objectness anywhere
        heads.append(values)
    p8 = heads[0][0]
    for gy, ty, objectness in ((15, 0.0, 4.0), (16, -1.0, 3.0)):
        p8[1, gy, 40], p8[3, gy, 40], p8[4, gy, 40], p8[5, gy, 40] = ty, 1.25, objectness, 4.0
    return heads


@pytest.mark.parametrize(
    ("convert", "output"),
    [("host", "host"), ("device", "host"), ("device", "device")],
    ids=["numpy on the host", "stream op", "stream op, device output"],
)
@pytest.mark.asyncio
async def test_a_box_in_the_padding_is_dropped_before_nms(
    model: bytes, monkeypatch: pytest.MonkeyPatch, convert: str, output: str
) -> None:
    """On every path the box in the padding is dropped and counted before NMS, so it
    does not suppress the box that reaches into the picture. One slot serves a 16:9
    frame, a square one (no padding: the better box is in the picture and suppresses
    the other) and the 16:9 one again: the work after the task is captured per frame
    size, never replayed with another frame's geometry."""
    from aiodla.emulator import _detector

    heads = padding_heads()
    plan = YOLOV5.plan((640, 640), HEADS)
    assert len(plan.run([h.astype(np.float32) for h in heads])) == 1  # model pixels

    def task_writes(raws: list[Any], outputs: Any, *args: Any) -> None:
        for raw, spec, head in zip(raws, outputs, heads, strict=True):
            spec.pack(head, out=raw)

    monkeypatch.setattr(_detector, "write_heads", task_writes)  # the emulated task's heads
    options: dict[str, Any] = {
        "preprocess": {"images": LETTERBOX}, "convert": convert, "cores": [0],
        "streams_per_core": 1,
    }  # fmt: skip
    runtime = DeviceMemoryRuntime() if output == "device" else EmulatedRuntime()
    async with Engine(model, runtime=runtime, postprocess=YOLOV5, **options) as engine:
        assert (engine._device.path.detect is not None) == (convert == "device")
        for size in ((1080, 1920), (640, 640), (1080, 1920), (640, 640)):
            got = await engine.infer(frame(0, size), output=output)
            boxes, scores = np.asarray(got.boxes), np.asarray(got.scores)
            assert output == "host" or isinstance(got.boxes, DeviceTensor)
            if size == (640, 640):
                assert scores.tolist() == [pytest.approx(0.964, abs=1e-3)]
                assert got.outside == 0
            else:
                assert scores.tolist() == [pytest.approx(0.935, abs=1e-3)]
                assert got.outside == 1 and got.not_finite == 0
                # rows 140..144 of the model are the frame's rows 0..12
                assert boxes[0, 1] == 0.0 and 11.0 < boxes[0, 3] < 13.0
        assert counts_add_up(engine.statistics())


def test_the_output_buffer_format() -> None:
    layout = output_layout(5)
    raw = np.full(layout.size, 0x5A, np.uint8)
    kept = Detections(
        np.arange(8, dtype=np.float32).reshape(2, 4),
        np.array([0.5, 0.25], np.float32),
        np.array([3, 1], np.int32),
        outside=7,
        not_finite=2,
    )
    write_output(kept, layout, raw)
    assert raw[:12].view(np.int32).tolist() == [2, 7, 2]
    back = read_output(raw, layout)
    assert (back.outside, back.not_finite, len(back)) == (7, 2, 2)
    assert back.boxes.tobytes() == kept.boxes.tobytes()
    write_output(None, layout, raw)
    assert int(raw[:4].view(np.int32)[0]) == FAILED
    with pytest.raises(ValueError, match="post-processing of this request failed"):
        read_count(raw, layout)
    found = Detections(np.ones((6, 4), np.float32), np.ones(6, np.float32), np.zeros(6, np.int32))
    with pytest.raises(ValueError, match="6 detections do not fit an output of max_det=5"):
        write_output(found, layout, raw)


def test_emulated_detect_refusals(model: bytes) -> None:
    runtime = EmulatedRuntime()
    plan = YOLOV5.plan((640, 640), HEADS)
    program = runtime.prepare_detect(plan)
    stream = runtime.create_stream()
    try:
        with pytest.raises(ValueError, match="2 head buffers given, the plan has 3"):
            runtime.detect(program, [0, 0], 0, 0, stream)
        from aiodla.runtime._protocol import CudaCallError

        with pytest.raises(CudaCallError):  # not device memory
            runtime.detect(program, [1, 2, 3], 4, 5, stream)
    finally:
        runtime.destroy_stream(stream)
        runtime.close()


@pytest.mark.asyncio
async def test_zero_copy_reads_the_output_where_the_device_wrote_it(model: bytes) -> None:
    """With zero copy the stream writes the output into mapped host memory: nothing is
    copied back, the detections are the host path's."""
    frames = [frame(seed, size) for seed, size in enumerate(SIZES)]
    want = await reference(model, frames)
    runtime = EmulatedRuntime()
    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "convert": "device"}
    async with Engine(
        model, runtime=runtime, postprocess=YOLOV5, zero_copy=True, **options
    ) as engine:
        detect = engine._device.path.detect
        assert detect is not None and detect.zero_copy
        counts = runtime.counts
        for camera, expected in zip(frames, want, strict=True):
            before = counts.copies_to_host
            same(await engine.infer(camera), expected)
            assert counts.copies_to_host == before
    assert all(count == 0 for count in runtime.live_handles().values())


class RefusingRuntime(EmulatedRuntime):
    """The emulated runtime refusing to release the pointers in ``refused``."""

    refused: set[int]

    def free(self, pointer: int) -> None:
        if pointer in self.refused:
            raise RuntimeError(f"refused {pointer:#x}")
        super().free(pointer)

    def host_free(self, buffer: Any) -> None:
        if buffer.ptr in self.refused:
            raise RuntimeError(f"refused {buffer.ptr:#x}")
        super().host_free(buffer)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copied", "zero copy"])
@pytest.mark.asyncio
async def test_the_detector_buffers_are_named_when_their_release_fails(
    model: bytes, caplog: pytest.LogCaptureFixture, zero_copy: bool
) -> None:
    """Each slot's detector buffers are released at close under their names: a release
    that fails says which buffer it was."""
    runtime = RefusingRuntime()
    runtime.refused = set()
    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "convert": "device"}
    engine = Engine(
        model, runtime=runtime, postprocess=YOLOV5, zero_copy=zero_copy, cores=[0],
        streams_per_core=1, **options,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="aiodla"):
        async with engine:
            await engine.infer(frame(0, (480, 640)))
            detect = engine._device.path.detect
            assert detect is not None
            (buffers,) = detect._buffers.values()
            runtime.refused |= {buffers.work, buffers.out, buffers.host.ptr}
    failed = sorted(
        r.getMessage().split(" failed: ")[0].removeprefix("aiodla: releasing core 0 slot 0 ")
        for r in caplog.records
        if "releasing" in r.getMessage()
    )
    want = ["detector output: host_alloc", "detector scratch: malloc"]
    assert failed == sorted(want if zero_copy else [*want, "detector output: malloc"])


@pytest.mark.parametrize(
    "runtime_type", [DeviceMemoryRuntime, EmulatedRuntime], ids=["device memory", "host-backed"]
)
@pytest.mark.asyncio
async def test_device_output_carries_the_drop_counts(
    model: bytes, monkeypatch: pytest.MonkeyPatch, runtime_type: type[EmulatedRuntime]
) -> None:
    real = DetectPlan.run

    def counted(self: DetectPlan, *args: Any) -> Detections:
        found = real(self, *args)
        found.outside, found.not_finite = 5, 3
        return found

    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "convert": "device"}
    async with Engine(model, runtime=runtime_type(), postprocess=YOLOV5, **options) as engine:
        monkeypatch.setattr(DetectPlan, "run", counted)
        got = await engine.infer(frame(1), output="device")
        assert isinstance(got.boxes, DeviceTensor)
        assert (got.outside, got.not_finite) == (5, 3)
