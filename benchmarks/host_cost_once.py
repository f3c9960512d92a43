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
subtracts as ``device_time`` too. ``--device skipped`` leaves it out and does not run it
either (``skip_device_work``): callgrind runs what it does not count all the same, and
on the boxes path that is most of a run's time.

``--workload engine`` (the default) is bench_engine's host-cost workload above.
``--workload boxes`` is ``bench_data_path``'s camera to boxes (``--only boxes``, the
engine + buffers case): a 1080p BGR frame in an engine frame buffer, letterboxed on the
device into the YOLOv5s-shaped model, ``Detect`` on the device, two cores with four
streams each and 16 requests in flight. It takes paths the engine workload never does
(the frame-buffer read, the pre-processing's frame check, the detections' unpack), so
changes to those show only there. ``--workload small`` is the same engine set-up with
bench_data_path's small model (a 3x32x32 input, no pre- or post-processing): boxes /
small tells a change to the camera path from one to the path every request takes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_data_path
import bench_engine

from aiodla import Engine

WORKLOADS = ("engine", "boxes", "small")
CONCURRENCY = {"engine": 64, "boxes": 16, "small": 16}  # bench_data_path runs 16 workers


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


def skip_device_work() -> None:
    """Make every stream operation but a task's a no-op: the emulated copies, the
    device's letterbox and its ``Detect`` are not run at all (a task's op still is, as
    its timing comes with it).

    Set apart, that work is not counted, but callgrind still runs it, slowly: on the
    boxes path (a 1080p frame letterboxed, three heads decoded a request) a run of
    ``--warmup 100 --size 200 --segments 3`` took six minutes. Skipped, the outputs are
    not written, so what the host reads back differs (the detections' buffer stays as
    it was), and the device finishing at once changes how requests batch on the loop:
    its figures compare between trees, not with ``excluded``'s."""
    from aiodla.runtime import _timeline

    operation = _timeline._Operation
    init = operation.__init__

    def __init__(self: Any, effect: Any, *args: Any, **kwargs: Any) -> None:
        init(self, effect if hasattr(effect, "hung") else _nothing, *args, **kwargs)

    operation.__init__ = __init__  # type: ignore[method-assign]


def _nothing() -> None:
    pass


async def open_workload(
    name: str, stack: contextlib.AsyncExitStack
) -> tuple[Engine, Callable[[], Awaitable[Any]]]:
    """The engine of workload ``name``, open on ``stack``, and one request of it."""
    if name == "engine":
        x: Any = bench_engine.sample()
        engine = await stack.enter_async_context(
            Engine(
                bench_engine.model_bytes(0.0),
                cores=range(bench_engine.CORES),
                runtime="emulated",
            )
        )
        return engine, lambda: engine.infer(x)
    if name == "small":
        model, x, options = bench_data_path.small(0.0), bench_data_path.small_input(), {}
    else:  # boxes: bench_data_path's "boxes: engine + buffers"
        model, x = bench_data_path.yolov5s(0.0), bench_data_path.camera_frame()
        options = bench_data_path.boxes_options()
    engine = await stack.enter_async_context(
        Engine(
            model,
            runtime="emulated",
            cores=range(bench_data_path.CORES),
            streams_per_core=4,
            **options,
        )
    )
    if name == "boxes":  # the camera writes into an engine frame buffer
        x = bench_data_path.in_frame_buffer(engine, x)
    return engine, lambda: engine.infer(x)


async def segments(
    workload: str,
    warmup: int,
    size: int,
    count: int,
    concurrency: int,
    collect: str,
    device: str,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        engine, infer = await open_workload(workload, stack)
        if device != "counted":
            set_apart(engine.runtime)
        remaining = 0

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await infer()

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
    parser.add_argument("--workload", choices=WORKLOADS, default="engine")
    parser.add_argument(
        "--concurrency", type=int, help="requests in flight (default: 64 engine, 16 others)"
    )
    parser.add_argument("--gc", choices=("on", "frozen", "off"), default="frozen")
    parser.add_argument("--device", choices=("counted", "excluded", "skipped"), default="excluded")
    args = parser.parse_args()
    if args.device == "skipped":
        skip_device_work()
    concurrency = args.concurrency or CONCURRENCY[args.workload]
    asyncio.run(
        segments(
            args.workload,
            args.warmup,
            args.size,
            args.segments,
            concurrency,
            args.gc,
            args.device,
        )
    )


if __name__ == "__main__":
    main()
