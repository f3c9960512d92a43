"""The ``aiodla`` command line: every command, its output, and each error path.

Commands run in-process through click's CliRunner (stdout is then not a terminal);
the progress bar is checked by forcing the console's terminal detection, and once for
real under a pseudo-terminal. cuDLA's presence is faked by replacing the probe and
the CUDA runtime with the emulated one.
"""

from __future__ import annotations

import copy
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from rich.console import Console

from aiodla import EmulatedRuntime, Engine, TensorSpec, _bench, _cli
from aiodla.emulator import parse_loadable
from aiodla.emulator._format import make_loadable
from aiodla.runtime import _select

from support import affine_model, two_pair_model

NO_CUDLA = "no cuDLA runtime (libcudla.so.1) was found"
WHAT_A_DLA_LOADABLE_NEEDS = "if it is a DLA loadable, it needs cuDLA (libcudla.so.1, on a Jetson)"


def run(*args: str) -> Result:
    return CliRunner().invoke(_cli.cli, list(args))


def assert_one_line_error(result: Result, code: int, *words: str) -> None:
    assert result.exit_code == code, result.output
    # click moves past a ^C with an empty line; the message itself is one line.
    lines = [line for line in result.stderr.splitlines() if line]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.bin"
    path.write_bytes(affine_model())
    return path


@pytest.fixture
def dla_file(tmp_path: Path) -> Path:
    # Not an emulator loadable: to aiodla, bytes only cuDLA could read.
    path = tmp_path / "resnet.bin"
    path.write_bytes(b"NVDA" + bytes(60))
    return path


class FakeCuda(EmulatedRuntime):
    """The emulated runtime standing in for the CUDA one, as if libcudla were present."""

    name = "cuda"
    tensors: Any = None

    def module_tensors(self, module: int) -> Any:
        return self.tensors if self.tensors is not None else super().module_tensors(module)


@pytest.fixture
def no_cudla(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_select, "cuda_probe", lambda: (False, NO_CUDLA, False))


@pytest.fixture
def fake_cudla(monkeypatch: pytest.MonkeyPatch) -> list[FakeCuda]:
    """cuDLA "present"; returns the runtimes handed out, to check they were released."""
    made: list[FakeCuda] = []

    def make() -> FakeCuda:
        made.append(FakeCuda(cores=2))
        return made[-1]

    monkeypatch.setattr(_select, "cuda_probe", lambda: (True, "libcudla.so.1 reports 2", False))
    monkeypatch.setattr(_select, "_cuda_runtime", make)
    return made


class TestMain:
    def test_no_command_prints_help(self) -> None:
        result = run()
        assert result.exit_code == 0
        for command in ("devices", "inspect", "emulate", "bench"):
            assert command in result.output

    def test_version(self) -> None:
        result = run("--version")
        assert result.exit_code == 0
        assert "aiodla" in result.output

    def test_python_dash_m_and_the_console_script(self) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "aiodla", "inspect", "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "--json" in done.stdout
        from importlib.metadata import entry_points

        (script,) = [e for e in entry_points(group="console_scripts") if e.name == "aiodla"]
        assert script.value == "aiodla._cli:main"

    def test_unknown_command(self) -> None:
        assert_one_line_error(run("frobnicate"), 2, "No such command", "--help")

    def test_missing_argument(self) -> None:
        assert_one_line_error(run("bench"), 2, "aiodla bench: error", "MODEL")

    def test_debug_adds_the_traceback(self, tmp_path: Path) -> None:
        result = run("inspect", str(tmp_path / "missing.bin"), "--debug")
        assert result.exit_code == 1
        assert "Traceback" in result.stderr
        assert result.stderr.splitlines()[-1].startswith("aiodla: error: cannot read")

    def test_a_bug_is_one_line_with_a_hint(
        self, model: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        def broken(path: str) -> bytes:
            raise RuntimeError("boom")

        monkeypatch.setattr(_cli, "_read_model", broken)
        assert_one_line_error(run("inspect", str(model)), 1, "internal error", "boom", "--debug")
        assert "Traceback" in run("--debug", "inspect", str(model)).stderr

    def test_interrupted(self, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        def interrupted(path: str) -> bytes:
            raise KeyboardInterrupt

        monkeypatch.setattr(_cli, "_read_model", interrupted)
        assert_one_line_error(run("inspect", str(model)), 130, "interrupted")


class TestDevices:
    def test_without_cudla(self, no_cudla: None) -> None:
        result = run("devices")
        assert result.exit_code == 0
        assert f"cuDLA:      not available: {NO_CUDLA}" in result.output
        assert "for a DLA loadable:       none: a DLA loadable needs cuDLA" in result.output
        assert "for an emulator loadable: emulated" in result.output

    def test_with_cudla(self, fake_cudla: list[FakeCuda]) -> None:
        result = run("devices")
        assert result.exit_code == 0, result.output
        assert "cuDLA:      libcudla.so.1, version 1.2.1 (1002001)" in result.output
        assert "DLA cores:  2" in result.output
        assert "for a DLA loadable:       cuda" in result.output
        assert "for an emulator loadable: emulated" in result.output

    def test_with_the_gpu_standin(
        self, fake_cudla: list[FakeCuda], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(_select, "cuda_probe", lambda: (True, "stand-in", True))
        result = run("devices")
        assert "GPU stand-in" in result.output
        assert "for an emulator loadable: cuda" in result.output

    def test_ray_resources_without_cudla(self, no_cudla: None) -> None:
        result = run("devices", "--ray-resources")
        assert result.exit_code == 0, result.output
        assert json.loads(result.output) == {}  # no replica of a DLA loadable lands here

    def test_ray_resources_with_cudla(self, fake_cudla: list[FakeCuda]) -> None:
        result = run("devices", "--ray-resources")
        assert json.loads(result.output) == {"DLA": 2.0}


class TestInspect:
    def test_table(self, model: Path) -> None:
        result = run("inspect", str(model))
        assert result.exit_code == 0, result.output
        assert "emulator loadable, op affine (scale 2, bias 0.5), 1.000 ms" in result.output
        rows = {line.split()[0]: line.split() for line in result.output.splitlines()[2:4]}
        assert rows["input"][1:6] == ["x", "1x3x8x8", "float16", "chw16", "32"]
        assert rows["output"][1:5] == ["y", "1x3x8x8", "float32", "nchw"]
        assert rows["input"][-1] == "2048"

    @pytest.mark.parametrize("build", [affine_model, two_pair_model])
    def test_json_spec_round_trips_through_emulate(
        self, build: Callable[[], bytes], tmp_path: Path
    ) -> None:
        original = tmp_path / "original.bin"
        original.write_bytes(build())
        result = run("inspect", str(original), "--json")
        assert result.exit_code == 0
        spec = json.loads(result.stdout)
        assert (spec["format"], spec["version"], spec["loadable"]) == (
            "aiodla-model-spec",
            1,
            "emulator",
        )
        assert set(spec["inputs"][0]["descriptor"]) == set(_cli.DESCRIPTOR_FIELDS)
        (tmp_path / "spec.json").write_text(result.stdout)
        copied = tmp_path / "copy.bin"
        made = run("emulate", "--like", str(tmp_path / "spec.json"), "-o", str(copied))
        assert made.exit_code == 0, made.output
        assert copied.read_bytes() == original.read_bytes()

    def test_missing_file(self, tmp_path: Path) -> None:
        assert_one_line_error(
            run("inspect", str(tmp_path / "nope.bin")), 1, "cannot read", "nope.bin", "No such file"
        )

    def test_empty_file(self, tmp_path: Path) -> None:
        (tmp_path / "empty.bin").write_bytes(b"")
        result = run("inspect", str(tmp_path / "empty.bin"))
        assert_one_line_error(result, 1, "empty", "not a loadable")

    def test_malformed_emulator_loadable(self, tmp_path: Path) -> None:
        (tmp_path / "cut.bin").write_bytes(affine_model()[:100])
        assert_one_line_error(
            run("inspect", str(tmp_path / "cut.bin")), 1, "cut.bin", "not a valid emulator loadable"
        )

    def test_dla_loadable_without_cudla(self, dla_file: Path, no_cudla: None) -> None:
        assert_one_line_error(
            run("inspect", str(dla_file)), 1, "not an emulator loadable", "needs cuDLA", NO_CUDLA
        )

    def test_random_bytes_are_not_called_a_dla_loadable(
        self, tmp_path: Path, no_cudla: None
    ) -> None:
        (tmp_path / "noise.bin").write_bytes(os.urandom(256))
        for command in ("inspect", "bench"):
            result = run(command, str(tmp_path / "noise.bin"))
            assert_one_line_error(
                result, 1, "is not an emulator loadable", WHAT_A_DLA_LOADABLE_NEEDS, NO_CUDLA
            )
            assert "this is a DLA loadable" not in result.stderr

    def test_the_runtimes_guide_quotes_the_message(self) -> None:
        guide = Path(__file__).parents[1] / "docs" / "guides" / "runtimes.md"
        quoted = " ".join(guide.read_text(encoding="utf-8").split())
        assert _select.not_an_emulator_loadable("the model", NO_CUDLA) in quoted

    def test_a_model_spec_is_shown_like_a_loadable(self, model: Path, tmp_path: Path) -> None:
        written = run("inspect", str(model), "--json").stdout
        spec = tmp_path / "model.json"
        spec.write_text(written)
        shown = run("inspect", str(spec))
        assert shown.exit_code == 0, shown.output
        assert f"{spec}: model spec of model.bin (emulator loadable)" in shown.stdout
        assert "1x3x8x8" in shown.stdout
        assert "chw16" in shown.stdout
        again = run("inspect", str(spec), "--json")
        assert again.exit_code == 0, again.output
        assert json.loads(again.stdout) == json.loads(written)

    def test_a_broken_model_spec_names_the_file(self, model: Path, tmp_path: Path) -> None:
        spec = json.loads(run("inspect", str(model), "--json").stdout)
        (tmp_path / "s.json").write_text(json.dumps(put(spec, "n", -1)))
        assert_one_line_error(
            run("inspect", str(tmp_path / "s.json")),
            1,
            "s.json",
            "descriptor.n must be an integer >= 0",
        )

    def test_dla_loadable_with_cudla(
        self, model: Path, fake_cudla: list[FakeCuda], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The fake cuDLA reads emulator loadables; make the command treat this one as DLA.
        monkeypatch.setattr(_cli, "is_emulator_loadable", lambda data: False)
        result = run("inspect", str(model))
        assert result.exit_code == 0, result.output
        assert "DLA loadable" in result.output
        assert "1x3x8x8" in result.output
        spec = json.loads(run("inspect", str(model), "--json").stdout)
        assert (spec["loadable"], spec["emulator"]) == ("dla", None)
        for runtime in fake_cudla:  # device and module were released
            assert all(count == 0 for count in runtime.live_handles().values())

    def test_cudla_refuses_the_file(self, dla_file: Path, fake_cudla: list[FakeCuda]) -> None:
        assert_one_line_error(run("inspect", str(dla_file)), 1, "cuDLA cannot load", "resnet.bin")
        assert all(count == 0 for count in fake_cudla[0].live_handles().values())

    def test_a_descriptor_aiodla_cannot_read(
        self, model: Path, fake_cudla: list[FakeCuda], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(_cli, "is_emulator_loadable", lambda data: False)
        x = TensorSpec("x", (1, 3, 8, 8), "float16", "chw16").to_descriptor()
        y = TensorSpec("y", (1, 3, 8, 8), "float32", "nchw").to_descriptor()
        block_linear = type(x)(**{**x.__dict__, "pixel_mapping": 1})
        FakeCuda.tensors = ((block_linear,), (y,))
        try:
            result = run("inspect", str(model))
            spec = json.loads(run("inspect", str(model), "--json").stdout)
        finally:
            FakeCuda.tensors = None
        assert result.exit_code == 0
        assert "aiodla cannot serve this model" in result.output
        assert "block linear" in result.output
        assert spec["inputs"][0]["format"] is None
        assert "block linear" in spec["inputs"][0]["problem"]
        assert spec["inputs"][0]["descriptor"]["pixel_mapping"] == 1


class TestEmulate:
    def test_from_inputs_and_outputs(self, tmp_path: Path) -> None:
        out = tmp_path / "m.bin"
        result = run(
            "emulate",
            "--input",
            "image:1x3x16x16:float16:chw16",
            "--output",
            "scores:1x3x16x16:float32",
            "--latency",
            "0.004",
            "--scale",
            "2",
            "--bias",
            "-1",
            "-o",
            str(out),
        )
        assert result.exit_code == 0, result.output
        assert "wrote" in result.output
        assert "op affine" in result.output
        model = parse_loadable(out.read_bytes())
        assert (model.op, model.latency, model.scale, model.bias) == ("affine", 0.004, 2.0, -1.0)
        assert model.inputs[0] == TensorSpec("image", (1, 3, 16, 16), "float16", "chw16")
        assert model.outputs[0] == TensorSpec("scores", (1, 3, 16, 16), "float32", "nchw")

    def test_defaults_names_with_colons_and_the_op_the_shapes_fit(self, tmp_path: Path) -> None:
        out = tmp_path / "m.bin"
        result = run(
            "emulate",
            "--input",
            "in:0:2x4x6x6",
            "--input",
            "b:1x1x2x2:uint8:nhwc",
            "--output",
            "out:0:2x4x1x1",
            "--output",
            "o2:1x1x1x1:float32",
            "-o",
            str(out),
        )
        assert result.exit_code == 0, result.output
        model = parse_loadable(out.read_bytes())
        assert (model.op, model.latency) == ("mean_hw", 0.001)
        assert model.inputs[0] == TensorSpec("in:0", (2, 4, 6, 6), "float16", "nchw")
        assert model.inputs[1] == TensorSpec("b", (1, 1, 2, 2), "uint8", "nhwc")

    @pytest.mark.parametrize(
        ("args", "words"),
        [
            (["--input", "x:1x3", "--output", "y:1x3x2x2"], ["'--input'", "NAME:NxCxHxW"]),
            (["--input", "x:1x3x4x4:float32:chw16", "--output", "y:1x3x4x4"], ["chw16"]),
            (["--input", "x:1x3x4x4:complex64", "--output", "y:1x3x4x4"], ["DLA element type"]),
            (["--input", "x:1x3x4x4", "--output", "y:1x3x4x4:float16:nope"], ["format"]),
            (["--input", "x:1x3x4x4"], ["at least one --input and one --output"]),
            ([], ["--like SPEC.json"]),
            (["--like", "s.json", "--input", "x:1x1x1x1"], ["not both"]),
            (["--input", "x:1x3x4x4", "--output", "y:1x3x4x4", "--latency", "-1"], ["--latency"]),
            (["--input", "x:1x3x4x4", "--output", "y:1x3x4x4", "--op", "fft"], ["--op"]),
        ],
    )
    def test_bad_arguments(self, args: list[str], words: list[str], tmp_path: Path) -> None:
        result = run("emulate", *args, "-o", str(tmp_path / "m.bin"))
        assert_one_line_error(result, 2, "aiodla emulate: error", *words)
        assert not (tmp_path / "m.bin").exists()

    def test_shapes_no_paired_op_fits_get_mix(self, tmp_path: Path) -> None:
        result = run(
            "emulate",
            "--input",
            "x:1x3x224x224",
            "--output",
            "logits:1x1000x1x1",
            "-o",
            str(tmp_path / "m.bin"),
        )
        assert result.exit_code == 0, result.output
        assert "op mix" in result.output
        assert parse_loadable((tmp_path / "m.bin").read_bytes()).op == "mix"

    def test_an_op_the_shapes_do_not_fit(self, tmp_path: Path) -> None:
        result = run(
            "emulate",
            "--input",
            "x:1x3x4x4",
            "--output",
            "y:1x3x4x4",
            "--op",
            "mean_hw",
            "-o",
            str(tmp_path / "m.bin"),
        )
        assert_one_line_error(result, 1, "mean_hw", "(1, 3, 1, 1)")

    def test_unwritable_output(self, tmp_path: Path) -> None:
        result = run(
            "emulate",
            "--input",
            "x:1x3x4x4",
            "--output",
            "y:1x3x4x4",
            "-o",
            str(tmp_path / "no" / "such" / "m.bin"),
        )
        assert_one_line_error(result, 1, "cannot write", "No such file")

    def test_like_with_overrides(self, model: Path, tmp_path: Path) -> None:
        (tmp_path / "s.json").write_text(run("inspect", str(model), "--json").stdout)
        out = tmp_path / "m.bin"
        result = run(
            "emulate",
            "--like",
            str(tmp_path / "s.json"),
            "--latency",
            "0.005",
            "--scale",
            "3",
            "-o",
            str(out),
        )
        assert result.exit_code == 0, result.output
        made, original = parse_loadable(out.read_bytes()), parse_loadable(model.read_bytes())
        assert (made.latency, made.scale, made.bias) == (0.005, 3.0, original.bias)
        assert made.descriptors == original.descriptors

    def test_like_a_dla_spec_reports_fields_it_cannot_copy(
        self, model: Path, tmp_path: Path
    ) -> None:
        spec = json.loads(run("inspect", str(model), "--json").stdout)
        spec["loadable"], spec["emulator"] = "dla", None
        spec["inputs"][0]["descriptor"]["pixel_format"] = 37
        (tmp_path / "s.json").write_text(json.dumps(spec))
        result = run("emulate", "--like", str(tmp_path / "s.json"), "-o", str(tmp_path / "m.bin"))
        assert result.exit_code == 0, result.output
        assert "warning: tensor 'x': pixel_format 37 is written as 36" in result.stderr
        assert parse_loadable((tmp_path / "m.bin").read_bytes()).op == "affine"

    @pytest.mark.parametrize(
        ("mutate", "words"),
        [
            (lambda s: "{not json", ["not a JSON model spec"]),
            (lambda s: {**s, "format": "onnx"}, ["not an aiodla model spec"]),
            (lambda s: {**s, "version": 2}, ["version 2", "reads version 1"]),
            (lambda s: {**s, "inputs": []}, ["'inputs' must be a non-empty list"]),
            (lambda s: {**s, "outputs": [{"name": "y"}]}, ['outputs[0] has no "descriptor"']),
            (lambda s: drop(s, "stride"), ["inputs[0].descriptor lacks stride"]),
            (lambda s: put(s, "n", -1), ["descriptor.n must be an integer >= 0"]),
            (lambda s: put(s, "c", True), ["descriptor.c must be an integer"]),
            (lambda s: put(s, "stride", [1, 2]), ["descriptor.stride must be 8 integers"]),
            (lambda s: put(s, "name", ""), ["descriptor.name must be a non-empty string"]),
            (lambda s: put(s, "data_type", 9), ["dataType 9"]),
        ],
    )
    def test_bad_specs(
        self, mutate: Callable[[dict[str, Any]], Any], words: list[str], model: Path, tmp_path: Path
    ) -> None:
        spec = mutate(json.loads(run("inspect", str(model), "--json").stdout))
        path = tmp_path / "s.json"
        path.write_text(spec if isinstance(spec, str) else json.dumps(spec))
        result = run("emulate", "--like", str(path), "-o", str(tmp_path / "m.bin"))
        assert_one_line_error(result, 1, "s.json", *words)

    def test_missing_spec(self, tmp_path: Path) -> None:
        result = run("emulate", "--like", str(tmp_path / "s.json"), "-o", str(tmp_path / "m.bin"))
        assert_one_line_error(result, 1, "cannot read", "s.json")


def drop(spec: dict[str, Any], field: str) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    del spec["inputs"][0]["descriptor"][field]
    return spec


def put(spec: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    spec["inputs"][0]["descriptor"][field] = value
    return spec


class TestBench:
    def test_summary(self, model: Path) -> None:
        result = run("bench", str(model), "--requests", "200")
        assert result.exit_code == 0, result.output
        out = result.stdout
        for label in (
            "throughput",
            "of the ideal 2000 req/s",
            "p50",
            "p90",
            "p99",
            "max",
            "core 0",
            "core 1",
            "% busy",
            "200 completed, 0 failed",
        ):
            assert label in out, out
        assert "errors      none" in out
        # Not a terminal: no progress bar, no escape sequences.
        assert "━" not in out
        assert "\x1b" not in out

    def test_json(self, model: Path) -> None:
        result = run(
            "bench",
            str(model),
            "--requests",
            "100",
            "--cores",
            "1",
            "--streams",
            "1",
            "--concurrency",
            "3",
            "--json",
        )
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert (report["format"], report["version"]) == ("aiodla-bench", 1)
        assert (report["requests"], report["completed"], report["failed"]) == (100, 100, 0)
        assert (report["cores"], report["streams_per_core"], report["concurrency"]) == ([1], 1, 3)
        assert report["runtime"] == "emulated"
        assert report["ideal_rps"] == 1000.0
        assert set(report["latency_s"]) == {"p50", "p90", "p99", "max", "mean"}
        assert report["latency_s"]["p50"] <= report["latency_s"]["max"]
        (core,) = report["per_core"]
        assert core["core"] == 1
        assert core["completed"] == 100
        assert 0 < core["utilization"] <= 1

    def test_duration(self, model: Path) -> None:
        result = run("bench", str(model), "--duration", "0.2", "--json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["elapsed_s"] >= 0.2
        assert report["completed"] > 10

    def test_progress_bar_on_a_terminal(self, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        screen = io.StringIO()
        monkeypatch.setattr(
            _cli, "_console", lambda: Console(file=screen, force_terminal=True, width=100)
        )
        result = run("bench", str(model), "--requests", "300")
        assert result.exit_code == 0, result.output
        drawn = screen.getvalue()
        assert "━" in drawn
        assert "100%" in drawn
        assert "300 requests" in drawn
        assert "throughput" in result.stdout

    def test_no_progress_bar_with_json_even_on_a_terminal(
        self, model: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        screen = io.StringIO()
        monkeypatch.setattr(_cli, "_console", lambda: Console(file=screen, force_terminal=True))
        result = run("bench", str(model), "--requests", "50", "--json")
        assert result.exit_code == 0
        assert screen.getvalue() == ""
        json.loads(result.stdout)

    @pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses a Linux pty")
    def test_progress_bar_under_a_real_pseudo_terminal(self, model: Path) -> None:
        import pty

        controller, terminal = pty.openpty()
        env = {**os.environ, "COLUMNS": "100", "TERM": "xterm-256color"}
        env.pop("NO_COLOR", None)
        process = subprocess.Popen(
            [sys.executable, "-m", "aiodla", "bench", str(model), "--requests", "400"],
            stdin=terminal,
            stdout=terminal,
            stderr=terminal,
            env=env,
        )
        os.close(terminal)
        chunks = []
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the terminal closed: the process is gone
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(controller)
        assert process.wait(timeout=60) == 0
        screen = b"".join(chunks).decode("utf-8", "replace")
        assert "━" in screen
        assert "100%" in screen
        assert "400 requests" in screen
        assert "\r" in screen  # redrawn in place
        assert "throughput" in screen

    def test_the_ideal_counts_only_the_requests_offered(self, model: Path) -> None:
        # One request at a time keeps one core busy at most, whatever the cores.
        result = run("bench", str(model), "--requests", "50", "--concurrency", "1", "--json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["ideal_rps"] == 1000.0
        assert (report["concurrency"], report["slots"]) == (1, 4)
        assert report["limited_by"] == "concurrency 1 < 4 slots"

    def test_the_default_concurrency_fills_every_slot(self, model: Path) -> None:
        result = run("bench", str(model), "--requests", "50", "--streams", "3", "--json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert report["concurrency"] == report["slots"] == 6

    def test_a_run_the_cores_limited_says_so(self, tmp_path: Path) -> None:
        # Every request in flight from the start (as many as the slots): each core runs
        # its 16 tasks of 80 ms back to back on the emulated timeline, whenever the host
        # gets to look, so no stall of a loaded machine between the first submission
        # and the last completion idles a core; only one at the very start or end of
        # the run, of more than a tenth of its 1.28 s, could.
        (tmp_path / "slow.bin").write_bytes(affine_model(latency=0.08))
        result = run("bench", str(tmp_path / "slow.bin"), "--streams", "16", "--requests", "32")
        assert result.exit_code == 0, result.output
        (line,) = [line for line in result.stdout.splitlines() if line.startswith("limited by")]
        # Busy from the verdict's 90% up to 100% (a run without an idle moment), one
        # figure or a range: "both busy 97%", "both busy 99%-100%".
        found = re.search(r"limited by +the DLA cores \(both busy (\d+)%(?:-(\d+)%)?\)", line)
        assert found is not None, line
        busy = [int(figure) for figure in found.groups() if figure is not None]
        assert all(90 <= figure <= 100 for figure in busy), line

    @pytest.mark.parametrize(
        ("cores", "utilization", "concurrency", "expected"),
        [
            ([0, 1], [0.98, 0.97], 4, "the DLA cores (both busy 97%-98%)"),
            ([1], [0.95], 2, "the DLA cores (core 1 busy 95%)"),
            ([0, 1], [0.5, 0.5], 2, "concurrency 2 < 4 slots"),
            (
                [0, 1],
                [0.6, 0.6],
                4,
                "the host (the DLA cores only 60% busy with every slot offered work)",
            ),
        ],
    )
    def test_what_limited_a_run(
        self, cores: list[int], utilization: list[float], concurrency: int, expected: str
    ) -> None:
        report = {
            "cores": cores,
            "concurrency": concurrency,
            "slots": 2 * len(cores),
            "per_core": [{"utilization": u} for u in utilization],
        }
        assert _bench.limited_by(report) == expected

    def test_json_reports_progress_on_stderr_when_it_is_a_terminal(
        self, model: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        screen = io.StringIO()
        monkeypatch.setattr(
            _cli, "_error_console", lambda: Console(file=screen, force_terminal=True, width=100)
        )
        result = run("bench", str(model), "--requests", "300", "--json")
        assert result.exit_code == 0, result.output
        assert "300 requests" in screen.getvalue()
        assert json.loads(result.stdout)["completed"] == 300  # stdout holds only the JSON

    @pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses a Linux pty")
    @pytest.mark.parametrize("as_json", [False, True])
    def test_ctrl_c_prints_the_partial_results(self, model: Path, as_json: bool) -> None:
        import pty
        import re
        import select
        import signal

        # The bar is drawn on the terminal: stdout's, or stderr's with --json.
        controller, terminal = pty.openpty()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aiodla",
                "bench",
                str(model),
                "--duration",
                "60",
                *(["--json"] if as_json else []),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if as_json else terminal,
            stderr=terminal if as_json else subprocess.PIPE,
            env={**os.environ, "COLUMNS": "100", "TERM": "xterm"},
        )
        os.close(terminal)
        screen = b""
        try:
            # Interrupt once the bar shows completed requests: the run is under way.
            while not re.search(rb"[1-9]\d* requests", screen):
                ready, _, _ = select.select([controller], [], [], 30)
                assert ready, screen
                screen += os.read(controller, 65536)
            process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=30)
            piped = out if as_json else err
            while True:  # the rest of the screen, until the terminal closes
                try:
                    chunk = os.read(controller, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                screen += chunk
        finally:
            process.kill()
            process.wait()
            os.close(controller)
        assert process.returncode == 130
        if as_json:
            report = json.loads(piped)
            assert report["interrupted"] is True
            assert report["completed"] > 0
            assert report["elapsed_s"] < 60
            assert b"aiodla: interrupted" in screen
        else:
            text = screen.decode("utf-8", "replace")
            assert "interrupted by Ctrl-C after" in text
            assert "partial results" in text
            assert "throughput" in text
            assert piped.decode().strip() == "aiodla: interrupted"

    @pytest.mark.parametrize(
        ("args", "code", "words"),
        [
            (["--requests", "5", "--duration", "1"], 2, ["not both"]),
            (["--cores", "a,b"], 2, ["'--cores'", "e.g. 0,1"]),
            (["--cores", "-1"], 2, ["'--cores'"]),
            (["--streams", "0"], 2, ["'--streams'"]),
            (["--runtime", "tpu"], 2, ["'--runtime'"]),
            (["--cores", "7"], 1, ["DLA core 7 does not exist"]),
            (["--cores", "0,0"], 1, ["names a core twice"]),
            (["--streams", "99"], 1, ["streams_per_core"]),
        ],
    )
    def test_bad_arguments(self, model: Path, args: list[str], code: int, words: list[str]) -> None:
        assert_one_line_error(run("bench", str(model), *args), code, *words)

    def test_missing_file(self, tmp_path: Path) -> None:
        assert_one_line_error(run("bench", str(tmp_path / "m.bin")), 1, "cannot read", "m.bin")

    def test_malformed_emulator_loadable(self, tmp_path: Path) -> None:
        (tmp_path / "cut.bin").write_bytes(affine_model()[:70])
        assert_one_line_error(run("bench", str(tmp_path / "cut.bin")), 1, "not a valid emulator")

    def test_dla_loadable_without_cudla(self, dla_file: Path, no_cudla: None) -> None:
        assert_one_line_error(run("bench", str(dla_file)), 1, "DLA loadable", NO_CUDLA)

    def test_a_model_spec_is_not_benchmarked(self, model: Path, tmp_path: Path) -> None:
        (tmp_path / "m.json").write_text(run("inspect", str(model), "--json").stdout)
        assert_one_line_error(
            run("bench", str(tmp_path / "m.json")),
            1,
            "is a model spec, not a loadable",
            "aiodla emulate --like",
        )

    def test_cuda_runtime_asked_for_but_absent(self, model: Path, no_cudla: None) -> None:
        assert_one_line_error(
            run("bench", str(model), "--runtime", "cuda"),
            1,
            "runtime='cuda' is not available",
            NO_CUDLA,
        )

    def test_failed_requests_are_counted_and_fail_the_run(
        self, model: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        runtime = EmulatedRuntime(cores=2)
        for core in (0, 0, 1):
            runtime.fail_next_task(core)
        use_runtime(monkeypatch, runtime)
        result = run("bench", str(model), "--requests", "50", "--json")
        assert result.exit_code == 1
        report = json.loads(result.stdout)
        assert (report["completed"], report["failed"]) == (47, 3)
        assert report["errors"] == {"TaskError": 3}
        assert sum(core["failed"] for core in report["per_core"]) == 3
        assert result.stderr.strip() == "aiodla: error: 3 of 50 requests failed (TaskError x3)"

    def test_an_engine_that_dies_stops_the_run(
        self, model: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        runtime = EmulatedRuntime(cores=2)
        use_runtime(monkeypatch, runtime, poison=True)
        result = run("bench", str(model), "--requests", "1000")
        assert result.exit_code == 1
        assert "EngineDeadError" in result.stdout
        (line,) = result.stderr.splitlines()
        assert "requests failed (EngineDeadError" in line
        assert "engine is dead" in line
        assert "0 completed" in result.stdout

    def test_an_engine_that_cannot_open(self, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        runtime = EmulatedRuntime(cores=2)
        runtime.poison()
        use_runtime(monkeypatch, runtime)
        assert_one_line_error(
            run("bench", str(model)), 1, "aiodla: error:", "make_current", "cudaErrorExternalDevice"
        )


def use_runtime(
    monkeypatch: pytest.MonkeyPatch, runtime: EmulatedRuntime, *, poison: bool = False
) -> None:
    """Make ``bench`` open its engine on ``runtime`` (poisoned once open, if asked)."""

    class RuntimeEngine(Engine):
        def __init__(self, model: Any, **options: Any) -> None:
            options["runtime"] = runtime
            super().__init__(model, **options)

        async def __aenter__(self) -> Engine:
            opened = await super().__aenter__()
            if poison:
                runtime.poison()
            return opened

    monkeypatch.setattr(_cli, "Engine", RuntimeEngine)


def test_emulator_loadables_from_python_and_the_cli_agree(tmp_path: Path) -> None:
    x = TensorSpec("x", (1, 3, 8, 8), "float16", "chw16")
    y = TensorSpec("y", (1, 3, 8, 8), "float32", "nchw")
    out = tmp_path / "m.bin"
    result = run(
        "emulate",
        "--input",
        "x:1x3x8x8:float16:chw16",
        "--output",
        "y:1x3x8x8:float32",
        "--scale",
        "2",
        "--bias",
        "0.5",
        "-o",
        str(out),
    )
    assert result.exit_code == 0
    assert out.read_bytes() == make_loadable([x], [y], "affine", 0.001, scale=2.0, bias=0.5)


class TestSharedOptions:
    """The options several commands share are made once (``_cli_frame``): the same
    name takes the same values, and refuses the same way, in every command."""

    @staticmethod
    def option(command: str, name: str) -> Any:
        group = _cli.cli
        found = group.commands[command]  # type: ignore[attr-defined]
        (param,) = [p for p in found.params if name in p.opts]
        return param

    @pytest.mark.parametrize("command", ["bench", "record", "verify", "serve"])
    def test_runtime_is_one_choice_everywhere(self, command: str) -> None:
        runtime = self.option(command, "--runtime")
        assert list(runtime.type.choices) == list(_select.RUNTIME_CHOICES)
        assert runtime.default == "auto" and runtime.show_default

    @pytest.mark.parametrize(
        ("args", "words"),
        [
            (["verify", "m.bin", "--samples", "0"], "'--samples': 0 is not in the range x>=1"),
            (["verify", "m.bin", "--requests", "0"], "'--requests': 0 is not in the range x>=1"),
            (["serve", "m.bin", "--max-queue", "0"], "'--max-queue': 0 is not in the range x>=1"),
            (["bench", "m.bin", "--streams", "0"], "'--streams': 0 is not in the range x>=1"),
            (["serve", "m.bin", "--drain-timeout", "-1"], "'--drain-timeout': -1.0 is not in"),
            (["serve", "m.bin", "--body-timeout", "0"], "'--body-timeout': 0.0 is not in"),
            (["doctor", "--timeout", "0"], "'--timeout': 0.0 is not in the range x>0"),
        ],
    )
    def test_counts_and_seconds_are_refused_alike(self, args: list[str], words: str) -> None:
        result = run(*args)
        assert result.exit_code == 2
        assert words in " ".join(result.output.split())

    @pytest.mark.parametrize(
        ("command", "name", "default"),
        [
            ("verify", "--samples", 8),
            ("verify", "--requests", 100),
            ("serve", "--max-queue", 1024),
            ("serve", "--drain-timeout", 30.0),
            ("serve", "--body-timeout", 5.0),
            ("doctor", "--timeout", 30.0),
            ("bench", "--streams", 2),
        ],
    )
    def test_defaults_are_shown(self, command: str, name: str, default: float) -> None:
        param = self.option(command, name)
        assert param.default == default and param.show_default
