"""The check that every test gives its slots back (``conftest.everything_given_back``,
through ``support.slots_not_back``): it must see a slot that nothing holds, and must
not take a slot the DLA still holds for one."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aiodla import DeviceError, EmulatedRuntime, Engine
from aiodla.testing import DLAControls

from support import X, affine_model, slots_not_back

ONES = np.ones(X.shape, np.float32)


@pytest.mark.asyncio
async def test_a_slot_that_nothing_holds_is_reported(leaky_runtime: EmulatedRuntime) -> None:
    # A slot whose end event cannot be recorded is kept out of the pool for good (its
    # stream may still hold copies): busy, with no request and no task; it stands in
    # for a slot leaked by a bug (the leaky runtime: its handles stay, on purpose).
    async with Engine(
        affine_model(), runtime=leaky_runtime, cores=[0], streams_per_core=2, close_timeout=0.1
    ) as engine:
        assert await slots_not_back(engine, leaky_runtime, settle=0.05) is None
        leaky_runtime.fail_call("submit_task", 1)
        leaky_runtime.fail_call("record_event", 1)
        with pytest.raises(DeviceError):
            await engine.infer(ONES)
        said = await slots_not_back(engine, leaky_runtime, settle=0.05)
        assert said is not None
        assert "holds 1 busy slot(s) with 0 request(s) in flight and 0 task(s)" in said


@pytest.mark.asyncio
async def test_a_slot_the_dla_still_holds_is_not_a_leak(aiodla_controls: DLAControls) -> None:
    runtime = aiodla_controls.runtime
    async with Engine(affine_model(), runtime=runtime, cores=[0], streams_per_core=1) as engine:
        with aiodla_controls.hold(0) as gate:
            call = asyncio.ensure_future(engine.infer(ONES))
            await gate.reached(1)
            assert await slots_not_back(engine, runtime, settle=0.05) is None  # in flight
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            # Ended, and its task still held on the DLA: its slot waits for the task.
            assert engine.statistics().in_flight == 0
            assert await slots_not_back(engine, runtime, settle=0.05) is None
        assert await slots_not_back(engine, runtime) is None  # back once the task ends
