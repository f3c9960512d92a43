"""A user's tests, written as an application that uses aiodla would write them.

The application scores camera frames on the DLA. Its tests run in CI with no DLA:
aiodla's pytest plugin gives them an emulated engine for the model's I/O
(``aiodla_engine``) and controls to fail, delay or hold DLA tasks
(``aiodla_controls``). The README quotes this file.
"""

import asyncio

import numpy as np
import pytest
import pytest_asyncio

from aiodla import RequestTimeoutError, TaskError, TensorSpec

# -- the application (in a real project, this lives in the application's package) --------


async def score_frames(engine, frames, *, timeout=0.5):
    """Score every camera's frame at once; a frame the DLA fails on or that takes
    longer than ``timeout`` scores None, and the others still count."""

    async def score(frame):
        try:
            scores = await engine.infer(frame, timeout=timeout)
        except (TaskError, RequestTimeoutError):
            return None
        return float(scores.mean())

    return await asyncio.gather(*(score(frame) for frame in frames))


class LiveCamera:
    """Live video wants the newest frame: one frame on the DLA at a time, and a frame
    that arrives meanwhile is dropped, not queued."""

    def __init__(self, engine):
        self.engine = engine
        self.busy = False
        self.dropped = 0

    async def offer(self, frame):
        if self.busy:
            self.dropped += 1
            return None
        self.busy = True
        try:
            return float((await self.engine.infer(frame)).mean())
        finally:
            self.busy = False


# -- its tests --------------------------------------------------------------------------------

# The model's I/O. With a spec written on the Jetson by 'aiodla inspect model.bin --json',
# pass its path instead: await aiodla_engine("tests/model-spec.json").
IMAGE = TensorSpec("image", (1, 3, 32, 32), "float16", "chw16")
SCORES = TensorSpec("scores", (1, 3, 32, 32), "float32", "nchw")


def frame(value):
    return np.full(IMAGE.shape, value, np.float32)


@pytest_asyncio.fixture
async def engine(aiodla_engine):
    # The emulator computes scores = 2 * image + 1, each task taking 2 ms on a core.
    return await aiodla_engine(inputs=[IMAGE], outputs=[SCORES], latency=0.002, scale=2.0, bias=1.0)


@pytest.mark.asyncio
async def test_every_camera_gets_its_own_score(engine):
    assert await score_frames(engine, [frame(0), frame(1), frame(2)]) == [1.0, 3.0, 5.0]


@pytest.mark.asyncio
async def test_a_dla_fault_costs_one_frame(engine, aiodla_controls):
    aiodla_controls.fail_next()
    scores = await score_frames(engine, [frame(1)] * 4)
    assert scores.count(None) == 1
    assert scores.count(3.0) == 3


@pytest.mark.asyncio
async def test_a_slow_frame_times_out_alone(engine, aiodla_controls):
    aiodla_controls.delay_next(5.0)
    scores = await score_frames(engine, [frame(1), frame(2)], timeout=0.2)
    assert scores == [None, 5.0]


@pytest.mark.asyncio
async def test_live_camera_drops_frames_while_the_dla_works(engine, aiodla_controls):
    camera = LiveCamera(engine)
    with aiodla_controls.hold() as gate:
        first = asyncio.create_task(camera.offer(frame(1)))
        await gate.reached(1)  # the first frame is on the DLA now
        assert await camera.offer(frame(2)) is None
        assert camera.dropped == 1
    assert await first == 3.0
    assert await camera.offer(frame(2)) == 5.0
