"""aiodla on the emulated runtime against the ideal and against hand-written baselines.

Measures, in one run, with repeats (median and min..max):

- throughput of aiodla at concurrency 1, 8 and 64 against the physical ideal
  ``cores / latency``;
- the *seed loop*: what NVIDIA's Python example does per request on one core, set up
  once (copy in, submit, stream synchronize, copy out), one request at a time;
- ``asyncio.to_thread`` over that seed loop, one thread per core, at the same
  concurrencies;
- aiodla's host CPU time per request with zero-latency cores: CPU time of the event
  loop's thread plus the poller's thread, less the emulated device's own work (the
  copies and the op, which the emulator does in whichever thread looks at an event;
  on a Jetson the copy engines and the DLA do it). Inputs are float16 already, so
  no dtype conversion is counted (benchmarks/bench_layouts.py measures packing).

Usage::

    python benchmarks/bench_engine.py [--latency 0.001] [--seconds 1.0] [--repeats 5]
                                      [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _reports import report_path

import aiodla
from aiodla import EmulatedRuntime, Engine, TensorSpec
from aiodla.emulator import make_loadable

INPUT = TensorSpec("x", (1, 8, 16, 16), "float16", "chw16")
OUTPUT = TensorSpec("y", (1, 8, 16, 16), "float16", "nchw")
CORES = 2
CONCURRENCIES = (1, 8, 64)


def model_bytes(latency: float) -> bytes:
    return make_loadable([INPUT], [OUTPUT], "affine", latency, scale=0.5, bias=0.25)


def sample() -> np.ndarray[Any, Any]:
    # Already in the tensor's dtype: the host cost measures aiodla, not numpy's float
    # conversion (benchmarks/bench_layouts.py measures that).
    return np.random.default_rng(0).standard_normal(INPUT.shape).astype(INPUT.dtype)


# -- the seed loop: nine cuDLA/CUDA steps by hand, one request at a time ------------------


class SeedLoop:
    """Set up once on one core; then per request: copy in, submit, sync, copy out."""

    def __init__(self, runtime: EmulatedRuntime, model: bytes, core: int) -> None:
        rt = self.rt = runtime
        self.device = rt.create_device(core)
        self.module = rt.load_module(self.device, model)
        self.stream = rt.create_stream()
        self.buffers = []
        for spec in (INPUT, OUTPUT):
            ptr = rt.malloc(spec.size)
            self.buffers.append(
                (spec, ptr, rt.mem_register(self.device, ptr, spec.size), rt.host_alloc(spec.size))
            )
        (_, _, reg_in, _), (_, _, reg_out, _) = self.buffers
        self.task = rt.make_task(self.module, [reg_in], [reg_out])

    def infer(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        rt = self.rt
        (spec_in, ptr_in, _, host_in), (spec_out, ptr_out, _, host_out) = self.buffers
        spec_in.pack(x, out=host_in.array)
        rt.copy_to_device(ptr_in, host_in, spec_in.size, self.stream)
        rt.submit_task(self.device, self.task, self.stream)
        rt.synchronize_stream(self.stream)
        if rt.get_last_error(self.device):
            raise RuntimeError("task failed")
        rt.copy_to_host(host_out, ptr_out, spec_out.size, self.stream)
        rt.synchronize_stream(self.stream)
        return spec_out.unpack(host_out.array)

    def close(self) -> None:
        rt = self.rt
        for _, ptr, reg, host in self.buffers:
            rt.mem_unregister(self.device, reg)
            rt.free(ptr)
            rt.host_free(host)
        rt.destroy_stream(self.stream)
        rt.unload_module(self.module)
        rt.destroy_device(self.device)


def run_seed_loop(latency: float, seconds: float) -> float:
    runtime = EmulatedRuntime(cores=CORES)
    seed = SeedLoop(runtime, model_bytes(latency), 0)
    x = sample()
    seed.infer(x)
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        seed.infer(x)
        count += 1
    seed.close()
    runtime.close()
    return count / elapsed


async def run_to_thread(latency: float, seconds: float, concurrency: int) -> float:
    runtime = EmulatedRuntime(cores=CORES)
    model = model_bytes(latency)
    seeds = [SeedLoop(runtime, model, core) for core in range(CORES)]
    executors = [concurrent.futures.ThreadPoolExecutor(1) for _ in range(CORES)]
    loop = asyncio.get_running_loop()
    turn = itertools.cycle(range(CORES))
    x = sample()

    async def one() -> None:
        core = next(turn)
        await loop.run_in_executor(executors[core], seeds[core].infer, x)

    rate = await _closed_loop(one, seconds, concurrency)
    for executor in executors:
        executor.shutdown()
    for seed in seeds:
        seed.close()
    runtime.close()
    return rate


async def _closed_loop(one: Callable[[], Any], seconds: float, concurrency: int) -> float:
    """``concurrency`` workers each issue requests back to back; steady-state rate."""
    for _ in range(2 * concurrency):  # warm up
        await one()
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await one()
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


async def run_aiodla(latency: float, seconds: float, concurrency: int) -> float:
    x = sample()
    async with Engine(model_bytes(latency), cores=range(CORES), runtime="emulated") as engine:

        async def one() -> None:
            await engine.infer(x)

        return await _closed_loop(one, seconds, concurrency)


def _thread_cpu(ident: int | None) -> float:
    if ident is None:
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


async def host_cost(requests: int, concurrency: int = 64, pin: bool = False) -> dict[str, float]:
    """CPU seconds per request of the loop and poller threads, zero-latency cores.

    ``pin``: run the event loop and the poller on one CPU, so the figure holds aiodla's
    own work without the cost of waking threads across CPUs (large on this VM).
    """
    x = sample()
    affinity = os.sched_getaffinity(0)
    if pin:  # Linux: applies to this thread, and threads started from now inherit it
        os.sched_setaffinity(0, {min(affinity)})
    try:
        return await _host_cost(x, requests, concurrency)
    finally:
        os.sched_setaffinity(0, affinity)


async def _host_cost(x: np.ndarray[Any, Any], requests: int, concurrency: int) -> dict[str, float]:
    async with Engine(model_bytes(0.0), cores=range(CORES), runtime="emulated") as engine:
        for _ in range(200):
            await engine.infer(x)
        poller = next(t for t in threading.enumerate() if t.name == "aiodla-poller")
        runtime = engine.runtime
        assert isinstance(runtime, EmulatedRuntime)
        device_before = runtime.device_time
        loop_before, poller_before = time.thread_time(), _thread_cpu(poller.ident)
        process_before, wall_before = time.process_time(), time.perf_counter()
        remaining = requests

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await engine.infer(x)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        loop_cpu = time.thread_time() - loop_before
        poller_cpu = _thread_cpu(poller.ident) - poller_before
        # The emulator does the "device" work (copies, the op) in whichever thread
        # looks at an event, mostly the poller; on a Jetson the DLA and copy engines
        # do it. It keeps count, and that time is not aiodla's host cost.
        device_cpu = runtime.device_time - device_before
        process_cpu = time.process_time() - process_before
        wall = time.perf_counter() - wall_before
    return {
        "loop_us": 1e6 * loop_cpu / requests,
        "poller_us": 1e6 * poller_cpu / requests,
        "device_us": 1e6 * device_cpu / requests,
        "host_us": 1e6 * (loop_cpu + poller_cpu - device_cpu) / requests,
        "process_us": 1e6 * process_cpu / requests,
        "wall_us": 1e6 * wall / requests,
    }


def summarize(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": len(values),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    latency, seconds, repeats = args.latency, args.seconds, args.repeats
    ideal = CORES / latency
    results: dict[str, Any] = {"ideal": ideal}
    rows: dict[str, list[float]] = {}
    for _ in range(repeats):
        rows.setdefault("seed loop (1 core, sync)", []).append(run_seed_loop(latency, seconds))
        for c in CONCURRENCIES:
            rows.setdefault(f"to_thread, 1 thread/core, c={c}", []).append(
                await run_to_thread(latency, seconds, c)
            )
            rows.setdefault(f"aiodla c={c}", []).append(await run_aiodla(latency, seconds, c))
    results["throughput"] = {name: summarize(values) for name, values in rows.items()}
    for key, pin in (("host_cost", False), ("host_cost_one_cpu", True)):
        costs = [await host_cost(args.host_requests, pin=pin) for _ in range(repeats)]
        results[key] = {name: summarize([c[name] for c in costs]) for name in costs[0]}
    return results


def print_table(results: dict[str, Any], args: argparse.Namespace) -> None:
    ideal = results["ideal"]
    seed = results["throughput"]["seed loop (1 core, sync)"]["median"]
    print(
        f"\naiodla {aiodla.__version__} on the emulated runtime: {CORES} cores x "
        f"{args.latency * 1e3:g} ms, {args.repeats} runs of {args.seconds:g} s each "
        f"(median, min..max)"
    )
    print(f"{'':36} {'req/s':>9} {'min..max':>17} {'x ideal':>8} {'x seed':>7}")
    print(f"{'ideal (cores / latency)':36} {ideal:9.0f}")
    for name, row in results["throughput"].items():
        print(
            f"{name:36} {row['median']:9.0f} {row['min']:8.0f}..{row['max']:<8.0f}"
            f" {row['median'] / ideal:8.3f} {row['median'] / seed:7.2f}"
        )
    for key, title in (
        ("host_cost", "all CPUs"),
        ("host_cost_one_cpu", "loop and poller pinned to one CPU"),
    ):
        cost = results[key]
        print(
            f"\nhost CPU per request, zero-latency cores, {args.host_requests} requests at "
            f"c=64, {title}:"
        )
        for name, label in (
            ("loop_us", "event-loop thread"),
            ("poller_us", "poller thread"),
            ("device_us", "emulated device work (in those threads)"),
            ("host_us", "aiodla host cost (loop + poller - device)"),
            ("process_us", "whole process"),
            ("wall_us", "wall time per request"),
        ):
            row = cost[name]
            print(f"  {label:42} {row['median']:7.1f} us  ({row['min']:.1f}..{row['max']:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, default=0.001)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--host-requests", type=int, default=5000)
    parser.add_argument("--json", help="report path (default: a temporary file)")
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    results["machine"] = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    results["parameters"] = vars(args)
    print_table(results, args)
    path = report_path(args.json, "engine-emulated.json")
    path.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
