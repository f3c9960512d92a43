"""VideoSource with the ffmpeg decoder, against clips PyAV encodes and a real RTSP server."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from video_support import FPS, reference_frames, take, wait_for

from aiodla import ConfigurationError, VideoSource, VideoSourceError
from aiodla.testing import RtspServer

pytest.importorskip("av", reason="the video tests need PyAV (pip install 'aiodla[video]')")

pytestmark = pytest.mark.asyncio


def adds_up(source: VideoSource) -> None:
    stats = source.statistics()
    assert stats.decoded == stats.delivered + stats.dropped + stats.buffered, stats


class TestFiles:
    @pytest.mark.parametrize("clip", ["h264.mp4", "h265.mkv", "h264.mov", "h265.ts"])
    async def test_every_frame_in_order_equals_pyav_decode(
        self, clips: dict[str, Path], clip: str
    ) -> None:
        expected = reference_frames(clips[clip])
        async with VideoSource(clips[clip], "ffmpeg", max_frames=len(expected)) as source:
            frames = [frame async for frame in source]
        assert [f.index for f in frames] == list(range(len(expected)))
        for frame, (pts, pixels) in zip(frames, expected, strict=True):
            assert frame.format == source.format == "i420"
            assert not frame.on_device
            assert (frame.width, frame.height) == (pixels.shape[1], pixels.shape[0] * 2 // 3)
            assert frame.pts == pytest.approx(pts)
            np.testing.assert_array_equal(frame.array, pixels)
            assert frame.source == str(clips[clip])
        stats = source.statistics()
        assert stats.decoded == stats.delivered == len(expected)
        assert (stats.state, stats.reason, stats.decoder) == ("closed", None, "ffmpeg")
        assert stats.codec == ("h264" if "h264" in clip else "hevc")
        assert stats.decode_cpu > 0

    async def test_a_file_ends_and_its_state_says_so(self, clips: dict[str, Path]) -> None:
        async with VideoSource(clips["h264.mov"], "ffmpeg", max_frames=100) as source:
            frames = [frame async for frame in source]
            assert source.statistics().state == "ended"
            assert source.statistics().reason == "end of file"
        assert len(frames) == 20

    async def test_repeat_starts_again_at_the_end(self, clips: dict[str, Path]) -> None:
        async with VideoSource(clips["h264.mov"], "ffmpeg", repeat=True, max_frames=100) as source:
            frames = await take(source, 45)
        assert [f.index for f in frames] == list(range(45))
        np.testing.assert_array_equal(frames[20].array, frames[0].array)
        assert frames[20].pts == frames[0].pts

    async def test_a_file_is_read_at_the_readers_pace_without_drops(
        self, clips: dict[str, Path]
    ) -> None:
        async with VideoSource(clips["h264.mp4"], "ffmpeg", max_frames=2) as source:
            frames = await take(source, 5)
            await asyncio.sleep(0.3)  # a slow reader: the file waits for it
            stats = source.statistics()
            assert stats.decoded <= 5 + 2 and stats.buffered == 2 and stats.dropped == 0
            frames += [frame async for frame in source]
        assert [f.index for f in frames] == list(range(60))
        assert source.statistics().dropped == 0

    async def test_closing_drops_the_queued_frames_and_counts_them(
        self, clips: dict[str, Path]
    ) -> None:
        source = VideoSource(clips["h264.mp4"], "ffmpeg", max_frames=4)
        async with source:
            first = await take(source, 1)
            await wait_for(lambda: source.statistics().buffered == 4, what="a full queue")
        stats = source.statistics()
        assert stats.buffered == 0
        assert stats.delivered == 1
        assert stats.decoded == stats.delivered + stats.dropped
        assert first[0].array.shape == (180, 160)  # a handed-out frame stays readable
        assert [frame async for frame in source] == []


class TestRefused:
    async def test_a_missing_file(self, tmp_path: Path) -> None:
        with pytest.raises(VideoSourceError, match="does not exist") as caught:
            async with VideoSource(tmp_path / "nope.mp4", "ffmpeg"):
                pass
        assert (caught.value.reason, caught.value.retryable) == ("not found", False)
        assert caught.value.source == str(tmp_path / "nope.mp4")

    async def test_a_missing_file_is_not_retried_even_with_reconnect(self, tmp_path: Path) -> None:
        source = VideoSource(tmp_path / "nope.mp4", "ffmpeg", reconnect=True)
        with pytest.raises(VideoSourceError):
            await source.start()
        assert source.statistics().reconnects == 0
        assert source.statistics().state == "closed"

    async def test_a_usb_camera_that_is_not_there(self) -> None:
        # (No camera here: reading one, MJPEG or YUYV, has not run on this machine.)
        with pytest.raises(VideoSourceError, match="no such camera") as caught:
            async with VideoSource("/dev/video97", "ffmpeg"):
                pass
        assert (caught.value.reason, caught.value.retryable) == ("not found", False)

    async def test_an_unsupported_codec(self, tmp_path: Path) -> None:
        import av

        path = tmp_path / "vp9.mkv"
        with av.open(str(path), "w") as out:
            stream = out.add_stream("libvpx-vp9", rate=30)
            stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
            for i in range(3):
                frame = av.VideoFrame.from_ndarray(
                    np.full((48, 64, 3), i, np.uint8), format="rgb24"
                )
                out.mux(stream.encode(frame))
            out.mux(stream.encode())
        with pytest.raises(VideoSourceError, match="vp9, a codec aiodla does not read") as caught:
            async with VideoSource(path, "ffmpeg"):
                pass
        assert (caught.value.reason, caught.value.retryable) == ("unsupported codec", False)

    async def test_a_file_with_no_video(self, tmp_path: Path) -> None:
        import av

        path = tmp_path / "audio.mkv"
        with av.open(str(path), "w") as out:
            stream = out.add_stream("pcm_s16le", rate=8000)
            frame = av.AudioFrame.from_ndarray(
                np.zeros((1, 800), np.int16), format="s16", layout="mono"
            )
            frame.sample_rate = 8000
            out.mux(stream.encode(frame))
            out.mux(stream.encode())
        with pytest.raises(VideoSourceError, match="has no video stream") as caught:
            async with VideoSource(path, "ffmpeg"):
                pass
        assert caught.value.reason == "no video"

    async def test_a_file_that_is_no_video(self, tmp_path: Path) -> None:
        path = tmp_path / "notes.mp4"
        path.write_text("not a video")
        with pytest.raises(VideoSourceError, match="cannot be read as a video") as caught:
            async with VideoSource(path, "ffmpeg"):
                pass
        assert caught.value.retryable is False

    @pytest.mark.parametrize(
        ("kw", "match"),
        [
            ({"max_frames": 0}, "max_frames=0 must be an int >= 1"),
            ({"transport": "quic"}, "transport='quic'"),
            ({"stall_timeout": 0}, "stall_timeout=0 must be seconds > 0"),
            ({"reconnect_delay": 2.0, "max_reconnect_delay": 1.0}, "max_reconnect_delay"),
            ({"engine": object()}, "engine must be an aiodla.Engine"),
        ],
    )
    async def test_bad_options(
        self, clips: dict[str, Path], kw: dict[str, Any], match: str
    ) -> None:
        with pytest.raises(ConfigurationError, match=match):
            VideoSource(clips["h264.mov"], "ffmpeg", **kw)

    @pytest.mark.parametrize("uri", ["http://cam/stream", "", "udp://1.2.3.4:5"])
    async def test_uris_it_does_not_read(self, uri: str) -> None:
        with pytest.raises(ConfigurationError):
            VideoSource(uri)

    async def test_a_decoder_that_is_not_one(self, clips: dict[str, Path]) -> None:
        with pytest.raises(ConfigurationError, match="decoder='opencv'"):
            VideoSource(clips["h264.mov"], "opencv")

    async def test_a_csi_camera_is_not_for_ffmpeg(self) -> None:
        with pytest.raises(
            VideoSourceError, match="CSI cameras are read through GStreamer"
        ) as caught:
            VideoSource("csi://0", "ffmpeg")
        assert caught.value.reason == "decoder"

    async def test_reopening_a_closed_source(self, clips: dict[str, Path]) -> None:
        source = VideoSource(clips["h264.mov"], "ffmpeg")
        async with source:
            pass
        with pytest.raises(Exception, match="Cannot reopen a video source"):
            async with source:
                pass


class TestCorruption:
    @pytest.mark.parametrize("damage", ["truncated", "garbage"])
    async def test_a_damaged_packet_is_counted_and_the_next_keyframe_recovers(
        self, tmp_path: Path, damage: str
    ) -> None:
        import av

        from aiodla.testing import encode_clip

        clean = encode_clip(tmp_path / "clean.mkv", "h264", frames=45, size=(160, 120), keyint=15)
        with av.open(str(clean)) as src:
            packets = [
                (bytes(p), p.pts, p.dts, p.is_keyframe) for p in src.demux(video=0) if p.size
            ]
            time_base = src.streams.video[0].time_base
        assert [k for *_, k in packets].count(True) == 3
        broken = tmp_path / "broken.mkv"
        with av.open(str(clean)) as src, av.open(str(broken), "w") as out:
            stream = out.add_stream_from_template(src.streams.video[0])
            for index, (data, pts, dts, _) in enumerate(packets):
                if index == 20:  # a P-frame between the keyframes at 15 and 30
                    rng = np.random.default_rng(1)
                    data = (
                        data[: len(data) // 3]
                        if damage == "truncated"
                        else data[:4] + rng.integers(0, 255, len(data) - 4, np.uint8).tobytes()
                    )
                packet = av.Packet(data)
                packet.pts, packet.dts, packet.time_base, packet.stream = (
                    pts,
                    dts,
                    time_base,
                    stream,
                )
                out.mux(packet)
        expected = {round(pts * FPS): pixels for pts, pixels in reference_frames(clean)}
        async with VideoSource(broken, "ffmpeg", max_frames=100) as source:
            frames = [frame async for frame in source]
        stats = source.statistics()
        assert stats.decode_errors >= 1
        shown = [round(f.pts * FPS) for f in frames]
        assert shown[:20] == list(range(20))
        assert 30 in shown and shown[-1] == 44  # recovered at the keyframe
        assert not any(21 <= n < 30 for n in shown)
        for frame in frames:
            np.testing.assert_array_equal(frame.array, expected[round(frame.pts * FPS)])


class TestRtsp:
    @pytest.mark.parametrize("transport", ["tcp", "udp"])
    @pytest.mark.parametrize("mount", ["h264", "h265"])
    async def test_frames_in_order_with_timestamps_equal_to_the_clip(
        self, rtsp: RtspServer, clips: dict[str, Path], mount: str, transport: str
    ) -> None:
        clip = clips["long264.mp4" if mount == "h264" else "long265.mkv"]
        expected = {round(pts * FPS): pixels for pts, pixels in reference_frames(clip)[:60]}
        async with VideoSource(
            rtsp.url(mount), "ffmpeg", transport=transport, max_frames=64
        ) as source:
            frames = await take(source, 30)
        assert [f.index for f in frames] == list(range(30))
        times = [f.pts for f in frames if f.pts is not None]
        assert len(times) >= 28 and times == sorted(times)
        assert np.allclose(np.diff(times), 1 / FPS, atol=2e-3)
        for frame in frames:
            if frame.pts is not None and transport == "tcp":  # UDP may lose a packet
                np.testing.assert_array_equal(frame.array, expected[round(frame.pts * FPS)])
        captured = [f.captured_at for f in frames]
        assert captured == sorted(captured)
        assert source.statistics().codec == ("h264" if mount == "h264" else "hevc")

    async def test_wrong_credentials_are_refused_and_never_shown(
        self, clips: dict[str, Path], caplog: pytest.LogCaptureFixture
    ) -> None:
        server = RtspServer({"cam": (clips["long264.mp4"], "h264")}, auth=("viewer", "right-pw"))
        caplog.set_level(logging.DEBUG, logger="aiodla")
        with server:
            url = server.url("cam", user="viewer", password="wrong-pw")
            with pytest.raises(VideoSourceError, match="refused the credentials") as caught:
                async with VideoSource(url, "ffmpeg"):
                    pass
            async with VideoSource(
                server.url("cam", user="viewer", password="right-pw"), "ffmpeg"
            ) as good:
                await take(good, 3)
                shown = [repr(good), str(good.statistics()), good.name]
        error = caught.value
        assert (error.reason, error.retryable) == ("unauthorized", False)
        assert error.source == f"rtsp://127.0.0.1:{server.port}/cam"
        for text in [str(error), repr(error), error.source, caplog.text, *shown]:
            assert "wrong-pw" not in text and "right-pw" not in text and "viewer" not in text

    async def test_a_slow_reader_gets_the_newest_and_drops_are_counted(
        self, rtsp: RtspServer
    ) -> None:
        async with VideoSource(rtsp.url("h264"), "ffmpeg", max_frames=2) as source:
            await take(source, 1)
            await asyncio.sleep(0.5)  # 15 frames come meanwhile; 2 wait
            assert source.statistics().buffered == 2
            frames = await take(source, 3)
            stats = source.statistics()
        assert frames[1].index == frames[0].index + 1
        assert frames[0].index >= 10
        assert stats.dropped >= 8
        in_transit = stats.decoded - stats.delivered - stats.dropped - stats.buffered
        assert 0 <= in_transit <= 2

    async def test_a_path_the_server_does_not_have(self, rtsp: RtspServer) -> None:
        with pytest.raises(VideoSourceError, match="was not found") as caught:
            async with VideoSource(rtsp.url("nothing-here"), "ffmpeg"):
                pass
        assert caught.value.retryable is False

    async def test_closing_mid_stream_ends_the_thread(self, rtsp: RtspServer) -> None:
        before = threading.active_count()
        source = VideoSource(rtsp.url("h264"), "ffmpeg")
        async with source:
            await take(source, 5)
        assert threading.active_count() == before
        assert source.statistics().state == "closed"


def silent_server() -> tuple[socket.socket, str]:
    """A TCP listener that accepts and never answers: an RTSP camera that hangs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    return listener, f"rtsp://127.0.0.1:{listener.getsockname()[1]}/stream"


class TestReconnect:
    async def test_the_server_goes_away_and_comes_back(self, clips: dict[str, Path]) -> None:
        """Reconnects within 2 s of the server's return; the other source, on another
        server, keeps its frame rate through the outage; the loss is counted."""
        flaky = RtspServer({"cam": (clips["long264.mp4"], "h264")})
        steady = RtspServer({"cam": (clips["long265.mkv"], "h265")})
        with flaky, steady:
            async with (
                VideoSource(flaky.url("cam"), "ffmpeg", stall_timeout=2.0) as lost,
                VideoSource(steady.url("cam"), "ffmpeg", stall_timeout=2.0) as other,
            ):
                seen: dict[str, list[float]] = {"lost": [], "other": []}
                loop = asyncio.get_running_loop()

                async def drain(name: str, source: VideoSource) -> None:
                    async for _ in source:
                        seen[name].append(loop.time())

                readers = [
                    asyncio.create_task(drain("lost", lost)),
                    asyncio.create_task(drain("other", other)),
                ]
                await wait_for(lambda: len(seen["lost"]) >= 30 and len(seen["other"]) >= 30)
                before_start = loop.time()
                await asyncio.sleep(1.5)
                before = _rate(seen["other"], before_start, loop.time())

                flaky.stop()
                down_at = loop.time()
                await wait_for(
                    lambda: lost.statistics().state == "reconnecting", what="reconnecting"
                )
                assert lost.statistics().reason in ("lost", "stalled")
                await asyncio.sleep(1.5)
                during = _rate(seen["other"], down_at, loop.time())
                flaky.start()
                back_at = loop.time()
                count = len(seen["lost"])
                await wait_for(lambda: len(seen["lost"]) > count, timeout=10, what="frames again")
                assert loop.time() - back_at <= 2.0
                for reader in readers:
                    reader.cancel()
                await asyncio.gather(*readers, return_exceptions=True)
                stats = lost.statistics()
        assert stats.reconnects == 1
        assert stats.state == "streaming"
        assert during >= 0.95 * before, (before, during)

    async def test_without_reconnect_the_first_loss_ends_the_iteration(
        self, clips: dict[str, Path]
    ) -> None:
        server = RtspServer({"cam": (clips["long264.mp4"], "h264")})
        with server:
            async with VideoSource(
                server.url("cam"), "ffmpeg", reconnect=False, stall_timeout=2
            ) as source:
                await take(source, 5)
                server.stop()
                with pytest.raises(VideoSourceError) as caught:
                    async for _ in source:
                        pass
        assert caught.value.reason in ("lost", "stalled")
        assert caught.value.retryable is True
        assert source.statistics().reconnects == 0

    async def test_a_stalled_camera_reconnects_and_blocks_no_other_source(
        self, clips: dict[str, Path]
    ) -> None:
        listener, url = silent_server()
        with listener:
            async with VideoSource(
                url, "ffmpeg", stall_timeout=0.3, max_reconnect_delay=0.2
            ) as hung:
                async with VideoSource(clips["h264.mp4"], "ffmpeg", max_frames=100) as fine:
                    frames = [frame async for frame in fine]
                assert len(frames) == 60
                await wait_for(lambda: hung.statistics().state == "reconnecting")
                assert hung.statistics().reason == "stalled"

    async def test_a_camera_that_is_not_there_yet_is_retried(self) -> None:
        listener, url = silent_server()
        listener.close()  # nothing listens on that port now: connection refused
        async with VideoSource(url, "ffmpeg", max_reconnect_delay=0.1) as source:
            await wait_for(lambda: source.statistics().state == "reconnecting")
            assert source.statistics().reason == "lost"
        with pytest.raises(VideoSourceError, match="was lost"):
            async with VideoSource(url, "ffmpeg", reconnect=False):
                pass


def _rate(times: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in times) / (end - start)


class TestBackOff:
    async def test_capped_exponential_with_jitter_from_the_upper_half(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Each wait is drawn from [delay / 2, delay], the delay doubling from
        reconnect_delay up to max_reconnect_delay; the attempts go on meanwhile."""
        from aiodla import _video_reader

        drawn: list[tuple[float, float]] = []

        def uniform(low: float, high: float) -> float:
            drawn.append((low, high))
            return low

        monkeypatch.setattr(_video_reader.random, "uniform", uniform)
        listener, url = silent_server()
        listener.close()  # connection refused, at once, on every attempt
        async with VideoSource(url, "ffmpeg", reconnect_delay=0.01, max_reconnect_delay=0.04):
            await wait_for(lambda: len(drawn) >= 6, what="six attempts")
        highs = [high for _, high in drawn[:6]]
        assert highs == pytest.approx([0.01, 0.02, 0.04, 0.04, 0.04, 0.04])
        assert all(low == pytest.approx(high / 2) for low, high in drawn[:6])
