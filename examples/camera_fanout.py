"""Camera fan-out: many cameras share one engine, each keeping only its newest frame.

    python examples/camera_fanout.py                    # emulated DLA, no GPU needed
    python examples/camera_fanout.py --model model.bin  # your loadable, on a Jetson

Each camera is an asyncio task producing frames at --fps into its own
aiodla.LatestFrameStream: at most one request in flight, one frame waiting, and a newer
frame replaces the waiting one (counted as dropped). Offering more frames than the DLA
can run therefore never builds a backlog: latency stays bounded and the excess shows up
as dropped frames. Without --model it builds an emulator loadable taking --latency
seconds per frame on each of two cores; the defaults offer twice what it can run.

The cameras hand over raw 1920x1080 BGR frames, as OpenCV or a decoder gives them: the
engine letterboxes each to the model's 640x640 RGB input, normalizes it and converts it
to FP16 CHW16 (aiodla.ImagePreprocess); ``geometry`` maps boxes back to the frame.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from aiodla import Engine, ImagePreprocess, LatestFrameStream, StreamStatistics, TensorSpec
from aiodla.emulator import make_loadable

FRAME_SIZE = (1080, 1920)  # what each simulated camera delivers (height, width)
LETTERBOX = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")


def demo_model(latency: float, size: int = 640) -> bytes:
    """A detector-sized input (640x640 RGB, FP16 CHW16) and a small output."""
    images = TensorSpec("images", (1, 3, size, size), "float16", "chw16")
    scores = TensorSpec("scores", (1, 3, 1, 1), "float32", "nchw")
    return make_loadable([images], [scores], "mean_hw", latency)


def camera_frame(index: int, size: tuple[int, int] = FRAME_SIZE) -> np.ndarray[Any, Any]:
    """A synthetic 1080p BGR frame (of ``size``: height, width), different for each camera."""
    height, width = size
    rows = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    columns = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    frame = np.empty((height, width, 3), np.uint8)
    frame[..., 0] = rows
    frame[..., 1] = columns
    frame[..., 2] = (index * 37) % 256
    return frame


async def camera(stream: LatestFrameStream, frame: Any, fps: float, duration: float) -> None:
    async def read() -> None:
        async for result in stream:  # answers arrive in frame order
            if result.error is None:  # a failed frame has an error and no output
                _ = result.output  # a real application draws or publishes it here

    async with stream:  # leaving it closes the stream, which ends read()
        reader = asyncio.create_task(read())
        loop = asyncio.get_running_loop()
        tick = loop.time()
        end = tick + duration
        while tick < end:
            stream.submit(frame)  # never waits: the newest frame wins
            tick += 1 / fps
            await asyncio.sleep(max(0.0, tick - loop.time()))
    await reader


async def run(
    model: str | bytes,
    cameras: int,
    fps: float,
    duration: float,
    frame_size: tuple[int, int] = FRAME_SIZE,
) -> list[StreamStatistics]:
    """Run the cameras for ``duration`` seconds; print and return each one's statistics."""
    first = TensorSpec("probe", (1, 3, 1, 1))  # replaced by the model's own input below
    async with Engine(model, cores=[0, 1]) as probe:
        first = probe.inputs[0]
    # The model's (first) input takes the cameras' raw frames, letterboxed to its size.
    async with Engine(model, cores=[0, 1], preprocess={first.name: LETTERBOX}) as engine:
        height, width = first.shape[2:]
        scale, top, left = LETTERBOX.geometry(*frame_size, height, width)
        print(
            f"frames {frame_size[1]}x{frame_size[0]} -> input {width}x{height}: "
            f"scale {scale:.4f}, top {top}, left {left} (to map boxes back)"
        )
        streams = [LatestFrameStream(engine, name=f"cam{i}") for i in range(cameras)]
        await asyncio.gather(
            *(camera(s, camera_frame(i, frame_size), fps, duration) for i, s in enumerate(streams))
        )
        stats = [stream.statistics() for stream in streams]
        runtime = engine.runtime.name if engine.runtime else "?"
    print(f"{cameras} cameras x {fps:g} fps on the {runtime} runtime for {duration:g} s")
    print("camera     fps  offered  dropped   p50 ms   p99 ms   max ms")
    for s in stats:
        print(
            f"{s.name:<6} {s.fps:7.1f} {s.offered_fps:8.1f} {s.dropped:8d} "
            f"{s.latency.p50 * 1e3:8.1f} {s.latency.p99 * 1e3:8.1f} {s.latency.max * 1e3:8.1f}"
        )
    print(
        f"total  {sum(s.fps for s in stats):7.1f} {sum(s.offered_fps for s in stats):8.1f} "
        f"{sum(s.dropped for s in stats):8d}"
    )
    return stats


def main(argv: Sequence[str] | None = None) -> list[StreamStatistics]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a loadable; default: a built-in emulator loadable")
    parser.add_argument("--cameras", type=int, default=8)
    parser.add_argument("--fps", type=float, default=10.0, help="frames per second per camera")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds")
    parser.add_argument(
        "--latency",
        type=float,
        # 1080p frames pre-processed and packed with numpy (the emulated runtime, no GPU)
        # cost the host about 20 ms each: keep the emulated DLA the slower part.
        default=0.05,
        help="seconds per frame of the built-in model (2 cores: 40 fps at 0.05)",
    )
    args = parser.parse_args(argv)
    model = args.model or demo_model(args.latency)
    if args.model is None:
        print(
            f"built-in model: {args.latency * 1e3:g} ms per frame on 2 cores = "
            f"{2 / args.latency:.0f} frames/s; offered {args.cameras * args.fps:.0f} frames/s"
        )
    return asyncio.run(run(model, args.cameras, args.fps, args.duration))


if __name__ == "__main__":
    main()
