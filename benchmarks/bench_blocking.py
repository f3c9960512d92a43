"""Host CPU per request: BlockingEngine from threads against Engine from coroutines.

Both run the same emulator loadable (1 ms per task by default) on two emulated cores,
with the same number of callers (``--callers`` threads calling ``infer``, or as many
coroutines awaiting it), each sending its share of ``--requests`` one after another.
A round measures the process's CPU time (every thread: the callers, the loop, the
poller, the emulator's workers) over the requests only (open and close excluded) and
divides by the requests. Rounds are interleaved, the order alternating; the table
gives medians and min..max per mode, the ratio of the medians, and the median and
spread of the per-round ratios. The target is a ratio within 1.5.

Usage::

    python benchmarks/bench_blocking.py [--requests 4000] [--callers 8] [--rounds 5]
        [--service 1e-3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _thread_cpu import Snapshot, per_request, snapshot

from aiodla import BlockingEngine, Engine, TensorSpec
from aiodla.emulator import make_loadable


def model(service: float) -> bytes:
    x = TensorSpec("image", (1, 3, 32, 32), "float16", "chw16")
    y = TensorSpec("scores", (1, 3, 32, 32), "float16", "nchw")
    return make_loadable([x], [y], "affine", latency=service, scale=2.0, bias=1.0)


def shares(requests: int, callers: int) -> list[int]:
    return [requests // callers + (i < requests % callers) for i in range(callers)]


Measured = tuple[Snapshot, Snapshot, float, int]  # CPU before, after, wall s, loop's id


def run_async(data: bytes, requests: int, callers: int) -> Measured:
    """CPU and wall time of ``requests`` awaited by ``callers`` coroutines."""

    async def main() -> Measured:
        async with Engine(data, cores=[0, 1]) as engine:
            x = np.ones(engine.inputs[0].shape, np.float32)

            async def caller(count: int) -> None:
                for _ in range(count):
                    await engine.infer(x)

            await engine.infer(x)  # warm: the first request's one-off work
            before, wall = snapshot(), time.perf_counter()
            await asyncio.gather(*(caller(n) for n in shares(requests, callers)))
            wall = time.perf_counter() - wall
            return before, snapshot(), wall, threading.get_native_id()

    return asyncio.run(main())


def run_blocking(data: bytes, requests: int, callers: int) -> Measured:
    """CPU and wall time of ``requests`` sent by ``callers`` threads."""
    with BlockingEngine(data, cores=[0, 1]) as engine:
        x = np.ones(engine.inputs[0].shape, np.float32)
        engine.infer(x)
        # The callers' CPU clocks are read while they live: they wait for ``measured``.
        start, done = threading.Barrier(callers + 1), threading.Barrier(callers + 1)
        measured = threading.Event()

        def caller(count: int) -> None:
            start.wait()
            for _ in range(count):
                engine.infer(x)
            done.wait()
            measured.wait()

        threads = [
            threading.Thread(target=caller, args=(n,), name=f"caller-{i}")
            for i, n in enumerate(shares(requests, callers))
        ]
        # anyio's portal names its loop's thread after the backend.
        (loop_id,) = [t.native_id for t in threading.enumerate() if "portal" in t.name]
        for thread in threads:
            thread.start()
        before, wall = snapshot(), time.perf_counter()
        start.wait()
        done.wait()
        wall, after = time.perf_counter() - wall, snapshot()
        measured.set()
        for thread in threads:
            thread.join()
        return before, after, wall, loop_id or 0


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.0f}..{max(values):.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--service", type=float, default=1e-3)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    data = model(args.service)
    modes: dict[str, Callable[[bytes, int, int], Measured]] = {
        "async": run_async,
        "blocking": run_blocking,
    }
    groups = ("process", "loop", "callers", "poller", "other")
    cpu: dict[str, dict[str, list[float]]] = {n: {g: [] for g in groups} for n in modes}
    rate: dict[str, list[float]] = {name: [] for name in modes}
    for round_ in range(args.rounds):
        order = list(modes) if round_ % 2 == 0 else list(reversed(modes))
        for name in order:
            before, after, wall, loop_id = modes[name](data, args.requests, args.callers)
            split, by_name = per_request(before, after, args.requests, loop_id)
            # The async callers are coroutines: their cost is the loop's.
            callers = sum(v for k, v in by_name.items() if k.startswith("caller-"))
            split["callers"], split["other"] = callers, split["other"] - callers
            for group in groups:
                cpu[name][group].append(split[group])
            rate[name].append(args.requests / wall)
    process = {name: cpu[name]["process"] for name in modes}
    ratios = [b / a for a, b in zip(process["async"], process["blocking"], strict=True)]
    ideal = 2 / args.service if args.service > 0 else float("inf")
    print(
        f"{args.requests} requests, {args.callers} callers, {args.service * 1e3:g} ms service, "
        f"2 emulated cores (ideal {ideal:.0f} req/s), {args.rounds} interleaved rounds"
    )
    print("CPU us/request by thread, median (min..max); other: every other thread")
    print(f"{'':<9} " + "".join(f"{g:>26}" for g in groups) + f"{'req/s':>26}")
    for name in modes:
        cells = [*(spread(cpu[name][g]) for g in groups), spread(rate[name])]
        print(f"{name:<9} " + "".join(f"{c:>26}" for c in cells))
    ratio = statistics.median(process["blocking"]) / statistics.median(process["async"])
    print(
        f"blocking / async CPU per request: {ratio:.2f} x (ratio of medians); per round "
        f"{statistics.median(ratios):.2f} x ({min(ratios):.2f}..{max(ratios):.2f}); "
        "target <= 1.5 x"
    )
    if args.json:
        result: dict[str, Any] = {
            "settings": vars(args),
            "cpu_us_per_request": cpu,
            "requests_per_second": rate,
            "ratio_of_medians": ratio,
            "per_round_ratios": ratios,
        }
        with open(args.json, "w") as file:
            json.dump(result, file, indent=2)


if __name__ == "__main__":
    main()
