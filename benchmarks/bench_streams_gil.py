"""Paced camera streams into one engine beside threads that hold the interpreter lock,
as a decoder's binding may (PyNvVideoCodec's ``Decode`` keeps other threads waiting:
``bench_nvdec_phases.py``): how many frames the streams deliver, and how busy the
cores stay, at each ring depth (``streams_per_core``).

The engine runs the small 32x32 model with the detector's task time (3.8 ms stated) on
both emulated cores, so the cores' capacity (526 tasks/s) is what sixteen 30 frames/s
streams need (480) plus a tenth, and the host's part is small. Each stream is paced as
in ``bench_video.py --streams`` (``_paced``: three frames in flight at most, newest
wins). Beside them, ``--holders`` threads each hold the interpreter lock for
``--hold-us`` at every frame interval, in one C call that the interpreter cannot break
(``sorted`` of a shuffled list, calibrated to the time asked), as sixteen decoders'
threads would. For each depth, with and without the holders, interleaved and repeated:
each stream's delivered rate and p99 from capture to result, the drops by cause, each
core's busy time over the window (aiodla's accounting: a task counts until its
completion is seen), and the loop's lag p99. Emulated runtime only: it needs no GPU,
and the GIL's effect on the loop is the host's.

Usage::

    python benchmarks/bench_streams_gil.py [OUT.json] [--streams 16] [--holders 16]
        [--hold-us 450] [--depths 2,4,8] [--seconds 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
from _paced import FPS, cores_busy, paced
from _reports import report_path
from bench_data_path import SMALL_IN, small, summarize, ticker

from aiodla import Engine

CORES = 2


def calibrated(hold_us: float) -> list[int]:
    """A shuffled list whose ``sorted`` takes about ``hold_us`` on this machine."""
    size = 1000
    while True:
        data = random.sample(range(size), size)
        began = time.perf_counter()
        for _ in range(5):
            sorted(data)
        took = (time.perf_counter() - began) / 5 * 1e6
        if took >= hold_us or size > 10**7:
            return random.sample(range(size), max(1, int(size * hold_us / took)))
        size *= 2


def hold(data: list[int], stop: threading.Event) -> None:
    """Hold the interpreter lock in one ``sorted`` call at every frame interval."""
    next_at = time.perf_counter() + random.random() / FPS
    while not stop.is_set():
        time.sleep(max(0.0, next_at - time.perf_counter()))
        sorted(data)
        next_at += 1 / FPS


async def run_once(
    args: argparse.Namespace, depth: int, holders: int, data: list[int]
) -> dict[str, Any]:
    stop = threading.Event()
    threads = [
        threading.Thread(target=hold, args=(data, stop), daemon=True) for _ in range(holders)
    ]
    x = np.ones(SMALL_IN.shape, np.float16)
    async with Engine(
        small(args.task_ms / 1e3),
        runtime="emulated",
        cores=range(CORES),
        streams_per_core=depth,
    ) as engine:
        for thread in threads:
            thread.start()
        begin = time.perf_counter() + 0.5
        end = begin + args.seconds
        lags: list[float] = []
        ticking = asyncio.Event()
        tick = asyncio.ensure_future(ticker(lags, ticking))

        async def take() -> Any:
            return x

        fractions, *streams = await asyncio.gather(
            cores_busy(engine, begin, end),
            *(paced(take, engine.infer, begin, end) for _ in range(args.streams)),
        )
        ticking.set()
        await tick
    stop.set()
    for thread in threads:
        thread.join()
    rates = [len(s["latencies"]) / args.seconds for s in streams]
    return {
        "fps": statistics.median(rates),
        "fps_min": min(rates),
        "p99_ms": statistics.median(
            1e3 * float(np.percentile(s["latencies"], 99)) for s in streams
        ),
        "late": sum(s["late"] for s in streams),
        "full": sum(s["full"] for s in streams),
        "core_busy": statistics.mean(fractions),
        "loop_lag_p99_ms": 1e3 * float(np.percentile(lags, 99)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", nargs="?", help="JSON path")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--holders", type=int, default=16)
    parser.add_argument("--hold-us", type=float, default=450.0)
    parser.add_argument("--task-ms", type=float, default=3.8)
    parser.add_argument("--depths", default="2,4,8")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]
    cases = [(depth, holders) for depth in depths for holders in (0, args.holders)]
    raw: dict[str, list[dict[str, Any]]] = {f"depth {d}, {h} holders": [] for d, h in cases}
    data = calibrated(args.hold_us)  # once: every case's holders hold the lock alike
    for repeat in range(args.repeats):
        for depth, holders in cases:  # interleaved
            result = asyncio.run(run_once(args, depth, holders, data))
            raw[f"depth {depth}, {holders} holders"].append(result)
            print(f"[{repeat + 1}/{args.repeats}] depth {depth}, {holders} holders: {result}")
    summary = {
        name: {key: summarize([r[key] for r in runs]) for key in runs[0]}
        for name, runs in raw.items()
    }
    report = {
        "benchmark": "bench_streams_gil",
        "streams": args.streams,
        "holders": args.holders,
        "hold_us": args.hold_us,
        "task_ms": args.task_ms,
        "needed_per_s": args.streams * FPS,
        "capacity_per_s": CORES / (args.task_ms / 1e3),
        "seconds": args.seconds,
        "repeats": args.repeats,
        "results": summary,
        "raw": raw,
    }
    report_path(args.output, "streams-gil.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{'case':24s} {'fps':>14s} {'p99 ms':>16s} {'late':>6s} {'full':>6s} {'busy':>6s} {'lag99':>7s}"
    )
    for name, figures in summary.items():
        fps, p99 = figures["fps"], figures["p99_ms"]
        print(
            f"{name:24s} {fps['median']:5.2f} ({fps['min']:.1f}..{fps['max']:.1f})"
            f" {p99['median']:6.1f} ({p99['min']:.0f}..{p99['max']:.0f})"
            f" {figures['late']['median']:6.0f} {figures['full']['median']:6.0f}"
            f" {figures['core_busy']['median']:6.3f} {figures['loop_lag_p99_ms']['median']:7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
