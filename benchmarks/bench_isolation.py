"""Engine(isolation="process") against the in-process engine, in one run.

Measures, on the same model and machine:

- throughput at a closed-loop concurrency against the physical ideal
  ``cores / service time``, for ``isolation="thread"`` and ``"process"`` (ratio);
- added latency at light load (one request at a time): p50 of request latency less
  the stated service time, both modes, and the difference in microseconds;
- recovery time with ``isolation="process"``: from each fault to the first request
  completed on the new worker, median and max over ``--faults`` faults, under a light
  load of ``--clients`` concurrent callers. The fault is a DLA fault surfacing on the
  stream as a sticky CUDA error (``--fault sticky``, the emulated runtime's
  ``fail_next_task(on_stream=True)``, on the GPU stand-in its trap), or a SIGKILL of
  the worker (``--fault sigkill``).

Throughput and latency are measured ``--repeats`` times, the two modes interleaved in
alternating order; the table gives medians with their spread.

``--runtime emulated`` (default) needs nothing; ``--runtime cuda`` runs the CUDA runtime
with aiodla's GPU stand-in (``--standin PATH`` or ``AIODLA_STANDIN_LIB``, else built
with nvcc), loaded here and, by the engine, in its worker process.

Usage::

    python benchmarks/bench_isolation.py [--runtime emulated|cuda] [--service 0.001]
        [--seconds 2] [--repeats 5] [--clients 4] [--faults 20] [--fault sticky|sigkill]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from aiodla import AiodlaError, Engine, ProcessIsolation, TensorSpec
from aiodla._isolation import inject_fault
from aiodla.emulator import make_loadable

INPUT = TensorSpec("x", (1, 8, 16, 16), "float16", "chw16")
OUTPUT = TensorSpec("y", (1, 8, 16, 16), "float16", "nchw")
CORES = (0, 1)
ENGINE_TIMEOUT = 0x40000006


def model(service: float) -> bytes:
    return make_loadable([INPUT], [OUTPUT], "affine", service, scale=0.5, bias=0.25)


def sample() -> np.ndarray[Any, Any]:
    return np.random.default_rng(0).standard_normal(INPUT.shape).astype(INPUT.numpy_dtype)


async def throughput(engine: Engine, seconds: float, concurrency: int) -> float:
    """Completed requests per second with ``concurrency`` callers in a closed loop."""
    x = sample()
    done = 0
    stop = time.monotonic() + seconds

    async def caller() -> None:
        nonlocal done
        while time.monotonic() < stop:
            await engine.infer(x)
            done += 1

    started = time.monotonic()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return done / (time.monotonic() - started)


async def light_latency(engine: Engine, requests: int) -> list[float]:
    """Latency of ``requests`` requests made one at a time."""
    x = sample()
    latencies = []
    for _ in range(requests):
        started = time.perf_counter()
        await engine.infer(x)
        latencies.append(time.perf_counter() - started)
    return latencies


async def recovery(engine: Engine, faults: int, clients: int, fault: str) -> list[float]:
    """Seconds from each fault to the first request completed on the new worker."""
    return [await one_recovery(engine, clients, fault) for _ in range(faults)]


async def one_recovery(engine: Engine, clients: int, fault: str) -> float:
    x = sample()
    stats = engine.statistics().worker
    assert stats is not None
    before, old_pid = stats.restarts, stats.pid
    faulted_at = 0.0
    recovered: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    async def caller() -> None:
        while not recovered.done():
            try:
                await engine.infer(x)
            except AiodlaError:  # what the fault cost: requests in flight on the worker
                continue
            worker = engine.statistics().worker
            restarted = worker is not None and worker.restarts > before
            if faulted_at and restarted and not recovered.done():
                recovered.set_result(time.perf_counter() - faulted_at)

    callers = [asyncio.ensure_future(caller()) for _ in range(clients)]
    await asyncio.sleep(0.05)  # under load
    if fault == "sigkill":
        assert old_pid is not None
        faulted_at = time.perf_counter()
        os.kill(old_pid, signal.SIGKILL)
    else:
        await inject_fault(engine, "fail_next_task", 0, ENGINE_TIMEOUT, on_stream=True)
        faulted_at = time.perf_counter()  # armed: the next task on core 0 faults
    took = await asyncio.wait_for(recovered, 60)
    await asyncio.gather(*callers)
    return took


async def measure(args: argparse.Namespace, isolation: str) -> dict[str, float]:
    """One engine of ``isolation``: throughput against the ideal, light-load latency."""
    options: dict[str, Any] = {"cores": CORES, "streams_per_core": args.streams}
    if isolation == "process":
        options["isolation"] = isolation
    async with Engine(model(args.service), runtime=args.runtime, **options) as engine:
        await light_latency(engine, 20)  # warm up
        rate = await throughput(engine, args.seconds, args.concurrency)
        latencies = await light_latency(engine, args.requests)
    return {
        "throughput": rate,
        "of_ideal": rate * args.service / len(CORES),
        "p50_latency_us": 1e6 * statistics.median(latencies),
        "p50_added_us": 1e6 * (statistics.median(latencies) - args.service),
    }


def summary(samples: list[dict[str, float]]) -> dict[str, Any]:
    """Median of each figure over the repeats, with its spread (min, max)."""
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]} | {
        "spread": {
            key: [min(s[key] for s in samples), max(s[key] for s in samples)] for key in samples[0]
        },
        "repeats": samples,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "runtime": args.runtime,
        "service_s": args.service,
        "repeats": args.repeats,
        "modes": {},
    }
    samples: dict[str, list[dict[str, float]]] = {"thread": [], "process": []}
    differences = []
    for repeat in range(args.repeats):  # interleaved, the order alternating
        order = ("thread", "process") if repeat % 2 == 0 else ("process", "thread")
        for isolation in order:
            samples[isolation].append(await measure(args, isolation))
        differences.append(
            samples["process"][-1]["p50_added_us"] - samples["thread"][-1]["p50_added_us"]
        )
    for isolation, taken in samples.items():
        report["modes"][isolation] = summary(taken)
    report["added_latency_difference_us"] = {
        "median": statistics.median(differences),
        "min": min(differences),
        "max": max(differences),
    }
    if args.faults:  # every fault is a restart: allow them all
        async with Engine(
            model(args.service),
            runtime=args.runtime,
            cores=CORES,
            streams_per_core=args.streams,
            isolation=ProcessIsolation(max_restarts=args.faults + 1),
        ) as engine:
            times = await recovery(engine, args.faults, args.clients, args.fault)
        report["recovery_ms"] = {
            "fault": args.fault,
            "median": 1e3 * statistics.median(times),
            "max": 1e3 * max(times),
            "all": [1e3 * t for t in times],
        }
    return report


def table(report: dict[str, Any]) -> str:
    thread, process = report["modes"]["thread"], report["modes"]["process"]
    lines = [
        f"runtime {report['runtime']}, {1e3 * report['service_s']:.2f} ms service, "
        f"{len(CORES)} cores, medians of {report['repeats']} interleaved repeats "
        "[min-max]",
        f"{'':>10}{'req/s':>10}{'x ideal':>22}{'p50 us':>9}{'added us':>20}",
    ]
    for name, entry in (("thread", thread), ("process", process)):
        low, high = entry["spread"]["of_ideal"]
        added_low, added_high = entry["spread"]["p50_added_us"]
        lines.append(
            f"{name:>10}{entry['throughput']:>10.0f}"
            f"{entry['of_ideal']:>9.3f} [{low:.3f}-{high:.3f}]"
            f"{entry['p50_latency_us']:>9.0f}"
            f"{entry['p50_added_us']:>8.0f} [{added_low:.0f}-{added_high:.0f}]"
        )
    difference = report["added_latency_difference_us"]
    lines += [
        f"process/thread throughput ratio: {process['throughput'] / thread['throughput']:.3f}",
        f"process - thread added p50 latency, per repeat: median "
        f"{difference['median']:+.0f} us [{difference['min']:+.0f} to {difference['max']:+.0f}]",
    ]
    recovery_ms = report.get("recovery_ms")
    if recovery_ms is not None:
        lines.append(
            f"recovery ({recovery_ms['fault']}: fault to first completion on the new "
            f"worker, {len(recovery_ms['all'])} faults): median {recovery_ms['median']:.0f} "
            f"ms, max {recovery_ms['max']:.0f} ms"
        )
    return "\n".join(lines)


def load_standin(path: str | None) -> None:
    from aiodla.emulator._standin import build_standin
    from aiodla.emulator._standin import load_standin as load

    load(Path(path or build_standin(tempfile.mkdtemp(prefix="aiodla-bench-"))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", choices=("emulated", "cuda"), default="emulated")
    parser.add_argument("--standin", default=os.environ.get("AIODLA_STANDIN_LIB"))
    parser.add_argument("--service", type=float, default=0.001, help="seconds per task")
    parser.add_argument("--streams", type=int, default=4, help="streams per core")
    parser.add_argument("--seconds", type=float, default=2.0, help="throughput run")
    parser.add_argument("--concurrency", type=int, default=32, help="throughput callers")
    parser.add_argument("--requests", type=int, default=300, help="light-load requests")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats")
    parser.add_argument("--faults", type=int, default=20, help="0: no recovery run")
    parser.add_argument("--clients", type=int, default=4, help="callers while faulting")
    parser.add_argument("--fault", choices=("sticky", "sigkill"), default="sticky")
    parser.add_argument("--json", help="write the report here too")
    args = parser.parse_args()
    if args.runtime == "cuda":
        load_standin(args.standin)
    report = asyncio.run(run(args))
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
