"""Soak: a million requests on the emulated runtime; memory must stay flat.

Runs ``--requests`` requests at ``--concurrency`` with a mix of cancellations and
timeouts, and reports resident memory (RSS) after warm-up and at the end, the slot and
handle accounting, and whether the counts add up. Exits non-zero when RSS grew more
than ``--tolerance`` (default 5 %), a slot is still busy, or a handle leaked.

    python benchmarks/soak.py [--requests 1000000] [--concurrency 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import time
from typing import Any

import numpy as np
from _reports import report_path

from aiodla import EmulatedRuntime, Engine, TensorSpec
from aiodla.emulator import make_loadable

X = TensorSpec("x", (1, 8, 16, 16), "float16", "chw16")
Y = TensorSpec("y", (1, 8, 16, 16), "float16", "nchw")


def rss_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def soak(requests: int, concurrency: int, report_every: int) -> dict[str, Any]:
    runtime = EmulatedRuntime(cores=2)
    model = make_loadable([X], [Y], "affine", 0.0, scale=2.0, bias=1.0)
    x = np.ones(X.shape, np.float16)
    expected = (x.astype(np.float64) * 2 + 1).astype(np.float16)
    rng = random.Random(5)
    outcomes = {"ok": 0, "cancelled": 0, "timed_out": 0, "wrong": 0}
    samples: list[tuple[int, int]] = []
    async with Engine(model, runtime=runtime, max_queue=4 * concurrency) as engine:
        issued = 0

        async def one(timeout: float | None) -> None:
            try:
                y = await engine.infer(x, timeout=timeout)
            except TimeoutError:
                outcomes["timed_out"] += 1
            else:
                outcomes["ok" if np.array_equal(y, expected) else "wrong"] += 1

        async def worker() -> None:
            nonlocal issued
            while issued < requests:
                issued += 1
                mine = issued
                roll = rng.random()
                if roll < 0.01:  # cancel one at a random moment
                    task = asyncio.ensure_future(one(None))
                    await asyncio.sleep(0)
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        outcomes["cancelled"] += 1
                else:
                    await one(1e-4 if roll < 0.02 else None)
                if mine % report_every == 0:
                    gc.collect()
                    samples.append((mine, rss_bytes()))
                    print(f"  {mine:>9} requests  rss {rss_bytes() / 2**20:7.1f} MiB", flush=True)

        warm = min(20_000, requests // 10)
        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - began
        stats = engine.statistics()
    baseline = next((rss for done, rss in samples if done >= warm), samples[0][1] if samples else 0)
    final = rss_bytes()
    growth = (final - baseline) / baseline if baseline else 0.0
    ended = stats.completed + stats.failed + stats.cancelled + stats.timed_out
    return {
        "requests": requests,
        "seconds": elapsed,
        "rate": requests / elapsed,
        "rss_after_warmup_mib": baseline / 2**20,
        "rss_end_mib": final / 2**20,
        "rss_growth": growth,
        "outcomes": outcomes,
        "statistics": {
            "submitted": stats.submitted,
            "completed": stats.completed,
            "failed": stats.failed,
            "cancelled": stats.cancelled,
            "timed_out": stats.timed_out,
            "queued": stats.queued,
            "in_flight": stats.in_flight,
        },
        "counts_add_up": ended == stats.submitted,
        "busy_slots_at_end": sum(core.busy_slots for core in stats.cores),
        "live_handles_after_close": runtime.live_handles(),
        "invalid_releases": runtime.invalid_releases,
        "samples": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--json", help="report path (default: a temporary file)")
    args = parser.parse_args()
    report = asyncio.run(soak(args.requests, args.concurrency, max(1, args.requests // 20)))
    leaked = any(report["live_handles_after_close"].values()) or report["invalid_releases"]
    ok = (
        report["rss_growth"] <= args.tolerance
        and not leaked
        and report["counts_add_up"]
        and report["busy_slots_at_end"] == 0
        and report["outcomes"]["wrong"] == 0
    )
    print(f"\n{report['requests']} requests in {report['seconds']:.0f} s ({report['rate']:.0f}/s)")
    print(
        f"RSS after warm-up {report['rss_after_warmup_mib']:.1f} MiB, at the end "
        f"{report['rss_end_mib']:.1f} MiB: {100 * report['rss_growth']:+.2f} % "
        f"(limit {100 * args.tolerance:g} %)"
    )
    print(
        f"outcomes {report['outcomes']}; counts add up: {report['counts_add_up']}; "
        f"busy slots at the end: {report['busy_slots_at_end']}"
    )
    print(
        f"live handles after close: {report['live_handles_after_close']}; "
        f"invalid releases: {report['invalid_releases']}"
    )
    print("PASS" if ok else "FAIL")
    path = report_path(args.json, "soak.json")
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
