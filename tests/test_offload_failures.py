"""A step that a request's coroutine does in a worker thread (``offload_bytes=0``) and
that fails: the request fails alone, its slot comes back, and an engine of one slot
serves the next request."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from aiodla import AiodlaError, Engine, PostprocessError
from aiodla.testing import EngineFactory

from support import X, affine_model, all_idle, counts_add_up, expected_affine

# The failures are put into this process's device layer and flow.
pytestmark = pytest.mark.in_process

ONES = np.ones(X.shape, np.float32)


async def one_slot(aiodla_engine: EngineFactory) -> Engine:
    return await aiodla_engine(affine_model(), cores=[0], streams_per_core=1, offload_bytes=0)


def fails_once(real: Any, error: BaseException) -> Any:
    calls: list[int] = []

    def failing(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise error
        return real(*args)

    return failing


async def serves_again(engine: Engine) -> None:
    assert all_idle(engine)
    result = await asyncio.wait_for(engine.infer(ONES * 2), 10)
    np.testing.assert_array_equal(result, expected_affine(ONES * 2))
    stats = engine.statistics()
    assert (stats.failed, stats.completed) == (1, 1) and counts_add_up(stats)


class TestAFailedStepGivesItsSlotBack:
    @pytest.mark.asyncio
    async def test_packing(
        self, aiodla_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        engine = await one_slot(aiodla_engine)
        device = engine._device
        monkeypatch.setattr(
            device, "write_inputs", fails_once(device.write_inputs, RuntimeError("broke"))
        )
        with pytest.raises(AiodlaError, match="packing the input failed: broke"):
            await engine.infer(ONES)
        await serves_again(engine)

    @pytest.mark.asyncio
    async def test_post_processing(
        self, aiodla_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        engine = await one_slot(aiodla_engine)
        flow = engine._flow
        assert flow is not None
        error = PostprocessError("the boxes could not be decoded")
        monkeypatch.setattr(flow, "read_results", fails_once(flow.read_results, error))
        with pytest.raises(PostprocessError, match="could not be decoded"):
            await engine.infer(ONES)
        await serves_again(engine)

    @pytest.mark.asyncio
    async def test_unpacking_with_an_unexpected_error(
        self, aiodla_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        engine = await one_slot(aiodla_engine)
        device = engine._device
        monkeypatch.setattr(
            device, "read_outputs", fails_once(device.read_outputs, RuntimeError("broke"))
        )
        with pytest.raises(AiodlaError, match="reading the outputs failed: broke"):
            await engine.infer(ONES)
        await serves_again(engine)
