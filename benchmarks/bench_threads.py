"""CPU per request by thread, on the emulated runtime, at several service times and loads.

For each service time (0, 100 us, 1 ms, 3.8 ms by default) and load (saturated: 64
requests kept in flight; half: requests arriving at half the ideal rate
``cores / service_time``, evenly spaced), it reports CPU seconds per request of

- the event loop's thread,
- the poller's thread,
- every other thread together (the emulator's stream workers, anyio's workers),
- the whole process,

each less the emulated device's own work done in that thread group (the copies and the
op, which on a Jetson the copy engines and the DLA do: the emulator counts it), plus
the achieved rate against the ideal. Repeated, medians and min..max.

Usage::

    python benchmarks/bench_threads.py [--seconds 1.0] [--repeats 5] [--service 0,1e-4,1e-3,3.8e-3]
                                       [--json benchmarks/results/threads-emulated.json]

This is the emulated half of the measurement the host-cost issue asks for; on the GPU
stand-in, ``benchmarks/bench_gpu.py`` reports the loop's and the poller's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import threading
import time
from typing import Any

import bench_engine

from aiodla import EmulatedRuntime, Engine

CORES = bench_engine.CORES


def _thread_cpu(thread: threading.Thread) -> float:
    if thread.ident is None or not thread.is_alive():
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, ProcessLookupError):  # ended between the check and the read
        return 0.0


def _cpu_by_group(loop_thread: threading.Thread) -> dict[str, float]:
    groups = {"loop": 0.0, "poller": 0.0, "other": 0.0}
    for thread in threading.enumerate():
        if thread is loop_thread:
            continue
        key = "poller" if thread.name == "aiodla-poller" else "other"
        groups[key] += _thread_cpu(thread)
    groups["loop"] = time.thread_time()
    groups["process"] = time.process_time()
    return groups


async def measure(service: float, load: str, seconds: float) -> dict[str, float]:
    """One measurement: CPU per request by thread group, and the rate against ideal."""
    x = bench_engine.sample()
    model = bench_engine.model_bytes(service)
    async with Engine(model, cores=range(CORES), runtime="emulated") as engine:
        runtime = engine.runtime
        assert isinstance(runtime, EmulatedRuntime)
        for _ in range(100):
            await engine.infer(x)
        loop_thread = threading.current_thread()
        before = _cpu_by_group(loop_thread)
        device_before = runtime.device_time
        started = time.perf_counter()
        stop = started + seconds
        done = 0
        if load == "saturated":

            async def worker() -> None:
                nonlocal done
                while time.perf_counter() < stop:
                    await engine.infer(x)
                    done += 1

            await asyncio.gather(*(worker() for _ in range(64)))
        else:  # half the ideal rate, evenly spaced arrivals
            interval = service / CORES * 2
            pending: set[asyncio.Task[Any]] = set()
            next_at = started
            while next_at < stop:
                pending.add(asyncio.ensure_future(engine.infer(x)))
                next_at += interval
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            await asyncio.gather(*pending)
            done = len(pending)
        elapsed = time.perf_counter() - started
        after = _cpu_by_group(loop_thread)
        device = runtime.device_time - device_before
    per = {key: 1e6 * (after[key] - before[key]) / done for key in after}
    ideal = CORES / service if service else float("inf")
    return {
        "loop_us": per["loop"],
        "poller_us": per["poller"],
        "other_us": per["other"],
        "process_us": per["process"],
        "device_us": 1e6 * device / done,
        "host_us": per["process"] - 1e6 * device / done,
        "rate": done / elapsed,
        "x_ideal": (done / elapsed) / ideal if service else float("nan"),
    }


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    cases = [
        (s, load)
        for s in args.service
        for load in ("saturated", "half")
        if s or load == "saturated"
    ]
    rows: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.repeats):  # interleaved: every case once per round
        for service, load in cases:
            rows.setdefault(f"{service * 1e6:g} us {load}", []).append(
                await measure(service, load, args.seconds)
            )
    return {
        name: {key: summarize([r[key] for r in runs]) for key in runs[0]}
        for name, runs in rows.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--service",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[0.0, 100e-6, 1e-3, 3.8e-3],
    )
    parser.add_argument("--json", default="benchmarks/results/threads-emulated.json")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    print(
        f"CPU per request by thread (us), emulated runtime, {CORES} cores; "
        f"median of {args.repeats} (min..max); device work subtracted in host"
    )
    header = ("case", "loop", "poller", "other", "process", "device", "host", "x ideal")
    print("{:<22} {:>8} {:>8} {:>8} {:>8} {:>8} {:>14} {:>8}".format(*header))
    for name, row in results.items():
        host = row["host_us"]
        print(
            f"{name:<22} {row['loop_us']['median']:8.1f} {row['poller_us']['median']:8.1f} "
            f"{row['other_us']['median']:8.1f} {row['process_us']['median']:8.1f} "
            f"{row['device_us']['median']:8.1f} {host['median']:6.1f} "
            f"({host['min']:.0f}..{host['max']:.0f}) {row['x_ideal']['median']:8.3f}"
        )
    if args.json:
        report = {
            "results": results,
            "parameters": {**vars(args)},
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
            },
        }
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
