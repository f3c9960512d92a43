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
event loop thread's instructions per request, which the load does not move::

    python benchmarks/bench_trace.py --base /tmp/base --without-hooks --instructions \
        [--delta 400] [--segments 3] [--rounds 3] [--jobs 2]

Each run (a mode in one process, rounds interleaved as above) warms its engine up, then
runs ``--segments`` segments of ``--delta`` requests and calls ``os.getppid()`` at each
boundary; callgrind's ``--dump-before=getppid`` writes the counters there, so each
segment is a measurement of its own with start-up left out. As in
``count_instructions.py``: the hash seed is fixed, the warm-up's objects are frozen out
of the collector's sight, and the emulated device's own work (its copies and the op,
done by whichever thread looks at an event first, which timing decides) runs inside
``sys.call_tracing``, which ``--toggle-collect=sys_call_tracing`` leaves out. ``--jobs``
runs that many callgrind processes at once: counts do not depend on how busy the
machine is.

``--without-hooks`` adds the mode ``bare``: a copy of this tree with each hook's two
lines (``if self.trace is not None:`` and its call) taken out, so ``off / bare`` is the
hooks' own cost, apart from whatever else changed since the tree at ``--base``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import gc
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

    from aiodla import Engine

    x = np.ones((1, 16, 8, 8), np.float32)
    async with Engine(_model(), cores=[0, 1], streams_per_core=4, runtime="emulated") as engine:
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


def _model() -> bytes:
    from aiodla import TensorSpec
    from aiodla.emulator import make_loadable

    return make_loadable(
        [TensorSpec("x", (1, 16, 8, 8), "float16", "chw16")],
        [TensorSpec("y", (1, 16, 8, 8), "float16", "nchw")],
        "affine",
        latency=0.0,
    )


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


async def _segments(mode: str, size: int, count: int, concurrency: int, warmup: int) -> None:
    """The instruction counting run: warm up, then ``count`` segments of ``size``
    requests, with ``os.getppid()`` (callgrind's dump) at each boundary."""
    import numpy as np
    from host_cost_once import set_apart

    from aiodla import Engine

    x = np.ones((1, 16, 8, 8), np.float32)
    async with Engine(_model(), cores=[0, 1], streams_per_core=4, runtime="emulated") as engine:
        set_apart(engine.runtime)
        remaining = 0

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await engine.infer(x)

        async def run(requests: int) -> None:
            nonlocal remaining
            remaining = requests
            await asyncio.gather(*(worker() for _ in range(concurrency)))

        await run(warmup)  # warm: graphs, caches
        async with contextlib.AsyncExitStack() as stack:
            if mode == "on":  # the ring as large as the run: nothing dropped
                await stack.enter_async_context(engine.trace(capacity=size * count + 1))
            gc.collect()
            gc.freeze()
            os.getppid()  # a boundary: start-up and warm-up end here
            for _ in range(count):
                await run(size)
                os.getppid()
        gc.unfreeze()


def _instructions(mode: str, tree: Path, args: argparse.Namespace) -> list[float]:
    """The event loop thread's instructions a request, in each segment of one run."""
    from count_instructions import callgrind, loop_parts

    with tempfile.TemporaryDirectory() as scratch:
        command = [
            *callgrind(Path(scratch) / "cg"),
            sys.executable,
            __file__,
            "--worker",
            mode,
            "--delta",
            str(args.delta),
            "--segments",
            str(args.segments),
            "--concurrency",
            str(args.concurrency),
            "--warmup",
            str(args.warmup),
        ]
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
        done = subprocess.run(command, env=env, cwd=scratch, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"callgrind run of {mode} ({tree}) failed:\n{done.stderr[-3000:]}")
        parts = loop_parts(Path(scratch))
    # Part 1 is start-up and warm-up; then one part per segment.
    segments = [parts[part] / args.delta for part in sorted(parts) if part > 1]
    if len(segments) != args.segments:
        sys.exit(f"{mode}: callgrind wrote {len(segments)} segments, not {args.segments}")
    return segments


HOOK = re.compile(r"^([ \t]*)if self\.trace is not None:\n\1[ \t]+self\.trace\.\w+\(.*\)\n", re.M)


def without_hooks(tree: Path, into: Path) -> Path:
    """A copy of ``tree``'s package with every trace hook taken out (see the module's
    docstring); refuses a tree whose hooks are not all of that two-line shape."""
    shutil.copytree(tree / "aiodla", into / "aiodla", ignore=shutil.ignore_patterns("__pycache__"))
    taken = 0
    for path in sorted((into / "aiodla").rglob("*.py")):
        text = path.read_text()
        stripped, count = HOOK.subn("", text)
        if re.search(r"if self\.trace is not None:\s*$", stripped, re.M):
            sys.exit(f"{path}: a trace hook of another shape; cannot take it out")
        if count:
            path.write_text(stripped)
            compile(stripped, str(path), "exec")
            taken += count
    if not taken:
        sys.exit(f"{tree}: no trace hooks found")
    print(f"bare: {taken} hooks taken out of a copy of {tree} ({into})")
    return into


def count_instructions(modes: dict[str, Path], args: argparse.Namespace) -> None:
    if shutil.which("valgrind") is None:
        sys.exit("--instructions needs valgrind (apt-get install valgrind)")
    names = list(modes)
    # One process a mode a round, in each round's rotated order; ``--jobs`` at a time.
    runs = [
        (i, mode)
        for i in range(args.rounds)
        for mode in names[i % len(names) :] + names[: i % len(names)]
    ]
    counts: dict[tuple[int, str], list[float]] = {}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(_instructions, m, modes[m], args): (i, m) for i, m in runs}
        for future in concurrent.futures.as_completed(futures):
            i, m = futures[future]
            counts[i, m] = future.result()
            shown = ", ".join(f"{c:,.0f}" for c in counts[i, m])
            print(f"  round {i + 1} {m}: {shown} a request", file=sys.stderr)
    # A run's figure is the median of its segments; ratios are taken within a round.
    rounds = [{m: statistics.median(counts[i, m]) for m in names} for i in range(args.rounds)]
    report: dict[str, Any] = {
        "parameters": {
            "requests_a_segment": args.delta,
            "warmup": args.warmup,
            "segments": args.segments,
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            "trees": {m: str(t) for m, t in modes.items()},
            "base_commit": args.base_commit,
            "python": sys.version.split()[0],
            "method": "callgrind --dump-before=getppid, one segment a dump; "
            "--toggle-collect=sys_call_tracing (the emulated device's work excluded); "
            "PYTHONHASHSEED=0; the warm-up frozen out of the collector",
        },
        "loop_instructions_per_request": {
            m: spread([c for (_, mode), cs in counts.items() if mode == m for c in cs])
            for m in names
        },
        "ratios": {f"{a} / {b}": spread([r[a] / r[b] for r in rounds]) for a, b in _pairs(modes)},
        "segments": {f"{m} round {i + 1}": cs for (i, m), cs in sorted(counts.items())},
    }
    print(
        f"event loop instructions a request ({args.rounds} interleaved rounds of "
        f"{args.segments} segments of {args.delta} requests; median [min..max]):"
    )
    for m, s in report["loop_instructions_per_request"].items():
        print(f"  {m:>4}: {s['median']:10,.0f} [{s['min']:,.0f}..{s['max']:,.0f}]")
    for name, s in report["ratios"].items():
        print(f"  {name}: {s['median']:.4f} [{s['min']:.4f}..{s['max']:.4f}]")
    path = args.json or tempfile.mkstemp(prefix="bench-trace-instructions-", suffix=".json")[1]
    Path(path).write_text(json.dumps(report, indent=2))
    print(f"report: {path}")


def _pairs(modes: dict[str, Path]) -> list[tuple[str, str]]:
    pairs = [("on", "off")]
    pairs += [("off", b) for b in ("bare", "base") if b in modes]
    pairs += [("on", b) for b in ("bare", "base") if b in modes]
    return pairs


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
    parser.add_argument("--delta", type=int, default=400, help="requests a segment")
    parser.add_argument("--segments", type=int, default=3, help="segments a run")
    parser.add_argument("--warmup", type=int, default=200, help="requests before segments")
    parser.add_argument("--jobs", type=int, default=1, help="callgrind runs at once")
    parser.add_argument("--without-hooks", action="store_true", help="add the 'bare' mode")
    parser.add_argument("--base-commit", help="the commit --base was made from (recorded)")
    parser.add_argument("--worker", choices=("bare", "base", "off", "on"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker and args.out is None:  # an instruction counting run
        asyncio.run(
            _segments(args.worker, args.delta, args.segments, args.concurrency, args.warmup)
        )
        return
    if args.worker:
        result = asyncio.run(_measure(args.worker, args.requests, args.concurrency))
        Path(args.out).write_text(json.dumps(result))
        return
    modes = {"off": TREE, "on": TREE}
    if args.base is not None:
        modes = {"base": args.base.resolve(), **modes}
    with tempfile.TemporaryDirectory() as scratch:
        if args.without_hooks:
            modes = {"bare": without_hooks(TREE, Path(scratch)), **modes}
        if args.instructions:
            count_instructions(modes, args)
        else:
            compare_cpu(modes, args)


def compare_cpu(modes: dict[str, Path], args: argparse.Namespace) -> None:
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
    pairs = _pairs(modes)
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
