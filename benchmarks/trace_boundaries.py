"""How many calls one warm request makes on the event loop's thread, and how many module
boundaries it crosses.

Profiles (``sys.setprofile``) one ``await engine.infer(x)`` on the emulated runtime with
host conversion, after warm-up requests, in two settings: a lone engine on cores of its
own, and the higher-priority engine of two on one ``aiodla.Cores`` (the shared cores'
dispatcher and poller on the path). For each it prints the calls into aiodla functions,
the boundaries (calls from a function of one aiodla module into a function of another:
each is one a reader follows; the engine's share: neither end in the runtime) and the
modules the request passes. Only the calling thread is traced (the poller's sweep is
its own thread's work).

Usage::

    python benchmarks/trace_boundaries.py [--list]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_engine

from aiodla import Cores, Engine


def module_of(frame: FrameType | None) -> str | None:
    if frame is None:
        return None
    name = frame.f_globals.get("__name__", "")
    return name if isinstance(name, str) and name.startswith("aiodla") else None


class Trace:
    """What one traced request did: every call into aiodla, and each crossing."""

    def __init__(self) -> None:
        self.calls = 0
        self.modules: set[str] = set()
        self.crossings: list[tuple[str, str, str]] = []

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = module_of(frame)
        if callee is None:
            return
        self.calls += 1
        self.modules.add(callee)
        caller = module_of(frame.f_back)
        if caller is not None and caller != callee:
            self.crossings.append((caller, callee, frame.f_code.co_name))


async def trace_one(shared: bool = False, warm: int = 20) -> Trace:
    """One warm request: on a lone engine, or (``shared``) the priority-1 engine of two
    on one ``Cores``, the other (priority 0) serving a request beside each warm-up."""
    model = bench_engine.model_bytes(0.0)
    x = bench_engine.sample()
    trace = Trace()

    async def traced(engine: Engine) -> None:
        sys.setprofile(trace.profile)
        try:
            await engine.infer(x)
        finally:
            sys.setprofile(None)

    if not shared:
        async with Engine(model, runtime="emulated", cores=[0, 1], convert="host") as engine:
            for _ in range(warm):
                await engine.infer(x)
            await traced(engine)
        return trace
    async with (
        Cores([0, 1], runtime="emulated") as dla,
        Engine(model, cores=dla, convert="host", priority=1) as high,
        Engine(model, cores=dla, convert="host") as low,
    ):
        for _ in range(warm):
            await asyncio.gather(high.infer(x), low.infer(x))
        await traced(high)
    return trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print each crossing")
    args = parser.parse_args()
    for title, shared in (("a lone engine", False), ("a shared-cores engine, priority 1", True)):
        trace = asyncio.run(trace_one(shared))
        crossings = trace.crossings
        print(f"one warm request, {title}:")
        if args.list:
            for caller, callee, function in crossings:
                print(f"  {caller} -> {callee}.{function}")
            pairs = collections.Counter((caller, callee) for caller, callee, _ in crossings)
            print(f"  distinct module pairs: {len(pairs)}")
        engine_side = [
            c for c in crossings if not any(m.startswith("aiodla.runtime") for m in c[:2])
        ]
        engine_modules = sorted(m for m in trace.modules if not m.startswith("aiodla.runtime"))
        print(f"  calls into aiodla functions: {trace.calls}")
        print(f"  module boundaries crossed: {len(crossings)}")
        print(
            f"    of which between engine modules (neither in aiodla.runtime): {len(engine_side)}"
        )
        print(
            f"  modules passed: {len(trace.modules)} ({len(engine_modules)} outside aiodla.runtime)"
        )


if __name__ == "__main__":
    main()
