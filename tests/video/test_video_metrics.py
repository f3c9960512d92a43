"""Prometheus metrics of video sources: the statistics, labelled by the source's name,
and never its credentials."""

from __future__ import annotations

from pathlib import Path

import pytest
from video_support import take

from aiodla import ConfigurationError, VideoSource
from aiodla.testing import RtspServer

prometheus_client = pytest.importorskip("prometheus_client")
pytest.importorskip("av", reason="the video tests need PyAV (pip install 'aiodla[video]')")

from aiodla.metrics import VideoSourceCollector  # noqa: E402

pytestmark = pytest.mark.asyncio


async def test_the_families_follow_the_statistics(clips: dict[str, Path]) -> None:
    registry = prometheus_client.CollectorRegistry()
    async with VideoSource(clips["h264.mp4"], "ffmpeg", max_frames=4, name="cam1") as source:
        collector = VideoSourceCollector([source])
        registry.register(collector)
        await take(source, 10)
        stats = source.statistics()
        value = registry.get_sample_value
        labels = {"source": "cam1"}
        assert value("aiodla_video_frames_decoded_total", labels) == stats.decoded
        assert value("aiodla_video_frames_delivered_total", labels) == 10
        assert value("aiodla_video_frames_dropped_total", labels) == stats.dropped
        assert value("aiodla_video_decode_errors_total", labels) == 0
        assert value("aiodla_video_reconnects_total", labels) == 0
        assert value("aiodla_video_decode_cpu_seconds_total", labels) == pytest.approx(
            stats.decode_cpu, rel=0.5
        )
        assert value("aiodla_video_source_state", {"source": "cam1", "state": "streaming"}) == 1
        assert value("aiodla_video_source_state", {"source": "cam1", "state": "closed"}) == 0
        info = {"source": "cam1", "decoder": "ffmpeg", "codec": "h264"}
        assert value("aiodla_video_source_info", info) == 1
        with pytest.raises(ConfigurationError, match="watched already"):
            collector.add(source)
    assert value("aiodla_video_source_state", {"source": "cam1", "state": "closed"}) == 1
    collector.remove("cam1")
    assert value("aiodla_video_frames_decoded_total", labels) is None


async def test_credentials_never_reach_a_label(clips: dict[str, Path]) -> None:
    server = RtspServer({"cam": (clips["long264.mp4"], "h264")}, auth=("viewer", "pass-word"))
    registry = prometheus_client.CollectorRegistry()
    with server:
        url = server.url("cam", user="viewer", password="pass-word")
        async with VideoSource(url, "ffmpeg") as source:
            registry.register(VideoSourceCollector([source]))
            await take(source, 3)
            text = prometheus_client.generate_latest(registry).decode()
    assert f'source="rtsp://127.0.0.1:{server.port}/cam"' in text
    assert "pass-word" not in text and "viewer" not in text
