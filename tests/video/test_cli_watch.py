"""``aiodla watch``: cameras into a detector, each one's rate and latency printed."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from video_support import mjpeg_clip

from aiodla import TensorSpec, _cli
from aiodla.emulator import make_loadable
from aiodla.emulator._detector import PRESETS
from aiodla.testing import RtspServer

pytest.importorskip("av", reason="the video tests need PyAV (pip install 'aiodla[video]')")

pytestmark = pytest.mark.in_process  # it prints the engine's runtime


@pytest.fixture
def detector(tmp_path: Path) -> Path:
    """YOLOv5s' heads at a 160x160 input: the host letterboxes frames cheaply."""
    _, outputs, _ = PRESETS["yolov5s"]
    inputs = (TensorSpec("images", (1, 3, 160, 160), "float16", "chw16"),)
    heads = tuple(
        TensorSpec(s.name, (1, 255, 160 // k, 160 // k), "float16", "chw16")
        for s, k in zip(outputs, (8, 16, 32), strict=True)
    )
    path = tmp_path / "det.bin"
    path.write_bytes(make_loadable(inputs, heads, "detect", 0.005))
    return path


def test_two_cameras_reported_every_interval(clips: dict[str, Path], detector: Path) -> None:
    result = CliRunner().invoke(
        _cli.cli,
        ["watch", str(clips["h264.mp4"]), str(clips["h265.mkv"]), "--model", str(detector),
         "--seconds", "1.6", "--interval", "0.5", "--decoder", "ffmpeg"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("2 camera(s), decoded by ffmpeg, into 'images'")
    assert sum(line.startswith("camera ") for line in lines) >= 3
    rows = [line.split() for line in lines if line.startswith(str(clips["h264.mp4"])[:38])]
    assert rows and any(float(row[1]) > 0 for row in rows)  # frames answered a second
    assert any(line.startswith("host CPU ") for line in lines)


def test_cameras_decoded_in_processes_report_those_processes_cpu(
    clips: dict[str, Path], detector: Path
) -> None:
    result = CliRunner().invoke(
        _cli.cli,
        ["watch", str(clips["h264.mp4"]), "--model", str(detector), "--seconds", "2.5",
         "--interval", "0.5", "--decoder", "ffmpeg", "--isolation", "process"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "decoded by ffmpeg in processes of their own" in result.output.splitlines()[0]
    shares = [
        float(line.split("decoding processes ")[1].split("%")[0])
        for line in result.output.splitlines()
        if line.startswith("host CPU ")
    ]
    assert len(shares) >= 4, result.output
    assert max(shares) > 0  # the decoding process's CPU, which process_time never sees


def test_a_full_range_camera_is_read_as_full_range(
    tmp_path: Path, detector: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A USB camera's MJPEG (full-range YUV) stands in here as an MJPEG file: its frames
    are answered, which an engine reading limited range would refuse one by one."""
    from aiodla import _video_ffmpeg

    monkeypatch.setattr(_video_ffmpeg, "CODECS", (*_video_ffmpeg.CODECS, "mjpeg"))
    clip = mjpeg_clip(tmp_path / "mjpeg.mkv", "yuvj420p", frames=30)
    result = CliRunner().invoke(
        _cli.cli,
        ["watch", str(clip), "--model", str(detector), "--seconds", "1.2", "--interval", "0.5",
         "--decoder", "ffmpeg"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines() if line.startswith(str(clip)[:38])]
    assert rows and any(float(row[1]) > 0 for row in rows), result.output


def test_a_refused_camera_is_one_line_without_its_credentials(
    clips: dict[str, Path], detector: Path
) -> None:
    server = RtspServer({"cam": (clips["long264.mp4"], "h264")}, auth=("viewer", "right-pw"))
    with server:
        url = server.url("cam", user="viewer", password="wrong-pw")
        result = CliRunner().invoke(
            _cli.cli, ["watch", url, "--model", str(detector), "--seconds", "1"]
        )
    assert result.exit_code == 1, result.output
    assert "refused the credentials" in result.output
    assert "wrong-pw" not in result.output and "viewer" not in result.output


def test_a_missing_file(tmp_path: Path, detector: Path) -> None:
    result = CliRunner().invoke(
        _cli.cli, ["watch", str(tmp_path / "nope.mp4"), "--model", str(detector)]
    )
    assert result.exit_code == 1
    assert "does not exist" in result.output
