"""Which requests take a step in a worker thread: those whose step moves more than
``offload_bytes`` on the host. A frame the kernels read in place from an engine frame
buffer and detections decoded on the slot's stream move next to nothing, so they stay
on the event loop (a thread hop would cost more than the step); an ordinary camera
frame staged by a copy, or heads read back and decoded on the host, go to a thread."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from aiodla import Detect, Detections, Engine, ImagePreprocess
from aiodla.emulator import make_loadable
from aiodla.emulator._detector import PRESETS

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


class Threads:
    """Records, per call of a device layer method, whether it ran on the loop's thread."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.on_loop: list[bool] = []
        layer = engine._device
        real = getattr(layer, name)
        loop_thread = threading.current_thread()

        def spy(*args: Any) -> Any:
            self.on_loop.append(threading.current_thread() is loop_thread)
            return real(*args)

        setattr(layer, name, spy)


@pytest.mark.asyncio
async def test_a_frame_in_a_frame_buffer_is_staged_on_the_loop(model: bytes) -> None:
    async with detector(model) as engine:
        (buffer,) = engine.frame_buffers(1, (720, 1280, 3))
        buffer[:] = frame()
        packs = Threads(engine, "write_inputs")
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
        reads = Threads(engine, "read_outputs")
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
        packs = Threads(engine, "write_inputs")
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
async def test_what_was_found_for_other_arrays_is_not_used(model: bytes) -> None:
    """The reads found while weighing one request's arrays serve those arrays only: a
    slot staged with other arrays next looks them up itself."""
    async with detector(model) as engine:
        first, second = engine.frame_buffers(2, (720, 1280, 3))
        first[:], second[:] = frame(), frame()[::-1]
        path, slot = engine._device.path, engine._device.slots[0]
        assert path.staging_bytes(slot, [first]) == 0  # (found in place)
        arrays = [second]
        path.write_inputs(slot, arrays)
        expected = path._frame_buffer_read(slot.inputs[0], second)
        assert expected is not None and slot.reads == [expected]
        assert slot.frames_found is None  # taken, not left for a later request
