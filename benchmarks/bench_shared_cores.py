"""Several models on the same two emulated DLA cores: utilisation, weight shares,
priority latency against two independent engines, and batch assembly.

Every case runs on one emulated runtime whose cores serialise the tasks of every
engine (as a DLA does), in this process; the cases are interleaved within each repeat,
so drift in the machine touches all of them; the report gives medians over the repeats
with min..max.

- ``utilisation``: a 1 ms and a 3 ms model, each with 16 callers, on one
  ``aiodla.Cores``, ``streams_per_core=4`` each (as the weights cases): the cores'
  busy time over the window / (2 x the window).
- ``weights 1:1`` / ``weights 2:1``: two 1 ms models, both saturating, equal priority:
  each one's share of core time against its weight's share.
- ``priority shared`` / ``priority independent``: a detector (3 ms tasks, priority 1)
  at 30 requests/s per core (Poisson arrivals) against a classifier (1 ms tasks,
  priority 0, 16 callers, ``streams_per_core=4``) flooding the same cores: the
  detector's p99 latency against its bound (3 ms + 2 x 1 ms + 1 ms). ``independent``
  is the same load on two engines with cores of their own (no shared feed), on the
  same emulated cores. ``alone_p50_ms``: a detector request on idle cores, measured
  after the load: its own task and the host's round trip, which the bound's 1 ms is
  for.
- ``batching``: a batch-8 classifier (8 x 0.5 ms = 4 ms a task: the emulator spends
  the loadable's stated time per task, whatever the batch) fed by 64 single-item
  callers with ``Batching(max_delay=0.002)``: items/s against the ideal
  2 cores x 8 / 4 ms = 4000; ``lone caller``: one caller's latency against
  ``max_delay`` + one task, where one task is ``task_p50_ms``: a whole batch from a
  lone caller on the same engine (no delay: the task as a caller sees it, its 4 ms on
  the core and the host's round trip), measured alternately with the lone items
  (``lone_bound_ms``); ``lone_device_bound_ms`` counts the task's 4 ms on the core
  alone (6 ms). ``lone_over_task_ms`` is the difference of the medians, the batcher's
  own part (``max_delay`` less its timer's lead, and the assembly), which
  ``max_delay`` bounds.

``--slow K`` makes every task (and the detector's arrival interval, the batching delay
and each window) K times longer and reports times divided by K again: the device's
time against the host's cost is then K times what it is at 1 ms tasks, which shows the
policy on a machine whose host is too loaded to keep up with 1 ms tasks.

``--gpu`` runs the same cases on the CUDA runtime over the GPU stand-in (its cores
serialise every engine's tasks on the GPU, as the emulated cores do on the host), built
with nvcc or taken from ``--standin`` / ``AIODLA_STANDIN_LIB``; one runtime serves every
case. The figures then include the real CUDA path's host cost (copies, events, the
poller's queries), which the emulated runtime does not have.

Usage::

    python benchmarks/bench_shared_cores.py [--repeats 5] [--seconds 1.0] [--slow 1]
                                            [--only "priority shared,..."] [--json PATH]
                                            [--gpu [--standin LIB]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from _reports import report_path

import aiodla
from aiodla import Batching, Cores, EmulatedRuntime, Engine, TensorSpec
from aiodla.emulator import make_loadable
from aiodla.runtime import Runtime

X = TensorSpec("x", (1, 3, 16, 16), "float16", "chw16")
Y = TensorSpec("y", (1, 3, 16, 16), "float32", "nchw")
XB = TensorSpec("x", (8, 3, 16, 16), "float16", "chw16")
YB = TensorSpec("y", (8, 3, 1, 1), "float32", "nchw")
ITEM = np.ones((1, 3, 16, 16), np.float32)
SLOW = 1.0  # --slow: every device time and interval is this many times longer
# The utilisation and weights cases' rings: 4 slots a core, as every engine on a Cores
# had until its streams_per_core was no longer rewritten (the default is 2), so their
# figures stay comparable with earlier ones.
RING = 4


def model(service: float) -> bytes:
    return make_loadable([X], [Y], "affine", SLOW * service, scale=2.0, bias=0.5)


def batch_model(per_item: float) -> bytes:
    return make_loadable([XB], [YB], "mean_hw", SLOW * 8 * per_item, scale=1.0, bias=0.0)


def busy(engine: Engine) -> float:
    return sum(core.busy_time for core in engine.statistics().cores)


async def callers(engine: Engine, count: int, stop: asyncio.Event) -> None:
    async def loop() -> None:
        while not stop.is_set():
            await engine.infer(ITEM)

    await asyncio.gather(*(loop() for _ in range(count)))


async def window(
    engines: list[Engine], load: list[Callable[[asyncio.Event], Awaitable[None]]], seconds: float
) -> tuple[list[float], float]:
    """Run ``load`` for a warm-up and ``seconds``; each engine's core time in the
    window, and the window's length."""
    stop = asyncio.Event()
    tasks = [asyncio.ensure_future(run(stop)) for run in load]
    await asyncio.sleep(0.2 * SLOW)  # warm-up: estimates learned, graphs captured
    first, start = [busy(e) for e in engines], time.perf_counter()
    await asyncio.sleep(seconds * SLOW)
    last, end = [busy(e) for e in engines], time.perf_counter()
    stop.set()
    await asyncio.gather(*tasks)
    return [b - a for a, b in zip(first, last, strict=True)], end - start


async def utilisation(runtime: Runtime, seconds: float) -> dict[str, float]:
    async with (
        Cores([0, 1], runtime=runtime) as dla,
        Engine(model(0.001), cores=dla, streams_per_core=RING) as short,
        Engine(model(0.003), cores=dla, streams_per_core=RING) as long,
    ):
        times, elapsed = await window(
            [short, long],
            [lambda s: callers(short, 16, s), lambda s: callers(long, 16, s)],
            seconds,
        )
    return {"utilisation": sum(times) / (2 * elapsed)}


async def weights(runtime: Runtime, seconds: float, ratio: float) -> dict[str, float]:
    async with (
        Cores([0, 1], runtime=runtime) as dla,
        Engine(model(0.001), cores=dla, weight=ratio, streams_per_core=RING) as heavy,
        Engine(model(0.001), cores=dla, weight=1, streams_per_core=RING) as light,
    ):
        times, _ = await window(
            [heavy, light],
            [lambda s: callers(heavy, 16, s), lambda s: callers(light, 16, s)],
            seconds,
        )
    share = times[0] / sum(times)
    target = ratio / (ratio + 1)
    return {"share": share, "target": target, "error": abs(share - target) / target}


async def detector_load(engine: Engine, rate: float, stop: asyncio.Event) -> list[float]:
    """Poisson arrivals at ``rate`` per second; each request's latency."""
    rng = random.Random(7)
    latencies: list[float] = []
    pending: set[asyncio.Task[None]] = set()

    async def one() -> None:
        start = time.perf_counter()
        await engine.infer(ITEM)
        latencies.append(time.perf_counter() - start)

    while not stop.is_set():
        task = asyncio.ensure_future(one())
        pending.add(task)
        task.add_done_callback(pending.discard)
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*pending)
    return latencies


async def priority(runtime: Runtime, seconds: float, shared: bool) -> dict[str, float]:
    async with Cores([0, 1], runtime=runtime) as dla:
        where: dict[str, Any] = {"cores": dla} if shared else {"runtime": runtime}
        async with (
            Engine(model(0.003), priority=1, **where) as detector,
            Engine(model(0.001), priority=0, streams_per_core=4, **where) as classifier,
        ):
            stop = asyncio.Event()
            flood = asyncio.ensure_future(callers(classifier, 16, stop))
            await asyncio.sleep(0.2 * SLOW)
            arrivals = asyncio.ensure_future(detector_load(detector, 60.0 / SLOW, stop))
            await asyncio.sleep(seconds * SLOW)
            stop.set()
            latencies = sorted(await arrivals)
            await flood
            alone = []
            for _ in range(30):
                begin = time.perf_counter()
                await detector.infer(ITEM)
                alone.append((time.perf_counter() - begin) / SLOW)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return {
        "p50_ms": 1e3 * statistics.median(latencies) / SLOW,
        "p99_ms": 1e3 * p99 / SLOW,
        "bound_ms": 3 + 2 * 1 + 1,
        "requests": len(latencies),
        "alone_p50_ms": 1e3 * statistics.median(alone),
    }


async def batching(runtime: Runtime, seconds: float) -> dict[str, float]:
    async with Engine(
        batch_model(0.0005), runtime=runtime, batch=Batching(max_delay=0.002 * SLOW)
    ) as engine:
        stop = asyncio.Event()
        load = asyncio.ensure_future(callers(engine, 64, stop))
        await asyncio.sleep(0.2 * SLOW)
        first, start = engine.statistics().batching, time.perf_counter()
        await asyncio.sleep(seconds * SLOW)
        last, end = engine.statistics().batching, time.perf_counter()
        stop.set()
        await load
        assert first is not None
        assert last is not None
        items_per_s = (last.completed - first.completed) / (end - start) * SLOW
        lone: list[float] = []
        whole: list[float] = []
        batch = np.ones(XB.shape, np.float32)
        for _ in range(50):
            for inputs, into in ((ITEM, lone), (batch, whole)):
                begin = time.perf_counter()
                await engine.infer(inputs)
                into.append((time.perf_counter() - begin) / SLOW)
    ideal = 2 * 8 / 0.004
    lone.sort()
    return {
        "items_per_s": items_per_s,
        "x_ideal": items_per_s / ideal,
        "lone_p50_ms": 1e3 * statistics.median(lone),
        "lone_max_ms": 1e3 * lone[-1],
        "lone_bound_ms": 1e3 * (0.002 + statistics.median(whole)),
        "lone_device_bound_ms": 1e3 * (0.002 + 0.004),
        "task_p50_ms": 1e3 * statistics.median(whole),
        "lone_over_task_ms": 1e3 * (statistics.median(lone) - statistics.median(whole)),
    }


CASES: dict[str, Callable[[Runtime, float], Awaitable[dict[str, float]]]] = {
    "utilisation": utilisation,
    "weights 1:1": lambda r, s: weights(r, s, 1.0),
    "weights 2:1": lambda r, s: weights(r, s, 2.0),
    "priority shared": lambda r, s: priority(r, s, True),
    "priority independent": lambda r, s: priority(r, s, False),
    "batching": batching,
}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def measure(
    repeats: int, seconds: float, only: list[str], gpu: Runtime | None = None
) -> dict[str, dict[str, dict[str, float]]]:
    """Each case on a fresh emulated runtime, or on ``gpu`` (one CUDA runtime for all)."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in only}
    for repeat in range(repeats):
        for name in only:
            case = CASES[name]
            runtime = gpu or EmulatedRuntime(cores=2)
            try:
                runs[name].append(await case(runtime, seconds))
            finally:
                if gpu is None:
                    runtime.close()
        print(f"repeat {repeat + 1}/{repeats} done", file=sys.stderr)
    return {
        name: {key: summary([run[key] for run in found]) for key in found[0]}
        for name, found in runs.items()
    }


def cuda_runtime(standin: str | None) -> Runtime:
    """The CUDA runtime over the GPU stand-in: ``standin``, else one built here."""
    from _standin_lib import load_standin

    from aiodla.runtime._cuda import CudaRuntime

    load_standin(standin)
    return CudaRuntime(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--slow", type=float, default=1.0)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--only", default=",".join(CASES), help=f"cases, comma-separated: {', '.join(CASES)}"
    )
    parser.add_argument("--gpu", action="store_true", help="the CUDA runtime and the stand-in")
    parser.add_argument("--standin", default=os.environ.get("AIODLA_STANDIN_LIB"))
    args = parser.parse_args(argv)
    only = [name.strip() for name in args.only.split(",")]
    unknown = [name for name in only if name not in CASES]
    if unknown:
        parser.error(f"no such case: {', '.join(unknown)} (cases: {', '.join(CASES)})")
    global SLOW
    SLOW = args.slow
    load_before = os.getloadavg()
    gpu = cuda_runtime(args.standin) if args.gpu else None
    try:
        results = asyncio.run(measure(args.repeats, args.seconds, only, gpu))
    finally:
        if gpu is not None:
            gpu.close()
    for name, figures in results.items():
        shown = ", ".join(
            f"{key} {value['median']:.3f} ({value['min']:.3f}..{value['max']:.3f})"
            for key, value in figures.items()
        )
        print(f"{name:22s} {shown}")
    report = {
        "benchmark": "bench_shared_cores",
        "aiodla": aiodla.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        # Other work on the machine: the host's share of the CPUs bounds 1 ms tasks.
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "repeats": args.repeats,
        "seconds": args.seconds,
        "slow": args.slow,
        "runtime": "cuda (GPU stand-in)" if args.gpu else "emulated",
        "results": results,
    }
    path = report_path(args.json, "shared-cores.json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
