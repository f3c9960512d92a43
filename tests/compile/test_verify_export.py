"""aiodla verify --export: a compiled detector (emulated) held against its full export's
own detections, per core."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("onnx", reason="needs onnx (aiodla[compile])")
pytest.importorskip("onnxruntime", reason="needs onnxruntime (aiodla[compile])")
pytest.importorskip("onnx_graphsurgeon", reason="needs onnx-graphsurgeon (aiodla[compile])")

from click.testing import CliRunner

from aiodla._cli import cli
from aiodla.compile import compile_model

import detector_graphs as graphs

QUICK = ["--samples", "3", "--requests", "2"]


def compiled(tmp_path: Path, family: str) -> tuple[str, str]:
    source = tmp_path / f"{family}.onnx"
    source.write_bytes(graphs.FAMILIES[family]())
    out = str(tmp_path / f"{family}.bin")
    # the test graphs take inputs in [0, 1]; a real YOLOX takes pixel values (scale 1)
    compile_model(source, out, emulate=True, preprocess={"scale": 1 / 255})
    return out, str(source)


@pytest.mark.parametrize("family", ["yolov5", "yolov8", "yolox"])
def test_the_compiled_model_agrees_with_its_export_on_every_core(
    tmp_path: Path, family: str
) -> None:
    out, source = compiled(tmp_path, family)
    result = CliRunner().invoke(cli, ["verify", out, "--export", source, "--json", *QUICK])
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)["detections"]
    assert set(found["cores"]) == {"0", "1"}
    for entry in found["cores"].values():
        assert entry["pass"]
        assert entry["reference"] > 0
        assert entry["matched"] >= 0.95 * entry["reference"]
        # FP16 heads can swap two near-tied neighbours in NMS: the one kept instead
        # overlaps the other, less than fully
        assert entry["mean_iou"] > 0.9
        assert entry["max_score_difference"] < 1e-3


def test_boxes_beyond_float_range_match_nothing() -> None:
    import numpy as np

    from aiodla.compile._exporter import match

    inf = np.float32("inf")
    want = (np.array([[0, 0, inf, 10]], np.float32), np.array([0.9]), np.array([0]))
    got = (np.array([[0, 0, inf, 10]], np.float32), np.array([0.9]), np.array([0]))
    assert match(got, want) == (0, [], [])
    finite = (np.array([[0, 0, 10, 10]], np.float32), np.array([0.9]), np.array([0]))
    assert match(finite, finite) == (1, [1.0], [0.0])


def test_another_export_fails_with_the_figures(tmp_path: Path) -> None:
    out, _ = compiled(tmp_path, "yolov8")
    other = tmp_path / "other.onnx"
    other.write_bytes(graphs.yolov8(99))  # same I/O, other weights
    result = CliRunner().invoke(cli, ["verify", out, "--export", str(other), *QUICK])
    assert result.exit_code == 1, result.output
    assert "vs export  core 0:" in result.output and "FAIL (under 95%)" in result.output
    assert "verdict    FAIL" in result.output


def test_a_model_without_compile_settings_is_refused(tmp_path: Path) -> None:
    out, source = compiled(tmp_path, "yolov5")
    Path(out + ".detect.json").unlink()
    result = CliRunner().invoke(cli, ["verify", out, "--export", source, *QUICK])
    assert result.exit_code == 1
    assert "--export compares a compiled detector" in result.output


def test_an_export_of_other_io_is_refused(tmp_path: Path) -> None:
    out, _ = compiled(tmp_path, "yolov5")
    other = tmp_path / "x.onnx"
    other.write_bytes(graphs.yolox())  # its output is named "output", not "output0"
    result = CliRunner().invoke(cli, ["verify", out, "--export", str(other), *QUICK])
    assert result.exit_code == 1
    assert "the compiled model was cut from an export with input 'images' and output" in (
        result.output
    )
