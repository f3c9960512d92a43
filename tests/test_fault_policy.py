"""The fault policy's figures as a user reads them: a core's consecutive failures, when it
leaves rotation and comes back, and what the log says at each step.

States are reached with aiodla.testing's controls: failures armed on one core, taken
by the requests and the probes that run there, so the number of failed tasks is known.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from aiodla import Engine, TaskError
from aiodla.testing import DLAControls, EngineFactory

from support import X, affine_model, counts_add_up, expected_affine, wait_until

ONES = np.ones(X.shape, np.float32)


async def fail_once_on(engine: Engine, core: int) -> None:
    """Send requests until one fails on ``core`` (the armed failure's)."""
    for _ in range(10):
        try:
            await engine.infer(ONES)
        except TaskError as error:
            assert error.core == core
            return
    raise AssertionError(f"no request failed on core {core}")


def messages(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if words in r.getMessage()]


class TestACoreOutOfRotation:
    @pytest.mark.asyncio
    async def test_leaves_after_the_limit_and_comes_back_counted_from_zero(
        self,
        aiodla_engine: EngineFactory,
        aiodla_controls: DLAControls,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        caplog.set_level(logging.INFO, logger="aiodla")
        engine = await aiodla_engine(
            affine_model(latency=0.0),
            max_consecutive_faults=2,
            probe_interval=0.01,
            streams_per_core=1,
        )
        # Two failures on core 0, no more: the first probe afterwards succeeds.
        aiodla_controls.fail_next(0, count=2)
        await fail_once_on(engine, 0)
        core = engine.statistics().cores[0]
        assert (core.consecutive_failures, core.in_rotation) == (1, True)
        assert messages(caplog, "out of rotation") == []  # one failure of two allowed
        await fail_once_on(engine, 0)
        core = engine.statistics().cores[0]
        assert core.in_rotation is False and core.consecutive_failures == 2
        assert engine.health().cores_out == (0,)
        (left,) = messages(caplog, "out of rotation")
        assert "core 0 is out of rotation after 2 consecutive faults" in left
        await wait_until(lambda: engine.health().status == "ok")
        core = engine.statistics().cores[0]
        assert core.in_rotation is True and core.consecutive_failures == 0
        assert len(messages(caplog, "core 0 is back in rotation")) == 1
        # Counted from zero again: one more failure leaves it in rotation.
        aiodla_controls.fail_next(0)
        await fail_once_on(engine, 0)
        core = engine.statistics().cores[0]
        assert (core.consecutive_failures, core.in_rotation) == (1, True)
        for value in range(4):  # both cores serve, correctly
            y = await engine.infer(ONES * value)
            np.testing.assert_array_equal(y, expected_affine(ONES * value))
        assert engine.statistics().cores[0].consecutive_failures == 0
        assert counts_add_up(engine.statistics())
