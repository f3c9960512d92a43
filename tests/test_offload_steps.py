"""Requests whose outputs are unpacked in a worker thread (``offload_bytes=0``), caught
while that step waits for a thread.

The step waits for a token of anyio's default thread limiter; the test holds every
token, so the request stays between its completion on the DLA and its unpacking for as
long as the test needs, without sleeping.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from aiodla import Engine, EngineClosedError, RequestTimeoutError
from aiodla.testing import DLAControls, EngineFactory

from support import (
    HeldRequest,
    NoThreads,
    X,
    affine_model,
    all_idle,
    counts_add_up,
    expected_affine,
    wait_until,
)

ONES = np.ones(X.shape, np.float32)


class TestWaitingToUnpack:
    @pytest.mark.asyncio
    async def test_cancelled_its_slot_comes_back(self, held_offloaded_request: HeldRequest) -> None:
        engine, gate, task = held_offloaded_request
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


async def one_slot(aiodla_engine: EngineFactory, **options: Any) -> Engine:
    """An engine of one slot whose every packing and unpacking runs in a worker thread."""
    return await aiodla_engine(
        affine_model(), cores=[0], streams_per_core=1, offload_bytes=0, **options
    )


async def waiting_to_pack(
    engine: Engine, no_threads: NoThreads, timeout: float | None = None
) -> asyncio.Future[Any]:
    """A request whose packing step waits for one of the thread tokens the test holds."""
    task = asyncio.ensure_future(engine.infer(ONES, timeout=timeout))
    await wait_until(lambda: no_threads.waiting() == 1)
    return task


class TestWaitingToPack:
    @pytest.mark.asyncio
    async def test_an_outcome_decided_meanwhile_reaches_the_caller_at_once(
        self, aiodla_engine: EngineFactory
    ) -> None:
        # The engine closes while a request's packing step waits for a thread: the
        # caller has its EngineClosedError at once (its one future, resolved once), and
        # the step gives the slot back when it ends.
        engine = await one_slot(aiodla_engine, close_timeout=0)
        async with NoThreads() as no_threads:
            task = await waiting_to_pack(engine, no_threads)
            closing = asyncio.ensure_future(engine.aclose())
            with pytest.raises(EngineClosedError):
                await asyncio.wait_for(task, 5)
            assert engine.statistics().failed == 1  # (no thread was free all along)
        await closing
        stats = engine.statistics()
        assert stats.failed == 1 and counts_add_up(stats)

    @pytest.mark.asyncio
    async def test_a_deadline_passed_meanwhile_times_it_out_when_the_step_ends(
        self, aiodla_engine: EngineFactory
    ) -> None:
        # The timer leaves a packing request alone (its step holds the slot); the step
        # reads the deadline once its thread is done: timed out, not submitted, the slot
        # back for the next request.
        engine = await one_slot(aiodla_engine)
        async with NoThreads() as no_threads:
            task = await waiting_to_pack(engine, no_threads, timeout=0.02)
            await asyncio.sleep(0.1)  # past its deadline
            assert not task.done()
        with pytest.raises(RequestTimeoutError):
            await asyncio.wait_for(task, 5)
        assert all_idle(engine)
        np.testing.assert_array_equal(await engine.infer(ONES * 2), expected_affine(ONES * 2))
        stats = engine.statistics()
        assert (stats.timed_out, stats.completed, stats.failed) == (1, 1, 0)
        assert counts_add_up(stats)

    @pytest.mark.asyncio
    async def test_a_close_that_drains_meanwhile_fails_it_when_the_step_ends(
        self, aiodla_engine: EngineFactory
    ) -> None:
        # The close waits for work in flight (close_timeout): the packed request is not
        # submitted to an engine that stopped serving; it fails as closed, not as timed
        # out, and the close ends without waiting out its timeout.
        engine = await one_slot(aiodla_engine, close_timeout=30)
        async with NoThreads() as no_threads:
            task = await waiting_to_pack(engine, no_threads, timeout=60)
            closing = asyncio.ensure_future(engine.aclose())
            await wait_until(lambda: engine.state.value == "closing")
            assert not task.done()
        with pytest.raises(EngineClosedError, match="the engine was closed"):
            await asyncio.wait_for(task, 5)
        await asyncio.wait_for(closing, 5)
        stats = engine.statistics()
        assert (stats.failed, stats.timed_out, stats.completed) == (1, 0, 0)
        assert counts_add_up(stats)


class TestPackedOffTheLoop:
    @pytest.mark.asyncio
    async def test_on_the_dla_it_times_out_at_its_deadline(
        self, aiodla_engine: EngineFactory, aiodla_controls: DLAControls
    ) -> None:
        # Packed in a worker thread, then submitted: from then on the request is in
        # flight like any other, and its timer ends it at its deadline while the DLA
        # still holds its task.
        engine = await one_slot(aiodla_engine)
        with aiodla_controls.hold(0) as gate:
            task = asyncio.ensure_future(engine.infer(ONES, timeout=0.05))
            await gate.reached(1)  # packed (in a thread) and submitted
            with pytest.raises(RequestTimeoutError):
                await asyncio.wait_for(task, 5)
            assert engine.statistics().timed_out == 1
        await wait_until(lambda: all_idle(engine))
        np.testing.assert_array_equal(await engine.infer(ONES * 2), expected_affine(ONES * 2))
        stats = engine.statistics()
        assert (stats.timed_out, stats.completed) == (1, 1) and counts_add_up(stats)
