"""CPU per request by thread, at several service times and loads, emulated or on a GPU.

For each service time (0, 100 us, 1 ms, 3.8 ms by default) and load (saturated: 64
requests kept in flight; half: requests arriving at half the ideal rate
``cores / service_time``, evenly spaced), on two cores, it reports CPU microseconds per
request of

- the event loop's thread,
- the poller's thread,
- every other thread together (the process less those two: the emulator's stream
  workers, anyio's workers, the CUDA driver's own threads), split by thread name in
  the JSON,
- the whole process, and the host's share: the process less the emulated device's own
  work (the copies and the op, which on a Jetson the copy engines and the DLA do: the
  emulator counts it; the GPU stand-in does it on the GPU, so nothing is subtracted),

plus the achieved rate against the ideal; and the light-load latency: p50 added latency
(wall time of one request at a time less the 1 ms service time) of aiodla against the
busy-poll floor of ``bench_gpu.py`` (a thread spinning on the event query that wakes the
loop), measured in the same run. Repeats are interleaved (every setting once per
round); medians and min..max.

``--runtime emulated`` (default) runs on the emulated runtime, ``--runtime cuda`` on the
CUDA runtime over the GPU stand-in (``bench_gpu.py``'s set-up: a prebuilt stand-in from
``--standin`` / ``AIODLA_STANDIN_LIB``, else one built here; ``--host-fake`` dry-runs it
without a GPU, numbers meaning nothing).

``--profile`` instead runs one measurement (``--profile-service``, saturated unless
``--profile-load half``) with the loop's and the poller's threads profiled
(``benchmarks/profile_threads.py``), prints the top functions of each by own time and
saves a pstats file per thread (``--profile-out PREFIX``: PREFIX-loop.pstats,
PREFIX-poller.pstats).

Usage::

    python benchmarks/bench_threads.py [--runtime emulated|cuda] [--seconds 1.0] [--repeats 5]
        [--service 0,1e-4,1e-3,3.8e-3] [--json PATH] [--profile [--profile-service 1e-3]]

On the GPU machine (an H200 with 16 cores): the stand-in's build (skipped when built
already) takes under a minute, the table about 60 s (5 rounds of 7 settings, 1 s
each, and the light load), the profile about 10 s. One command, files under $OUT::

    export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; OUT=${OUT:-$PWD/device-out}; mkdir -p $OUT
    [ -f /tmp/aiodla-standin/libcudla.so.1 ] || python3 -m aiodla.emulator.standin_build \
        /tmp/aiodla-standin > $OUT/standin-build.log 2>&1
    export AIODLA_STANDIN_LIB=/tmp/aiodla-standin/libcudla.so.1
    timeout 150 python3 benchmarks/bench_threads.py --runtime cuda --repeats 5 \
        --seconds 1 --json $OUT/threads-cuda.json 2>&1 | tee $OUT/threads-cuda.log
    timeout 40 python3 benchmarks/bench_threads.py --runtime cuda --profile \
        --profile-service 1e-3 --profile-out $OUT/profile-cuda-1000us 2>&1 \
        | tee $OUT/profile-cuda.log

The JSON goes to ``--json PATH``, by default to a temporary file (the path is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _thread_cpu
import bench_engine
import bench_gpu
import numpy as np
from _reports import report_path
from _thread_cpu import summarize

import aiodla
from aiodla import EmulatedRuntime, Engine

CORES = 2
LIGHT_SERVICE = 1e-3
LOADS = ("saturated", "half")


@dataclass
class Setup:
    """What differs between the runtimes: the model, the engine's runtime and options."""

    name: str
    model: Callable[[float], bytes]
    sample: Callable[[], np.ndarray[Any, Any]]
    runtime: Callable[[], Any]  # for each engine: a runtime instance, or "emulated"
    engine_options: dict[str, Any] = field(default_factory=dict)
    light_runtime: Any = None  # for the light-load engine and the floor's slot
    controls: Any = None  # the stand-in's controls (cuda)
    details: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        if self.name == "emulated" and self.light_runtime is not None:
            self.light_runtime.close()
        if self.controls is not None:
            leftover = self.controls.live_handles()
            if any(leftover.values()):
                raise RuntimeError(f"the benchmark leaked cuDLA handles: {leftover}")


def setup(args: argparse.Namespace) -> Setup:
    if args.runtime == "emulated":
        # The 8x16x16 model of bench_engine.py, as the emulated figures always used;
        # each engine gets its own emulated runtime (its device time is counted).
        return Setup(
            "emulated",
            bench_engine.model_bytes,
            bench_engine.sample,
            lambda: "emulated",
            {"streams_per_core": args.streams_per_core or 2},
            light_runtime=EmulatedRuntime(),
            details={"model": bench_engine.INPUT.describe()},
        )
    controls, path = bench_gpu.setup_standin(args)
    runtime = bench_gpu.CudaRuntime(0)
    runtime.make_current()
    slug, gpu = bench_gpu.machine_name()
    # bench_gpu.py's model and ring (8 slots a core), as the GPU figures always used.
    return Setup(
        "cuda",
        bench_gpu.model_bytes,
        bench_gpu.sample,
        lambda: runtime,
        {"streams_per_core": args.streams_per_core or 8},
        light_runtime=runtime,
        controls=controls,
        details={
            "model": bench_gpu.INPUT.describe(),
            "gpu": gpu,
            "machine": slug,
            "standin": str(path),
            "host_fake": controls.host_fake,
        },
    )


def revision() -> str:
    """The commit of the aiodla measured, and whether its aiodla/ had changes on top."""
    root = Path(aiodla.__file__).resolve().parents[1]
    try:
        git = ["git", "-C", str(root)]
        top = subprocess.run([*git, "rev-parse", "--show-toplevel"], capture_output=True, text=True)
        if top.returncode or Path(top.stdout.strip()).resolve() != root:
            # A tree unpacked from `git archive` (inside another checkout, say) has none.
            return "unknown: not a git checkout"
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "aiodla"], capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + (
        " with uncommitted changes in aiodla/" if dirty.stdout.strip() else ""
    )


def device_time(engine: Engine) -> float:
    """CPU seconds of emulated device work so far (none on the GPU stand-in)."""
    runtime = engine.runtime
    return runtime.device_time if isinstance(runtime, EmulatedRuntime) else 0.0


async def measure(
    s: Setup, service: float, load: str, seconds: float, profiler: Any = None
) -> dict[str, Any]:
    """One measurement: CPU per request by thread group, and the rate against ideal."""
    x = s.sample()
    async with Engine(
        s.model(service), cores=range(CORES), runtime=s.runtime(), **s.engine_options
    ) as engine:
        for _ in range(100):
            await engine.infer(x)
        await asyncio.gather(*(engine.infer(x) for _ in range(128)))
        loop_id = threading.get_native_id()
        if profiler is not None:
            profiler.start()
        before = _thread_cpu.snapshot()
        device_before = device_time(engine)
        poller = engine._flow.poller
        posts, sweeps = getattr(poller, "wakeups", 0), getattr(poller, "sweeps", 0)
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
        after = _thread_cpu.snapshot()
        if profiler is not None:
            profiler.stop()
        device = 1e6 * (device_time(engine) - device_before) / done
        # The poller's hand-offs to the loop (a wake-up each) and its own sweeps.
        posts = (getattr(poller, "wakeups", 0) - posts) / done
        sweeps = (getattr(poller, "sweeps", 0) - sweeps) / done
    per, by_name = _thread_cpu.per_request(before, after, done, loop_id)
    ideal = CORES / service if service else float("inf")
    return {
        "loop_us": per["loop"],
        "poller_us": per["poller"],
        "other_us": per["other"],
        "process_us": per["process"],
        "device_us": device,
        "host_us": per["process"] - device,
        "rate": done / elapsed,
        "x_ideal": (done / elapsed) / ideal if service else float("nan"),
        "requests": done,
        "loop_wakeups": posts,
        "poller_sweeps": sweeps,
        "other_by_thread": by_name,
    }


async def light(s: Setup, requests: int) -> dict[str, float]:
    """p50 and p99 added latency, one request at a time: aiodla, then the busy-poll floor."""
    data = bench_gpu.model_bytes(LIGHT_SERVICE)
    aiodla = await bench_gpu.aiodla_light(data, s.light_runtime, requests, LIGHT_SERVICE)
    slot = bench_gpu.Slot(s.light_runtime, data, 0)
    try:
        floor = await bench_gpu.floor_light(slot, requests, LIGHT_SERVICE, blocking=False)
    finally:
        slot.close()
    a50, a99 = np.percentile(aiodla, (50, 99))
    f50, f99 = np.percentile(floor, (50, 99))
    return {
        "aiodla_p50_us": 1e6 * a50,
        "aiodla_p99_us": 1e6 * a99,
        "floor_p50_us": 1e6 * f50,
        "floor_p99_us": 1e6 * f99,
        "p50_over_floor": a50 / f50,
    }


def cases(services: list[float]) -> list[tuple[float, str]]:
    return [(s, load) for s in services for load in LOADS if s or load == "saturated"]


async def table_async(s: Setup, args: argparse.Namespace) -> dict[str, Any]:
    rows: dict[str, list[dict[str, Any]]] = {}
    lights: list[dict[str, float]] = []
    for round_ in range(args.repeats):  # interleaved: every setting once per round
        began = time.perf_counter()
        for service, load in cases(args.service):
            rows.setdefault(f"{service * 1e6:g} us {load}", []).append(
                await measure(s, service, load, args.seconds)
            )
        if args.requests:
            lights.append(await light(s, args.requests))
        print(f"  round {round_ + 1}/{args.repeats}: {time.perf_counter() - began:.1f} s")
    results = {}
    for name, runs in rows.items():
        summary = {
            key: summarize([r[key] for r in runs]) for key in runs[0] if key != "other_by_thread"
        }
        names = sorted({n for r in runs for n in r["other_by_thread"]})
        summary["other_by_thread"] = {
            n: summarize([r["other_by_thread"].get(n, 0.0) for r in runs]) for n in names
        }
        results[name] = summary
    report: dict[str, Any] = {"results": results}
    if lights:
        report["light"] = {
            "service_time": LIGHT_SERVICE,
            "requests": args.requests,
            **{key: summarize([r[key] for r in lights]) for key in lights[0]},
        }
    return report


def print_table(report: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"CPU per request by thread (us), {args.runtime} runtime, {CORES} cores, 64 in flight "
        f"(saturated) or half the ideal rate; median of {args.repeats} (min..max); "
        "host = process less emulated device work; posts: the poller's hand-offs to the "
        "loop, sweeps: its own, per request"
    )
    header = (
        "case",
        "loop",
        "poller",
        "other",
        "process",
        "device",
        "host",
        "rate/s",
        "x ideal",
        "posts",
        "sweeps",
    )
    columns = "{:<20} {:>7} {:>7} {:>7} {:>8} {:>7} {:>16} {:>8} {:>18} {:>6} {:>6}"
    print(columns.format(*header))
    for name, row in report["results"].items():
        host, ideal = row["host_us"], row["x_ideal"]
        spread = f"({host['min']:.0f}..{host['max']:.0f})"
        ratio = (
            f"{ideal['median']:.3f} ({ideal['min']:.2f}..{ideal['max']:.2f})"
            if ideal["median"] == ideal["median"]
            else "-"
        )
        print(
            f"{name:<20} {row['loop_us']['median']:7.1f} {row['poller_us']['median']:7.1f} "
            f"{row['other_us']['median']:7.1f} {row['process_us']['median']:8.1f} "
            f"{row['device_us']['median']:7.1f} {host['median']:6.1f} {spread:>9} "
            f"{row['rate']['median']:8.0f} {ratio:>18} "
            f"{row['loop_wakeups']['median']:6.2f} {row['poller_sweeps']['median']:6.2f}"
        )
    if "light" in report:
        lt = report["light"]
        ratio = lt["p50_over_floor"]
        print(
            f"light load, {LIGHT_SERVICE * 1e3:g} ms service, one request at a time: "
            f"aiodla p50 {lt['aiodla_p50_us']['median']:.1f} us "
            f"(p99 {lt['aiodla_p99_us']['median']:.1f}), busy-poll floor p50 "
            f"{lt['floor_p50_us']['median']:.1f} us (p99 {lt['floor_p99_us']['median']:.1f})"
        )
        print(
            f"  aiodla p50 / floor = {ratio['median']:.2f} "
            f"({ratio['min']:.2f}..{ratio['max']:.2f}, per round)"
        )


def run_profile(s: Setup, args: argparse.Namespace) -> None:
    from profile_threads import ThreadProfiler

    service, load = args.profile_service, args.profile_load
    # Unprofiled first: warms every cache (kernels, imports) and gives the figures the
    # profiled run is to be held against (a profiler slows what it watches).
    plain = asyncio.run(measure(s, service, load, args.seconds))
    profiler = ThreadProfiler(args.profiler, args.profile_clock)
    profiler.install()
    try:
        row = profiler.run(lambda: asyncio.run(measure(s, service, load, args.seconds, profiler)))
    finally:
        profiler.uninstall()
    profiler.collect()
    prefix = args.profile_out or f"/tmp/aiodla-profile-{args.runtime}-{service * 1e6:g}us-{load}"
    print(
        f"profile: {args.runtime} runtime, {service * 1e6:g} us service, {load}, "
        f"{args.seconds:g} s; CPU per request (us) and x ideal"
    )
    for label, r in (("unprofiled", plain), (f"under {args.profiler}", row)):
        print(
            f"  {label:<18} loop {r['loop_us']:7.1f}  poller {r['poller_us']:7.1f}  "
            f"process {r['process_us']:7.1f}  {r['requests']} requests  "
            f"{r['x_ideal']:.3f} x ideal"
        )
    profiler.report(prefix, row["requests"], args.top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", choices=("emulated", "cuda"), default="emulated")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--service",
        type=lambda text: [float(v) for v in text.split(",")],
        default=[0.0, 100e-6, 1e-3, 3.8e-3],
    )
    parser.add_argument(
        "--requests", type=int, default=200, help="requests per light-load run (0: none)"
    )
    parser.add_argument(
        "--streams-per-core",
        type=int,
        default=None,
        help="slots per core (default: 2 emulated, the engine's; 8 cuda, bench_gpu.py's)",
    )
    parser.add_argument("--json", help="report path (default: a temporary file)")
    # The stand-in (cuda), as bench_gpu.py takes it.
    parser.add_argument("--standin", default=os.environ.get("AIODLA_STANDIN_LIB"))
    parser.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"))
    parser.add_argument("--host-fake", action="store_true", help="dry run without a GPU")
    # The profile.
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-service", type=float, default=1e-3)
    parser.add_argument("--profile-load", choices=LOADS, default="saturated")
    parser.add_argument("--profile-out", help="pstats path prefix")
    parser.add_argument(
        "--profiler",
        choices=("cprofile", "process", "profile"),
        default=None,
        help="default: cprofile up to Python 3.11, process from 3.12",
    )
    parser.add_argument(
        "--profile-clock", choices=("wall", "cpu"), default="wall", help="the profiler's timer"
    )
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    if args.profiler is None:
        from profile_threads import default_backend

        args.profiler = default_backend()
    s = setup(args)
    try:
        if args.profile:
            run_profile(s, args)
            return 0
        report = asyncio.run(table_async(s, args))
    finally:
        s.close()
    print_table(report, args)
    path = report_path(args.json, f"threads-{args.runtime}.json")
    report.update(
        runtime=args.runtime,
        revision=revision(),
        setup=s.details,
        parameters={k: v for k, v in vars(args).items() if not k.startswith("profile")},
        machine={
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
    )
    with open(path, "w") as file:
        json.dump(report, file, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
