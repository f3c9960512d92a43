"""aiodla verify on the emulated runtime: an emulator loadable computed by
onnx_compute from an ONNX network is held against that network (a pass), against a
different one (a fail naming the output), and against one whose I/O names differ."""

from __future__ import annotations

import functools
import importlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

from aiodla import TensorSpec, _cli, _verify
from aiodla._doctor import Host
from aiodla.emulator import make_loadable

onnx = pytest.importorskip("onnx", reason="needs onnx (the 'test' extra; no wheel here)")
pytest.importorskip("onnxruntime", reason="needs onnxruntime (no wheel for this Python)")
from onnx import TensorProto, helper  # noqa: E402

IMAGE = TensorSpec("image", (1, 3, 16, 16), "float16", "chw16")
FEATURES = TensorSpec("features", (1, 3, 16, 16), "float16", "nchw")
SCORES = TensorSpec("scores", (1, 8, 1, 1), "float16", "nchw")


def network(seed: int = 3, input_name: str = "image") -> bytes:
    """Conv 3->3 + ReLU + 3x3 max pooling (features), and a classifier head: global
    average pooling and a 1x1 conv to 8 classes (scores, [1, 8] in ONNX)."""
    rng = np.random.default_rng(seed)

    def tensor(name: str, shape: tuple[int, ...]) -> Any:
        values = rng.standard_normal(shape).astype(np.float32) * 0.5
        return helper.make_tensor(name, TensorProto.FLOAT, shape, values.ravel())

    nodes = [
        helper.make_node("Conv", [input_name, "w", "b"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("MaxPool", ["relu"], ["features"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pooled"]),
        helper.make_node("Conv", ["pooled", "wc", "bc"], ["logits"]),
        helper.make_node("Flatten", ["logits"], ["scores"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [1, 3, 16, 16])],
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, 3, 16, 16]),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 8]),
        ],
        initializer=[
            tensor("w", (3, 3, 3, 3)),
            tensor("b", (3,)),
            tensor("wc", (8, 3, 1, 1)),
            tensor("bc", (8,)),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


class Setup:
    """An ONNX network, a module whose ``compute`` is onnx_compute of it, and the
    emulator loadable that names that compute function."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = tmp_path
        self.onnx = tmp_path / "net.onnx"
        self.onnx.write_bytes(network())
        module = f"verify_net_{uuid.uuid4().hex}"  # a fresh import per test
        (tmp_path / f"{module}.py").write_text(
            "import os\n"
            "from aiodla.emulator import onnx_compute\n"
            "compute = onnx_compute(os.path.join(os.path.dirname(__file__), 'net.onnx'))\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        self.model = tmp_path / "model.bin"
        self.model.write_bytes(
            make_loadable([IMAGE], [FEATURES, SCORES], latency=0.001, compute=f"{module}:compute")
        )

    def other(self, name: str, **kwargs: Any) -> Path:
        path = self.dir / name
        path.write_bytes(network(**kwargs))
        return path

    def run(self, *args: str) -> Result:
        base = [str(self.model), "--runtime", "emulated", "--trust-compute"]
        return CliRunner().invoke(
            _cli.cli, ["verify", *base, "--requests", "20", "--samples", "4", *args]
        )


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Setup:
    return Setup(tmp_path, monkeypatch)


@pytest.fixture
def quick_doctor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The doctor's CUDA probe answers at once (its own tests run the real one)."""
    facts = json.dumps({"bindings_version": "13.5.0"})
    fast = functools.partial(Host, probe_command=(sys.executable, "-c", f"print({facts!r})"))
    monkeypatch.setattr(_verify, "Host", fast)


def test_the_onnx_model_it_was_built_from_passes(setup: Setup) -> None:
    report = setup.dir / "report.md"
    result = setup.run("--onnx", str(setup.onnx), "--report", str(report), "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["verdict"] == "pass"
    assert document["cores"] == [0, 1] and set(document["latency"]) == {"0", "1"}
    assert document["cores_agree"] == {"identical": True, "against": 0, "differences": []}
    assert document["precision"] == "fp16"
    comparison = {entry["output"]: entry for entry in document["comparison"]}
    assert set(comparison) == {"features", "scores"}
    for entry in comparison.values():
        assert entry["pass"] and entry["failures"] == []
        assert entry["cosine"] > 0.999 and 0 < entry["max_rel"] < 0.02  # FP16 rounding
    assert comparison["scores"]["top1"] == 1.0 and comparison["features"]["top1"] is None
    for figures in document["latency"].values():
        assert 1.0 <= figures["median_ms"] <= figures["p99_ms"]  # 1 ms per task at least
        assert figures["requests"] == 20
    assert document["throughput"]["requests_per_second"] > 0
    assert document["versions"]["cuda_bindings"]  # the doctor's own probe ran
    text = report.read_text()
    assert "**Verdict: PASS**" in text
    assert "| `scores` |" in text and "| `features` |" in text
    assert "Cores [0, 1] gave identical bytes on every output." in text


def tiled(dynamic_name: str | None = "N") -> bytes:
    """An ONNX model with the loadable's I/O names whose 'features' output is 4 x 4
    times too large, and declares no shape: only the inputs' shapes tell its size."""
    rng = np.random.default_rng(1)
    weights = helper.make_tensor(
        "wc", TensorProto.FLOAT, (8, 3, 1, 1), rng.standard_normal(24).astype(np.float32)
    )
    nodes = [
        helper.make_node("Tile", ["image", "repeats"], ["features"]),
        helper.make_node("GlobalAveragePool", ["image"], ["pooled"]),
        helper.make_node("Conv", ["pooled", "wc"], ["logits"]),
        helper.make_node("Flatten", ["logits"], ["scores"]),
    ]
    batch = dynamic_name if dynamic_name is not None else 1
    graph = helper.make_graph(
        nodes,
        "tiled",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [batch, 3, 16, 16])],
        [
            helper.make_tensor_value_info("features", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [batch, 8]),
        ],
        initializer=[helper.make_tensor("repeats", TensorProto.INT64, [4], [1, 1, 4, 4]), weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


@pytest.mark.usefixtures("quick_doctor")
class TestOutputShapes:
    @pytest.mark.timeout(60)
    def test_an_output_of_another_shape_is_refused_before_anything_runs(self, setup: Setup) -> None:
        other = setup.dir / "tiled.onnx"
        other.write_bytes(tiled())
        # Checked before any measuring: a million requests would outlast the test.
        result = setup.run("--onnx", str(other), "--requests", "1000000")
        assert result.exit_code == 1, result.output
        assert result.output.count("\n") == 1, result.output
        assert "ONNX output 'features' has shape [1, 3, 64, 64]" in result.output
        assert "does not fit the model's (1, 3, 16, 16)" in result.output

    def test_an_output_of_another_size_found_at_run_time_is_a_model_error(self) -> None:
        from aiodla import ModelError
        from aiodla.emulator import onnx_compute

        network = onnx_compute(tiled(dynamic_name=None))
        # 'features' declares no shape; with no free dimension to fix, its size is
        # known only once computed: a ModelError naming it, not numpy's reshape error.
        network._plan = (
            [("image", "image", np.float32)],
            [("features", "features", (1, 3, 16, 16))],
        )
        network._checked = True
        with pytest.raises(ModelError, match=r"'features' came out \[1, 3, 64, 64\]"):
            network({"image": np.zeros((1, 3, 16, 16), np.float32)})


def test_the_first_hours_compute_recipe_runs_from_the_working_directory(
    tmp_path: Path,
) -> None:
    """docs/first-hour.md: 'aiodla verify model.emu.bin ... --trust-compute' with the
    compute module ci_reference.py beside the model, run as the installed script
    (which, unlike python -m, has no working directory on its path)."""
    script = shutil.which("aiodla", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("no 'aiodla' script beside this Python (not installed with pip)")
    module = f"ci_reference_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        "import numpy as np\n"
        "def compute(inputs):\n"
        "    return {'features': inputs['image'].astype(np.float32) * 2}\n"
    )
    (tmp_path / "model.emu.bin").write_bytes(
        make_loadable([IMAGE], [FEATURES], latency=0.001, compute=f"{module}:compute")
    )
    root = Path(__file__).resolve().parent.parent  # this tree's aiodla, not the cwd
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(root)
    done = subprocess.run(
        [script, "verify", "model.emu.bin", "--runtime", "emulated", "--trust-compute",
         "--requests", "2", "--samples", "1", "--cores", "0", "--json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert json.loads(done.stdout)["verdict"] == "pass"


@pytest.mark.usefixtures("quick_doctor")
class TestRequests:
    def test_requests_n_runs_n_a_core_and_4n_for_the_throughput(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """--requests' help: N one at a time per core for the latency, four times as
        many for the throughput; counted by the tasks the emulated DLA ran."""
        module = f"verify_count_{uuid.uuid4().hex}"
        (tmp_path / f"{module}.py").write_text(
            "import numpy as np\n"
            "calls = []\n"
            "def compute(inputs):\n"
            "    calls.append(1)\n"
            "    return {'features': np.zeros((1, 3, 16, 16), np.float32)}\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        model = tmp_path / "model.bin"
        model.write_bytes(make_loadable([IMAGE], [FEATURES], latency=0.001,
                                        compute=f"{module}:compute"))  # fmt: skip
        n, samples = 7, 3
        result = CliRunner().invoke(
            _cli.cli,
            ["verify", str(model), "--runtime", "emulated", "--trust-compute", "--json",
             "--requests", str(n), "--samples", str(samples)],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        document = json.loads(result.output)
        assert [f["requests"] for f in document["latency"].values()] == [n, n]
        assert document["throughput"]["requests"] == 4 * n
        calls = len(importlib.import_module(module).calls)
        # Per core: the samples, a warm-up and N; then a warm-up and 4N on both cores.
        assert calls == 2 * (samples + 1 + n) + 1 + 4 * n

    def test_the_ratio_is_explained_where_it_is_printed(self, setup: Setup) -> None:
        result = setup.run("--cores", "0")
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        (at,) = [i for i, line in enumerate(lines) if line.startswith("throughput ")]
        assert "x cores / median latency" in lines[at]
        assert "80 requests, 4 at a time" in lines[at]  # --requests 20: 4 x 20
        assert lines[at + 1].strip().startswith("(cores / median latency: the rate of each")


@pytest.mark.usefixtures("quick_doctor")
class TestFailures:
    def test_a_different_onnx_model_fails_naming_the_output(self, setup: Setup) -> None:
        other = setup.other("other.onnx", seed=4)
        report = setup.dir / "report.md"
        result = setup.run("--onnx", str(other), "--report", str(report))
        assert result.exit_code == 1, result.output
        lines = result.output.splitlines()
        failing = [line for line in lines if line.startswith("vs onnx") and "FAIL" in line]
        assert any("'features'" in line and "cosine similarity" in line for line in failing)
        assert lines[-1] == "verdict    FAIL"
        text = report.read_text()
        assert "**Verdict: FAIL**" in text
        assert "| `features` |" in text and "**fail**: max relative error" in text

    def test_mismatched_io_names_are_a_clear_error(self, setup: Setup) -> None:
        other = setup.other("renamed.onnx", input_name="input")
        # Checked before any measuring: a million requests would outlast the test.
        result = setup.run("--onnx", str(other), "--requests", "1000000")
        assert result.exit_code == 1
        assert result.output.count("\n") == 1, result.output  # one line
        assert "does not match the loadable's by name" in result.output
        assert "inputs ['image']" in result.output and "inputs ['input']" in result.output


@pytest.mark.usefixtures("quick_doctor")
class TestInputs:
    def test_a_given_input_is_the_one_sample(self, setup: Setup) -> None:
        array = np.random.default_rng(5).standard_normal(IMAGE.shape).astype(np.float32)
        np.save(setup.dir / "frame.npy", array)
        result = setup.run("--input", f"image={setup.dir / 'frame.npy'}", "--json", "--cores", "1")
        assert result.exit_code == 0, result.output
        document = json.loads(result.output)
        assert document["samples"] == 1 and document["inputs"][0]["source"] == "given"
        assert document["cores"] == [1] and "comparison" not in document

    def test_an_unknown_input_name_is_a_clear_error(self, setup: Setup) -> None:
        np.save(setup.dir / "frame.npy", np.zeros(IMAGE.shape, np.float32))
        result = setup.run("--input", f"picture={setup.dir / 'frame.npy'}")
        assert result.exit_code == 1
        assert "--input names ['picture'] are not inputs" in result.output
        assert "['image']" in result.output

    def test_an_unreadable_input_file_is_a_clear_error(self, setup: Setup) -> None:
        (setup.dir / "bad.npy").write_text("not numpy")
        result = setup.run("--input", f"image={setup.dir / 'bad.npy'}")
        assert result.exit_code == 1
        assert "cannot read a .npy array" in result.output

    @pytest.mark.timeout(30)
    def test_a_fifo_input_is_refused_not_waited_on(self, setup: Setup) -> None:
        os.mkfifo(setup.dir / "frame.npy")
        result = setup.run("--input", f"image={setup.dir / 'frame.npy'}")
        assert result.exit_code == 1
        assert "cannot read a .npy array" in result.output
        assert "a FIFO (named pipe), not a regular file" in result.output

    @pytest.mark.timeout(60)
    def test_the_report_is_not_written_through_a_symlink_nor_into_a_fifo(
        self, setup: Setup
    ) -> None:
        victim = setup.dir / "precious.md"
        victim.write_text("keep me")
        (setup.dir / "link.md").symlink_to(victim)
        os.mkfifo(setup.dir / "fifo.md")
        for name, words in (("link.md", "symbolic link"), ("fifo.md", "FIFO")):
            result = setup.run("--cores", "0", "--report", str(setup.dir / name))
            assert result.exit_code == 1, result.output
            assert f"cannot write {str(setup.dir / name)!r}" in result.output
            assert words in result.output
        assert victim.read_text() == "keep me"

    def test_an_input_of_the_wrong_shape_is_the_engines_input_error(self, setup: Setup) -> None:
        np.save(setup.dir / "small.npy", np.zeros((1, 3, 8, 8), np.float32))
        result = setup.run("--input", f"image={setup.dir / 'small.npy'}")
        assert result.exit_code == 1
        assert "shape" in result.output and "image" in result.output


class TestJudging:
    def test_cores_that_differ_are_named(self) -> None:
        same = {"y": np.array([1.0, 2.0], np.float32)}
        other = {"y": np.array([1.0, 2.5], np.float32)}
        agreement = _verify._agreement({0: [same, same], 1: [same, other]}, 0)
        assert not agreement["identical"]
        assert agreement["differences"] == [{"core": 1, "sample": 1, "output": "y", "max_abs": 0.5}]

    def test_precision_is_int8_when_any_tensor_is_8_bit(self) -> None:
        int8 = TensorSpec("q", (1, 32, 4, 4), "int8", "chw32")
        assert _verify._precision([IMAGE], [FEATURES]) == "fp16"
        assert _verify._precision([int8], [FEATURES]) == "int8"

    def test_top1_disagreement_fails_a_classifier(self) -> None:
        want = [np.eye(8, dtype=np.float32)[i % 8].reshape(1, 8, 1, 1) for i in range(4)]
        got = [np.roll(w, 1, axis=1) for w in want]
        entry = _verify._compare(SCORES, got, want, _verify.TOLERANCES["fp16"])
        assert entry["top1"] == 0.0 and not entry["pass"]
        assert any("top-1 agreement 0.000" in f for f in entry["failures"])

    def test_the_dla_reads_int8_quantized(self) -> None:
        spec = TensorSpec("q", (1, 1, 1, 3), "int8", "nchw", scale=0.5)
        seen = _verify._device_view(spec, np.array([[[[0.26, 100.0, -1.1]]]], np.float32))
        np.testing.assert_array_equal(seen, np.array([[[[0.5, 63.5, -1.0]]]], np.float32))
