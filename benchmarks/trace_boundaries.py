"""How many module boundaries one warm request crosses on the event loop's thread.

Profiles (``sys.setprofile``) one ``await engine.infer(x)`` on the emulated runtime with
host conversion, after warm-up requests, and counts the calls from a function of one
aiodla module into a function of another: each is one boundary a reader follows. It
prints the total, and the engine's share: crossings with neither end in the runtime. Only
the calling thread is traced (the poller's sweep is its own thread's work).

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

from aiodla import Engine


def module_of(frame: FrameType | None) -> str | None:
    if frame is None:
        return None
    name = frame.f_globals.get("__name__", "")
    return name if isinstance(name, str) and name.startswith("aiodla") else None


async def trace_one(warm: int = 20) -> list[tuple[str, str, str]]:
    """The crossings of one warm request: (from module, to module, to function)."""
    model = bench_engine.model_bytes(0.0)
    x = bench_engine.sample()
    crossings: list[tuple[str, str, str]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = module_of(frame)
        caller = module_of(frame.f_back)
        if callee is not None and caller is not None and callee != caller:
            crossings.append((caller, callee, frame.f_code.co_name))

    async with Engine(model, runtime="emulated", cores=[0, 1], convert="host") as engine:
        for _ in range(warm):
            await engine.infer(x)
        sys.setprofile(profile)
        try:
            await engine.infer(x)
        finally:
            sys.setprofile(None)
    return crossings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print each crossing")
    args = parser.parse_args()
    crossings = asyncio.run(trace_one())
    if args.list:
        for caller, callee, function in crossings:
            print(f"  {caller} -> {callee}.{function}")
        pairs = collections.Counter((caller, callee) for caller, callee, _ in crossings)
        print(f"distinct module pairs: {len(pairs)}")
    engine_side = [c for c in crossings if not any(m.startswith("aiodla.runtime") for m in c[:2])]
    print(f"module boundaries crossed by one warm request: {len(crossings)}")
    print(f"  of which between engine modules (neither end in aiodla.runtime): {len(engine_side)}")


if __name__ == "__main__":
    main()
