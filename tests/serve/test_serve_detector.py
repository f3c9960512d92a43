"""A detector served as what it is: camera frames in (UINT8 H x W x 3, or NV12, any
size up to max_frame), detections out (boxes in frame pixels, scores, classes and a
count), over both protocols and Triton's four clients, with metadata and config that
say so; ``aiodla serve --preprocess/--detect``; the serving guide's example."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from click.testing import CliRunner
from clients import KINDS, Client, failure

from aiodla import Detect, Detections, Engine, ImagePreprocess, _cli
from aiodla.emulator import make_loadable
from aiodla.emulator._detector import PRESETS
from aiodla.serve import Server
from aiodla.testing import EngineFactory

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "serving.md"
INPUTS, HEADS, _ = PRESETS["yolov5s"]
MAX_FRAME = (720, 1280)
BGR = ImagePreprocess(source="bgr", order="rgb", resize="letterbox", max_frame=MAX_FRAME)
NV12 = ImagePreprocess(source="nv12", order="rgb", resize="letterbox", max_frame=MAX_FRAME)
YOLOV5 = Detect(head="yolov5")
# The emulated heads' objects score sigmoid(4) * sigmoid(4), about 0.96: none passes.
NOTHING = Detect(head="yolov5", conf=0.99)


@pytest.fixture(scope="module")
def loadable() -> bytes:
    return make_loadable(INPUTS, HEADS, "detect", 0.001)


@pytest_asyncio.fixture
async def detectors(aiodla_engine: EngineFactory, loadable: bytes) -> dict[str, Engine]:
    return {
        "det": await aiodla_engine(loadable, preprocess={"images": BGR}, postprocess=YOLOV5),
        "det12": await aiodla_engine(loadable, preprocess={"images": NV12}, postprocess=YOLOV5),
        "none": await aiodla_engine(loadable, preprocess={"images": BGR}, postprocess=NOTHING),
        "heads": await aiodla_engine(loadable, preprocess={"images": BGR}),
        "tensor": await aiodla_engine(loadable, postprocess=YOLOV5),
    }


@pytest_asyncio.fixture
async def server(detectors: dict[str, Engine]) -> Any:
    async with Server(detectors, http="127.0.0.1:0", grpc="127.0.0.1:0") as s:
        yield s


def frame(seed: int, height: int = 480, width: int = 640) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)


def nv12(seed: int, height: int = 360, width: int = 640) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(16, 240, (height * 3 // 2, width), np.uint8)


def as_arrays(found: Detections) -> dict[str, np.ndarray[Any, Any]]:
    return {
        "boxes": np.asarray(found.boxes, np.float32),
        "scores": np.asarray(found.scores, np.float32),
        "classes": np.asarray(found.classes, np.int32),
        "count": np.array([len(found)], np.int32),
    }


def same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert got[name].shape == value.shape, name
        assert got[name].tobytes() == value.tobytes(), name


FRAME_METADATA = {"name": "images", "datatype": "UINT8", "shape": [-1, -1, 3]}
DETECTION_METADATA = [
    {"name": "boxes", "datatype": "FP32", "shape": [-1, 4]},
    {"name": "scores", "datatype": "FP32", "shape": [-1]},
    {"name": "classes", "datatype": "INT32", "shape": [-1]},
    {"name": "count", "datatype": "INT32", "shape": [1]},
]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["http", "grpc"])
async def test_metadata_says_frames_in_detections_out(server: Server, kind: str) -> None:
    client = Client(kind, server)
    answer = await client.metadata("det")
    assert answer["inputs"] == [FRAME_METADATA]
    assert answer["outputs"] == DETECTION_METADATA
    nv12_answer = await client.metadata("det12")
    assert nv12_answer["inputs"] == [{"name": "images", "datatype": "UINT8", "shape": [-1, -1]}]
    heads = await client.metadata("heads")  # frames in, the model's own heads out
    assert heads["inputs"] == [FRAME_METADATA]
    assert [o["name"] for o in heads["outputs"]] == [s.name for s in HEADS]


@pytest.mark.asyncio
async def test_the_config_says_what_the_frames_and_boxes_are(server: Server) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{server.http_port}/v2/models/det/config") as response,
    ):
        config = await response.json()
    assert config["input"] == [{"name": "images", "data_type": "TYPE_UINT8", "dims": [-1, -1, 3]}]
    assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == [
        ("boxes", "TYPE_FP32", [-1, 4]),
        ("scores", "TYPE_FP32", [-1]),
        ("classes", "TYPE_INT32", [-1]),
        ("count", "TYPE_INT32", [1]),
    ]
    parameters = {k: v["string_value"] for k, v in config["parameters"].items()}
    assert parameters["images.source"] == "bgr"
    assert parameters["images.max_frame"].startswith("720x1280")
    assert "frame's pixels" in parameters["boxes"]
    assert "head=yolov5" in parameters["detect"] and "max_det=300" in parameters["detect"]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_frames_of_any_size_give_the_engines_detections(
    server: Server, detectors: dict[str, Engine], kind: str
) -> None:
    client = Client(kind, server)
    # (Under a MiB each: aiohttp's client, under tritonclient.http.aio, warns past one.)
    sizes = [(480, 640), (240, 320), (400, 240)]
    if kind in ("http", "grpc"):
        sizes += [MAX_FRAME, MAX_FRAME[::-1]]  # max_frame, either way round
    for seed, (height, width) in enumerate(sizes):
        camera = frame(seed, height, width)
        got, _ = await client.infer("det", {"images": camera})
        want = as_arrays(await detectors["det"].infer(camera))
        same(got, want)
        assert 0 < got["count"][0] == len(got["boxes"]) == len(got["scores"])
        assert got["boxes"][:, 0::2].max() <= width and got["boxes"][:, 1::2].max() <= height


@pytest.mark.asyncio
async def test_without_preprocess_the_models_tensor_in_and_detections_out(
    server: Server, detectors: dict[str, Engine]
) -> None:
    client = Client("grpc", server)
    answer = await client.metadata("tensor")
    assert answer["inputs"] == [{"name": "images", "datatype": "FP16", "shape": [1, 3, 640, 640]}]
    assert answer["outputs"] == DETECTION_METADATA
    x = np.random.default_rng(5).random((1, 3, 640, 640)).astype(np.float16)
    got, _ = await client.infer("tensor", {"images": x})
    same(got, as_arrays(await detectors["tensor"].infer(x)))
    config = server.models["tensor"].config()
    assert "model input's pixels" in config["parameters"]["boxes"]["string_value"]


@pytest.mark.asyncio
async def test_json_frames_and_json_detections(
    server: Server, detectors: dict[str, Engine]
) -> None:
    camera = frame(7, 48, 64)
    got, _ = await Client("http", server).infer("det", {"images": camera}, binary=False)
    same(got, as_arrays(await detectors["det"].infer(camera)))


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["http", "grpc_aio"])
async def test_nv12_frames_and_asked_outputs(
    server: Server, detectors: dict[str, Engine], kind: str
) -> None:
    camera = nv12(3)
    got, _ = await Client(kind, server).infer(
        "det12", {"images": camera}, outputs=["count", "boxes"]
    )
    want = as_arrays(await detectors["det12"].infer(camera))
    same(got, {"count": want["count"], "boxes": want["boxes"]})


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_no_detection_is_a_count_of_zero_and_empty_rows(server: Server, kind: str) -> None:
    got, _ = await Client(kind, server).infer("none", {"images": frame(1)})
    assert got["count"].tolist() == [0]
    assert got["boxes"].shape == (0, 4) and got["scores"].shape == got["classes"].shape == (0,)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("kind", "code"), [("http", "400"), ("grpc", "StatusCode.INVALID_ARGUMENT")]
)
async def test_frames_the_engine_cannot_take_are_refused(
    server: Server, kind: str, code: str
) -> None:
    client = Client(kind, server)
    cases: list[tuple[dict[str, Any], dict[str, str], str]] = [
        ({"images": frame(0, 1080, 1920)}, {}, "max_frame"),  # larger than max_frame
        (
            {"images": frame(0)[:, :, :2].copy()},
            {},
            r"shape \[480, 640, 2\], expected \[-1, -1, 3\]",
        ),
        ({"images": frame(0).astype(np.float32)}, {}, "datatype 'FP32', expected UINT8"),
        ({"images": frame(0)[None]}, {}, r"expected \[-1, -1, 3\]"),
    ]
    for arrays, datatypes, message in cases:
        exc = await failure(client.infer("det", arrays, datatypes=datatypes))
        assert str(exc.status()) == code, exc
        assert re.search(message, exc.message()), exc.message()
    assert server.statistics().failed == {"INVALID_ARGUMENT": len(cases)}


# -- the command line ---------------------------------------------------------------------


def record_serve(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    from aiodla.serve import _app

    given: dict[str, Any] = {}

    async def recording(models: list[str], **options: Any) -> None:
        given.update(options, models=models)

    monkeypatch.setattr(_app, "serve", recording)
    return given


def test_the_command_passes_frames_and_detect_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    given = record_serve(monkeypatch)
    result = CliRunner().invoke(
        _cli.cli,
        ["serve", "det.bin", "--preprocess",
         "images:source=nv12,order=bgr,resize=stretch,max_frame=480x640,mean=0.1/0.2/0.3,std=0.5,"
         "color_range=full",
         "--detect", "head=yolov8,classes=3,conf=0.5,iou=0.6,max_det=7,class_agnostic=true,"
         "strides=8/16,outputs=a/b"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert given["preprocess"] == {
        "": {
            "images": ImagePreprocess(
                source="nv12", order="bgr", resize="stretch", max_frame=(480, 640),
                mean=(0.1, 0.2, 0.3), std=0.5, color_range="full",
            )
        }
    }  # fmt: skip
    assert given["postprocess"] == {
        "": Detect(
            head="yolov8", classes=3, conf=0.5, iou=0.6, max_det=7, class_agnostic=True,
            strides=(8, 16), outputs=("a", "b"),
        )
    }  # fmt: skip


def test_the_command_names_models_for_several(monkeypatch: pytest.MonkeyPatch) -> None:
    given = record_serve(monkeypatch)
    result = CliRunner().invoke(
        _cli.cli,
        ["serve", "det=a.bin", "cls=b.bin", "--preprocess",
         "det/images:source=bgr,order=rgb,resize=letterbox", "--detect", "det:head=yolov5"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert list(given["preprocess"]) == ["det"] and list(given["postprocess"]) == ["det"]


def test_the_command_passes_connection_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    given = record_serve(monkeypatch)
    argv = ["serve", "det.bin", "--header-timeout", "2.5", "--max-connections", "64"]
    result = CliRunner().invoke(_cli.cli, argv)
    assert result.exit_code == 0, result.output
    assert given["header_timeout"] == 2.5 and given["max_connections"] == 64
    defaults = record_serve(monkeypatch)
    assert CliRunner().invoke(_cli.cli, ["serve", "det.bin"]).exit_code == 0
    assert defaults["header_timeout"] == 10.0 and defaults["max_connections"] == 1024


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--preprocess", "source=bgr"], "must be [MODEL/]INPUT:KEY=VALUE"),
        (["--preprocess", "images:source=bgr,colour=red"], "KEY one of source, order"),
        (["--preprocess", "images:source=bgr,order=rgb"], "ImagePreprocess needs"),
        (["--preprocess", "images:source=yuv,order=rgb,resize=none"], "source='yuv' must be"),
        (["--preprocess", "images:source=bgr,order=rgb,resize=none,max_frame=big"], "not a value"),
        (["--detect", "classes=3"], "Detect needs"),
        (["--detect", "head=yolov5,conf=2"], "conf=2.0 must be within"),
        (["--detect", "head=yolov5", "--detect", "head=yolov8"], "a second --detect"),
    ],
)
def test_the_command_refuses_bad_settings(option: list[str], message: str) -> None:
    result = CliRunner().invoke(_cli.cli, ["serve", "det.bin", *option])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output


@pytest.mark.asyncio
async def test_unnamed_settings_with_several_models_are_refused() -> None:
    from aiodla import ConfigurationError
    from aiodla.serve import serve

    with pytest.raises(ConfigurationError, match="--detect must name its model"):
        await serve(["a.bin", "b.bin"], postprocess={"": YOLOV5}, runtime="emulated")
    with pytest.raises(ConfigurationError, match=r"--preprocess names \['c'\]"):
        await serve(["a.bin", "b.bin"], preprocess={"c": {"images": BGR}}, runtime="emulated")


# -- the serving guide's example -------------------------------------------------------------


def guide_blocks() -> tuple[str, str]:
    """The guide's detector example: its console block and its Python client."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("### Serving a detector", 1)[1].split("\n## ", 1)[0]
    console = re.findall(r"```console\n(.*?)```", section, re.S)[0]
    client = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    return console, client


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_guides_detector_example_runs(tmp_path: Path) -> None:
    console, client = guide_blocks()
    commands = [line.split("#")[0].strip() for line in console.splitlines() if line.strip()]
    emulate, serve_line = commands
    assert emulate.startswith("aiodla emulate") and serve_line.startswith("aiodla serve")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    aiodla = [sys.executable, "-m", "aiodla"]
    made = await asyncio.create_subprocess_exec(
        *aiodla, *emulate.split()[1:], cwd=tmp_path, env=env
    )
    assert await made.wait() == 0
    # The guide's ports, made free ones; the runtime the emulated one.
    argv = serve_line.replace("127.0.0.1:8000", "127.0.0.1:0").split()[1:]
    process = await asyncio.create_subprocess_exec(
        *aiodla, *argv, "--grpc", "off", "--runtime", "emulated",
        cwd=tmp_path, env=env, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        line = (await asyncio.wait_for(process.stderr.readline(), 60)).decode()
        port = re.search(r"HTTP port (\d+)", line)
        assert port, line
        script = tmp_path / "client.py"
        script.write_text(client.replace("127.0.0.1:8000", f"127.0.0.1:{port[1]}"))
        run = await asyncio.create_subprocess_exec(
            sys.executable, str(script), cwd=tmp_path, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output = (await asyncio.wait_for(run.communicate(), 60))[0].decode()
        assert run.returncode == 0, output
        # It prints the count, then one line a detection: class, score, box.
        count, *rows = output.splitlines()
        assert int(count.split()[0]) == len(rows) > 0, output
        for row in rows:
            assert re.fullmatch(r"class \d+ score 0\.\d+ box \[.*\]", row), row
    finally:
        process.terminate()
        await process.wait()
