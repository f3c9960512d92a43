"""The emulator op detect and ``aiodla emulate --preset yolov5s``: raw YOLOv5 heads with
a few dozen objects a frame, their definition (written out cell by cell below, apart
from the vectorized numpy), objects only in the picture, and the refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from aiodla import Detect, Engine, ImagePreprocess, TensorSpec, _cli
from aiodla._errors import ModelError
from aiodla.emulator import make_loadable, parse_loadable
from aiodla.emulator._detector import PRESETS
from aiodla.emulator._ops import compute_outputs, run_model

from vectors import vectors

M64 = (1 << 64) - 1
G = 0x9E3779B97F4A7C15


def finalize(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def reference_digest(stored: list[np.ndarray[Any, Any]]) -> int:
    """The format's digest of op detect, on Python ints: mix's weighted sum of each
    input's stored bits, over the elements whose h and w are multiples of 8 only, ``j``
    each element's row-major index in its whole tensor."""
    digest = 0
    for t, x in enumerate(stored):
        seed = finalize(0x41494F444C41 + t)
        bits = x.view(np.dtype(f"<u{x.itemsize}"))
        n, c, h, w = x.shape
        total = 0
        for index in np.ndindex(n, c, h, w):
            if index[2] % 8 or index[3] % 8:
                continue
            j = int(np.ravel_multi_index(index, x.shape))
            weight = finalize((seed + (j + 1) * G) & M64) | 1
            total = (total + int(bits[index]) * weight) & M64
        digest = finalize((digest + total + G) & M64)
    return digest


def in_picture(image: np.ndarray[Any, Any], y: int, x: int, height: int, width: int) -> bool:
    """Cell (y, x) of a height x width output: its first and last pixels of input 0
    each differ from pixel (0, 0) in some channel's stored bits."""
    bits = image[0].view(np.dtype(f"<u{image.itemsize}"))
    _, h, w = bits.shape
    corners = [
        (y * h // height, x * w // width),
        (((y + 1) * h - 1) // height, ((x + 1) * w - 1) // width),
    ]
    return all(
        any(int(bits[c, row, column]) != int(bits[c, 0, 0]) for c in range(bits.shape[0]))
        for row, column in corners
    )


def reference_head(
    spec: TensorSpec, digest: int, o: int, image: np.ndarray[Any, Any]
) -> np.ndarray[Any, Any]:
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
        if not in_picture(image, y, x, height, width):
            continue
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


def letterboxed(x: np.ndarray[Any, Any], rows: int) -> np.ndarray[Any, Any]:
    """``x`` with its first and last ``rows`` rows one uniform colour, as a letterbox's
    padding (the colour of its pixel (0, 0) in every channel)."""
    x = x.copy()
    x[:, :, :rows] = x[:, :, :1, :1]
    x[:, :, x.shape[2] - rows :] = x[:, :, :1, :1]
    return x


@pytest.mark.parametrize("rows", [0, 6], ids=["picture everywhere", "letterboxed"])
def test_op_matches_its_definition(rows: int) -> None:
    model = parse_loadable(make_loadable(*SMALL, "detect"))
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = letterboxed(rng.normal(size=SMALL[0][0].shape).astype(np.float16), rows)
        digest = reference_digest([x])
        outputs = compute_outputs(model, [x])
        for o, (spec, got) in enumerate(zip(SMALL[1], outputs, strict=True)):
            assert got.dtype == spec.numpy_dtype and got.shape == spec.shape
            assert (got == reference_head(spec, digest, o, x)).all()


DETECT_VECTORS = [v for v in vectors(requests=2) if v.model.op == "detect"]


@pytest.mark.parametrize("vector", DETECT_VECTORS, ids=[v.name for v in DETECT_VECTORS])
def test_shared_vectors_follow_the_definition(vector: Any) -> None:
    """The shared vectors (the GPU stand-in is held to them): several inputs, images in
    a batch, sizes no multiple of the grid."""
    for arrays in vector.arrays:
        digest = reference_digest(list(arrays))
        outputs = compute_outputs(vector.model, list(arrays))
        for o, (spec, got) in enumerate(zip(vector.model.outputs, outputs, strict=True)):
            assert (got == reference_head(spec, digest, o, arrays[0])).all(), spec.name


def test_the_digest_reads_the_grid_only() -> None:
    """An emulated task's objects follow the input's elements on the 8 x 8 grid of (h, w)
    and no other: a frame changed between the grid's points keeps its heads, one changed
    element on the grid gives other objects. The task reads nothing else of the input
    but the cell corners, so NaN anywhere off the grid changes nothing either."""
    model = parse_loadable(make_loadable(*SMALL, "detect"))
    (image,) = SMALL[0]
    x = np.random.default_rng(5).normal(size=image.shape).astype(np.float16)

    def task(x: np.ndarray[Any, Any]) -> list[bytes]:
        outputs = [np.zeros(spec.size, np.uint8) for spec in SMALL[1]]
        run_model(model, [image.pack(x)], outputs)
        return [out.tobytes() for out in outputs]

    before = task(x)
    off_grid = x.copy()
    off_grid[:, :, 1::8] = np.nan  # cell corners of both heads lie on rows 0, 7, 8, 15, ...
    off_grid[:, :, 2:7, :] += 1
    assert task(off_grid) == before
    on_grid = x.copy()
    on_grid[0, 2, 8, 16] += 1
    assert task(on_grid) != before


@pytest.mark.parametrize("rows", [0, 6, 8], ids=["square", "letterboxed", "all padding"])
def test_the_task_writes_what_the_definition_gives(rows: int) -> None:
    """The emulated task (the background's bytes, then the object cells at their offsets
    in the DLA layout) equals the definition's logical heads packed, byte for byte, over
    a buffer holding another request's heads: every byte is written."""
    model = parse_loadable(make_loadable(*SMALL, "detect"))
    (image,) = SMALL[0]
    rng = np.random.default_rng(rows)
    stale = [np.full(spec.size, 0x5A, np.uint8) for spec in SMALL[1]]
    for _ in range(3):
        x = letterboxed(rng.normal(size=image.shape).astype(np.float16), rows)
        run_model(model, [image.pack(x)], stale)
        want = compute_outputs(model, [x])
        for spec, got, head in zip(SMALL[1], stale, want, strict=True):
            assert got.tobytes() == spec.pack(head).tobytes(), spec.name


def test_objects_only_in_the_picture() -> None:
    """YOLOv5s' heads from a 16:9 frame letterboxed into 640 x 640 (picture rows 140..500):
    every object's box centre lies in the picture, each frame has its own objects, and
    the heads are a function of the input alone."""
    inputs, outputs, _ = PRESETS["yolov5s"]
    model = parse_loadable(make_loadable(inputs, outputs, "detect"))
    plan = Detect(head="yolov5").plan((640, 640), outputs)
    letterbox = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
    rng = np.random.default_rng(4)
    seen = []
    for _ in range(4):
        frame = rng.integers(0, 256, (1080, 1920, 3), np.uint8)
        x = letterbox.apply(frame, inputs[0]).astype(np.float16)
        heads = compute_outputs(model, [x])
        assert all((a == b).all() for a, b in zip(heads, compute_outputs(model, [x])))
        found = plan.run(heads)
        centres = (found.boxes[:, 1] + found.boxes[:, 3]) / 2
        assert len(found) >= 10 and ((centres >= 140) & (centres <= 500)).all()
        geometry = letterbox.geometry(1080, 1920, 640, 640)
        assert plan.run(heads, geometry, (1080, 1920)).outside == 0
        seen.append(found.boxes.tobytes())
    assert len(set(seen)) == 4  # each frame its own objects


@pytest.mark.parametrize("convert", ["host", "device"])
@pytest.mark.asyncio
async def test_no_box_from_the_padding_through_an_engine(convert: str) -> None:
    """The emulated task as an engine runs it (reading the input buffer as it lies in the
    DLA layout), frames of four shapes letterboxed into the preset: padding above and
    below, left and right, none. Every frame has boxes, all with an area, and none that
    Detect finds in the padding (``outside``), on the numpy path and the stream op."""
    inputs, outputs, _ = PRESETS["yolov5s"]
    letterbox = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
    options: dict[str, Any] = {"preprocess": {"images": letterbox}, "convert": convert}
    rng = np.random.default_rng(6)
    async with Engine(
        make_loadable(inputs, outputs, "detect"), postprocess=Detect(head="yolov5"), **options
    ) as engine:
        for size in ((1080, 1920), (960, 540), (480, 640), (640, 640)):
            found = await engine.infer(rng.integers(0, 256, (*size, 3), np.uint8))
            boxes = np.asarray(found.boxes)
            assert len(found) >= 10 and found.outside == 0, (size, len(found), found.outside)
            assert ((boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])).all()


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
