"""``aiodla trace-plot`` and ``aiodla bench --trace``: a run's timeline from the command
line, drawn one row per core, and the errors of each."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import anyio
import numpy as np
import pytest
from click.testing import CliRunner, Result

from aiodla import _cli
from aiodla.testing import EngineFactory

from support import X, affine_model
from trace_format import check_trace_format

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CAMERA_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "camera_fanout.py"


def run(*args: str) -> Result:
    return CliRunner().invoke(_cli.cli, list(args))


def one_line_error(result: Result, code: int, *words: str) -> None:
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "affine.bin"
    path.write_bytes(affine_model(0.001))
    return path


@pytest.fixture
def bench_trace(model_file: Path, tmp_path: Path) -> Path:
    trace = tmp_path / "run.json"
    result = run(
        "bench", str(model_file), "--requests", "120", "--runtime", "emulated",
        "--trace", str(trace), "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return trace


class TestBenchTrace:
    def test_bench_writes_a_trace_of_its_run(self, bench_trace: Path) -> None:
        document = json.loads(bench_trace.read_text())
        check_trace_format(document)
        tasks = [e for e in document["traceEvents"] if e.get("name") == "DLA task"]
        assert len(tasks) == 120
        assert {t["args"]["model"] for t in tasks} == {"affine"}
        assert document["otherData"]["engine"] == "affine"

    def test_an_unwritable_trace_path_is_one_line(self, model_file: Path, tmp_path: Path) -> None:
        target = tmp_path / "missing" / "run.json"
        result = run("bench", str(model_file), "--requests", "5", "--runtime", "emulated",
                     "--trace", str(target))  # fmt: skip
        one_line_error(result, 1, "run.json")


class TestTracePlot:
    @pytest.mark.parametrize("color", ["model", "state"])
    def test_one_row_per_core(self, bench_trace: Path, tmp_path: Path, color: str) -> None:
        out = tmp_path / "timeline.svg"
        result = run("trace-plot", str(bench_trace), str(out), "--color", color)
        assert result.exit_code == 0, result.output
        svg = out.read_text()
        assert "core 0" in svg and "core 1" in svg and "core 2" not in svg
        assert ("DLA: affine" in svg) == (color == "model")
        assert ("waiting for the core" in svg) == (color == "state")

    def test_a_png(self, bench_trace: Path, tmp_path: Path) -> None:
        out = tmp_path / "timeline.png"
        assert run("trace-plot", str(bench_trace), str(out)).exit_code == 0
        data = out.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000

    @pytest.mark.asyncio
    async def test_a_single_core_engine_has_one_core_row(
        self, aiodla_engine: EngineFactory, tmp_path: Path
    ) -> None:
        engine = await aiodla_engine(affine_model(), cores=[1])
        trace = tmp_path / "one.json"
        async with engine.trace(trace):
            for _ in range(5):
                await engine.infer(np.ones(X.shape, np.float32))
        out = tmp_path / "one.svg"
        assert run("trace-plot", str(trace), str(out)).exit_code == 0
        svg = out.read_text()
        assert "core 1" in svg and "core 0" not in svg

    def test_a_window_of_the_trace(self, bench_trace: Path, tmp_path: Path) -> None:
        out = tmp_path / "window.png"
        result = run("trace-plot", str(bench_trace), str(out), "--start", "0", "--end", "1e6")
        assert result.exit_code == 0, result.output


class TestTracePlotErrors:
    def test_not_json(self, tmp_path: Path) -> None:
        path = tmp_path / "bad.json"
        path.write_text("{not json")
        one_line_error(run("trace-plot", str(path), str(tmp_path / "o.png")), 1, "not JSON")

    def test_not_a_trace(self, tmp_path: Path) -> None:
        path = tmp_path / "other.json"
        path.write_text('{"format": "aiodla-bench"}')
        result = run("trace-plot", str(path), str(tmp_path / "o.png"))
        one_line_error(result, 1, "not a trace", "traceEvents")

    def test_an_empty_trace(self, tmp_path: Path) -> None:
        path = tmp_path / "empty.json"
        path.write_text('{"traceEvents": []}')
        result = run("trace-plot", str(path), str(tmp_path / "o.png"))
        one_line_error(result, 1, "no DLA task")

    def test_a_missing_file(self, tmp_path: Path) -> None:
        result = run("trace-plot", str(tmp_path / "nowhere.json"), str(tmp_path / "o.png"))
        one_line_error(result, 1, "nowhere.json")

    def test_an_empty_window(self, bench_trace: Path, tmp_path: Path) -> None:
        result = run("trace-plot", str(bench_trace), str(tmp_path / "o.png"), "--start", "5",
                     "--end", "5")  # fmt: skip
        one_line_error(result, 1, "window")

    @pytest.mark.parametrize(
        ("events", "words"),
        [
            ("[5]", ["traceEvents[0] is not an object", "5"]),
            ('[{"ph": "X", "name": "DLA task", "ts": 1}]', ["traceEvents[0]", "no numeric 'dur'"]),
            ('[{"ph": "X", "ts": "soon", "dur": 1, "name": "a"}]', ["no numeric 'ts'"]),
            ('[{"ph": 3}]', ["no phase"]),
            ('[{"ph": "X", "ts": 1, "dur": 1}]', ["no 'name' string"]),
            ('[{"ph": "X", "ts": 1, "dur": 1, "name": "a", "args": [1]}]', ["'args' that are not"]),
            ('[{"ph": "M", "name": "thread_name", "tid": 1, "args": {}}]', ["names a track"]),
            ('[{"ph": "b", "ts": 1, "name": "queued", "cat": "queue", "id": [1]}]', ["no 'id'"]),
        ],
    )
    def test_events_that_are_not_trace_events(
        self, tmp_path: Path, events: str, words: list[str]
    ) -> None:
        path = tmp_path / "odd.json"
        path.write_text(f'{{"traceEvents": {events}}}')
        one_line_error(run("trace-plot", str(path), str(tmp_path / "o.png")), 1, *words)

    def test_deep_nesting(self, tmp_path: Path) -> None:
        path = tmp_path / "deep.json"
        path.write_text('{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}")
        result = run("trace-plot", str(path), str(tmp_path / "o.png"))
        one_line_error(result, 1, "nests its JSON too deeply")

    @pytest.mark.timeout(20)
    def test_a_fifo_is_refused_not_waited_on(self, tmp_path: Path) -> None:
        path = tmp_path / "run.json"
        os.mkfifo(path)
        result = run("trace-plot", str(path), str(tmp_path / "o.png"))
        one_line_error(result, 1, "a FIFO (named pipe), not a regular file")

    def test_a_device_is_refused(self, tmp_path: Path) -> None:
        result = run("trace-plot", os.devnull, str(tmp_path / "o.png"))
        one_line_error(result, 1, "a character device")

    def test_a_bad_coloring(self, bench_trace: Path, tmp_path: Path) -> None:
        result = run("trace-plot", str(bench_trace), str(tmp_path / "o.png"), "--color", "x")
        one_line_error(result, 2, "--color")


class TestCameraExample:
    @pytest.mark.in_process  # the example prints engine.runtime.name, the worker's in process mode
    @pytest.mark.asyncio
    async def test_the_camera_fanout_writes_its_timeline(self, tmp_path: Path) -> None:
        spec = importlib.util.spec_from_file_location("camera_fanout_traced", CAMERA_EXAMPLE)
        assert spec is not None
        assert spec.loader is not None
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        trace = tmp_path / "cameras.json"
        # Small frames and model, as tests/test_session.py runs the example.
        pytest.importorskip("av", reason="the example's cameras need PyAV")
        from aiodla.testing import encode_clip

        clips = [
            str(encode_clip(tmp_path / f"clip{i}.mkv", frames=60, size=(320, 180)))
            for i in range(2)
        ]
        stats = await example.run(
            example.demo_model(0.05, size=160), clips, duration=1.5, trace=str(trace)
        )
        document = json.loads(await anyio.Path(trace).read_text())
        check_trace_format(document)
        tasks = [e for e in document["traceEvents"] if e.get("name") == "DLA task"]
        completed = [t for t in tasks if t["args"]["outcome"] == "completed"]
        # One DLA task for every frame that got its answer to its camera.
        assert len(completed) == sum(s.completed for s in stats) > 0
        assert {t["args"]["model"] for t in tasks} == {"yolov5s"}
