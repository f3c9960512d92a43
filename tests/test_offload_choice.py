"""Which requests take a step in a worker thread: those whose step moves more than
``offload_bytes`` on the host. A frame the kernels read in place from an engine frame
buffer and detections decoded on the slot's stream move next to nothing, so they stay
on the event loop (a thread hop would cost more than the step); an ordinary camera
frame staged by a copy, or heads read back and decoded on the host, go to a thread."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiodla import Detect, Detections, Engine, ImagePreprocess
from aiodla.emulator import make_loadable
from aiodla.emulator._detector import PRESETS

from support import StepThreads

INPUTS, HEADS, _ = PRESETS["yolov5s"]
LETTERBOX = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")


@pytest.fixture(scope="module")
def model() -> bytes:
    return make_loadable(INPUTS, HEADS, "detect", 0.002)


def frame(shape: tuple[int, int] = (720, 1280)) -> Any:
    return np.random.default_rng(3).integers(0, 256, (*shape, 3), np.uint8)


def detector(model: bytes, convert: str = "device") -> Engine:
    """The detector with letterboxing and Detect on the engine."""
    return Engine(
        model,
        preprocess={"images": LETTERBOX},
        postprocess=Detect(head="yolov5"),
        convert=convert,
    )


@pytest.mark.asyncio
async def test_a_frame_in_a_frame_buffer_is_staged_on_the_loop(model: bytes) -> None:
    async with detector(model) as engine:
        (buffer,) = engine.frame_buffers(1, (720, 1280, 3))
        buffer[:] = frame()
        packs = StepThreads(engine, "write_inputs")
        in_place = await engine.infer(buffer)  # read where it lies: no copy
        cropped = await engine.infer(buffer[40:680, 100:1200])  # a view, found in place
        copied = await engine.infer(buffer.copy())  # 2.8 MB staged by a copy
        flipped = await engine.infer(buffer[::-1])  # rows descending: staged by a copy
        assert packs.on_loop == [True, True, False, False]
        assert in_place.boxes.tobytes() == copied.boxes.tobytes() and len(in_place) > 5
        assert isinstance(cropped, Detections) and isinstance(flipped, Detections)


@pytest.mark.parametrize(("convert", "on_loop"), [("device", True), ("host", False)])
@pytest.mark.asyncio
async def test_detections_are_read_where_their_bytes_are_few(
    model: bytes, convert: str, on_loop: bool
) -> None:
    """Decoded on the stream (device conversion) the host reads back the kept boxes
    only; with host conversion it reads 3.2 MB of heads and decodes them itself."""
    async with detector(model, convert) as engine:
        reads = StepThreads(engine, "read_outputs")
        got = [await engine.infer(frame()) for _ in range(2)]
        assert reads.on_loop == [on_loop, on_loop]
        assert got[0].boxes.tobytes() == got[1].boxes.tobytes() and len(got[0]) > 5


@pytest.mark.parametrize(("shape", "on_loop"), [((16, 16), True), ((720, 1280), False)])
@pytest.mark.asyncio
async def test_host_pre_processing_weighs_the_frame(shape: tuple[int, int], on_loop: bool) -> None:
    """Host conversion letterboxes on the host: a thumbnail into a small model stays on
    the loop, a 720p frame goes to a thread."""
    from aiodla import TensorSpec

    x = TensorSpec("images", (1, 3, 16, 16), "float16", "nchw")
    y = TensorSpec("y", (1, 3, 16, 16), "float16", "nchw")
    async with Engine(
        make_loadable([x], [y], "affine", 0.001),
        preprocess={"images": LETTERBOX},
        convert="host",
    ) as engine:
        packs = StepThreads(engine, "write_inputs")
        result = await engine.infer(frame(shape))
        assert packs.on_loop == [on_loop]
        assert result.shape == (1, 3, 16, 16)


class Lookups:
    """Counts the engine's look-ups of arrays in its frame buffers."""

    def __init__(self, engine: Engine) -> None:
        self.calls = 0
        frames = engine._device.path.frame_buffers
        real = frames.find

        def spy(array: Any) -> Any:
            self.calls += 1
            return real(array)

        frames.find = spy


@pytest.mark.asyncio
async def test_a_frame_in_a_frame_buffer_is_looked_up_once(model: bytes) -> None:
    """Weighing a request (is it worth a thread?) finds where its frame lies; staging
    it uses what was found rather than looking again: one look-up a request."""
    async with detector(model) as engine:
        (buffer,) = engine.frame_buffers(1, (720, 1280, 3))
        buffer[:] = frame()
        want = await engine.infer(buffer.copy())
        lookups = Lookups(engine)
        got = [await engine.infer(buffer) for _ in range(3)]
        assert lookups.calls == 3
        assert all(result.boxes.tobytes() == want.boxes.tobytes() for result in got)


@pytest.mark.asyncio
async def test_over_the_limit_nothing_is_staged(model: bytes) -> None:
    """Weighed over the limit, a request's arrays are left for a worker thread: the
    slot's reads stay as they were (nothing half staged); within it, or with no limit,
    they are staged. A frame read in place from a frame buffer weighs nothing."""
    async with detector(model) as engine:
        (buffer,) = engine.frame_buffers(1, (720, 1280, 3))
        buffer[:] = frame()
        path, slot = engine._device.path, engine._device.slots[0]
        copy = buffer.copy()
        before = list(slot.reads)
        assert path.write_inputs(slot, [copy], copy.nbytes - 1) is False
        assert slot.reads == before
        assert path.write_inputs(slot, [copy], copy.nbytes) is True
        assert slot.reads != before and slot.reads[0].source == 0  # staged by a copy
        assert path.write_inputs(slot, [buffer], 0) is True
        assert slot.reads == [path._frame_buffer_read(slot.inputs[0], buffer)]
        assert path.write_inputs(slot, [copy]) is True  # no limit: always staged


@pytest.mark.parametrize("convert", ["host", "device"])
@pytest.mark.asyncio
async def test_a_request_over_the_limit_is_staged_in_a_thread_once(
    model: bytes, convert: str
) -> None:
    """The loop's call weighs the frame and declines; the thread's call stages it:
    one staging, in the thread, and the same boxes as the next request's."""
    async with detector(model, convert) as engine:
        calls = StepThreads(engine, "write_inputs")
        want = await engine.infer(frame())
        assert calls.on_loop == [False] and calls.declined == 1
        got = await engine.infer(frame())
        assert got.boxes.tobytes() == want.boxes.tobytes() and len(got) > 5
