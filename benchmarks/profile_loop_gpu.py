"""Where the event loop thread's CPU goes per request on the CUDA runtime: camera to
boxes (a 1080p frame in an engine frame buffer, letterboxed on the device into a
YOLOv5s-shaped model, ``Detect`` on the stream) against the small 32x32 model.

For each: the loop thread's CPU per request with nothing attached, the CUDA runtime's
counted work per request, then the same load under cProfile (slower; for where, not
how much). Needs the GPU stand-in, loaded before anything opens cuDLA::

    python benchmarks/profile_loop_gpu.py [--standin LIB] [--seconds 2] [--service 0.0111]

``--only small`` or ``--only boxes`` runs one case; ``--no-cprofile`` skips the profiled
pass (for a sampling profiler outside the process, such as ``py-spy record --threads
--native``, which sees the loop thread alone and the C calls under it).

``--emulated`` runs it on the emulated runtime instead (a dry run without a GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import io
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_data_path as cases
from _standin_lib import load_standin

from aiodla import Detect, Engine, ImagePreprocess

CONCURRENCY = 16


async def measure(
    name: str,
    model: bytes,
    x: Any,
    options: dict[str, Any],
    in_buffer: bool,
    seconds: float,
    make_runtime: Any,
    profiled: bool = True,
) -> None:
    runtime = make_runtime()
    async with Engine(
        model, runtime=runtime, cores=range(2), streams_per_core=4, **options
    ) as engine:
        if in_buffer:
            (buffer,) = engine.frame_buffers(1, x.shape, x.dtype)
            buffer[:] = x
            x = buffer
        for _ in range(32):
            await engine.infer(x)

        async def load(profile: cProfile.Profile | None) -> tuple[int, float]:
            done = 0
            deadline = time.perf_counter() + seconds

            async def worker() -> None:
                nonlocal done
                while time.perf_counter() < deadline:
                    await engine.infer(x)
                    done += 1

            began = time.thread_time()
            if profile is not None:
                profile.enable()
            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
            if profile is not None:
                profile.disable()
            return done, time.thread_time() - began

        counts = dataclasses.replace(runtime.counts)
        done, cpu = await load(None)
        after = dataclasses.asdict(runtime.counts)
        per_request = {
            key: round((after[key] - value) / done, 2)
            for key, value in dataclasses.asdict(counts).items()
            if after[key] != value
        }
        print(
            f"\n##### {name} on {runtime.name}: {done} requests in {seconds:g} s, "
            f"loop thread {1e6 * cpu / done:.0f} us CPU a request; counted per request: "
            f"{per_request}"
        )
        if not profiled:
            return
        profile = cProfile.Profile()
        done, cpu = await load(profile)
    print(f"under cProfile: {done} requests, loop thread {1e6 * cpu / done:.0f} us a request")
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(30)
        print(text.getvalue()[-8000:])


async def main(args: argparse.Namespace) -> None:
    if args.emulated:
        from aiodla import EmulatedRuntime

        make_runtime: Any = EmulatedRuntime
    else:
        load_standin(args.standin)
        from aiodla.runtime import CudaRuntime

        def make_runtime() -> Any:
            return CudaRuntime(0)

    camera = np.random.default_rng(1).integers(0, 256, (1080, 1920, 3)).astype(np.uint8)
    letterbox = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
    small_input = np.ones(cases.SMALL_IN.shape, np.float16)
    boxes = {
        "convert": "device",
        "preprocess": {cases.FRAME.name: letterbox},
        "postprocess": Detect(head="yolov5"),
    }
    service, profiled = args.service, not args.no_cprofile
    runs = {
        "small": ("small 32x32", cases.small(service), small_input, {}, False),
        "boxes": ("boxes", cases.yolov5s(service), camera, boxes, True),
    }
    for key, (name, model, x, options, in_buffer) in runs.items():
        if args.only in (None, key):
            await measure(name, model, x, options, in_buffer, args.seconds, make_runtime, profiled)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--standin", default=os.environ.get("AIODLA_STANDIN_LIB"))
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--service", type=float, default=0.0111)
    parser.add_argument("--emulated", action="store_true")
    parser.add_argument("--only", choices=("small", "boxes"))
    parser.add_argument("--no-cprofile", action="store_true")
    asyncio.run(main(parser.parse_args()))
