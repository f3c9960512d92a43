"""Camera fan-out: eight cameras, one detector, boxes per frame.

    python examples/camera_fanout.py                        # emulated DLA, no GPU needed
    python examples/camera_fanout.py --model yolov5s.bin    # your loadable, on a Jetson
    python examples/camera_fanout.py --save frame.jpg       # draw one frame's boxes
    python examples/camera_fanout.py --trace run.json       # and the engine's timeline

Each simulated camera asks its own ``aiodla.LatestFrameStream`` for the frame buffer to
fill next (``stream.frame_buffer``: a ring of three the engine owns, pinned memory, so
``infer`` skips the staging copy; never the frame in flight nor the one waiting),
writes a 1920x1080 BGR frame into it and submits it: at most one frame in flight, one
waiting, a newer frame replacing the waiting one (counted as dropped). The engine
letterboxes each frame to the detector's 640x640 input (``ImagePreprocess``), runs it,
decodes the heads and runs NMS (``Detect``), and answers with ``Detections`` in the
frame's own pixels. Without --model it builds the YOLOv5s emulator loadable
(``aiodla emulate --preset yolov5s``): raw heads with a few dozen objects a frame.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from aiodla import (
    Detect,
    Detections,
    Engine,
    ImagePreprocess,
    LatestFrameStream,
    StreamStatistics,
    TensorSpec,
)
from aiodla.emulator import make_loadable
from aiodla.emulator._detector import PRESETS

FRAME_SIZE = (1080, 1920)  # what each simulated camera delivers (height, width; BGR)
LETTERBOX = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")


def demo_model(latency: float, size: int = 640) -> bytes:
    """YOLOv5s' I/O (``aiodla emulate --preset yolov5s``), or the same at a ``size`` x
    ``size`` input (heads of size/8, size/16, size/32)."""
    inputs, outputs, _ = PRESETS["yolov5s"]
    if size != 640:
        inputs = (TensorSpec("images", (1, 3, size, size), "float16", "chw16"),)
        outputs = tuple(
            TensorSpec(s.name, (1, 255, size // k, size // k), "float16", "chw16")
            for s, k in zip(outputs, (8, 16, 32), strict=True)
        )
    return make_loadable(inputs, outputs, "detect", latency)


def fill_frame(frame: np.ndarray[Any, Any], camera: int, index: int, painted: set[int]) -> None:
    """A synthetic frame written in place, as ``cv2.VideoCapture.read(image=frame)``
    would (a camera's DMA costs the host nothing; here a moving band of rows is
    rewritten, over a gradient painted once per buffer)."""
    height, width, _ = frame.shape
    if frame.ctypes.data not in painted:  # the buffer's first use: the whole gradient
        painted.add(frame.ctypes.data)
        frame[..., 0] = (np.arange(width) * 255 // width).astype(np.uint8)
        frame[..., 1] = (np.arange(height) * 255 // height).astype(np.uint8)[:, None]
        frame[..., 2] = camera * 37 % 256
    band = index * 16 % height
    frame[band : band + 16] = (camera * 37 + index) % 256


async def camera(
    number: int,
    stream: LatestFrameStream,
    frame_size: tuple[int, int],
    fps: float,
    duration: float,
    shown: dict[int, tuple[np.ndarray[Any, Any], Detections]],
) -> int:
    boxes = 0

    async def read() -> None:
        nonlocal boxes
        async for result in stream:  # answers arrive in frame order
            if result.error is None:  # a failed frame has an error and no output
                detections: Detections = result.output
                boxes += len(detections)
                if result.context is not None:  # the first frame of a camera
                    shown[number] = (result.context, detections)

    async with stream:  # leaving it closes the stream, which ends read()
        reader = asyncio.create_task(read())
        loop = asyncio.get_running_loop()
        tick, end, index = loop.time(), loop.time() + duration, 0
        painted: set[int] = set()
        while tick < end:
            frame = stream.frame_buffer((*frame_size, 3))  # never one the engine still reads
            fill_frame(frame, number, index, painted)
            # The first frame starts at once (nothing is in flight), so it is never
            # dropped; a copy of it to draw, since its buffer serves later frames.
            stream.submit(frame, context=frame.copy() if index == 0 else None)
            index += 1
            tick += 1 / fps
            await asyncio.sleep(max(0.0, tick - loop.time()))
    await reader
    return boxes


async def run(
    model: str | bytes,
    cameras: int,
    fps: float,
    duration: float,
    frame_size: tuple[int, int] = FRAME_SIZE,
    save: str | None = None,
    trace: str | None = None,
) -> list[StreamStatistics]:
    """Run the cameras for ``duration`` seconds; print and return each one's statistics.
    With ``trace``, write the engine's timeline there (``aiodla trace-plot`` draws it)."""
    detector = Detect(head="yolov5", classes=80, conf=0.25, iou=0.45)
    async with Engine(model, preprocess={"images": LETTERBOX}, postprocess=detector) as engine:
        streams = [LatestFrameStream(engine, name=f"cam{i}") for i in range(cameras)]
        shown: dict[int, tuple[np.ndarray[Any, Any], Detections]] = {}
        timeline = engine.trace(trace, name="yolov5s") if trace else contextlib.nullcontext()
        async with timeline:
            boxes = await asyncio.gather(
                *(camera(i, s, frame_size, fps, duration, shown) for i, s in enumerate(streams))
            )
        stats = [stream.statistics() for stream in streams]
        runtime = engine.runtime.name if engine.runtime else "?"
    print(f"{cameras} cameras x {fps:g} fps on the {runtime} runtime for {duration:g} s")
    print("camera     fps  dropped   p50 ms   p99 ms  boxes/frame")
    for s, count in zip(stats, boxes, strict=True):
        print(
            f"{s.name:<6} {s.fps:7.1f} {s.dropped:8d} {s.latency.p50 * 1e3:8.1f} "
            f"{s.latency.p99 * 1e3:8.1f} {count / max(s.completed, 1):12.1f}"
        )
    if shown:
        frame, detections = shown[min(shown)]
        for box, score, cls in list(detections)[:3]:
            print(f"  class {cls:2d} score {score:.2f} at {np.round(box).astype(int).tolist()}")
        if save:
            draw(frame, detections, save)
    return stats


def draw(frame: np.ndarray[Any, Any], detections: Detections, path: str) -> None:
    import cv2  # opencv-python-headless

    image = np.ascontiguousarray(frame)
    for box, score, cls in detections:
        x1, y1, x2, y2 = (round(float(v)) for v in box)
        cv2.rectangle(image, (x1, y1), (x2, y2), (0, 255, 0), 2)
        cv2.putText(
            image, f"{cls}:{score:.2f}", (x1, max(y1 - 4, 10)), cv2.FONT_HERSHEY_SIMPLEX,
            0.5, (0, 255, 0), 1,
        )  # fmt: skip
    if not cv2.imwrite(path, image):
        raise SystemExit(f"could not write {path}")
    print(f"wrote {path}: {len(detections)} boxes")


def main(argv: Sequence[str] | None = None) -> list[StreamStatistics]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a loadable; default: the YOLOv5s emulator loadable")
    parser.add_argument("--cameras", type=int, default=8)
    parser.add_argument("--fps", type=float, default=10.0, help="frames per second per camera")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds")
    parser.add_argument("--save", metavar="FRAME.jpg", help="draw one frame's boxes into it")
    parser.add_argument("--trace", metavar="RUN.json", help="write the engine's timeline")
    parser.add_argument(
        "--latency",
        type=float,
        # 1080p frames pre-processed with numpy (the emulated runtime, no GPU) cost the
        # host about 20 ms each: keep the emulated DLA the slower part.
        default=0.05,
        help="seconds per frame of the built-in model (2 cores: 40 fps at 0.05)",
    )
    args = parser.parse_args(argv)
    model = args.model or demo_model(args.latency)
    run_it = run(model, args.cameras, args.fps, args.duration, save=args.save, trace=args.trace)
    return asyncio.run(run_it)


if __name__ == "__main__":
    main()
