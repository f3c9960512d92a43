"""Quickstart: many concurrent requests through one engine, on both DLA cores.

    python examples/quickstart.py                # emulated DLA, no GPU needed
    python examples/quickstart.py --model m.bin  # your loadable, on a Jetson

Without --model it builds a small emulator loadable (y = 2x + 1 on a 1x3x32x32
float16 CHW16 tensor, 1 ms per task), so it runs anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from aiodla import Engine, TensorSpec
from aiodla.emulator import make_loadable


def demo_model() -> bytes:
    x = TensorSpec("image", (1, 3, 32, 32), "float16", "chw16")
    y = TensorSpec("scores", (1, 3, 32, 32), "float16", "nchw")
    return make_loadable([x], [y], "affine", latency=0.001, scale=2.0, bias=1.0)


async def main(model: str | bytes, requests: int) -> None:
    async with Engine(model, cores=[0, 1]) as engine:
        spec = engine.inputs[0]
        print(f"runtime: {engine.runtime.name}; inputs: {[s.describe() for s in engine.inputs]}")
        rng = np.random.default_rng(0)
        frames = [rng.standard_normal(spec.shape).astype(np.float32) for _ in range(requests)]
        started = time.perf_counter()
        outputs = await asyncio.gather(*(engine.infer(frame) for frame in frames))
        elapsed = time.perf_counter() - started
        stats = engine.statistics()
        print(f"{requests} requests in {elapsed * 1e3:.0f} ms: {requests / elapsed:.0f} req/s")
        print(
            f"per core: {[core.completed for core in stats.cores]} tasks; "
            f"latency p50 {stats.latency.p50 * 1e3:.2f} ms, p99 {stats.latency.p99 * 1e3:.2f} ms"
        )
        print(f"first output: shape {outputs[0].shape}, dtype {outputs[0].dtype}")
        print(engine)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a loadable; default: a built-in emulator loadable")
    parser.add_argument("--requests", type=int, default=500)
    args = parser.parse_args()
    asyncio.run(main(args.model or demo_model(), args.requests))
