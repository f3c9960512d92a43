"""Where a detector request's time goes beside a classifier flooding the same cores.

The priority case of ``bench_shared_cores`` (a 3 ms detector at 30 requests/s per core,
priority 1, against 16 callers of a 1 ms classifier, priority 0, on one ``aiodla.Cores``
of the emulated runtime), with ``engine.trace()`` on the detector and each emulated
task's start on its core taken beside it. Per detector request, in milliseconds:

- ``core wait``: from its submission to its task's start on the core (the feeds' rule
  bounds it: two classifier task times, besides earlier detector tasks);
- ``seen late``: from its task's end to the sweep (the poller's or the loop's) that saw
  it done;
- ``to loop``: from that sweep to the loop taking the completion;
- ``host rest``: queueing for a slot, packing, submission and unpacking.

It prints their medians and their means over the slowest 3 % of requests, for each run;
then the process's CPU by thread over the window, as a share of one CPU (the
interpreter lock lets the threads together use about one); then how long a 100 us timed
wait on a lock (the poller's pause between two looks on the emulated runtime) lasts on
this machine, median of 200.

Usage::

    python benchmarks/trace_priority.py [--runs 4] [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _thread_cpu
import bench_shared_cores as case

from aiodla import Cores, EmulatedRuntime, Engine
from aiodla._trace import RequestRecord
from aiodla.runtime import _timeline

DETECTOR = 0.003


def record_task_starts(into: list[tuple[float, float, float]]) -> None:
    """Keep (submitted, started, duration) of every emulated task, from the timeline."""
    start_task = _timeline.Timeline._start_task

    def recording(timeline: Any, operation: Any, device: Any, stream: Any, now: float) -> None:
        core = device.core
        started = max(core.free_at, stream.clock, now)
        start_task(timeline, operation, device, stream, now)
        into.append((now, started, core.free_at - started))

    _timeline.Timeline._start_task = recording  # type: ignore[method-assign]


def parts(
    requests: list[RequestRecord], tasks: list[tuple[float, float, float]]
) -> list[dict[str, float]]:
    """Each request's parts (ms), its task found by its submission time."""
    detector_tasks = sorted(t for t in tasks if abs(t[2] - DETECTOR) < 1e-6)
    submitted_at = [t[0] for t in detector_tasks]
    found = []
    for r in requests:
        if r.submitted is None or r.seen is None or r.handled is None or r.assigned is None:
            continue
        i = bisect.bisect_left(submitted_at, r.submitted - 5e-4)
        nearby = detector_tasks[i : i + 4]
        if not nearby:
            continue
        _, started, duration = min(nearby, key=lambda t: abs(t[0] - r.submitted))
        ended = started + duration
        total = r.returned - r.queued
        wait, late, hop = started - r.submitted, r.seen - ended, r.handled - r.seen
        found.append(
            {
                "total": 1e3 * total,
                "core wait": 1e3 * wait,
                "seen late": 1e3 * late,
                "to loop": 1e3 * hop,
                "host rest": 1e3 * (total - wait - duration - late - hop),
            }
        )
    return found


async def run(
    seconds: float, tasks: list[tuple[float, float, float]]
) -> tuple[list[dict[str, float]], dict[str, float]]:
    runtime = EmulatedRuntime(cores=2)
    try:
        async with (
            Cores([0, 1], runtime=runtime) as dla,
            Engine(case.model(DETECTOR), priority=1, cores=dla) as detector,
            Engine(case.model(0.001), priority=0, streams_per_core=4, cores=dla) as flood,
        ):
            stop = asyncio.Event()
            callers = asyncio.ensure_future(case.callers(flood, 16, stop))
            await asyncio.sleep(0.2)
            del tasks[:]
            before, began = _thread_cpu.snapshot(), time.perf_counter()
            async with detector.trace() as recorder:
                arrivals = asyncio.ensure_future(case.detector_load(detector, 60.0, stop))
                await asyncio.sleep(seconds)
                stop.set()
                await arrivals
            after, wall = _thread_cpu.snapshot(), time.perf_counter() - began
            await callers
    finally:
        runtime.close()
    cpu, _ = _thread_cpu.per_request(before, after, 1, threading.main_thread().native_id or 0)
    share = {name: value / 1e6 / wall for name, value in cpu.items()}
    return parts([RequestRecord(*r) for r in recorder.requests], tasks), share


def timed_wait(pause: float = 100e-6, times: int = 200) -> float:
    bell = threading.Lock()
    bell.acquire()
    lasted = []
    for _ in range(times):
        began = time.perf_counter()
        bell.acquire(timeout=pause)
        lasted.append(time.perf_counter() - began)
    return statistics.median(lasted)


def shown(rows: list[dict[str, float]]) -> str:
    return "  ".join(f"{k} {statistics.mean(r[k] for r in rows):.2f}" for k in rows[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    tasks: list[tuple[float, float, float]] = []
    record_task_starts(tasks)
    for number in range(args.runs):
        rows, share = asyncio.run(run(args.seconds, tasks))
        rows.sort(key=lambda r: r["total"])
        slowest = rows[-max(1, len(rows) * 3 // 100) :]
        medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"run {number + 1}: {len(rows)} detector requests")
        print("  median:     " + "  ".join(f"{k} {v:.2f}" for k, v in medians.items()))
        print(f"  slowest 3 %: {shown(slowest)}")
        print("  CPU share of one CPU: " + ", ".join(f"{k} {v:.2f}" for k, v in share.items()))
    print(f"a 100 us timed wait on a lock lasts {1e6 * timed_wait():.0f} us (median of 200)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
