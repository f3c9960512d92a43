"""The engine's own host cost: what a request costs with no device work at all.

An emulated runtime whose enqueue, submit, query and status calls do nothing (every
event is done at once) serves a saturated engine (2 cores, 8 slots a core, 64 callers,
a 1x3x32x32 float16 model fed float16 arrays, device conversion): what remains is the
engine's Python and asyncio. It prints, per repeat, the event loop's CPU per request
and the process's, and with ``--count-calls`` the Python function calls a request makes
(cProfile's count over the run; the time under the profiler means nothing).

The floor under ``bench_threads.py``'s host cost that no runtime call can explain: on
the H200 machine's CPU the loop's share was about 38 us a request (at c7a6c2a).

Usage::

    python benchmarks/bench_engine_python.py [--requests 20000] [--repeats 3] [--count-calls]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import time
from typing import Any

import numpy as np

from aiodla import Engine, TensorSpec
from aiodla.emulator import make_loadable
from aiodla.runtime import EmulatedRuntime

X = TensorSpec("x", (1, 3, 32, 32), "float16", "chw16")
Y = TensorSpec("y", (1, 3, 32, 32), "float16", "nchw")
CALLERS = 64


class NullRuntime(EmulatedRuntime):
    """Opens and allocates as the emulated runtime does; enqueues nothing (its graphs,
    if the engine captures any, hold nothing either)."""

    def copy_to_device(self, *args: Any) -> None:
        pass

    def copy_to_host(self, *args: Any) -> None:
        pass

    def pack(self, *args: Any) -> None:
        pass

    def unpack(self, *args: Any) -> None:
        pass

    def submit_task(self, device: int, task: Any, stream: int) -> None:
        pass

    def launch_graph(self, graph: int, stream: int) -> None:
        pass

    def record_event(self, event: int, stream: int) -> None:
        pass

    def query_event(self, event: int) -> bool:
        return True

    def get_last_error(self, device: int) -> int:
        return 0


async def serve(requests: int, profiler: cProfile.Profile | None) -> tuple[float, float]:
    """Loop and process CPU microseconds per request over ``requests`` requests."""
    model = make_loadable([X], [Y], "affine", 0.0, scale=2.0, bias=0.5)
    x = np.ones(X.shape, np.float16)
    async with Engine(model, runtime=NullRuntime(), convert="device", streams_per_core=8) as e:

        async def caller(count: int) -> None:
            for _ in range(count):
                await e.infer(x)

        await asyncio.gather(*(caller(50) for _ in range(CALLERS)))  # warm: graphs, caches
        each = requests // CALLERS
        if profiler is not None:
            profiler.enable()
        loop, process = time.thread_time(), time.process_time()
        await asyncio.gather(*(caller(each) for _ in range(CALLERS)))
        loop, process = time.thread_time() - loop, time.process_time() - process
        if profiler is not None:
            profiler.disable()
    done = each * CALLERS
    return loop / done * 1e6, process / done * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--count-calls", action="store_true")
    args = parser.parse_args(argv)
    loops = []
    for repeat in range(args.repeats):
        loop, process = asyncio.run(serve(args.requests, None))
        loops.append(loop)
        print(f"  repeat {repeat + 1}: loop {loop:.1f} us, process {process:.1f} us per request")
    print(
        f"loop CPU per request, no device work: median {statistics.median(loops):.1f} us "
        f"({min(loops):.1f}..{max(loops):.1f})"
    )
    if args.count_calls:
        profiler = cProfile.Profile()
        asyncio.run(serve(args.requests, profiler))
        calls = sum(entry[1] for entry in pstats.Stats(profiler).stats.values())  # type: ignore[attr-defined]
        print(
            f"Python function calls per request: {calls / (args.requests // CALLERS * CALLERS):.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
