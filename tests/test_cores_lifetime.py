"""The poller thread of an aiodla.Cores lives as long as the Cores: closed, or dropped
unclosed, it stops (the engines' own lifetimes are the engine suites')."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from aiodla import Cores, EmulatedRuntime, Engine

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
