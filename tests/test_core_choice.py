"""Which core a request goes to: the one with the least outstanding work, and between
cores equally loaded, the one chosen fewer times so far."""

from __future__ import annotations

import numpy as np
import pytest

from aiodla.testing import EngineFactory

from support import X, affine_model, expected_affine

ONES = np.ones(X.shape, np.float32)


class TestEquallyLoadedCores:
    @pytest.mark.asyncio
    async def test_one_request_at_a_time_alternates_between_the_cores(
        self, aiodla_engine: EngineFactory
    ) -> None:
        # Each request finds both cores idle: a tie, which the count of requests each
        # core was given breaks, so a client that waits for every answer still keeps
        # both cores in use rather than wearing one.
        engine = await aiodla_engine(affine_model(latency=0.0))
        for value in range(10):
            y = await engine.infer(ONES * value)
            np.testing.assert_array_equal(y, expected_affine(ONES * value))
            completed = [core.completed for core in engine.statistics().cores]
            assert completed == [value // 2 + 1, (value + 1) // 2], completed
