"""Serve an engine's metrics to Prometheus while it works.

    python examples/metrics_server.py                        # until Ctrl-C
    python examples/metrics_server.py --port 0 --duration 10 # any free port, 10 s

An engine on the emulated runtime (no DLA needed) under a steady load: four cameras
at 100 frames/s each, one DLA task in fifty failing so the failure counters move.
Metrics are served on 127.0.0.1 only. Needs the extra: pip install 'aiodla[metrics]'.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

import numpy as np
from prometheus_client import REGISTRY, start_http_server

from aiodla import EmulatedRuntime, Engine, TaskError, TensorSpec
from aiodla.emulator import make_loadable
from aiodla.metrics import EngineCollector


def demo_model() -> bytes:
    image = TensorSpec("image", (1, 3, 64, 64), "float16", "chw16")
    scores = TensorSpec("scores", (1, 3, 64, 64), "float16", "nchw")
    return make_loadable([image], [scores], "affine", latency=0.004)


async def camera(engine: Engine, runtime: EmulatedRuntime, index: int, fps: float) -> None:
    frame = np.zeros(engine.inputs[0].shape, np.float32)
    sent = 0
    while True:
        sent += 1
        if sent % 50 == 0:
            runtime.fail_next_task(index % 2)
        with contextlib.suppress(TaskError):
            await engine.infer(frame)
        await asyncio.sleep(1 / fps)


async def main(port: int, duration: float | None) -> None:
    runtime = EmulatedRuntime(cores=2)
    async with Engine(demo_model(), runtime=runtime, stage_times=True) as engine:
        collector = EngineCollector({"detector": engine})
        REGISTRY.register(collector)
        server, thread = start_http_server(port, addr="127.0.0.1")
        print(f"serving http://127.0.0.1:{server.server_port}/metrics", flush=True)
        load = asyncio.gather(*(camera(engine, runtime, i, fps=100) for i in range(4)))
        try:
            await asyncio.wait_for(load, duration)  # None: until interrupted
        except asyncio.TimeoutError:
            pass
        finally:
            server.shutdown()
            server.server_close()
            thread.join()
            REGISTRY.unregister(collector)
        print(engine.statistics().completed, "requests served")
    runtime.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=9464, help="0 picks a free port")
    parser.add_argument("--duration", type=float, help="seconds to run (default: until Ctrl-C)")
    args = parser.parse_args()
    # The injected faults would each log a warning; the counters show them instead.
    logging.getLogger("aiodla").setLevel(logging.ERROR)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(args.port, args.duration))
