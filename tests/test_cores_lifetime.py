"""The poller thread of an aiodla.Cores lives as long as the Cores: closed, or dropped
unclosed, it stops (the engines' own lifetimes are the engine suites'). A lone engine's
own Cores opens and closes with it."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import warnings
import weakref
from typing import Any

import numpy as np
import pytest

import aiodla
from aiodla import Cores, EmulatedRuntime, Engine
from aiodla._poller import SharedPoller

from support import X, affine_model, wait_until

# A shared Cores hands its runtime instance to its engines: in-process only.
pytestmark = pytest.mark.in_process


def poller_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "aiodla-poller" and t.is_alive()}


@pytest.mark.asyncio
async def test_cores_dropped_unclosed_stop_their_poller(runtime: EmulatedRuntime) -> None:
    before = poller_threads()  # (other tests' threads may still be ending)
    dla = Cores([0, 1], runtime=runtime)
    await dla.open()
    engine = Engine(affine_model(), cores=dla)
    async with engine:
        await engine.infer(np.ones(X.shape, np.float32))
    (its,) = poller_threads() - before  # the cores' one thread
    del dla, engine
    gc.collect()
    await wait_until(lambda: not its.is_alive())


@pytest.mark.asyncio
async def test_an_engine_closed_on_open_cores_is_let_go(runtime: EmulatedRuntime) -> None:
    # The cores keep nothing of an engine that closed (an application opens and closes
    # engines on cores that stay open): it goes once the caller drops it.
    async with Cores([0, 1], runtime=runtime) as dla:
        engine = Engine(affine_model(), cores=dla)
        async with engine:
            await engine.infer(np.ones(X.shape, np.float32))
        gone = weakref.ref(engine)
        del engine

        def collected() -> bool:
            gc.collect()
            return gone() is None

        await wait_until(collected)
        assert dla.engines == 0


class TestALoneEnginesOwnCores:
    """``Engine(model, cores=[0, 1])`` runs on a private Cores (docs/design.md): one
    dispatcher, one poller thread, one record per core, opened and closed with it."""

    @pytest.mark.asyncio
    async def test_its_cores_open_and_close_with_it(self, runtime: EmulatedRuntime) -> None:
        before = poller_threads()
        engine = Engine(affine_model(), runtime=runtime, cores=[0, 1])
        own = engine._dla
        assert own.is_private and engine.shared_cores is None
        async with engine:
            await engine.infer(np.ones(X.shape, np.float32))
            (its,) = poller_threads() - before  # the cores' one thread, no other
            assert own.pollers == 1
            # Its flow is the one client of the cores' dispatcher; its lanes on the
            # cores are those cores' records.
            (client,) = own.dispatcher.clients
            assert client.flow is engine._flow
            lanes = engine._device.lanes
            assert [lane.record for lane in lanes] == [own.records[0], own.records[1]]
        assert own.state.value == "closed" and own.pollers == 0
        assert not its.is_alive()
        assert own.dispatcher.clients == []

    @pytest.mark.asyncio
    async def test_its_completions_go_straight_to_its_flow(
        self, runtime: EmulatedRuntime, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # One engine, ever, on its own cores: no routing between engines, neither of
        # the poller thread's batches nor of the loop's harvests.
        routed: list[str] = []
        deliver, harvest = SharedPoller.deliver, SharedPoller.harvest

        def counted_deliver(self: SharedPoller, finished: Any) -> None:
            routed.append("deliver")
            deliver(self, finished)

        def counted_harvest(self: SharedPoller, member: Any, at_least: int | None) -> Any:
            routed.append("harvest")
            return harvest(self, member, at_least)

        monkeypatch.setattr(SharedPoller, "deliver", counted_deliver)
        monkeypatch.setattr(SharedPoller, "harvest", counted_harvest)
        ones = np.ones(X.shape, np.float32)
        async with Engine(affine_model(), runtime=runtime, cores=[0, 1]) as engine:
            await asyncio.gather(*(engine.infer(ones) for _ in range(20)))
            assert engine.statistics().completed == 20
        assert routed == []
        # (the same engine on shared cores, alone there for now, is routed)
        async with (
            Cores([0, 1], runtime=runtime) as dla,
            Engine(affine_model(), cores=dla) as engine,
        ):
            await asyncio.gather(*(engine.infer(ones) for _ in range(20)))
        assert "deliver" in routed

    @pytest.mark.asyncio
    async def test_a_failed_open_closes_its_cores(self) -> None:
        engine = Engine(b"not a loadable", runtime="emulated")
        with pytest.raises(aiodla.RuntimeUnavailableError):
            await engine.open()
        assert engine._dla.state.value == "closed" and engine._dla.pollers == 0

    def test_dropped_unclosed_its_poller_stops(self, leaky_runtime: EmulatedRuntime) -> None:
        before = poller_threads()
        threads: list[threading.Thread] = []

        async def leak() -> None:
            engine = Engine(affine_model(), runtime=leaky_runtime)
            await engine.open()
            await engine.infer(np.ones(X.shape, np.float32))
            threads.extend(poller_threads() - before)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            asyncio.run(leak())
            (its,) = threads
            # (the poller thread may hold its flow for an instant while it posts)
            deadline = time.monotonic() + 5
            while its.is_alive() and time.monotonic() < deadline:
                gc.collect()
                its.join(0.05)
        assert not its.is_alive()
