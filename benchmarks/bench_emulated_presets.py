"""What the emulator's presets cost the host: CPU milliseconds per frame (median and
min..max of interleaved repeats).

``aiodla emulate --preset yolov5s`` is a detector without a DLA; its cost is the host's,
so it must stay small beside what it imitates, or an application developed against it
looks host-bound where the real DLA would not be. Two measurements:

- *the task*: one emulated task of the preset on its own buffers (DLA layouts, as the
  emulated runtime runs it on a stream): read the input, its digest, the three heads
  written in their layout. CPU time of the thread that runs it, per task.
- *the engine*: a whole request through an engine on the emulated runtime, a camera
  frame (640x640 and 1920x1080 BGR) letterboxed by ``ImagePreprocess`` into the preset,
  then ``Detect``: CPU time of the whole process (every thread) per frame, requests one
  at a time. The task is one part of it; pre-processing and post-processing are the
  emulated runtime's numpy implementations, which the GPU does on a device.

With ``--base REV``, every repeat measures both in fresh processes, that revision's
``aiodla`` and this tree's, alternating which goes first, and prints the ratios.

Usage::

    python benchmarks/bench_emulated_presets.py [--repeats 7] [--rounds 20] [--base REV]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from compare_revisions import export

from aiodla import Detect, Engine, ImagePreprocess
from aiodla.emulator import make_loadable, parse_loadable
from aiodla.emulator._detector import PRESETS
from aiodla.emulator._ops import ModelRunner

FRAMES = ((640, 640), (1080, 1920))
ROOT = Path(__file__).resolve().parent.parent

# Run in the child: ``aiodla`` comes from the PYTHONPATH it was given.
CHILD = """
import json, sys
sys.path.insert(0, {benchmarks!r})
import aiodla, bench_emulated_presets as bench
print(json.dumps({{"aiodla": aiodla.__file__, **bench.measure({preset!r}, {rounds!r})}}))
"""


def preset(name: str) -> bytes:
    inputs, outputs, latency = PRESETS[name]
    return make_loadable(inputs, outputs, "detect", latency)


def task(name: str, seed: int) -> Callable[[], None]:
    """One task of the preset on its own buffers, an input packed from a random image."""
    model = parse_loadable(preset(name))
    (spec,) = model.inputs
    image = np.random.default_rng(seed).random(spec.shape).astype(spec.numpy_dtype)
    inputs = [spec.pack(image)]
    outputs = [np.zeros(out.size, np.uint8) for out in model.outputs]
    return ModelRunner(model, inputs, outputs)


def time_task(run: Callable[[], None], rounds: int) -> float:
    run()
    started = time.thread_time()
    for _ in range(rounds):
        run()
    return (time.thread_time() - started) / rounds * 1e3


async def time_engine(model: bytes, size: tuple[int, int], rounds: int) -> float:
    letterbox = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
    options: dict[str, Any] = {"preprocess": {"images": letterbox}}
    async with Engine(model, postprocess=Detect(head="yolov5"), **options) as engine:
        frame = np.random.default_rng(0).integers(0, 256, (*size, 3), np.uint8)
        for _ in range(3):  # graphs captured, tables planned
            await engine.infer(frame)
        started = time.process_time()
        for _ in range(rounds):
            await engine.infer(frame)
        return (time.process_time() - started) / rounds * 1e3


def measure(name: str, rounds: int) -> dict[str, float]:
    """One repeat: the task, then a frame of each size through an engine."""
    result = {"task": time_task(task(name, 1), rounds)}
    for size in FRAMES:
        result[case(size)] = asyncio.run(time_engine(preset(name), size, rounds))
    return result


def case(size: tuple[int, int]) -> str:
    height, width = size
    return f"engine, {width}x{height} BGR frame (all)"


def measure_at(source: Path, name: str, rounds: int) -> dict[str, float]:
    """:func:`measure` in a fresh process whose ``aiodla`` is the one under ``source``."""
    code = CHILD.format(benchmarks=str(ROOT / "benchmarks"), preset=name, rounds=rounds)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(source)},
        cwd=source,  # the current directory comes first on sys.path
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    assert result.pop("aiodla").startswith(str(source)), "measured the wrong aiodla"
    return result


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} ({min(values):.2f}..{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=20, help="frames per timing")
    parser.add_argument("--preset", default="yolov5s", choices=sorted(PRESETS))
    parser.add_argument("--base", default=None, help="git revision to compare against")
    args = parser.parse_args()
    cases = ["task", *(case(size) for size in FRAMES)]
    runs: dict[str, list[dict[str, float]]] = {"base": [], "this tree": []}
    with tempfile.TemporaryDirectory() as temp:
        base = None if args.base is None else export(args.base, Path(temp))
        for repeat in range(args.repeats):  # interleaved: drift hits every case alike
            if base is None:
                runs["this tree"].append(measure(args.preset, args.rounds))
                continue
            order = ["base", "this tree"] if repeat % 2 == 0 else ["this tree", "base"]
            for which in order:
                source = base if which == "base" else ROOT
                runs[which].append(measure_at(source, args.preset, args.rounds))
    stated = PRESETS[args.preset][2] * 1e3
    print(f"preset {args.preset}: {stated:.1f} ms a task stated (the DLA's time, not the host's)")
    print(f"CPU ms per frame, median (min..max) of {args.repeats} interleaved repeats")
    labels = {"task": "the task (one thread)"}
    columns = ["this tree"] if base is None else ["base", "this tree"]
    heading = "".join(f" {name if name != 'base' else args.base:>22}" for name in columns)
    print(f"{'':<34}{heading}" + ("  this/base" if base is not None else ""))
    for key in cases:
        values = {name: [run[key] for run in runs[name]] for name in columns}
        row = "".join(f" {spread(values[name]):>22}" for name in columns)
        if base is not None:
            ratio = statistics.median(values["this tree"]) / statistics.median(values["base"])
            row += f"  {ratio:9.3f}"
        print(f"{labels.get(key, key):<34}{row}")
    ours = runs["this tree"]
    share = statistics.median(r["task"] for r in ours) / statistics.median(
        r[cases[1]] for r in ours
    )
    print(f"the task is {share:.0%} of a 640x640 frame's CPU (this tree)")


if __name__ == "__main__":
    main()
