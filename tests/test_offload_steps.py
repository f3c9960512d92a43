"""Requests whose outputs are unpacked in a worker thread (``offload_bytes=0``), caught
while that step waits for a thread.

The step waits for a token of anyio's default thread limiter; the test holds every
token, so the request stays between its completion on the DLA and its unpacking for as
long as the test needs, without sleeping.
"""

from __future__ import annotations

import asyncio

import anyio
import numpy as np
import pytest

from aiodla.testing import DLAControls, EngineFactory

from support import X, affine_model, all_idle, counts_add_up, expected_affine, wait_until

ONES = np.ones(X.shape, np.float32)


class NoThreads:
    """Every token of the loop's default thread limiter, held until released."""

    def __init__(self) -> None:
        self.limiter = anyio.to_thread.current_default_thread_limiter()
        self.borrowers = [object() for _ in range(int(self.limiter.total_tokens))]

    async def __aenter__(self) -> NoThreads:
        for borrower in self.borrowers:
            await self.limiter.acquire_on_behalf_of(borrower)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for borrower in self.borrowers:
            self.limiter.release_on_behalf_of(borrower)

    def waiting(self) -> int:
        return int(self.limiter.statistics().tasks_waiting)


class TestWaitingToUnpack:
    @pytest.mark.asyncio
    async def test_cancelled_its_slot_comes_back(
        self, aiodla_engine: EngineFactory, aiodla_controls: DLAControls
    ) -> None:
        engine = await aiodla_engine(affine_model(), cores=[0], streams_per_core=1, offload_bytes=0)
        with aiodla_controls.hold(0) as gate:
            task = asyncio.ensure_future(engine.infer(ONES))
            await gate.reached(1)  # packed (in a thread) and submitted
            async with NoThreads() as no_threads:
                gate.release()
                await wait_until(lambda: no_threads.waiting() == 1)  # done on the DLA
                assert engine.statistics().in_flight == 1
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                # The slot the unpacking step held is given back at once: the next
                # request starts while no thread is free yet.
                assert all_idle(engine)
                follower = asyncio.ensure_future(engine.infer(ONES * 2))
                await wait_until(lambda: no_threads.waiting() == 1)  # its packing step
        np.testing.assert_array_equal(await follower, expected_affine(ONES * 2))
        stats = engine.statistics()
        assert (stats.cancelled, stats.completed) == (1, 1) and counts_add_up(stats)
