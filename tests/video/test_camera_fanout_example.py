"""examples/camera_fanout.py with no URI: its own clips, served over RTSP, into Detect."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from video_support import rtsp_or_skip

pytest.importorskip("av", reason="the example's cameras need PyAV")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "camera_fanout.py"


@pytest.mark.in_process  # the example prints engine.runtime.name
@pytest.mark.asyncio
async def test_its_own_cameras_over_rtsp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rtsp_or_skip()
    spec = importlib.util.spec_from_file_location("camera_fanout_own", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("camera_fanout_own", example)
    spec.loader.exec_module(example)
    with example.own_cameras(2, (320, 180), 2.0, tmp_path) as uris:
        assert all(uri.startswith("rtsp://127.0.0.1:") for uri in uris)
        stats = await example.run(example.demo_model(0.02, size=160), uris, duration=2.0)
    assert [s.name for s in stats] == ["cam0", "cam1"]
    assert all(s.completed > 0 for s in stats)
    printed = capsys.readouterr().out
    assert "2 cameras on the emulated runtime" in printed
    assert "capture-to-boxes" in printed
