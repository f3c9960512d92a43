"""--int8 --calib: explicit Q/DQ from onnxruntime, calibrated on exactly what the engine's
ImagePreprocess feeds the DLA, and the held-out agreement report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx", reason="needs onnx (aiodla[compile])")
pytest.importorskip("onnxruntime", reason="needs onnxruntime (aiodla[compile])")
pytest.importorskip("onnx_graphsurgeon", reason="needs onnx-graphsurgeon (aiodla[compile])")
Image = pytest.importorskip("PIL.Image", reason="needs Pillow (aiodla[compile])")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from aiodla import ConfigurationError, Detect, EmulatedRuntime, Engine, ImagePreprocess  # noqa: E402
from aiodla._cli import cli  # noqa: E402
from aiodla.compile import (  # noqa: E402
    _quantize,
    compile_model,
)

import detector_graphs as graphs  # noqa: E402

COUNT = 24  # images: 18 calibrate, 6 are held out


def scenes(directory: Path, count: int = COUNT) -> list[np.ndarray[Any, Any]]:
    """PNG frames of several sizes (the letterbox pads them differently): a gradient
    background with a few coloured boxes, and noise; written RGB, returned as read."""
    rng = np.random.default_rng(7)
    directory.mkdir(exist_ok=True)
    frames = []
    for i in range(count):
        h, w = (48, 80) if i % 3 else (90, 60)
        frame = (np.linspace(0, 200, w)[None, :, None] * np.ones((h, 1, 3))).astype(np.uint8)
        for _ in range(3):
            y, x = rng.integers(0, h - 10), rng.integers(0, w - 10)
            frame[y : y + rng.integers(5, 25), x : x + rng.integers(5, 25)] = rng.integers(
                0, 256, 3
            )
        frame = np.clip(frame + rng.normal(0, 6, frame.shape), 0, 255).astype(np.uint8)
        Image.fromarray(frame).save(directory / f"frame{i:02d}.png")
        frames.append(frame)
    return frames


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """yolov8 compiled --int8 --emulate, with what the calibrator was fed recorded."""
    tmp = tmp_path_factory.mktemp("int8")
    frames = scenes(tmp / "calib")
    source = tmp / "yolov8.onnx"
    source.write_bytes(graphs.yolov8())
    fed: list[np.ndarray[Any, Any]] = []
    original = _quantize._Reader.get_next

    def recording(self: Any) -> Any:
        item = original(self)
        if item is not None:
            fed.append(item["images"].copy())
        return item

    _quantize._Reader.get_next = recording  # type: ignore[method-assign]
    try:
        result = compile_model(source, tmp / "q.bin", int8=True, calib=tmp / "calib", emulate=True)
    finally:
        _quantize._Reader.get_next = original  # type: ignore[method-assign]
    return {"result": result, "fed": fed, "frames": frames, "tmp": tmp}


def test_the_quantized_network_has_qdq_nodes_and_runs(compiled: dict[str, Any]) -> None:
    result = compiled["result"]
    model = onnx.load(result.quantized)
    kinds = [node.op_type for node in model.graph.node]
    assert kinds.count("QuantizeLinear") > 10 and kinds.count("DequantizeLinear") > 10
    for node in model.graph.node:  # symmetric INT8: what TensorRT's explicit quantization takes
        if node.op_type == "QuantizeLinear":
            zero = next(t for t in model.graph.initializer if t.name == node.input[2])
            assert onnx.numpy_helper.to_array(zero).dtype == np.int8
            assert not onnx.numpy_helper.to_array(zero).any()
    session = ort.InferenceSession(result.quantized, providers=["CPUExecutionProvider"])
    heads = session.run(None, {"images": graphs.images(1)[0]})
    assert [h.shape for h in heads] == [(1, 66, 8, 8), (1, 66, 4, 4), (1, 66, 2, 2)]
    assert all(h.dtype == np.float32 for h in heads)  # the heads leave unquantized


def test_calibration_sees_bit_for_bit_what_the_engine_feeds(compiled: dict[str, Any]) -> None:
    """The arrays the calibrator read are the very input tensors the engine hands the
    DLA for the same frames through the compiled model's ImagePreprocess."""
    result, fed, frames = compiled["result"], compiled["fed"], compiled["frames"]
    assert len(fed) == len(result.calibration) == COUNT - COUNT // 4
    settings = json.loads(Path(result.settings).read_text())["preprocess"]
    seen: list[np.ndarray[Any, Any]] = []

    def recorder(inputs: Any) -> dict[str, Any]:
        seen.append(np.array(inputs["images"]))
        return {
            f"head_stride{s}": np.zeros((1, 66, 64 // s, 64 // s), np.float32)
            for s in graphs.STRIDES
        }

    async def run() -> None:
        async with Engine(
            result.loadable,
            runtime=EmulatedRuntime(compute=recorder),
            preprocess={"images": ImagePreprocess(source="rgb", **settings)},
        ) as engine:
            for frame in frames[: len(fed)]:
                await engine.infer(frame)

    import asyncio

    asyncio.run(run())
    assert len(seen) == len(fed)
    for engine_input, calibration in zip(seen, fed):
        assert engine_input.dtype == np.float16
        assert calibration.dtype == np.float32
        np.testing.assert_array_equal(
            calibration.astype(np.float16).view(np.uint16), engine_input.view(np.uint16)
        )
        np.testing.assert_array_equal(calibration, engine_input.astype(np.float32))


def test_the_agreement_report_holds_int8_against_fp32(compiled: dict[str, Any]) -> None:
    report = compiled["result"].agreement
    assert report["images"] == COUNT // 4
    assert report["held_out"] == [f"frame{i:02d}.png" for i in range(COUNT - COUNT // 4, COUNT)]
    assert report["fp32_detections"] > 0
    assert 0 < report["matched"] <= report["fp32_detections"]
    assert 0.5 <= report["mean_iou"] <= 1.0
    assert 0 <= report["mean_score_error"] <= report["max_score_error"] < 0.5


async def test_the_int8_emulated_chain_runs_the_quantized_network(
    compiled: dict[str, Any],
) -> None:
    result = compiled["result"]
    x = graphs.images(1, seed=4)[0]
    session = ort.InferenceSession(result.quantized, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    want = dict(zip(names, session.run(None, {"images": x.astype(np.float16).astype(np.float32)})))
    async with Engine(result.loadable) as engine:
        got = await engine.infer(x)
    for name in names:
        np.testing.assert_array_equal(got[name], want[name].astype(np.float16))


test_the_int8_emulated_chain_runs_the_quantized_network = pytest.mark.asyncio(
    test_the_int8_emulated_chain_runs_the_quantized_network
)


def test_verify_judges_an_int8_network_by_its_precision(compiled: dict[str, Any]) -> None:
    """Its I/O is FP16 (the tensors do not say INT8): the compile settings do."""
    result = compiled["result"]
    source = str(compiled["tmp"] / "yolov8.onnx")
    shown = CliRunner().invoke(
        cli, ["verify", result.loadable, "--export", source, "--json", "--samples", "2",
              "--requests", "2", "--cores", "0"],
    )  # fmt: skip
    found = json.loads(shown.output[shown.output.index("{") :])["detections"]
    assert (found["precision"], found["min_matched"]) == ("int8", 0.8)
    entry = found["cores"]["0"]
    assert entry["reference"] > 0
    assert entry["pass"] == (
        entry["matched"] >= 0.8 * entry["reference"] and entry["matched"] >= 0.8 * entry["found"]
    )


def test_the_cli_prints_the_agreement(tmp_path: Path) -> None:
    scenes(tmp_path / "calib", 8)
    source = tmp_path / "yolox.onnx"
    source.write_bytes(graphs.yolox())
    result = CliRunner().invoke(
        cli,
        [
            "compile",
            str(source),
            "-o",
            str(tmp_path / "x.bin"),
            "--int8",
            "--calib",
            str(tmp_path / "calib"),
            "--emulate",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "int8       " in result.output and "(6 images calibrated)" in result.output
    assert "held-out image(s)" in result.output
    assert Detect.for_model(str(tmp_path / "x.bin")).head == "yolox"


class TestCalibrationImages:
    def test_too_few_images(self, tmp_path: Path) -> None:
        scenes(tmp_path / "one", 1)
        with pytest.raises(ConfigurationError, match="holds 1 images"):
            _quantize.read_images(tmp_path / "one")

    def test_a_missing_directory(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigurationError, match="--calib"):
            _quantize.read_images(tmp_path / "nowhere")

    def test_npy_frames_and_a_bad_one(self, tmp_path: Path) -> None:
        np.save(tmp_path / "a.npy", np.zeros((10, 12, 3), np.uint8))
        np.save(tmp_path / "b.npy", np.zeros((10, 12, 3), np.uint8))
        assert [name for name, _ in _quantize.read_images(tmp_path)] == ["a.npy", "b.npy"]
        np.save(tmp_path / "c.npy", np.zeros((10, 12), np.float32))
        with pytest.raises(ConfigurationError, match=r"c\.npy.*not an H x W x 3 uint8"):
            _quantize.read_images(tmp_path)

    def test_an_unreadable_image(self, tmp_path: Path) -> None:
        scenes(tmp_path, 2)
        (tmp_path / "broken.png").write_bytes(b"not a png")
        with pytest.raises(ConfigurationError, match=r"cannot read .*broken\.png"):
            _quantize.read_images(tmp_path)
