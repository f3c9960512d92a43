"""aiodla on a real GPU (the cuDLA stand-in) against the ideal, two floors and two baselines.

Measured in one run, each measurement repeated (median and min..max of the repeats):

- **utilization**: requests per second of the aiodla engine on two stand-in cores,
  with enough concurrent requests to keep both busy, at 1 ms and at 100 us service
  time, against the physical ideal ``cores / service_time``; and the stand-in's own
  count of core busy time over the same wall time;
- **added latency** at light load (one request at a time, 1 ms service): wall time of
  ``await engine.infer(x)`` less the service time, p50 and p99, against two floors
  measured here on the same stand-in and model with the same copies and submit:
  (a) a dedicated thread busy-polling ``cudaEventQuery`` that wakes the event loop with
  ``call_soon_threadsafe``; (b) a thread blocked in ``cudaEventSynchronize`` on an
  event created with ``cudaEventBlockingSync``, waking the loop the same way;
- **baselines** on the same stand-in: the *seed loop* (NVIDIA's Python example, set up
  once; per request copy in, submit, ``cudaStreamSynchronize``, copy out, on one core)
  and ``asyncio`` + ``run_in_executor`` over that loop with one thread per core. Both
  pack and unpack the DLA layouts as aiodla does, so all compare the same work.

Usage (on the GPU machine; builds and loads the stand-in first)::

    python benchmarks/bench_gpu.py [OUTPUT.json] [--repeats 5] [--seconds 0.5] [--loop uvloop]

``--loop uvloop`` runs every asyncio measurement, aiodla's and the baselines', on uvloop
(when installed) instead of the standard event loop.

The JSON goes to the path given, by default to a temporary ``gpu-<machine>.json``, the machine
named from nvidia-smi (or cudaGetDeviceProperties). ``--host-fake`` runs the harness on
a machine without a GPU against the host-fake stand-in: a smoke test whose numbers mean
nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import platform
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _reports import report_path

import aiodla
import aiodla.runtime._cuda as cuda_module
from aiodla import Engine, TensorSpec
from aiodla.emulator._format import make_loadable, parse_loadable
from aiodla.emulator._ops import compute_logical, to_storage
from aiodla.emulator._standin import StandinControls, build_standin, load_standin
from aiodla.runtime._cuda import CudaRuntime, check_cuda

INPUT = TensorSpec("x", (1, 16, 8, 8), "float16", "chw16")
OUTPUT = TensorSpec("y", (1, 16, 8, 8), "float16", "nchw")
CORES = (0, 1)
SERVICE_TIMES = (1e-3, 1e-4)
LIGHT_SERVICE = 1e-3
REPO = Path(__file__).resolve().parents[1]


def model_bytes(latency: float) -> bytes:
    return make_loadable([INPUT], [OUTPUT], "affine", latency, scale=0.5, bias=0.25)


def sample() -> np.ndarray[Any, Any]:
    return np.random.default_rng(0).standard_normal(INPUT.shape).astype(np.float16)


def reference(data: bytes, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    model = parse_loadable(data)
    return to_storage(compute_logical(model, 0, x), OUTPUT.numpy_dtype)


def rt() -> Any:
    """cuda.bindings.runtime, looked up at call time (the smoke run swaps in a fake)."""
    return cuda_module._rt


# -- one slot by hand: what the seed loop and the floors use ----------------------------------


class Slot:
    """Device, module, buffers and task on one core, set up once (the seed loop's state)."""

    def __init__(self, runtime: CudaRuntime, data: bytes, core: int) -> None:
        self.runtime = runtime
        runtime.make_current()
        self.device = runtime.create_device(core)
        self.module = runtime.load_module(self.device, data)
        self.stream = runtime.create_stream()
        self.device_in, self.device_out = runtime.malloc(INPUT.size), runtime.malloc(OUTPUT.size)
        self.registered = [
            runtime.mem_register(self.device, self.device_in, INPUT.size),
            runtime.mem_register(self.device, self.device_out, OUTPUT.size),
        ]
        self.host_in, self.host_out = (
            runtime.host_alloc(INPUT.size),
            runtime.host_alloc(OUTPUT.size),
        )
        self.task = runtime.make_task(self.module, [self.registered[0]], [self.registered[1]])

    def enqueue(self, x: np.ndarray[Any, Any]) -> None:
        runtime = self.runtime
        INPUT.pack(x, out=self.host_in.array)
        runtime.copy_to_device(self.device_in, self.host_in, INPUT.size, self.stream)
        runtime.submit_task(self.device, self.task, self.stream)
        runtime.copy_to_host(self.host_out, self.device_out, OUTPUT.size, self.stream)

    def seed_request(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """NVIDIA's example per request: copy in, submit, synchronize, copy out."""
        runtime = self.runtime
        INPUT.pack(x, out=self.host_in.array)
        runtime.copy_to_device(self.device_in, self.host_in, INPUT.size, self.stream)
        runtime.submit_task(self.device, self.task, self.stream)
        runtime.synchronize_stream(self.stream)
        runtime.copy_to_host(self.host_out, self.device_out, OUTPUT.size, self.stream)
        runtime.synchronize_stream(self.stream)
        if runtime.get_last_error(self.device):
            raise RuntimeError("the DLA task failed")
        return OUTPUT.unpack(self.host_out.array)

    def close(self) -> None:
        runtime = self.runtime
        runtime.host_free(self.host_in)
        runtime.host_free(self.host_out)
        for registered in self.registered:
            runtime.mem_unregister(self.device, registered)
        runtime.free(self.device_in)
        runtime.free(self.device_out)
        runtime.destroy_stream(self.stream)
        runtime.unload_module(self.module)
        runtime.destroy_device(self.device)


# -- measurements ------------------------------------------------------------------------------


# The event loop every measurement runs on: asyncio's own, or uvloop's (--loop).
LOOP_FACTORY: Any = None


def run_on_loop(coroutine: Any) -> Any:
    if LOOP_FACTORY is None:
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=LOOP_FACTORY) as runner:  # Python >= 3.11
        return runner.run(coroutine)


def percentiles(values: list[float]) -> dict[str, float]:
    p50, p99 = np.percentile(np.asarray(values), (50, 99))
    return {"p50": float(p50), "p99": float(p99), "count": len(values)}


async def aiodla_throughput(
    data: bytes,
    runtime: CudaRuntime,
    controls: StandinControls,
    seconds: float,
    concurrency: int,
    streams_per_core: int,
) -> dict[str, float]:
    x = sample()
    async with Engine(
        data, cores=CORES, streams_per_core=streams_per_core, runtime=runtime
    ) as engine:
        result = await engine.infer(x)
        np.testing.assert_array_equal(result, reference(data, x))
        await asyncio.gather(*(engine.infer(x) for _ in range(4 * concurrency)))  # warm up
        busy = [controls.core_busy_time(core) for core in CORES]
        poller = next(t for t in threading.enumerate() if t.name == "aiodla-poller")
        assert poller.ident is not None
        poller_clock = time.pthread_getcpuclockid(poller.ident)
        loop_cpu, poller_cpu = time.thread_time(), time.clock_gettime(poller_clock)
        wakeups = engine._flow.poller.wakeups  # type: ignore[union-attr]
        done = 0
        stop = False

        async def worker() -> None:
            nonlocal done
            while not stop:
                await engine.infer(x)
                done += 1

        began = time.perf_counter()
        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await asyncio.sleep(seconds)
        stop = True
        await asyncio.gather(*workers)
        elapsed = time.perf_counter() - began
        loop_cpu = time.thread_time() - loop_cpu
        poller_cpu = time.clock_gettime(poller_clock) - poller_cpu
        wakeups = engine._flow.poller.wakeups - wakeups  # type: ignore[union-attr]
        busy_time = sum(controls.core_busy_time(c) - b for c, b in zip(CORES, busy, strict=True))
    return {
        "rate": done / elapsed,
        "device_utilization": busy_time / (len(CORES) * elapsed),
        # CPU seconds per request of the event loop's thread and of the poller's.
        "loop_cpu": loop_cpu / max(done, 1),
        "poller_cpu": poller_cpu / max(done, 1),
        # Completions the poller handed the loop per wake-up.
        "per_wakeup": done / max(wakeups, 1),
    }


async def aiodla_light(
    data: bytes, runtime: CudaRuntime, requests: int, service: float
) -> list[float]:
    x = sample()
    added = []
    async with Engine(data, cores=CORES, streams_per_core=2, runtime=runtime) as engine:
        for _ in range(10):
            await engine.infer(x)
        for _ in range(requests):
            began = time.perf_counter()
            await engine.infer(x)
            added.append(time.perf_counter() - began - service)
    return added


async def floor_light(slot: Slot, requests: int, service: float, *, blocking: bool) -> list[float]:
    """A waiter thread per design (a) busy poll (any runtime: bench_threads.py runs it
    emulated too) or (b) blocking sync (CUDA's own flag), waking the loop."""
    loop = asyncio.get_running_loop()
    if blocking:
        flags = rt().cudaEventDisableTiming | rt().cudaEventBlockingSync
        event = int(check_cuda("cudaEventCreateWithFlags", rt().cudaEventCreateWithFlags(flags)))
    else:
        event = slot.runtime.create_event()  # cudaEventDisableTiming, as before
    jobs: queue.SimpleQueue[asyncio.Future[None] | None] = queue.SimpleQueue()

    def waiter() -> None:
        slot.runtime.make_current()
        while (future := jobs.get()) is not None:
            if blocking:
                check_cuda("cudaEventSynchronize", rt().cudaEventSynchronize(event))
            else:
                while not slot.runtime.query_event(event):
                    pass
            loop.call_soon_threadsafe(future.set_result, None)

    thread = threading.Thread(target=waiter, name="floor-waiter", daemon=True)
    thread.start()
    x = sample()
    added = []
    try:
        for index in range(requests + 10):
            began = time.perf_counter()
            slot.enqueue(x)
            slot.runtime.record_event(event, slot.stream)
            future: asyncio.Future[None] = loop.create_future()
            jobs.put(future)
            await future
            OUTPUT.unpack(slot.host_out.array)
            if index >= 10:
                added.append(time.perf_counter() - began - service)
    finally:
        jobs.put(None)
        thread.join()
        slot.runtime.destroy_event(event)
    return added


def seed_throughput(slot: Slot, seconds: float) -> float:
    x = sample()
    for _ in range(10):
        slot.seed_request(x)
    done = 0
    began = time.perf_counter()
    while (elapsed := time.perf_counter() - began) < seconds:
        slot.seed_request(x)
        done += 1
    return done / elapsed


def seed_light(slot: Slot, requests: int, service: float) -> list[float]:
    x = sample()
    added = []
    for index in range(requests + 10):
        began = time.perf_counter()
        slot.seed_request(x)
        if index >= 10:
            added.append(time.perf_counter() - began - service)
    return added


async def threaded(
    slots: list[Slot], seconds: float, concurrency: int, requests: int, service: float
) -> tuple[float, list[float]]:
    """asyncio over the seed loop: one single-thread executor per core."""
    loop = asyncio.get_running_loop()
    executors = [concurrent.futures.ThreadPoolExecutor(1) for _ in slots]
    x = sample()
    try:
        for executor, slot in zip(executors, slots, strict=True):
            await loop.run_in_executor(executor, slot.runtime.make_current)
        done = 0
        stop = False

        async def worker(index: int) -> None:
            nonlocal done
            k = index % len(slots)
            while not stop:
                await loop.run_in_executor(executors[k], slots[k].seed_request, x)
                done += 1

        began = time.perf_counter()
        workers = [asyncio.create_task(worker(i)) for i in range(concurrency)]
        await asyncio.sleep(seconds)
        stop = True
        await asyncio.gather(*workers)
        rate = done / (time.perf_counter() - began)
        added = []
        for index in range(requests + 10):
            k = index % len(slots)
            began = time.perf_counter()
            await loop.run_in_executor(executors[k], slots[k].seed_request, x)
            if index >= 10:
                added.append(time.perf_counter() - began - service)
        return rate, added
    finally:
        for executor in executors:
            executor.shutdown()


# -- the run -----------------------------------------------------------------------------------


def machine_name() -> tuple[str, str]:
    """(file-name slug, GPU name) from nvidia-smi, else cudaGetDeviceProperties."""
    name = ""
    smi = shutil.which("nvidia-smi")
    if smi:
        result = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        name = result.stdout.strip().splitlines()[0].strip() if result.stdout.strip() else ""
    if not name:
        try:
            properties = check_cuda("cudaGetDeviceProperties", rt().cudaGetDeviceProperties(0))
            raw = properties.name
            name = raw.split(b"\0")[0].decode() if isinstance(raw, bytes) else str(raw)
        except Exception:
            name = platform.node() or "unknown"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"
    return slug, name


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def versions() -> dict[str, str]:
    import cuda.bindings

    return {
        "python": platform.python_version(),
        "aiodla": aiodla.__version__,
        "cuda-bindings": cuda.bindings.__version__,
        "numpy": np.__version__,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    controls, standin_path = setup_standin(args)
    runtime = CudaRuntime(0)
    runtime.make_current()
    slug, gpu = machine_name()
    raw: dict[str, Any] = {"throughput": {}, "light": {}}
    for service in SERVICE_TIMES:
        data = model_bytes(service)
        key = f"{service * 1e6:g}us"
        runs: dict[str, list[Any]] = {"aiodla": [], "seed": [], "threaded": []}
        slots = [Slot(runtime, data, core) for core in CORES]
        try:
            for _ in range(args.repeats):
                runs["aiodla"].append(
                    run_on_loop(
                        aiodla_throughput(
                            data,
                            runtime,
                            controls,
                            args.seconds,
                            args.concurrency,
                            args.streams_per_core,
                        )
                    )
                )
                runs["seed"].append(seed_throughput(slots[0], args.seconds))
                rate, _ = run_on_loop(threaded(slots, args.seconds, args.concurrency, 0, service))
                runs["threaded"].append(rate)
        finally:
            for slot in slots:
                slot.close()
        raw["throughput"][key] = {"service_time": service, "ideal": len(CORES) / service, **runs}
    data = model_bytes(LIGHT_SERVICE)
    light: dict[str, list[list[float]]] = {
        k: [] for k in ("aiodla", "poll", "block", "seed", "threaded")
    }
    slots = [Slot(runtime, data, core) for core in CORES]
    try:
        for _ in range(args.repeats):
            light["aiodla"].append(
                run_on_loop(aiodla_light(data, runtime, args.requests, LIGHT_SERVICE))
            )
            light["poll"].append(
                run_on_loop(floor_light(slots[0], args.requests, LIGHT_SERVICE, blocking=False))
            )
            light["block"].append(
                run_on_loop(floor_light(slots[0], args.requests, LIGHT_SERVICE, blocking=True))
            )
            light["seed"].append(seed_light(slots[0], args.requests, LIGHT_SERVICE))
            light["threaded"].append(
                run_on_loop(threaded(slots, 0.0, 1, args.requests, LIGHT_SERVICE))[1]
            )
    finally:
        for slot in slots:
            slot.close()
    raw["light"] = {"service_time": LIGHT_SERVICE, **light}
    leftover = controls.live_handles()
    if any(leftover.values()):
        raise RuntimeError(f"the benchmark leaked cuDLA handles: {leftover}")
    return {
        "machine": slug,
        "gpu": gpu,
        "host_fake": controls.host_fake,
        "standin": str(standin_path),
        "versions": versions(),
        "config": {
            "repeats": args.repeats,
            "seconds": args.seconds,
            "concurrency": args.concurrency,
            "streams_per_core": args.streams_per_core,
            "loop": args.loop,
            "requests": args.requests,
            "cores": list(CORES),
            "input": INPUT.describe(),
            "output": OUTPUT.describe(),
        },
        "raw": raw,
        "summary": summary(raw),
    }


def summary(raw: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {"throughput": {}, "light": {}}
    for key, entry in raw["throughput"].items():
        ideal = entry["ideal"]
        aiodla_rates = [r["rate"] for r in entry["aiodla"]]
        result["throughput"][key] = {
            "ideal": ideal,
            "aiodla": summarize(aiodla_rates),
            "aiodla_over_ideal": summarize([r / ideal for r in aiodla_rates]),
            "device_utilization": summarize([r["device_utilization"] for r in entry["aiodla"]]),
            "loop_cpu": summarize([r["loop_cpu"] for r in entry["aiodla"]]),
            "poller_cpu": summarize([r["poller_cpu"] for r in entry["aiodla"]]),
            "per_wakeup": summarize([r["per_wakeup"] for r in entry["aiodla"]]),
            "seed": summarize(entry["seed"]),
            "threaded": summarize(entry["threaded"]),
        }
    light = raw["light"]
    for name in ("aiodla", "poll", "block", "seed", "threaded"):
        per_run = [percentiles(values) for values in light[name]]
        result["light"][name] = {
            "p50": summarize([p["p50"] for p in per_run]),
            "p99": summarize([p["p99"] for p in per_run]),
        }
    p50 = result["light"]["aiodla"]["p50"]["median"]
    result["light"]["aiodla_p50_over_poll"] = p50 / result["light"]["poll"]["p50"]["median"]
    result["light"]["aiodla_p50_over_block"] = p50 / result["light"]["block"]["p50"]["median"]
    return result


def table(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [
        f"aiodla GPU benchmark on {report['gpu']} ({report['machine']}); "
        f"{report['config']['repeats']} repeats, median [min..max]",
        f"{'measurement':<48}{'median':>14}{'spread':>26}{'ratio':>16}",
    ]

    def rate(label: str, stat: dict[str, float], ratio: str = "") -> None:
        spread = f"[{stat['min']:.0f}..{stat['max']:.0f}]"
        lines.append(f"{label:<48}{stat['median']:>12.0f}/s{spread:>26}{ratio:>16}")

    def micro(label: str, stat: dict[str, float], ratio: str = "") -> None:
        spread = f"[{stat['min'] * 1e6:.1f}..{stat['max'] * 1e6:.1f}] us"
        lines.append(f"{label:<48}{stat['median'] * 1e6:>11.1f} us{spread:>26}{ratio:>16}")

    for key, entry in s["throughput"].items():
        lines.append(f"-- throughput, 2 cores, service time {key} (ideal {entry['ideal']:.0f}/s)")
        rate(
            "  aiodla engine",
            entry["aiodla"],
            f"{entry['aiodla_over_ideal']['median']:.3f} x ideal",
        )
        util = entry["device_utilization"]
        spread = f"[{util['min']:.3f}..{util['max']:.3f}]"
        label = "  stand-in busy time / (2 cores x wall)"
        lines.append(f"{label:<48}{util['median']:>14.3f}{spread:>26}")
        micro("  aiodla event-loop thread CPU per request", entry["loop_cpu"])
        micro("  aiodla poller thread CPU per request", entry["poller_cpu"])
        batch = entry["per_wakeup"]
        spread = f"[{batch['min']:.1f}..{batch['max']:.1f}]"
        label = "  completions per poller wake-up"
        lines.append(f"{label:<48}{batch['median']:>14.1f}{spread:>26}")
        rate(
            "  seed loop (1 core, blocking)",
            entry["seed"],
            f"{entry['seed']['median'] / entry['ideal']:.3f} x ideal",
        )
        rate(
            "  asyncio + thread per core over seed",
            entry["threaded"],
            f"{entry['threaded']['median'] / entry['ideal']:.3f} x ideal",
        )
    light = s["light"]
    lines.append("-- added latency over 1 ms service, one request at a time")
    for name, label in (
        ("aiodla", "aiodla engine"),
        ("poll", "floor (a): busy-poll thread + wake-up"),
        ("block", "floor (b): blocking-sync thread + wake-up"),
        ("seed", "seed loop (blocking, no event loop)"),
        ("threaded", "asyncio + thread per core over seed"),
    ):
        micro(f"  {label} p50", light[name]["p50"])
        micro(f"  {label} p99", light[name]["p99"])
    lines.append(
        f"  aiodla p50 / floor (a) = {light['aiodla_p50_over_poll']:.2f}; "
        f"aiodla p50 / floor (b) = {light['aiodla_p50_over_block']:.2f}"
    )
    return "\n".join(lines)


def setup_standin(args: argparse.Namespace) -> tuple[StandinControls, Path]:
    if args.host_fake:
        sys.path.insert(0, str(REPO / "tests" / "gpu"))
        from _host_fake import HostFakeRuntime

        path = build_standin(
            tempfile.mkdtemp(prefix="aiodla-bench-"), nvcc=args.nvcc, host_fake=True
        )
        controls = load_standin(path)
        cuda_module._rt = HostFakeRuntime(controls)
        return controls, path
    path = (
        Path(args.standin)
        if args.standin
        else build_standin(tempfile.mkdtemp(prefix="aiodla-bench-"), nvcc=args.nvcc)
    )
    return load_standin(path), path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "output", nargs="?", help="JSON path (default: a temporary gpu-<machine>.json)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5, help="length of each throughput run")
    parser.add_argument("--requests", type=int, default=200, help="requests per light-load run")
    # A ring of 8 slots per core holds 0.8 ms of work at 100 us service times: enough to
    # cover the loop's hop and batch (see the README's performance section).
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--streams-per-core", type=int, default=8)
    parser.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default="asyncio", help="the event loop"
    )
    parser.add_argument(
        "--standin",
        default=os.environ.get("AIODLA_STANDIN_LIB"),
        help="a prebuilt stand-in libcudla.so.1 (default: build one)",
    )
    parser.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"))
    parser.add_argument(
        "--host-fake", action="store_true", help="smoke-test the harness without a GPU"
    )
    args = parser.parse_args(argv)
    if args.loop == "uvloop":
        import uvloop

        global LOOP_FACTORY
        LOOP_FACTORY = uvloop.new_event_loop
    report = run(args)
    output = report_path(args.output, f"gpu-{report['machine']}.json")
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"written: {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
