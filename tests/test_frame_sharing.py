"""What the camera guide promises about one detector's frames and callers: a frame
buffer refilled before its frame's result is read leaves that result as it was, and a
thread and a coroutine share one engine (an asyncio Engine, or a BlockingEngine)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from aiodla import BlockingEngine, EmulatedRuntime, Engine, LatestFrameStream
from aiodla.testing import EngineFactory

from support import X, Y, affine_model, wait_until


def frame(value: float) -> np.ndarray:
    return np.full(X.shape, value, np.float32)


@pytest.mark.asyncio
async def test_a_buffer_refilled_before_its_result_is_read_leaves_the_result(
    aiodla_engine: EngineFactory,
) -> None:
    engine = await aiodla_engine(inputs=[X], outputs=[Y], latency=0.001, scale=2.0, bias=1.0)
    async with LatestFrameStream(engine, name="cam") as cam:
        buffer = cam.frame_buffer(X.shape, "float32")
        buffer[...] = 3.0
        cam.submit(buffer)
        await wait_until(lambda: cam.statistics().completed == 1)  # answered, not read
        again = cam.frame_buffer(X.shape, "float32")
        # Nothing is in flight or waiting: the answered frame's buffer comes back, and
        # the camera overwrites it before the first result is read.
        assert again is buffer
        again[...] = 4.0
        cam.submit(again)
        first = await cam.receive()
        second = await cam.receive()
    assert first.index == 0 and float(first.output.mean()) == 7.0  # 2 * 3 + 1
    assert second.index == 1 and float(second.output.mean()) == 9.0  # 2 * 4 + 1


@pytest.mark.asyncio
async def test_a_thread_and_a_coroutine_share_an_asyncio_engine(
    runtime: EmulatedRuntime,
) -> None:
    loop = asyncio.get_running_loop()
    async with Engine(affine_model(0.001, scale=2.0, bias=1.0), runtime=runtime) as engine:
        answers: list[float] = []

        def capture_thread() -> None:
            for value in range(5):
                future = asyncio.run_coroutine_threadsafe(
                    engine.infer(frame(value), timeout=5.0), loop
                )
                answers.append(float(future.result(timeout=10).mean()))

        thread = threading.Thread(target=capture_thread)
        thread.start()
        mine = [float((await engine.infer(frame(10 + i), timeout=5.0)).mean()) for i in range(5)]
        await asyncio.to_thread(thread.join, 10)
        assert not thread.is_alive()
    assert answers == [2.0 * v + 1.0 for v in range(5)]
    assert mine == [2.0 * (10 + i) + 1.0 for i in range(5)]
    assert engine.statistics().completed == 10


@pytest.mark.asyncio
async def test_a_coroutine_shares_a_blocking_engine_with_threads() -> None:
    blocking = BlockingEngine(affine_model(0.001, scale=2.0, bias=1.0), runtime="emulated")
    await asyncio.to_thread(blocking.open)  # (its open and close block: off the loop)
    try:
        answers: list[float] = []

        def capture_thread() -> None:
            answers.extend(float(blocking.infer(frame(v), timeout=5.0).mean()) for v in range(4))

        thread = threading.Thread(target=capture_thread)
        thread.start()
        mine = [
            float((await asyncio.wrap_future(blocking.infer_future(frame(v)))).mean())
            for v in range(10, 14)
        ]
        await asyncio.to_thread(thread.join, 10)
        assert not thread.is_alive()
        assert blocking.statistics().completed == 8
    finally:
        await asyncio.to_thread(blocking.close)
    assert answers == [2.0 * v + 1.0 for v in range(4)]
    assert mine == [2.0 * v + 1.0 for v in range(10, 14)]
