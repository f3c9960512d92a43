"""bench_engine's host-cost workload in segments, for instruction counting.

Opens one engine (the emulated runtime, two zero-latency cores, 64 requests in
flight), warms it up, then runs ``SEGMENTS`` segments of ``SIZE`` requests each and
calls ``os.getppid()`` at every segment boundary. Run under callgrind with
``--dump-before=getppid``, each call writes the counters since the last one (one file
per thread with ``--separate-threads=yes``), so each segment is a measurement of its
own, start-up and warm-up excluded, and the segments of one process show the spread::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --separate-threads=yes \\
        --dump-before=getppid --callgrind-out-file=cg python benchmarks/host_cost_once.py
    grep summary: cg.*-01      # thread 01 is the event loop's; cg.2-01 is segment 1

``benchmarks/count_instructions.py`` does that and sums up. Use the interpreter binary
itself (not a pyenv shim), and PYTHONPATH to pick the tree to measure.

``--gc frozen`` (the default): the warm-up's objects are moved out of the collector's
sight (``gc.freeze``) so a segment's collections scan what the requests allocated, not
the whole heap; collections still run as allocations trigger them. ``--gc off`` runs
none during the segments.

``--device excluded`` (the default): the emulated device's work (its copies and the
op, which the emulator does in whichever thread looks at an event: on a Jetson the
DLA and the copy engines do it) runs inside ``sys.call_tracing``, which callgrind's
``--toggle-collect=sys_call_tracing`` leaves out. Which thread looks first depends on
timing, so counted in, it moved tens of thousands of instructions per request between
the loop and the poller from run to run. It is what ``bench_engine``'s host cost
subtracts as ``device_time`` too.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_engine

from aiodla import Engine


def set_apart(runtime: object) -> None:
    """Run the emulated device's work (copies, the op) inside ``sys.call_tracing``, a
    C function nothing else on this path calls, so that callgrind's
    ``--toggle-collect=sys_call_tracing`` leaves it out of every thread's count.

    The work is the timeline's ``advance`` (the runtime's ``_advance`` in trees from
    before the timeline became an object of its own)."""
    owner = getattr(runtime, "_timeline", None)
    name = "advance"
    if owner is None:
        owner, name = runtime, "_advance"
    work = getattr(owner, name)
    setattr(owner, name, lambda stream, now: sys.call_tracing(work, (stream, now)))


async def segments(
    warmup: int, size: int, count: int, concurrency: int, collect: str, device: str
) -> None:
    x = bench_engine.sample()
    model = bench_engine.model_bytes(0.0)
    async with Engine(model, cores=range(bench_engine.CORES), runtime="emulated") as engine:
        if device == "excluded":
            set_apart(engine.runtime)
        remaining = 0

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await engine.infer(x)

        async def run(requests: int) -> None:
            nonlocal remaining
            remaining = requests
            await asyncio.gather(*(worker() for _ in range(concurrency)))

        await run(warmup)
        gc.collect()
        if collect == "frozen":
            gc.freeze()
        elif collect == "off":
            gc.disable()
        os.getppid()  # a boundary: callgrind dumps start-up and warm-up here
        for _ in range(count):
            await run(size)
            os.getppid()
        gc.enable()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--size", type=int, default=500, help="requests per segment")
    parser.add_argument("--segments", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--gc", choices=("on", "frozen", "off"), default="frozen")
    parser.add_argument("--device", choices=("counted", "excluded"), default="excluded")
    args = parser.parse_args()
    asyncio.run(
        segments(args.warmup, args.size, args.segments, args.concurrency, args.gc, args.device)
    )


if __name__ == "__main__":
    main()
