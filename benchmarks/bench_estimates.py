"""What a loadable's stated service time a little off the real one costs a saturated engine.

The emulated runtime runs each task for the loadable's latency (1 ms) while telling the
engine ``--factor`` times that; 64 callers keep both cores' rings (8 slots a core) full
for ``--seconds``. It prints the rate against the ideal ``cores / latency``, and per
request the poller's event queries, its sweeps, its hand-offs to the event loop and
the process's CPU. The engine's completion estimates follow what the poller finds
(``aiodla._local_device._follow_the_core``); without that, a time stated short drove the
poller to query each task several times and a time stated long let the rings run dry.

Usage (each factor in a fresh process; several factors interleave their repeats)::

    python benchmarks/bench_estimates.py [--factors 1.0,0.98,1.1] [--repeats 3] [--seconds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from aiodla import Engine, TensorSpec
from aiodla.emulator import make_loadable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import Misstated  # the runtime tests/test_estimates.py uses

X = TensorSpec("x", (1, 16, 8, 8), "float16", "chw16")
Y = TensorSpec("y", (1, 16, 8, 8), "float16", "nchw")
LATENCY = 1e-3
CORES = 2


async def measure(factor: float, seconds: float) -> dict[str, float]:
    runtime = Misstated(factor, CORES)
    model = make_loadable([X], [Y], "affine", LATENCY, scale=0.5, bias=0.25)
    x = np.ones(X.shape, np.float16)
    async with Engine(model, runtime=runtime, streams_per_core=8) as engine:
        await asyncio.gather(*(engine.infer(x) for _ in range(128)))
        poller: Any = engine._flow.poller
        sweeps, posts, queries = poller.sweeps, poller.wakeups, runtime.queries
        began, cpu = time.monotonic(), time.process_time()
        stop = began + seconds

        async def caller() -> int:
            done = 0
            while time.monotonic() < stop:
                await engine.infer(x)
                done += 1
            return done

        done = sum(await asyncio.gather(*(caller() for _ in range(64))))
        elapsed, cpu = time.monotonic() - began, time.process_time() - cpu
        return {
            "x_ideal": done / elapsed / (CORES / LATENCY),
            "queries": (runtime.queries - queries) / done,
            "sweeps": (poller.sweeps - sweeps) / done,
            "posts": (poller.wakeups - posts) / done,
            "process_us": cpu / done * 1e6,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--factors", default="1.0,0.98,1.1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--one", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:  # a child: one measurement, one line
        print(json.dumps(asyncio.run(measure(args.one, args.seconds))))
        return 0
    factors = [float(f) for f in args.factors.split(",")]
    runs: dict[float, list[dict[str, float]]] = {f: [] for f in factors}
    for _ in range(args.repeats):
        for factor in factors:
            out = subprocess.run(
                [sys.executable, __file__, "--one", str(factor), "--seconds", str(args.seconds)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs[factor].append(json.loads(out.strip().splitlines()[-1]))
    print(
        f"stated / real service time, 2 cores x 8 slots at {LATENCY * 1e3:g} ms, 64 callers; "
        f"median of {args.repeats} (min..max)"
    )
    for factor, results in runs.items():
        cells = []
        for key in ("x_ideal", "queries", "sweeps", "posts", "process_us"):
            values = [r[key] for r in results]
            cells.append(
                f"{key} {statistics.median(values):.3g} ({min(values):.3g}..{max(values):.3g})"
            )
        print(f"  x{factor:g}: " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
