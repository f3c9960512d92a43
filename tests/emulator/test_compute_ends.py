"""Every task of a compute function ends: whatever the function raises (SystemExit and
KeyboardInterrupt too) fails that request alone, a function that never returns is
ended by the task timeout as the DLA ends a hung task, and the core goes on serving
and is released at close."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from aiodla import ComputeError, EmulatedRuntime, Engine, TaskError
from aiodla.emulator import make_loadable

from support import X, Y, counts_add_up, doubled

# A bound on a wait that, broken, would never end (the test then fails, not hangs).
NEVER = 30.0


def model() -> bytes:
    return make_loadable([X], [Y], latency=0.001)


def sample(value: float) -> np.ndarray[Any, Any]:
    return np.full(X.shape, value, np.float32)


def expected(value: float) -> np.ndarray[Any, Any]:
    return sample(value).astype(np.float16).astype(np.float32) * 2


@pytest.mark.asyncio
@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt()], ids=repr)
async def test_base_exceptions_fail_the_request_alone(raised: BaseException) -> None:
    def function(inputs: Any) -> dict[str, Any]:
        if inputs["x"].flat[0] < 0:
            raise raised
        return doubled(inputs)

    runtime = EmulatedRuntime(compute=function)
    async with Engine(model(), runtime=runtime, cores=[0], streams_per_core=1) as engine:
        with pytest.raises(ComputeError, match=type(raised).__name__) as caught:
            await asyncio.wait_for(engine.infer(sample(-1)), NEVER)
        assert caught.value.__cause__ is raised
        # The same core, the same compute thread: it serves on.
        y = await asyncio.wait_for(engine.infer(sample(1)), NEVER)
        np.testing.assert_array_equal(y, expected(1))
        stats = engine.statistics()
        assert stats.failures["compute"] == 1 and counts_add_up(stats)
        assert engine.health().ok
        assert all(core.busy_slots == 0 for core in stats.cores)
    assert not any(runtime.live_handles().values())


@pytest.mark.asyncio
async def test_a_function_that_never_returns_is_ended_by_the_task_timeout() -> None:
    stuck, release = threading.Event(), threading.Event()
    returned = threading.Event()

    def function(inputs: Any) -> dict[str, Any]:
        if inputs["x"].flat[0] < 0:
            stuck.set()
            release.wait()  # as long as the test says: "never", to the engine
            returned.set()
            return {"y": np.full(Y.shape, 666, np.float32)}  # too late: discarded
        return doubled(inputs)

    runtime = EmulatedRuntime(compute=function)
    try:
        async with Engine(
            model(), runtime=runtime, cores=[0], streams_per_core=1, task_timeout=0.2
        ) as engine:
            with pytest.raises(TaskError, match=r"(?i)err_?engine_?timeout"):
                await asyncio.wait_for(engine.infer(sample(-1)), NEVER)
            assert stuck.is_set()
            # The core serves on, on a fresh compute thread, while the old one waits.
            y = await asyncio.wait_for(engine.infer(sample(1)), NEVER)
            np.testing.assert_array_equal(y, expected(1))
            release.set()
            assert await asyncio.to_thread(returned.wait, NEVER)
            # The late outputs went nowhere: the slot's next result is its own.
            y = await asyncio.wait_for(engine.infer(sample(2)), NEVER)
            np.testing.assert_array_equal(y, expected(2))
            stats = engine.statistics()
            assert stats.failed == 1 and stats.completed == 2 and counts_add_up(stats)
            assert all(core.busy_slots == 0 for core in stats.cores)
        assert not any(runtime.live_handles().values())
    finally:
        release.set()
