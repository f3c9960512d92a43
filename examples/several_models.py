"""Several models on the same two DLA cores: a detector on every frame, a classifier
on every object it finds (DeepStream's primary and secondary inference).

    python examples/several_models.py                  # emulated DLA, no GPU needed
    python examples/several_models.py --cameras 8

One ``aiodla.Cores([0, 1])`` owns the cores; the detector's engine has priority 1, so
its frames go before any waiting crop, and the classifier's engine assembles the crops
of every camera into tasks of its batch of 8 (``Batching``: a partial batch goes after
2 ms). Without a DLA, both models are emulator loadables: a YOLOv5-style detector
(160x160 input, 4 ms a task) and a batch-8 classifier (8 x 0.25 ms = 2 ms a task).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from aiodla import Batching, Cores, Detect, Engine, ImagePreprocess, TensorSpec
from aiodla.emulator import make_loadable

CROP = 32  # the classifier's input: 32x32 RGB crops


def detector_model(latency: float = 0.004, size: int = 160) -> bytes:
    """YOLOv5s' heads at a ``size`` x ``size`` input."""
    images = TensorSpec("images", (1, 3, size, size), "float16", "chw16")
    heads = [
        TensorSpec(f"head{k}", (1, 255, size // k, size // k), "float16", "chw16")
        for k in (8, 16, 32)
    ]
    return make_loadable([images], heads, "detect", latency)


def classifier_model(per_item: float = 0.00025, batch: int = 8) -> bytes:
    """A batch-``batch`` classifier of crops (here: three scores, the crop's channel means)."""
    crops = TensorSpec("crops", (batch, 3, CROP, CROP), "float16", "chw16")
    scores = TensorSpec("scores", (batch, 3, 1, 1), "float32", "nchw")
    return make_loadable([crops], [scores], "mean_hw", batch * per_item, scale=1.0, bias=0.0)


def crop(frame: np.ndarray[Any, Any], box: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The box's pixels, nearest-resized to CROP x CROP, as one (1, 3, CROP, CROP) item."""
    height, width = frame.shape[:2]
    x1, y1, x2, y2 = np.clip(np.round(box), 0, [width - 1, height - 1] * 2).astype(int)
    rows = np.linspace(y1, max(y1, y2), CROP).astype(int)
    cols = np.linspace(x1, max(x1, x2), CROP).astype(int)
    patch = frame[rows][:, cols][..., ::-1]  # BGR -> RGB
    item: np.ndarray[Any, Any] = (patch.transpose(2, 0, 1)[None] / 255.0).astype(np.float32)
    return item


async def camera(
    index: int, frames: int, detector: Engine, classifier: Engine, shape: tuple[int, int]
) -> tuple[int, int]:
    """``frames`` frames through both models: (frames done, objects classified)."""
    rng = np.random.default_rng(index)
    objects = 0
    for _ in range(frames):
        frame = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
        detections = await detector.infer(frame)
        items = [crop(frame, box) for box, _, _ in list(detections)[:16]]
        scores = await asyncio.gather(*(classifier.infer(item) for item in items))
        labels = [int(np.argmax(s)) for s in scores]
        objects += len(labels)
    return frames, objects


async def run(cameras: int = 4, frames: int = 10, shape: tuple[int, int] = (270, 480)) -> Any:
    """Every camera's frames through the detector and the classifier; print and
    return both engines' statistics."""
    letterbox = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
    heads = Detect(head="yolov5", classes=80, conf=0.25, iou=0.45)
    async with (
        Cores([0, 1]) as dla,
        Engine(
            detector_model(), cores=dla, priority=1,
            preprocess={"images": letterbox}, postprocess=heads,
        ) as detector,
        Engine(classifier_model(), cores=dla, batch=Batching(max_delay=0.002)) as classifier,
    ):  # fmt: skip
        done = await asyncio.gather(
            *(camera(i, frames, detector, classifier, shape) for i in range(cameras))
        )
        det, cls = detector.statistics(), classifier.statistics()
        runtime = dla.runtime.name
    items = cls.batching
    assert items is not None
    print(f"{cameras} cameras x {frames} frames, both models on cores 0 and 1 ({runtime})")
    print(
        f"detector:   {det.completed} frames, p50 {det.latency.p50 * 1e3:.1f} ms, "
        f"p99 {det.latency.p99 * 1e3:.1f} ms"
    )
    print(
        f"classifier: {items.completed} objects in {items.tasks} tasks, "
        f"batch sizes {dict(items.sizes)}"
    )
    print(f"objects per frame: {sum(o for _, o in done) / max(det.completed, 1):.1f}")
    return det, cls


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cameras", type=int, default=4)
    parser.add_argument("--frames", type=int, default=10)
    args = parser.parse_args(argv)
    asyncio.run(run(args.cameras, args.frames))


if __name__ == "__main__":
    main()
