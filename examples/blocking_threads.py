"""Two synchronous camera loops sharing the DLA through one BlockingEngine.

    python examples/blocking_threads.py                      # synthetic frames, emulated DLA
    python examples/blocking_threads.py --video a.mp4 --video b.mp4 --model m.bin   # OpenCV

Each thread runs the loop most Jetson programs start from: read a frame, run the
model, draw on the frame; no ``async`` anywhere. ``engine.infer`` blocks only its own
thread, so the two loops keep both DLA cores busy. Without --video each camera is a
synthetic source with ``cv2.VideoCapture``'s ``read()``; without --model the model is
an emulator loadable (a per-pixel map standing in for a segmentation head).
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import numpy as np

from aiodla import BlockingEngine, TensorSpec
from aiodla.emulator import make_loadable

SIZE = 64  # the model's input is 1x3xSIZExSIZE


class SyntheticCapture:
    """``cv2.VideoCapture``'s ``read()`` over generated BGR frames, ``frames`` of them."""

    def __init__(self, seed: int, frames: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._left = frames

    def read(self) -> tuple[bool, Any]:
        if self._left == 0:
            return False, None
        self._left -= 1
        return True, self._rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)

    def release(self) -> None:
        self._left = 0


def open_capture(source: str | None, seed: int, frames: int) -> Any:
    if source is None:
        return SyntheticCapture(seed, frames)
    import cv2  # only for real video: pip install opencv-python

    return cv2.VideoCapture(source)


def demo_model() -> bytes:
    image = TensorSpec("image", (1, 3, SIZE, SIZE), "float16", "chw16")
    mask = TensorSpec("mask", (1, 3, SIZE, SIZE), "float16", "nchw")
    return make_loadable([image], [mask], "affine", latency=0.002, scale=2.0, bias=-1.0)


def to_tensor(frame: Any) -> Any:
    """BGR HxWx3 uint8 -> 1x3xHxW float32 in [0, 1] (what cv2.dnn.blobFromImage does)."""
    resized = frame[:SIZE, :SIZE]
    return (resized.transpose(2, 0, 1)[None] / 255.0).astype(np.float32)


def draw(frame: Any, mask: Any) -> Any:
    """Mark the pixels the model scores above zero (cv2 would draw contours here)."""
    marked = frame.copy()
    marked[mask[0, 0] > 0] = (0, 0, 255)
    return marked


def camera_loop(engine: BlockingEngine, capture: Any, name: str, counts: dict[str, int]) -> None:
    try:
        while True:
            ok, frame = capture.read()
            if not ok:
                break
            mask = engine.infer(to_tensor(frame))  # blocks this thread only
            draw(frame, mask)
            counts[name] += 1
    finally:
        capture.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a loadable; default: a built-in emulator loadable")
    parser.add_argument("--video", action="append", help="a video file or camera (twice)")
    parser.add_argument("--frames", type=int, default=200, help="synthetic frames a camera")
    args = parser.parse_args()
    sources = args.video or [None, None]
    counts = {f"camera{i}": 0 for i in range(len(sources))}
    started = time.perf_counter()
    with BlockingEngine(args.model or demo_model(), cores=[0, 1]) as engine:
        threads = [
            threading.Thread(
                target=camera_loop,
                args=(engine, open_capture(source, i, args.frames), name, counts),
                name=name,
            )
            for i, (source, name) in enumerate(zip(sources, counts, strict=True))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stats = engine.statistics()
    elapsed = time.perf_counter() - started
    print(f"frames per camera: {counts}; {sum(counts.values()) / elapsed:.0f} frames/s in all")
    print(
        f"per core: {[core.completed for core in stats.cores]} tasks; "
        f"completed {stats.completed} of {stats.submitted}, failed {stats.failed}"
    )


if __name__ == "__main__":
    main()
