"""Engine(postprocess=Detect(...)) and engine frame buffers, on the emulated runtime with
host and device conversion: Detections in frame pixels equal to the numpy path on the
raw heads; bad heads refused at open; a failing post-processing fails its request
alone with the statistics adding up; frames in engine buffers read without a staging
copy, and a buffer dropped while its request runs."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import numpy as np
import pytest
from detect_reference import cap_heads, heads_for, plan_for

from aiodla import (
    ConfigurationError,
    Detect,
    Detections,
    EmulatedRuntime,
    Engine,
    EngineClosedError,
    ImagePreprocess,
    PostprocessError,
    TensorSpec,
)
from aiodla.emulator import make_loadable
from aiodla.emulator._detector import PRESETS

from support import counts_add_up

INPUTS, HEADS, _ = PRESETS["yolov5s"]
LETTERBOX = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
YOLOV5 = Detect(head="yolov5")
F = np.float32


@pytest.fixture(scope="module")
def model() -> bytes:
    return make_loadable(INPUTS, HEADS, "detect", 0.002)


def frame(seed: int, shape: tuple[int, int] = (1080, 1920)) -> Any:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), np.uint8)


@pytest.mark.parametrize("convert", ["host", "device"])
@pytest.mark.asyncio
async def test_detections_in_frame_pixels(model: bytes, convert: str) -> None:
    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}, "convert": convert}
    async with (
        Engine(model, postprocess=YOLOV5, **options) as detector,
        Engine(model, **options) as raw,
    ):
        plan = YOLOV5.plan((640, 640), HEADS)
        for seed, size in ((0, (1080, 1920)), (1, (480, 640)), (2, (720, 540))):
            camera = frame(seed, size)
            got = await detector.infer(camera)
            heads = await raw.infer(camera)
            geometry = LETTERBOX.geometry(*size, 640, 640)
            want = plan.run([heads[s.name] for s in plan.specs], geometry, size)
            assert isinstance(got, Detections) and 20 <= len(got) <= 100
            assert got.boxes.tobytes() == want.boxes.tobytes()
            assert got.scores.tobytes() == want.scores.tobytes()
            assert got.classes.tolist() == want.classes.tolist()
            assert got.boxes[:, 0::2].max() <= size[1] and got.boxes[:, 1::2].max() <= size[0]


@pytest.mark.asyncio
async def test_without_preprocess_boxes_are_in_model_pixels(model: bytes) -> None:
    async with Engine(model, postprocess=YOLOV5) as detector, Engine(model) as raw:
        x = np.random.default_rng(3).random((1, 3, 640, 640)).astype(np.float32)
        got = await detector.infer(x)
        heads = await raw.infer(x)
        plan = YOLOV5.plan((640, 640), HEADS)
        assert got.boxes.tobytes() == plan.run([heads[s.name] for s in plan.specs]).boxes.tobytes()


class TestRefusedAtOpen:
    @pytest.mark.asyncio
    async def test_heads_that_do_not_fit_name_the_tensor(self, model: bytes) -> None:
        engine = Engine(model, postprocess=Detect(head="yolov5", classes=81))
        with pytest.raises(ConfigurationError, match="output 'p8' has 255 channels"):
            await engine.open()
        assert engine.state.value == "closed"
        missing = Engine(model, postprocess=Detect(head="yolov5", strides=(8, 16, 32, 64),
                                                   anchors=((1, 2),) * 4))  # fmt: skip
        with pytest.raises(ConfigurationError, match="no output of 10x10 for stride 64"):
            await missing.open()

    @pytest.mark.asyncio
    async def test_a_boxes_output_that_reads_both_ways(self) -> None:
        """N equal to 4 + classes: refused at open until layout= says which; then it
        serves."""
        spec = TensorSpec("dets", (1, 7, 7, 1), "float16", "chw16")
        both = make_loadable([TensorSpec("x", spec.shape, "float16")], [spec], "affine")
        engine = Engine(both, postprocess=Detect(head="boxes", classes=3))
        with pytest.raises(ConfigurationError, match=r"output 'dets' is 1x7x7x1: .* say which"):
            await engine.open()
        assert engine.state.value == "closed"
        rows = Detect(head="boxes", classes=3, layout="rows")
        async with Engine(both, postprocess=rows) as engine:
            x = np.zeros(spec.shape, np.float16)
            x[0, 0, :, 0] = [10, 10, 4, 4, 0.9, 0.1, 0.1]  # one candidate, the first row
            got = await engine.infer(x)
        assert got.boxes.tolist() == [[8, 8, 12, 12]] and got.classes.tolist() == [0]

    def test_not_a_detect(self, model: bytes) -> None:
        with pytest.raises(ConfigurationError, match="postprocess='yolov5' must be an aiodla"):
            Engine(model, postprocess="yolov5")  # type: ignore[arg-type]

    @pytest.mark.asyncio
    async def test_image_input_must_be_known(self) -> None:
        two = make_loadable(
            [INPUTS[0], TensorSpec("extra", (1, 1, 1, 1), "float16", "nchw")], HEADS, "detect"
        )
        with pytest.raises(ConfigurationError, match="needs to know the image input"):
            await Engine(two, postprocess=YOLOV5).open()

    @pytest.mark.asyncio
    async def test_device_output_is_refused(self, model: bytes) -> None:
        async with Engine(model, postprocess=YOLOV5) as engine:
            with pytest.raises(ConfigurationError, match="output='device' with postprocess"):
                await engine.infer(np.zeros((1, 3, 640, 640), np.float32), output="device")


# Small heads (8x8 input, stride 8 and 4): outputs below offload_bytes, post-processed on
# the loop; the preset's 3.2 MB heads are unpacked and post-processed in a worker thread.
SMALL_IN = TensorSpec("images", (1, 3, 16, 16), "float16", "nchw")
SMALL_HEADS = (
    TensorSpec("a", (1, 21, 4, 4), "float16", "nchw"),
    TensorSpec("b", (1, 21, 2, 2), "float16", "nchw"),
)
SMALL = Detect(head="yolov5", classes=2, strides=(4, 8), anchors=((2, 3, 4, 5, 6, 7),) * 2)


@pytest.mark.parametrize("where", ["loop", "worker thread"])
@pytest.mark.asyncio
async def test_a_failing_postprocess_fails_its_request_alone(
    model: bytes, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if where == "loop":
        loadable, detect, x = make_loadable([SMALL_IN], SMALL_HEADS, "detect"), SMALL, SMALL_IN
    else:
        loadable, detect, x = model, YOLOV5, INPUTS[0]
    async with Engine(loadable, postprocess=detect) as engine:
        assert engine._flow.offload_unpack is (where != "loop")
        post = engine._flow.postprocess
        assert post is not None
        real = post.run
        calls = 0

        def flaky(outputs: Any, inputs: Any) -> Detections:
            nonlocal calls
            calls += 1
            if calls == 3:
                outputs = [outputs[0][:, :7]]  # a head that no longer fits: decoding raises
            return real(outputs, inputs)

        monkeypatch.setattr(post, "run", flaky)
        batch = [np.full(x.shape, k, np.float32) for k in range(6)]
        results = await asyncio.gather(*(engine.infer(b) for b in batch), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert len(failed) == 1 and isinstance(failed[0], PostprocessError)
        assert failed[0].__cause__ is not None
        assert all(isinstance(r, Detections) for r in results if r is not failed[0])
        stats = engine.statistics()
        assert counts_add_up(stats)
        assert (stats.completed, stats.failed, stats.failures["postprocess"]) == (5, 1, 1)
        assert isinstance(await engine.infer(batch[0]), Detections)  # it goes on serving


@pytest.mark.parametrize("convert", ["host", "device"])
@pytest.mark.asyncio
async def test_candidates_past_the_cap_keep_the_best(convert: str) -> None:
    """The issue's rule for the cap on an engine: heads with 90 candidates and a cap of
    40 give detections (the best 40 by score, less those NMS suppresses), no error, on
    the host's numpy path and on the emulated runtime's stream operation alike, and the
    statistics add up. The model passes its input through (affine), so the request's
    input is the head."""
    detect = Detect(head="boxes", classes=3, conf=0.2, max_det=40, max_candidates=40)
    plan = plan_for(detect)
    heads, found = cap_heads(plan, np.random.default_rng(40))
    want = [c for c in found[:40] if not c[4]]
    spec = plan.specs[0]
    model = make_loadable([TensorSpec("x", spec.shape, "float32")], [spec], "affine")
    async with Engine(model, postprocess=detect, convert=convert) as engine:
        on_stream = engine._device.path.detect is not None
        assert on_stream is (convert == "device")
        results = await asyncio.gather(*(engine.infer(heads[0]) for _ in range(6)))
        stats = engine.statistics()
    for got in results:
        assert got.boxes.tobytes() == np.array([c[1] for c in want], F).tobytes()
        assert got.scores.tobytes() == np.array([c[2] for c in want], F).tobytes()
        assert got.classes.tolist() == [c[3] for c in want]
    assert counts_add_up(stats) and (stats.completed, stats.failed) == (6, 0)


@pytest.mark.parametrize("convert", ["host", "device"])
@pytest.mark.asyncio
async def test_boxes_as_rows_or_columns(convert: str) -> None:
    """head='boxes' on an output of N x (4 + classes) and on one of (4 + classes) x N
    holding the same candidates: the same detections, equal to the numpy path, on the
    host and in the emulated runtime's stream operation. The models pass their input
    through (affine), so the request's input is the head."""
    detect = Detect(head="boxes", classes=3, conf=0.2, iou=0.3)
    columns = plan_for(detect, dtype="float16")
    heads = heads_for(columns, np.random.default_rng(8), ties=False)
    matrix = heads[0].reshape(7, 150)
    results = []
    for shape, head in (((1, 7, 1, 150), heads[0]), ((1, 150, 7, 1), matrix.T.reshape(-1))):
        head = np.ascontiguousarray(head).reshape(shape)
        out = TensorSpec("boxes", shape, "float16", "chw16")
        model = make_loadable([TensorSpec("x", shape, "float16")], [out], "affine")
        async with Engine(model, postprocess=detect, convert=convert) as engine:
            assert (engine._device.path.detect is not None) is (convert == "device")
            plan = engine._flow.postprocess.plan  # type: ignore[union-attr]
            assert plan.layouts[0].rows is (shape[1] == 150)
            got = await engine.infer(head)
            assert counts_add_up(engine.statistics())
        want = plan.run([head.astype(F)])
        assert got.boxes.tobytes() == want.boxes.tobytes() and len(got) > 5
        assert got.scores.tobytes() == want.scores.tobytes()
        assert got.classes.tolist() == want.classes.tolist()
        results.append(got)
    assert results[0].boxes.tobytes() == results[1].boxes.tobytes()
    assert results[0].classes.tolist() == results[1].classes.tolist()


class TestFrameBuffers:
    @pytest.mark.parametrize("zero_copy", [False, True])
    @pytest.mark.asyncio
    async def test_read_without_a_staging_copy(self, model: bytes, zero_copy: bool) -> None:
        options: dict[str, Any] = {"convert": "device", "zero_copy": zero_copy}
        async with Engine(
            model, preprocess={"images": LETTERBOX}, postprocess=YOLOV5, **options
        ) as engine:
            runtime = engine.runtime
            assert isinstance(runtime, EmulatedRuntime)
            buffers = engine.frame_buffers(2, (1080, 1920, 3))
            buffers[0][:] = frame(4)
            reads: list[int] = []
            sources: list[Any] = []
            preprocess, copy = runtime.preprocess, runtime.copy_to_device

            def spy_preprocess(spec: Any, pointer: int, *rest: Any) -> None:
                reads.append(pointer)
                preprocess(spec, pointer, *rest)

            def spy_copy(dst: int, src: Any, nbytes: int, stream: int) -> None:
                sources.append(src)
                copy(dst, src, nbytes, stream)

            runtime.preprocess = spy_preprocess  # type: ignore[method-assign]
            runtime.copy_to_device = spy_copy  # type: ignore[method-assign]
            crop = buffers[0][100:900, 300:1500]  # a view: found with its offset
            for view in (buffers[0], crop):
                got = await engine.infer(view)
                pinned = engine._device._frames
                assert pinned is not None
                buffer, offset = pinned.find(view)  # type: ignore[misc]
                if zero_copy:  # read where it lies
                    assert reads[-1] == buffer.device_ptr + offset and not sources
                else:  # one copy, from the frame buffer itself
                    assert sources[-1] is buffer
                want = await engine.infer(view.copy())  # staged as any frame
                assert reads[-1] != buffer.device_ptr + offset
                assert got.boxes.tobytes() == want.boxes.tobytes() and len(got) > 10

    @pytest.mark.asyncio
    async def test_dropping_a_buffer_while_its_request_runs(self, model: bytes) -> None:
        async with Engine(
            model, preprocess={"images": LETTERBOX}, postprocess=YOLOV5, convert="device"
        ) as engine:
            buffers = engine.frame_buffers(3, (720, 1280, 3))
            expected = []
            for k, buffer in enumerate(buffers):
                buffer[:] = frame(10 + k, (720, 1280))
                expected.append(await engine.infer(buffer.copy()))
            pending = [engine.infer_nowait(buffer) for buffer in buffers]
            del buffer, buffers  # the engine's requests hold the frames they read
            gc.collect()
            for future, want in zip(pending, expected, strict=True):
                got = await future
                assert got.boxes.tobytes() == want.boxes.tobytes()
            assert counts_add_up(engine.statistics())

    @pytest.mark.asyncio
    async def test_before_open_and_after_close(self, model: bytes) -> None:
        engine = Engine(model)
        with pytest.raises(EngineClosedError, match="open it first"):
            engine.frame_buffers(1, (8, 8, 3))
        async with engine:
            buffers = engine.frame_buffers(1, (8, 8, 3))
            with pytest.raises(ConfigurationError, match="count=0"):
                engine.frame_buffers(0, (8, 8, 3))
            frames = engine._device._frames
            assert frames is not None and len(frames) == 1
        assert buffers[0].shape == (8, 8, 3)
        assert len(frames) == 0  # given up at close, with the rest of the device layer
        with pytest.raises(EngineClosedError, match="belongs to an engine that was closed"):
            buffers[0][:] = 1  # a camera reader still writing after close: a clear error
        with pytest.raises(EngineClosedError):
            await engine.infer(buffers[0])
        with pytest.raises(EngineClosedError):
            engine.frame_buffers(1, (8, 8, 3))
