"""Opening and closing an engine gives back everything the stand-in made for it.

The stand-in's handle counts (devices, modules, registrations) already return to zero
after a clean close; this checks what sits behind them on the CUDA device: the memory,
events and streams the stand-in allocates for a device handle and a loaded module. A
stand-in that keeps any of them past unload or destroy (a pool of module tables, a
private stream per device) leaks a little on every open, and a long-lived service that
reopens its engine runs the device out of memory.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

try:
    from aiodla import Engine, TensorSpec
except ImportError as exc:  # only while the engine module does not exist yet
    pytest.skip(f"aiodla.Engine is not available: {exc}", allow_module_level=True)

from aiodla.emulator._format import make_loadable
from aiodla.runtime._cuda import CudaRuntime

pytestmark = pytest.mark.gpu

REOPENS = 50
NOTHING_LIVE = {"allocations": 0, "bytes": 0, "events": 0, "streams": 0}
NO_HANDLES = {"devices": 0, "modules": 0, "registrations": 0}


def test_engine_reopened_50_times_leaves_nothing_behind(standin: Any) -> None:
    x = TensorSpec("x", (1, 16, 2, 3), "float16", "chw16")
    y = TensorSpec("y", (1, 16, 2, 3), "float16", "nchw")
    loadable = make_loadable([x], [y], "affine", 0.0, scale=2.0, bias=1.0)
    data = np.arange(96, dtype=np.float16).reshape(1, 16, 2, 3)
    want = data.astype(np.float32) * 2 + 1
    before = standin.live_resources()
    assert before == NOTHING_LIVE, f"another test left stand-in resources behind: {before}"
    released = standin.released_by_destroy()
    while_open: list[dict[str, int]] = []

    async def open_use_close(runtime: CudaRuntime) -> None:
        async with Engine(loadable, cores=(0, 1), streams_per_core=2, runtime=runtime) as engine:
            got = await engine.infer(data)
            np.testing.assert_array_equal(np.asarray(got, dtype=np.float32), want)
            while_open.append(standin.live_resources())

    runtime = CudaRuntime(0)
    try:
        for _ in range(REOPENS):
            asyncio.run(open_use_close(runtime))
    finally:
        runtime.close()
    # The count is not vacuous: while open, each loaded module holds device memory and
    # each core its upload stream.
    assert all(s["allocations"] >= 1 and s["streams"] >= 1 for s in while_open), while_open[:3]
    assert standin.live_handles() == NO_HANDLES
    # ... and the engine released its modules and registrations itself, in order.
    assert standin.released_by_destroy() == released
    after = standin.live_resources()
    assert after == NOTHING_LIVE, (
        f"after {REOPENS} opens and closes the stand-in still holds {after}"
    )
