"""What ``engine.trace()`` costs the host: CPU per request with no trace installed
(against a tree without the trace's hooks) and with one recording.

Each round runs every mode once, each in a fresh process and in a rotating order, so
the modes see the same machine; a mode's figure is the median over rounds (min..max),
and each ratio is taken within a round, then its median. The engine runs on the
emulated runtime at zero service time with every slot busy, where the host's own cost
is all there is to measure (at real service times the same microseconds are a smaller
share). CPU is the event loop thread's (where the hooks run, but for the poller's
sweeps) and the whole process's.

    git archive COMMIT_BEFORE_THE_HOOKS aiodla | tar -x -C /tmp/base
    python benchmarks/bench_trace.py --base /tmp/base [--rounds 7] [--requests 4000]

Modes: ``base`` (the tree at --base, no hooks), ``off`` (this tree, no trace), ``on``
(this tree, ``engine.trace()`` recording every request). Without --base, ``off`` and
``on`` alone.

CPU times on a shared machine move by tens of percent from one run to the next, more
than the few percent in question. ``--instructions`` counts instead, with callgrind, the
event loop thread's instructions per request (runs of N and N + DELTA requests, their
difference over DELTA, so start-up cancels out), which the load does not move::

    python benchmarks/bench_trace.py --base /tmp/base --instructions [--delta 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TREE = HERE.parent


async def _measure(mode: str, requests: int, concurrency: int) -> dict[str, float]:
    import numpy as np

    from aiodla import Engine, TensorSpec
    from aiodla.emulator import make_loadable

    model = make_loadable(
        [TensorSpec("x", (1, 16, 8, 8), "float16", "chw16")],
        [TensorSpec("y", (1, 16, 8, 8), "float16", "nchw")],
        "affine",
        latency=0.0,
    )
    x = np.ones((1, 16, 8, 8), np.float32)
    async with Engine(model, cores=[0, 1], streams_per_core=4, runtime="emulated") as engine:
        await asyncio.gather(*(engine.infer(x) for _ in range(200)))  # warm: graphs, caches

        async def worker(count: int) -> None:
            for _ in range(count):
                await engine.infer(x)

        async def run() -> tuple[float, float, float]:
            wall, process, loop = time.perf_counter(), time.process_time(), time.thread_time()
            share = requests // concurrency
            await asyncio.gather(*(worker(share) for _ in range(concurrency)))
            return (
                time.perf_counter() - wall,
                time.process_time() - process,
                time.thread_time() - loop,
            )

        if mode == "on":
            async with engine.trace(capacity=requests) as recorder:
                wall, process, loop = await run()
            assert recorder.recorded >= requests // concurrency * concurrency
        else:
            wall, process, loop = await run()
    done = requests // concurrency * concurrency
    return {
        "loop_us": loop / done * 1e6,
        "process_us": process / done * 1e6,
        "wall_us": wall / done * 1e6,
    }


def _one(mode: str, tree: Path, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "r.json"
        command = [
            sys.executable,
            __file__,
            "--worker",
            mode,
            "--requests",
            str(args.requests),
            "--concurrency",
            str(args.concurrency),
            "--out",
            str(out),
        ]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run(command, env=env, check=True)
        result: dict[str, float] = json.loads(out.read_text())
    return result


def _instructions(mode: str, tree: Path, requests: int, args: argparse.Namespace) -> int:
    """The event loop thread's instructions in one run of ``requests`` under callgrind."""
    with tempfile.TemporaryDirectory() as scratch:
        prefix = Path(scratch) / "cg"
        command = [
            "valgrind",
            "--tool=callgrind",
            "--separate-threads=yes",
            f"--callgrind-out-file={prefix}",
            sys.executable,
            __file__,
            "--worker",
            mode,
            "--requests",
            str(requests),
            "--concurrency",
            str(args.concurrency),
            "--out",
            str(Path(scratch) / "r.json"),
        ]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run(command, env=env, check=True, capture_output=True)
        loop = Path(f"{prefix}-01").read_text(errors="replace")  # thread 1: the loop's
        found = re.search(r"^summary:\s+(\d+)", loop, re.MULTILINE)
        assert found is not None, "callgrind wrote no summary"
        return int(found[1])


def count_instructions(modes: dict[str, Path], args: argparse.Namespace) -> None:
    if shutil.which("valgrind") is None:
        sys.exit("--instructions needs valgrind (apt-get install valgrind)")
    low, high = args.concurrency * 4, args.concurrency * 4 + args.delta
    per_request = {}
    for mode, tree in modes.items():
        a = _instructions(mode, tree, low, args)
        b = _instructions(mode, tree, high, args)
        per_request[mode] = (b - a) / (high // args.concurrency * args.concurrency - low)
        print(f"  {mode:>4}: {per_request[mode]:10,.0f} loop instructions a request")
    report: dict[str, Any] = {
        "parameters": {"low": low, "high": high, "concurrency": args.concurrency},
        "loop_instructions_per_request": per_request,
        "ratios": {},
    }
    pairs = [("on", "off")] + ([("off", "base")] if "base" in modes else [])
    for a, b in pairs:
        report["ratios"][f"{a} / {b}"] = per_request[a] / per_request[b]
        print(f"  {a} / {b}: {per_request[a] / per_request[b]:.4f}")
    path = args.json or tempfile.mkstemp(prefix="bench-trace-instructions-", suffix=".json")[1]
    Path(path).write_text(json.dumps(report, indent=2))
    print(f"report: {path}")


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="a tree without the trace's hooks")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--json", help="report path (default: a temporary file)")
    parser.add_argument("--instructions", action="store_true", help="count, with callgrind")
    parser.add_argument("--delta", type=int, default=1000, help="with --instructions")
    parser.add_argument("--worker", choices=("base", "off", "on"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = asyncio.run(_measure(args.worker, args.requests, args.concurrency))
        Path(args.out).write_text(json.dumps(result))
        return
    modes = {"off": TREE, "on": TREE}
    if args.base is not None:
        modes = {"base": args.base.resolve(), **modes}
    if args.instructions:
        count_instructions(modes, args)
        return
    rounds: list[dict[str, dict[str, float]]] = []
    names = list(modes)
    for i in range(args.rounds):
        order = names[i % len(names) :] + names[: i % len(names)]
        rounds.append({mode: _one(mode, modes[mode], args) for mode in order})
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(
            f"{m} {rounds[-1][m]['loop_us']:.1f}/{rounds[-1][m]['process_us']:.1f} us"
            for m in names
        ), file=sys.stderr)  # fmt: skip
    report: dict[str, Any] = {"parameters": vars(args) | {"base": str(args.base)}, "modes": {}}
    for mode in names:
        report["modes"][mode] = {
            column: spread([r[mode][column] for r in rounds])
            for column in ("loop_us", "process_us", "wall_us")
        }
    pairs = [("on", "off")] + ([("off", "base")] if "base" in modes else [])
    report["ratios"] = {
        f"{a} / {b}": {
            column: spread([r[a][column] / r[b][column] for r in rounds])
            for column in ("loop_us", "process_us")
        }
        for a, b in pairs
    }
    report["rounds"] = rounds
    print(f"CPU a request, zero service time, medians of {args.rounds} interleaved rounds:")
    for mode in names:
        m = report["modes"][mode]
        print(
            f"  {mode:>4}: loop {m['loop_us']['median']:6.1f} us "
            f"[{m['loop_us']['min']:.1f}..{m['loop_us']['max']:.1f}], process "
            f"{m['process_us']['median']:6.1f} us "
            f"[{m['process_us']['min']:.1f}..{m['process_us']['max']:.1f}]"
        )
    for name, ratio in report["ratios"].items():
        loop, process = ratio["loop_us"], ratio["process_us"]
        print(
            f"  {name}: loop {loop['median']:.3f} [{loop['min']:.3f}..{loop['max']:.3f}], "
            f"process {process['median']:.3f} [{process['min']:.3f}..{process['max']:.3f}]"
        )
    path = args.json or tempfile.mkstemp(prefix="bench-trace-", suffix=".json")[1]
    Path(path).write_text(json.dumps(report, indent=2))
    print(f"report: {path}")


if __name__ == "__main__":
    main()
