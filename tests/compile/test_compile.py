"""aiodla compile end to end: the files it writes, the emulated chain (compile --emulate
-> Engine -> Detect.for_model) against onnxruntime's full graph, the build command and
I/O formats, and every refusal."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnx", reason="needs onnx (aiodla[compile])")
pytest.importorskip("onnxruntime", reason="needs onnxruntime (aiodla[compile])")
pytest.importorskip("onnx_graphsurgeon", reason="needs onnx-graphsurgeon (aiodla[compile])")

import onnx
import onnxruntime as ort
from click.testing import CliRunner

from aiodla import ConfigurationError, Detect, Engine, ModelError
from aiodla._cli import cli
from aiodla.compile import CompileError, compile_model, exporter_detections
from aiodla.compile._build import io_formats, trtexec_command
from aiodla.emulator import parse_loadable

import detector_graphs as graphs


def full_graph(model: bytes, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"images": x})[0])


def write(tmp_path: Path, family: str) -> str:
    path = tmp_path / f"{family}.onnx"
    path.write_bytes(graphs.FAMILIES[family]())
    return str(path)


@pytest.mark.asyncio
@pytest.mark.parametrize("family", sorted(graphs.FAMILIES))
async def test_emulated_chain_gives_the_full_graphs_detections(tmp_path: Path, family: str) -> None:
    """compile --emulate -> Engine -> Detect.for_model against onnxruntime's full graph
    on the FP16 input the DLA reads; the heads leave the DLA in FP16, so scores agree to
    FP16's rounding (1e-3) and a candidate that close to the threshold may fall on
    either side."""
    source = write(tmp_path, family)
    out = str(tmp_path / "model.bin")
    result = compile_model(source, out, emulate=True)
    detect = Detect.for_model(out)
    seen = 0
    async with Engine(out, postprocess=detect) as engine:
        for x in graphs.images(4, seed=3):
            got = await engine.infer(x)
            seen_fp16 = x.astype(np.float16).astype(np.float32)
            want = exporter_detections(
                result.cut.family, full_graph(graphs.FAMILIES[family](), seen_fp16)
            )
            _match(got, want, conf=detect.conf)
            seen += len(got)
    assert seen > 10


def _match(got: Any, want: tuple[Any, Any, Any], *, conf: float) -> None:
    boxes, scores, classes = want
    got_boxes, got_scores = np.asarray(got.boxes), np.asarray(got.scores)
    got_classes = np.asarray(got.classes)
    free = np.ones(len(got), bool)
    for box, score, cls in zip(boxes, scores, classes):
        fits = (
            free
            & (got_classes == cls)
            & (np.abs(got_boxes - box).max(axis=1) <= 0.5)
            & (np.abs(got_scores - score) <= 1e-3)
        )
        if not fits.any():
            assert abs(score - conf) < 1e-3, f"missing class {cls} at {box}, score {score}"
            continue
        free[np.flatnonzero(fits)[0]] = False
    assert all(abs(s - conf) < 1e-3 for s in got_scores[free]), got_scores[free]


def test_the_files_and_the_settings(tmp_path: Path) -> None:
    source = write(tmp_path, "yolov5")
    out = tmp_path / "yolo.bin"
    result = compile_model(source, out, emulate=True)
    assert result.trimmed == str(tmp_path / "yolo.trimmed.onnx")
    assert result.detect(conf=0.3) == Detect.for_model(str(out), conf=0.3)
    onnx.checker.check_model(result.trimmed)
    document = json.loads((tmp_path / "yolo.bin.detect.json").read_text())
    assert document["schema"] == "aiodla-compiled/1"
    assert document["detect"]["head"] == "yolov5"
    assert document["detect"]["anchors"] == [list(map(float, a)) for a in graphs.ANCHORS]
    assert document["input"] == {"name": "images", "height": 64, "width": 64}
    assert document["preprocess"]["order"] == "rgb"
    assert document["check"]["findings"] == []
    model = parse_loadable(out.read_bytes())
    assert model.onnx == Path(result.trimmed).read_bytes()
    assert [s.name for s in model.outputs] == ["head_stride8", "head_stride16", "head_stride32"]
    assert {(s.dtype, s.format) for s in (*model.inputs, *model.outputs)} == {("float16", "chw16")}
    shown = CliRunner().invoke(cli, ["inspect", str(out)])
    assert f"computed by its ONNX network ({len(model.onnx)} bytes)" in shown.output


class TestForModel:
    @pytest.fixture
    def compiled(self, tmp_path: Path) -> str:
        out = str(tmp_path / "m.bin")
        compile_model(write(tmp_path, "yolov8"), out, emulate=True)
        return out

    def test_thresholds_as_keywords(self, compiled: str) -> None:
        detect = Detect.for_model(compiled, conf=0.4, iou=0.6, max_det=10, class_agnostic=True)
        assert (detect.head, detect.classes, detect.reg_max) == ("yolov8", 2, 16)
        assert (detect.conf, detect.iou, detect.max_det, detect.class_agnostic) == (
            0.4,
            0.6,
            10,
            True,
        )
        assert detect.strides == (8, 16, 32)
        assert detect.outputs == ("head_stride8", "head_stride16", "head_stride32")

    def test_other_keywords_are_refused(self, compiled: str) -> None:
        with pytest.raises(ConfigurationError, match="classes come from the compiled model"):
            Detect.for_model(compiled, classes=3)

    def test_a_bad_threshold_is_refused_by_detect(self, compiled: str) -> None:
        with pytest.raises(ConfigurationError, match="conf=2"):
            Detect.for_model(compiled, conf=2)

    def test_a_missing_settings_file(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigurationError, match=r"other\.bin\.detect\.json' does not exist"):
            Detect.for_model(str(tmp_path / "other.bin"))

    def test_a_file_that_is_not_one(self, compiled: str) -> None:
        Path(compiled + ".detect.json").write_text('{"schema": "x"}')
        with pytest.raises(ConfigurationError, match="not an aiodla compile settings file"):
            Detect.for_model(compiled)
        Path(compiled + ".detect.json").write_text("{")
        with pytest.raises(ConfigurationError, match="cannot read"):
            Detect.for_model(compiled)
        Path(compiled + ".detect.json").write_text(
            json.dumps(
                {
                    "schema": "aiodla-compiled/1",
                    "detect": {"head": "yolov8", "x": 1},
                    "preprocess": {},
                    "input": {},
                }
            )
        )
        with pytest.raises(ConfigurationError, match="do not fit Detect"):
            Detect.for_model(compiled)

    def test_the_model_must_be_a_path(self) -> None:
        with pytest.raises(ConfigurationError, match="must be the loadable's path"):
            Detect.for_model(b"bytes")  # type: ignore[arg-type]


class TestBuild:
    def test_the_command_and_io_formats(self) -> None:
        shapes = [(1, 21, 8, 8), (1, 21, 4, 4)]
        fp16 = trtexec_command(
            "m.onnx", "m.bin", inputs=[(1, 3, 64, 64)], outputs=shapes, int8=False
        )
        assert fp16 == (
            "trtexec",
            "--onnx=m.onnx",
            "--saveEngine=m.bin",
            "--useDLACore=0",
            "--buildDLAStandalone",
            "--fp16",
            "--inputIOFormats=fp16:chw16",
            "--outputIOFormats=fp16:chw16,fp16:chw16",
        )
        int8 = trtexec_command(
            "q.onnx", "q.bin", inputs=[(1, 3, 64, 64)], outputs=shapes[:1], int8=True, core=1
        )
        assert "--int8" in int8 and "--fp16" in int8 and "--useDLACore=1" in int8
        assert not any("Fallback" in part for part in (*fp16, *int8))
        assert int8[-2:] == ("--inputIOFormats=fp16:chw16", "--outputIOFormats=fp16:chw16")

    def test_io_formats_refuse_what_the_dla_cannot_take(self) -> None:
        assert io_formats([(1, 3, 8, 8), (1, 100, 2, 2)]) == ("fp16:chw16", "fp16:chw16")
        with pytest.raises(ModelError, match=r"4-D.*\[1, 84, 8400\]"):
            io_formats([(1, 84, 8400)])

    def test_without_tensorrt_it_says_so_and_gives_the_command(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("PATH", str(tmp_path))
        source = write(tmp_path, "yolox")
        out = tmp_path / "x.bin"
        out.write_bytes(b"stale")
        result = CliRunner().invoke(cli, ["compile", source, "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert "NOT BUILT  this machine cannot build a DLA loadable" in result.output
        assert f"trtexec --onnx={tmp_path / 'x.trimmed.onnx'}" in result.output
        assert not out.exists()  # no stale loadable passes for this build's
        document = json.loads((tmp_path / "x.bin.detect.json").read_text())
        assert document["build"]["built"] is False
        assert "--buildDLAStandalone" in document["build"]["command"]

    def _fake_trtexec(self, directory: Path, code: int) -> Path:
        """A trtexec that records its arguments and, exiting 0, writes --saveEngine."""
        script = directory / "trtexec"
        script.write_text(
            f"#!{sys.executable}\n"
            "import json, sys\n"
            f"open({str(directory / 'args.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
            "out = [a.split('=', 1)[1] for a in sys.argv if a.startswith('--saveEngine=')][0]\n"
            f"if {code} == 0:\n    open(out, 'wb').write(b'loadable')\n"
            f"else:\n    print('[E] layer not supported on DLA')\n"
            f"sys.exit({code})\n"
        )
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        return script

    def test_where_trtexec_is_it_builds(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        self._fake_trtexec(tmp_path, 0)
        monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ["PATH"])
        out = tmp_path / "b.bin"
        result = CliRunner().invoke(cli, ["compile", write(tmp_path, "yolov8"), "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert "(built by trtexec)" in result.output
        args = json.loads((tmp_path / "args.json").read_text())
        assert "--buildDLAStandalone" in args and "--useDLACore=0" in args
        assert out.read_bytes() == b"loadable"

    def test_a_failed_build_exits_1_with_trtexecs_words(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        self._fake_trtexec(tmp_path, 3)
        monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ["PATH"])
        result = CliRunner().invoke(
            cli, ["compile", write(tmp_path, "yolov8"), "-o", str(tmp_path / "b.bin")]
        )
        assert result.exit_code == 1, result.output
        assert "trtexec failed (exit 3)" in result.output
        assert "layer not supported on DLA" in result.output


class _FakeTensorRT:
    """What build_with_api asks of TensorRT's Python package, recorded."""

    __version__ = "10.3.0"
    float16 = "float16"

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None:
            self.level = level

    class DeviceType:
        DLA = "DLA"

    class EngineCapability:
        DLA_STANDALONE = "DLA_STANDALONE"

    class BuilderFlag:
        FP16, INT8, GPU_FALLBACK = "FP16", "INT8", "GPU_FALLBACK"

    class TensorFormat:
        CHW16 = 5

    def __init__(self, parses: bool = True, builds: bool = True) -> None:
        fake = self
        self.parses, self.builds = parses, builds
        self.flags: list[str] = []
        self.tensors: list[Any] = []
        self.config: Any = None

        class Tensor:
            dtype: Any = "float32"
            allowed_formats = 0

        class Network:
            num_inputs, num_outputs = 1, 3

            def get_input(self, i: int) -> Any:
                fake.tensors.append(Tensor())
                return fake.tensors[-1]

            get_output = get_input

        class Config:
            def set_flag(self, flag: str) -> None:
                fake.flags.append(flag)

        class Builder:
            def __init__(self, logger: Any) -> None:
                pass

            def create_network(self, flags: int) -> Any:
                return Network()

            def create_builder_config(self) -> Any:
                fake.config = Config()
                return fake.config

            def build_serialized_network(self, network: Any, config: Any) -> Any:
                return b"dla loadable" if fake.builds else None

        class OnnxParser:
            num_errors = 1

            def __init__(self, network: Any, logger: Any) -> None:
                pass

            def parse(self, data: bytes, path: str) -> bool:
                assert data.startswith(b"\x08")  # an ONNX ModelProto: ir_version first
                return fake.parses

            def get_error(self, i: int) -> str:
                return "unsupported operator"

        self.Builder, self.OnnxParser = Builder, OnnxParser


class TestBuildWithTheTensorRTAPI:
    def _compile(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trt: Any) -> Any:
        monkeypatch.setenv("PATH", str(tmp_path))  # no trtexec
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        out = tmp_path / "api.bin"
        return CliRunner().invoke(cli, ["compile", write(tmp_path, "yolov5"), "-o", str(out),
                                        "--core", "1"]), out  # fmt: skip

    def test_it_builds_a_standalone_dla_loadable(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        trt = _FakeTensorRT()
        result, out = self._compile(tmp_path, monkeypatch, trt)
        assert result.exit_code == 0, result.output
        assert "(built by TensorRT 10.3.0's Python API)" in result.output
        assert out.read_bytes() == b"dla loadable"
        config = trt.config
        assert (config.default_device_type, config.DLA_core) == ("DLA", 1)
        assert config.engine_capability == "DLA_STANDALONE"
        assert trt.flags == ["FP16"]  # no GPU_FALLBACK
        assert [(t.dtype, t.allowed_formats) for t in trt.tensors] == [("float16", 1 << 5)] * 4

    def test_a_parse_or_build_failure_is_reported(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        result, out = self._compile(tmp_path, monkeypatch, _FakeTensorRT(parses=False))
        assert "NOT BUILT  TensorRT cannot parse" in result.output
        assert "unsupported operator" in result.output
        assert not out.exists()
        result, out = self._compile(tmp_path, monkeypatch, _FakeTensorRT(builds=False))
        assert "NOT BUILT  TensorRT's builder failed" in result.output
        assert not out.exists()


class TestRefusals:
    def test_a_layer_the_dla_cannot_run_is_named_before_any_build(self, tmp_path: Path) -> None:
        model = onnx.load_from_string(graphs.yolov5())
        first = next(n for n in model.graph.node if n.op_type == "Sigmoid")
        first.op_type = "HardSigmoid"
        path = tmp_path / "hard.onnx"
        onnx.save(model, path)
        with pytest.raises(CompileError) as caught:
            compile_model(path, tmp_path / "h.bin", emulate=True)
        assert [(f.op, f.rule) for f in caught.value.findings] == [("HardSigmoid", "unsupported")]
        result = CliRunner().invoke(cli, ["compile", str(path), "-o", str(tmp_path / "h.bin")])
        assert result.exit_code == 1
        assert "not on the DLA" in result.output and "HardSigmoid" in result.output
        assert not (tmp_path / "h.bin").exists()

    def test_output_over_the_source_is_refused(self, tmp_path: Path) -> None:
        source = write(tmp_path, "yolov5")
        with pytest.raises(ModelError, match="would overwrite the source model"):
            compile_model(source, tmp_path / "yolov5.onnx")
        with pytest.raises(ModelError, match="would overwrite the source model"):
            compile_model(tmp_path / "m.trimmed.onnx", tmp_path / "m.bin")

    def test_int8_needs_calib_and_calib_needs_int8(self, tmp_path: Path) -> None:
        source = write(tmp_path, "yolov5")
        with pytest.raises(ModelError, match="--int8 needs --calib"):
            compile_model(source, tmp_path / "m.bin", int8=True)
        with pytest.raises(ModelError, match="--calib is for --int8"):
            compile_model(source, tmp_path / "m.bin", calib=tmp_path)

    def test_the_cli_names_a_model_it_cannot_cut(self, tmp_path: Path) -> None:
        path = tmp_path / "junk.onnx"
        path.write_bytes(b"junk")
        result = CliRunner().invoke(cli, ["compile", str(path), "-o", str(tmp_path / "j.bin")])
        assert result.exit_code == 1
        assert "junk.onnx" in result.output
