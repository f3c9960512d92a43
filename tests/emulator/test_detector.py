"""The emulator op detect and ``aiodla emulate --preset yolov5s``: raw YOLOv5 heads with
a few dozen objects a frame, their definition (written out cell by cell below, apart
from the vectorized numpy), and the refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from aiodla import Detect, Engine, TensorSpec, _cli
from aiodla._errors import ModelError
from aiodla.emulator import make_loadable, parse_loadable
from aiodla.emulator._detector import PRESETS
from aiodla.emulator._ops import compute_outputs, mix_digest

M64 = (1 << 64) - 1
G = 0x9E3779B97F4A7C15


def finalize(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def reference_head(spec: TensorSpec, digest: int, o: int) -> np.ndarray[Any, Any]:
    """The module docstring's definition, one cell at a time on Python ints."""
    _, channels, height, width = spec.shape
    per, cells = channels // 3, 3 * height * width
    key = finalize((digest + (o + 1) * 0xD1B54A32D192ED03) & M64)
    out = np.zeros((3, per, height, width))
    out[:, 4] = -8.0
    for i in range(cells):
        r = finalize((key + (i + 1) * G) & M64)
        if r >> 48 >= max(1, (16 << 16) // cells):
            continue
        a, rest = divmod(i, height * width)
        y, x = divmod(rest, width)
        for channel, shift in enumerate((0, 8, 32, 40)):
            out[a, channel, y, x] = ((r >> shift) & 255) / 128 - 1
        out[a, 4, y, x] = 4.0
        out[a, 5:, y, x] = -4.0
        out[a, 5 + (r >> 16) % (per - 5), y, x] = 4.0
    return out.reshape(spec.shape)


SMALL = (
    (TensorSpec("img", (1, 3, 32, 32), "float16", "chw16"),),
    (
        TensorSpec("p8", (1, 21, 4, 4), "float16", "chw16"),  # 3 anchors of 2 classes
        TensorSpec("p16", (1, 21, 2, 2), "float32", "nchw"),
    ),
)


def test_op_matches_its_definition() -> None:
    model = parse_loadable(make_loadable(*SMALL, "detect"))
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.normal(size=SMALL[0][0].shape).astype(np.float16)
        digest = mix_digest(model, [x])
        outputs = compute_outputs(model, [x])
        for o, (spec, got) in enumerate(zip(SMALL[1], outputs, strict=True)):
            assert got.dtype == spec.numpy_dtype and got.shape == spec.shape
            assert (got == reference_head(spec, digest, o)).all()


def test_preset_heads_have_a_few_dozen_detections() -> None:
    inputs, outputs, _ = PRESETS["yolov5s"]
    model = parse_loadable(make_loadable(inputs, outputs, "detect"))
    plan = Detect(head="yolov5").plan((640, 640), outputs)
    rng = np.random.default_rng(1)
    counts = []
    for _ in range(4):
        x = rng.random(inputs[0].shape).astype(np.float16)
        heads = compute_outputs(model, [x])
        counts.append(len(plan.run(heads)))
    assert all(20 <= count <= 100 for count in counts), counts
    assert len(set(counts)) > 1  # each frame its own objects


@pytest.mark.parametrize(
    ("output", "words"),
    [
        (TensorSpec("h", (1, 20, 4, 4), "float16", "nchw"), "3*(5+k)"),  # not 3 anchors
        (TensorSpec("h", (1, 15, 4, 4), "float16", "nchw"), "k >= 1 classes"),  # no class
        (TensorSpec("h", (1, 21, 4, 4), "int8", "chw32", scale=0.1), "float16/float32"),
        (TensorSpec("h", (2, 21, 4, 4), "float16", "nchw"), "(1, 3*(5+k), H, W)"),
    ],
)
def test_refused_outputs(output: TensorSpec, words: str) -> None:
    with pytest.raises(ModelError, match=r"op 'detect': output 'h'") as info:
        make_loadable(SMALL[0], [output], "detect")
    assert words in str(info.value)


def run(*args: str) -> Any:
    return CliRunner().invoke(_cli.cli, list(args))


@pytest.mark.asyncio
async def test_emulate_preset_yolov5s(tmp_path: Path) -> None:
    out = tmp_path / "yolov5s.bin"
    result = run("emulate", "--preset", "yolov5s", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "op detect, 3.800 ms per task" in result.output
    model = parse_loadable(out.read_bytes())
    assert [spec.shape for spec in model.outputs] == [
        (1, 255, 80, 80), (1, 255, 40, 40), (1, 255, 20, 20),
    ]  # fmt: skip
    assert model.inputs[0].shape == (1, 3, 640, 640) and model.inputs[0].dtype == "float16"
    async with Engine(str(out)) as engine:
        frame = np.random.default_rng(2).random((1, 3, 640, 640)).astype(np.float32)
        heads = await engine.infer(frame)
    plan = Detect(head="yolov5").plan((640, 640), model.outputs)
    assert 20 <= len(plan.run([heads[spec.name] for spec in plan.specs])) <= 100


def test_emulate_preset_refusals(tmp_path: Path) -> None:
    out = str(tmp_path / "x.bin")
    result = run("emulate", "--preset", "yolov5s", "--input", "a:1x3x8x8", "-o", out)
    assert result.exit_code == 2 and "not both" in result.output
    result = run("emulate", "--preset", "yolov6", "-o", out)
    assert result.exit_code == 2 and "yolov6" in result.output
