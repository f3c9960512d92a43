"""A test suite for an application that post-processes a three-head detector on the DLA.

Runs in CI with no DLA: ``pytest examples/detector_tests.py`` (aiodla's pytest plugin
and pytest-asyncio installed). The emulated DLA takes the model's tensors from their
specs (with a real model: ``await aiodla_engine("tests/model-spec.json", ...)``, the
spec ``aiodla inspect model.bin --json`` wrote on the Jetson) and computes the heads
with ``compute=``: a few lines of numpy that stand in for the network, so the tests
know what the detector "sees" and can assert on what the application makes of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from aiodla import Engine, TaskError, TensorSpec
from aiodla.testing import DLAControls, EngineFactory

Frame = np.ndarray[Any, np.dtype[np.float32]]
Detection = tuple[str, float, tuple[int, ...]]

# -- the application (in a real project, this lives in the application's package) --------

CLASSES = ("red", "green", "blue")
GRID = 4  # the detector's 4x4 anchors over a 32x32 image


async def detect(engine: Engine, frame: Frame, *, threshold: float = 0.5) -> list[Detection]:
    """The frame's detections, best first: (class name, score, (x0, y0, x1, y1)).
    A frame the DLA fails on has none."""
    try:
        heads = await engine.infer(frame)
    except TaskError:
        return []
    scores = heads["scores"].reshape(-1).astype(np.float32)
    boxes = heads["boxes"].reshape(4, -1).T.astype(np.float32)
    classes = heads["classes"].reshape(-1)
    keep = np.flatnonzero(scores > threshold)
    keep = keep[np.argsort(-scores[keep], kind="stable")]
    return [
        (CLASSES[classes[i]], round(float(scores[i]), 2), tuple(int(v) for v in boxes[i]))
        for i in keep
    ]


# -- the model's I/O and a stand-in for the network ----------------------------------------

IMAGE = TensorSpec("image", (1, 3, 32, 32), "float16", "chw16")
BOXES = TensorSpec("boxes", (1, 4, GRID * GRID, 1), "float16", "nchw")
SCORES = TensorSpec("scores", (1, 1, GRID * GRID, 1), "float16", "nchw")
CLASS_IDS = TensorSpec("classes", (1, 1, GRID * GRID, 1), "int8", "nchw")


def detector(inputs: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, np.ndarray[Any, Any]]:
    """Each anchor is one 8x8 cell: its score is the cell's brightest channel mean, its
    class that channel, its box the cell. (Runs on the emulator's compute thread, on the
    image as the DLA reads it: rounded to FP16.)"""
    image = inputs["image"][0].astype(np.float32)  # 3 x 32 x 32
    cells = image.reshape(3, GRID, 8, GRID, 8).mean(axis=(2, 4)).reshape(3, -1)
    rows, cols = np.divmod(np.arange(GRID * GRID), GRID)
    boxes = np.stack([cols * 8, rows * 8, cols * 8 + 8, rows * 8 + 8])
    return {
        "boxes": boxes.reshape(BOXES.shape),
        "scores": cells.max(axis=0).reshape(SCORES.shape),
        "classes": cells.argmax(axis=0).astype(np.int8).reshape(CLASS_IDS.shape),
    }


def frame(*squares: tuple[int, int, int, float]) -> Frame:
    """A dark frame with bright squares: (class index, row, column, brightness)."""
    image = np.zeros(IMAGE.shape, np.float32)
    for channel, row, col, value in squares:
        image[0, channel, row * 8 : row * 8 + 8, col * 8 : col * 8 + 8] = value
    return image


# -- the tests -----------------------------------------------------------------------------


@pytest_asyncio.fixture
async def engine(aiodla_engine: EngineFactory) -> Engine:
    return await aiodla_engine(
        inputs=[IMAGE], outputs=[BOXES, SCORES, CLASS_IDS], latency=0.003, compute=detector
    )


@pytest.mark.asyncio
async def test_detections_are_thresholded_and_sorted(engine: Engine) -> None:
    found = await detect(engine, frame((0, 1, 2, 0.7), (2, 3, 0, 0.9), (1, 0, 0, 0.3)))
    assert found == [("blue", 0.9, (0, 24, 8, 32)), ("red", 0.7, (16, 8, 24, 16))]


@pytest.mark.asyncio
async def test_the_threshold_sees_fp16_scores(engine: Engine) -> None:
    # 0.50004 is 0.5 in FP16, as on the DLA: not above the threshold.
    assert await detect(engine, frame((1, 2, 2, 0.50004))) == []


@pytest.mark.asyncio
async def test_cameras_in_parallel_each_get_their_own_detections(engine: Engine) -> None:
    frames = [frame((i % 3, i % 4, (i // 4) % 4, 0.8)) for i in range(12)]
    results = await asyncio.gather(*(detect(engine, f) for f in frames))
    for i, found in enumerate(results):
        col, row = (i // 4) % 4 * 8, i % 4 * 8
        assert found == [(CLASSES[i % 3], 0.8, (col, row, col + 8, row + 8))]


@pytest.mark.asyncio
async def test_a_dla_fault_loses_one_frame_only(
    engine: Engine, aiodla_controls: DLAControls
) -> None:
    aiodla_controls.fail_next()
    results = await asyncio.gather(*(detect(engine, frame((0, 0, 0, 0.9))) for _ in range(4)))
    assert results.count([]) == 1
