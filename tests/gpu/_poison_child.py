"""Child process for the poisoned-context test: a real sticky CUDA error on the GPU.

A kernel that traps poisons the process's CUDA context (cudaErrorLaunchFailure); the
engine must then fail every request with EngineDeadError, refuse new ones, report
``dead`` and close without hanging. Prints one JSON line with what it saw.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np

from aiodla.emulator._standin import load_standin

controls = load_standin(os.environ["AIODLA_STANDIN_LIB"])

import cupy  # noqa: E402 - the stand-in must be loaded before anything binds libcudla

from aiodla import Engine, EngineDeadError, TensorSpec  # noqa: E402
from aiodla.emulator import make_loadable  # noqa: E402
from aiodla.runtime import CudaRuntime  # noqa: E402

X = TensorSpec("x", (1, 16, 4, 4), "float16", "chw16")
Y = TensorSpec("y", (1, 16, 4, 4), "float16", "nchw")
TRAP = cupy.RawKernel('extern "C" __global__ void trap() { __trap(); }', "trap")


async def main() -> dict[str, object]:
    model = make_loadable([X], [Y], "affine", 0.002)
    x = np.ones(X.shape, np.float16)
    runtime = CudaRuntime(0)
    engine = Engine(model, runtime=runtime, cores=(0,), streams_per_core=2, task_timeout=1.0)
    await engine.open()
    gate = controls.hold(0)
    tasks = [asyncio.create_task(engine.infer(x)) for _ in range(6)]
    await asyncio.sleep(0.05)
    TRAP((1,), (1,), ())  # poisons the context: every CUDA call fails from now
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    kinds = [type(o).__name__ for o in outcomes]
    try:
        await engine.infer(x)
        refused = False
    except EngineDeadError:
        refused = True
    health = engine.health()
    began = time.monotonic()
    await asyncio.wait_for(engine.aclose(), 30)
    gate.release()
    return {
        "outcomes": kinds,
        "cause": next((str(o) for o in outcomes if isinstance(o, EngineDeadError)), ""),
        "refused": refused,
        "health": health.status,
        "close_seconds": time.monotonic() - began,
        "state": engine.state.value,
    }


print(json.dumps(asyncio.run(main())), flush=True)
# The context is lost: libraries' own teardown (cupy unloading its module) would only
# fail now, so leave without it.
os._exit(0)
