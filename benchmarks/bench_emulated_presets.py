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

Usage::

    python benchmarks/bench_emulated_presets.py [--repeats 7] [--rounds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from aiodla import Detect, Engine, ImagePreprocess
from aiodla.emulator import make_loadable, parse_loadable
from aiodla.emulator._detector import PRESETS
from aiodla.emulator._ops import ModelRunner

FRAMES = ((640, 640), (1080, 1920))


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


def line(label: str, values: list[float]) -> str:
    return f"{label:<34} {statistics.median(values):7.2f} ({min(values):.2f}..{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=20, help="frames per timing")
    parser.add_argument("--preset", default="yolov5s", choices=sorted(PRESETS))
    args = parser.parse_args()
    model = preset(args.preset)
    run = task(args.preset, 1)
    tasks: list[float] = []
    engine: dict[tuple[int, int], list[float]] = {size: [] for size in FRAMES}
    for _ in range(args.repeats):  # interleaved: drift hits every case alike
        tasks.append(time_task(run, args.rounds))
        for size in FRAMES:
            engine[size].append(asyncio.run(time_engine(model, size, args.rounds)))
    stated = PRESETS[args.preset][2] * 1e3
    print(f"preset {args.preset}: {stated:.1f} ms a task stated (the DLA's time, not the host's)")
    print(f"{'CPU ms per frame':<34} {'median':>7} (min..max of {args.repeats} repeats)")
    print(line("the task (one thread)", tasks))
    for (height, width), values in engine.items():
        print(line(f"engine, {width}x{height} BGR frame (all)", values))
    whole = statistics.median(engine[FRAMES[0]])
    print(f"the task is {statistics.median(tasks) / whole:.0%} of a 640x640 frame's CPU")


if __name__ == "__main__":
    main()
