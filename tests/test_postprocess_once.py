"""One ``Postprocess`` per engine: matched to the model once, as the device layer opens,
and applied once per request: the detections decoded on the slot's stream are the
result as they stand, never passed through a second post-processing step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiodla import Detect, Detections, Engine, ImagePreprocess, _postprocess
from aiodla.emulator import make_loadable
from aiodla.emulator._detector import PRESETS

INPUTS, HEADS, _ = PRESETS["yolov5s"]
LETTERBOX = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")


@pytest.mark.parametrize("convert", ["host", "device"])
@pytest.mark.asyncio
async def test_an_engine_builds_one_postprocess_and_applies_it_once(
    convert: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[Any] = []
    runs: list[Any] = []
    init, run = _postprocess.Postprocess.__init__, _postprocess.Postprocess.run

    def counted_init(self: Any, *args: Any) -> None:
        made.append(self)
        init(self, *args)

    def counted_run(self: Any, *args: Any) -> Any:
        runs.append(self)
        return run(self, *args)

    monkeypatch.setattr(_postprocess.Postprocess, "__init__", counted_init)
    monkeypatch.setattr(_postprocess.Postprocess, "run", counted_run)
    model = make_loadable(INPUTS, HEADS, "detect", 0.002)
    frame = np.random.default_rng(0).integers(0, 256, (480, 640, 3), np.uint8)
    async with Engine(
        model, postprocess=Detect(head="yolov5"), preprocess={"images": LETTERBOX}, convert=convert
    ) as detector:
        assert len(made) == 1 and detector._flow.postprocess is made[0]  # type: ignore[union-attr]
        for _ in range(3):
            assert isinstance(await detector.infer(frame), Detections)
        on_stream = detector._device.detects_on_stream
    assert len(made) == 1
    # On the host each request runs the step once; on the stream, never on the host.
    assert len(runs) == (0 if on_stream else 3)
    assert on_stream == (convert == "device")
