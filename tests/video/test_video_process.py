"""VideoSource(isolation="process"): decoding in a process of its own.

Against real decoding processes (the ffmpeg decoder, clips PyAV encodes): the same
frames as on the reader thread, the same refusals, a decoding process killed or
hung is a reconnect, closing leaves no process, descriptor or thread behind, and the
decoding process dies with the application. Against a decoding process's own code
(``serve``) run on a thread with a scripted decoder: what a decoder can do that a
clip cannot make it do (a bug, a picture size that changes, damaged packets).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from video_support import reference_frames, take, wait_for

from aiodla import ConfigurationError, VideoSource, VideoSourceError
from aiodla import _video_process as video_process
from aiodla._video_decoders import DecodeTrouble, OpenOptions

from support import alive, open_fds

pytest.importorskip("av", reason="the video tests need PyAV (pip install 'aiodla[video]')")

pytestmark = pytest.mark.asyncio


def decoding_processes() -> set[int]:
    """This process's children that run a decoding process."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except OSError:
            continue  # gone meanwhile
        if parent == os.getpid() and b"aiodla._video_process" in command:
            found.add(int(entry))
    return found


async def one_decoding_process() -> int:
    await wait_for(lambda: len(decoding_processes()) == 1, what="one decoding process")
    (pid,) = decoding_processes()
    return pid


class TestFrames:
    @pytest.mark.parametrize("clip", ["h264.mp4", "h265.mkv"])
    async def test_the_same_frames_as_on_the_reader_thread(
        self, clips: dict[str, Path], clip: str
    ) -> None:
        expected = reference_frames(clips[clip])
        async with VideoSource(
            clips[clip], "ffmpeg", isolation="process", max_frames=len(expected)
        ) as source:
            frames = [frame async for frame in source]
        assert [f.index for f in frames] == list(range(len(expected)))
        for frame, (pts, pixels) in zip(frames, expected, strict=True):
            assert (frame.format, frame.on_device) == ("i420", False)
            assert frame.pts == pytest.approx(pts)
            np.testing.assert_array_equal(frame.array, pixels)
        stats = source.statistics()
        assert stats.decoded == stats.delivered == len(expected)
        assert (stats.isolation, stats.decoder) == ("process", "ffmpeg")
        assert stats.codec == ("h264" if "h264" in clip else "hevc")
        # The decoding process's CPU, from its start: its interpreter's and imports'
        # (tenths of a second) beyond the reader thread's copying (about 0.01 s here).
        assert stats.decode_cpu > 0.05

    async def test_a_slow_reader_holds_every_slot_and_loses_nothing(
        self, clips: dict[str, Path]
    ) -> None:
        async with VideoSource(
            clips["h264.mp4"], "ffmpeg", isolation="process", max_frames=1
        ) as source:
            frames = []
            async for frame in source:
                frames.append(frame)
                await asyncio.sleep(0.005)  # the decoder is ahead and waits for slots
        assert [f.index for f in frames] == list(range(60))
        assert source.statistics().dropped == 0

    async def test_isolation_is_checked(self, clips: dict[str, Path]) -> None:
        with pytest.raises(ConfigurationError, match="isolation='processes' must be one of"):
            VideoSource(clips["h264.mp4"], "ffmpeg", isolation="processes")


class TestLive:
    async def test_an_rtsp_stream_decoded_in_a_process(self, rtsp: Any) -> None:
        async with VideoSource(rtsp.url("h264"), "ffmpeg", isolation="process") as source:
            frames = await take(source, 20)
        assert [f.index for f in frames] == sorted(f.index for f in frames)
        pts = [f.pts for f in frames if f.pts is not None]  # (a stream's first may have none)
        assert len(pts) >= 15 and pts == sorted(pts) and len(set(pts)) == len(pts)
        stats = source.statistics()
        assert (stats.isolation, stats.codec, stats.decode_errors) == ("process", "h264", 0)
        assert stats.decoded == stats.delivered + stats.dropped + stats.buffered


class TestRefused:
    async def test_a_missing_file_is_the_same_error_as_on_the_thread(self, tmp_path: Path) -> None:
        errors = []
        for isolation in ("thread", "process"):
            with pytest.raises(VideoSourceError) as caught:
                async with VideoSource(tmp_path / "nope.mp4", "ffmpeg", isolation=isolation):
                    pass
            errors.append(caught.value)
        thread, process = errors
        assert str(process) == str(thread)
        assert (process.reason, process.retryable, process.source) == (
            "not found",
            False,
            str(tmp_path / "nope.mp4"),
        )
        assert decoding_processes() == set()

    async def test_a_file_that_is_no_video(self, tmp_path: Path) -> None:
        path = tmp_path / "text.mp4"
        path.write_text("not a video")
        with pytest.raises(VideoSourceError, match="cannot be read as a video") as caught:
            async with VideoSource(path, "ffmpeg", isolation="process"):
                pass
        assert (caught.value.reason, caught.value.retryable) == ("unreadable", False)


class TestLosses:
    async def test_a_killed_decoding_process_is_a_reconnect(self, clips: dict[str, Path]) -> None:
        async with VideoSource(
            clips["long264.mp4"], "ffmpeg", isolation="process", max_reconnect_delay=0.1
        ) as source:
            await take(source, 5)
            first = await one_decoding_process()
            os.kill(first, signal.SIGKILL)
            # A file is read at the reader's pace: the loss shows as the reads go on,
            # once the pictures already sent (up to a slot each) are read.
            frames = await take(source, 10)
            assert min(f.index for f in frames) >= 5
            stats = source.statistics()
            assert (stats.reconnects, stats.state) == (1, "streaming")
            assert decoding_processes() - {first}  # a new one
        assert decoding_processes() == set()

    async def test_without_reconnect_a_killed_process_ends_the_iteration(
        self, clips: dict[str, Path]
    ) -> None:
        async with VideoSource(
            clips["long264.mp4"], "ffmpeg", isolation="process", reconnect=False
        ) as source:
            await take(source, 2)
            os.kill(await one_decoding_process(), signal.SIGKILL)
            with pytest.raises(VideoSourceError, match=r"lost its decoding process") as caught:
                async for _ in source:
                    pass
        assert (caught.value.reason, caught.value.retryable) == ("decoder process ended", True)
        assert "exit status -9" in str(caught.value)

    async def test_a_hung_decoding_process_is_killed_and_replaced(self, rtsp: Any) -> None:
        # A live source: silence past twice stall_timeout and a second is a hang (a
        # file's decoding process is given OPEN_GRACE, since a file never stalls).
        async with VideoSource(
            rtsp.url("h264"),
            "ffmpeg",
            isolation="process",
            stall_timeout=0.3,
            max_reconnect_delay=0.1,
        ) as source:
            await take(source, 2)
            hung = await one_decoding_process()
            os.kill(hung, signal.SIGSTOP)  # says nothing more, and never exits by itself
            await wait_for(lambda: source.statistics().reconnects == 1, what="a reconnect")
            await take(source, 2)
            assert hung not in decoding_processes()  # killed, and reaped
        assert decoding_processes() == set()


class TestLeaks:
    async def test_open_and_close_cycles_leave_nothing_behind(self, clips: dict[str, Path]) -> None:
        async def cycle() -> None:
            async with VideoSource(
                clips["h264.mp4"], "ffmpeg", isolation="process", max_frames=2
            ) as source:
                await take(source, 1)  # and frames in flight as it closes

        await cycle()  # imports and the first lazily made objects
        fds = open_fds()
        threads = threading.active_count()
        for _ in range(20):
            await cycle()
        assert decoding_processes() == set()
        assert open_fds() == fds
        assert threading.active_count() == threads

    async def test_the_decoding_process_dies_with_the_application(
        self, clips: dict[str, Path], tmp_path: Path
    ) -> None:
        script = textwrap.dedent(
            f"""
            import asyncio, os, sys
            import aiodla
            async def main():
                async with aiodla.VideoSource({str(clips["long264.mp4"])!r}, "ffmpeg",
                                              isolation="process") as source:
                    async for frame in source:
                        break
                    for entry in os.listdir(f"/proc"):
                        if entry.isdigit() and int(entry) != os.getpid():
                            try:
                                stat = open(f"/proc/{{entry}}/stat").read()
                            except OSError:
                                continue
                            if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
                                print(entry, flush=True)
                    os._exit(0)  # no close: the application just dies
            asyncio.run(main())
            """
        )
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
        )
        children = [int(line) for line in done.stdout.split()]
        assert children, done.stderr
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not any(alive(pid) for pid in children)


# -- a decoding process's own code, on a thread, with a scripted decoder ---------------------


class ScriptedPicture:
    format = "i420"
    color_range = "limited"
    on_device = False
    cpu_elsewhere = 0.0

    def __init__(self, index: int, width: int = 8, height: int = 4) -> None:
        self.width, self.height, self.pts = width, height, index / 30
        self.index = index

    def write_into(self, out: np.ndarray[Any, Any]) -> None:
        out[...] = self.index


class ScriptedStream:
    codec = "h264"

    def __init__(self, script: list[Any]) -> None:
        self._script = script
        self.closed = False

    def pictures(self) -> Iterator[Any]:
        for step in self._script:
            if isinstance(step, BaseException):
                raise step
            yield step

    def close(self) -> None:
        self.closed = True


class ScriptedDecoder:
    name = "ffmpeg"

    def __init__(self, scripts: list[list[Any]]) -> None:
        self.scripts = scripts
        self.streams: list[ScriptedStream] = []

    def open(self, address: Any, options: OpenOptions) -> ScriptedStream:
        stream = ScriptedStream(self.scripts[min(len(self.streams), len(self.scripts) - 1)])
        self.streams.append(stream)
        return stream


class ThreadProcess:
    """What the application's side needs of a Popen, for a decoding process that is a
    thread of this one."""

    def __init__(self, thread: threading.Thread) -> None:
        self._thread = thread
        self.killed = False

    def wait(self, timeout: float | None = None) -> int:
        if self.killed:  # a thread cannot be killed: it is left to end by itself
            return -signal.SIGKILL
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired("decoding thread", timeout or 0)
        return 0

    def kill(self) -> None:
        self.killed = True


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """Decoding "processes" that are threads running ``serve`` with a scripted decoder;
    returns (decoder, a file path to name as the source)."""
    decoder = ScriptedDecoder([[]])

    def spawn(main: str) -> tuple[ThreadProcess, socket.socket]:
        mine, theirs = socket.socketpair()

        def run() -> None:
            try:
                video_process.serve(theirs, lambda name: decoder)
            finally:
                theirs.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return ThreadProcess(thread), mine

    monkeypatch.setattr(video_process, "_spawn", spawn)
    monkeypatch.setattr(video_process, "_kill", ThreadProcess.kill)
    path = tmp_path / "scripted.mp4"
    path.write_bytes(b"")
    return decoder, path


class TestServe:
    async def test_pictures_and_damaged_packets_cross(self, scripted: Any) -> None:
        decoder, path = scripted
        decoder.scripts = [
            [ScriptedPicture(0), DecodeTrouble("bad packet"), ScriptedPicture(1)]
            + [ScriptedPicture(i) for i in range(2, 12)]
        ]
        async with VideoSource(path, "ffmpeg", isolation="process", max_frames=20) as source:
            frames = [frame async for frame in source]
        assert [int(f.array[0, 0]) for f in frames] == list(range(12))
        assert [f.pts for f in frames] == pytest.approx([i / 30 for i in range(12)])
        stats = source.statistics()
        assert (stats.decode_errors, stats.decoded) == (1, 12)
        assert decoder.streams[0].closed

    async def test_a_bug_in_the_decoder_ends_the_source_and_is_not_retried(
        self, scripted: Any
    ) -> None:
        decoder, path = scripted
        decoder.scripts = [[ScriptedPicture(0), ZeroDivisionError("a bug")]]
        async with VideoSource(path, "ffmpeg", isolation="process", reconnect=True) as source:
            with pytest.raises(RuntimeError, match=r"decoder failed: ZeroDivisionError: a bug"):
                async for _ in source:
                    pass
        assert source.statistics().reconnects == 0
        assert len(decoder.streams) == 1

    async def test_a_picture_size_that_changes_gets_slots_of_its_size(self, scripted: Any) -> None:
        decoder, path = scripted
        decoder.scripts = [
            [ScriptedPicture(0), ScriptedPicture(1)]
            + [ScriptedPicture(i, width=16, height=6) for i in range(2, 9)]
            + [ScriptedPicture(9)]
        ]
        async with VideoSource(path, "ffmpeg", isolation="process", max_frames=1) as source:
            frames = []
            async for frame in source:
                frames.append(frame)
                await asyncio.sleep(0.01)  # the decoding process runs ahead, slots held
        assert [(f.width, f.height) for f in frames] == [(8, 4)] * 2 + [(16, 6)] * 7 + [(8, 4)]
        assert [int(f.array[0, 0]) for f in frames] == list(range(10))
        stats = source.statistics()
        assert (stats.reconnects, stats.state, len(decoder.streams)) == (0, "closed", 1)

    async def test_slots_that_cannot_be_allocated_are_a_loss_to_retry(
        self, scripted: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        decoder, path = scripted
        decoder.scripts = [[ScriptedPicture(0), ScriptedPicture(1)]]
        real, calls = video_process._Slots, []

        def slots_once_short(*args: Any) -> Any:
            calls.append(args)
            if len(calls) == 1:
                raise MemoryError("no room")
            return real(*args)

        monkeypatch.setattr(video_process, "_Slots", slots_once_short)
        async with VideoSource(
            path, "ffmpeg", isolation="process", max_reconnect_delay=0.1, max_frames=5
        ) as source:
            frames = [frame async for frame in source]
        assert [int(f.array[0, 0]) for f in frames] == [0, 1]
        assert source.statistics().reconnects == 1

    async def test_a_bug_while_opening_ends_the_source_without_credentials(
        self, scripted: Any
    ) -> None:
        decoder, _ = scripted

        def broken(address: Any, options: Any) -> Any:
            raise ZeroDivisionError(f"cannot open {address.uri}")

        decoder.open = broken
        with pytest.raises(RuntimeError, match=r"decoder failed: ZeroDivisionError") as caught:
            async with VideoSource(
                "rtsp://user:secret@127.0.0.1:9/cam", "ffmpeg", isolation="process"
            ):
                pass
        assert "secret" not in str(caught.value)
        assert "rtsp://127.0.0.1:9/cam" in str(caught.value)

    async def test_closing_while_the_decoding_process_hangs_is_prompt(self, scripted: Any) -> None:
        decoder, path = scripted
        hang = threading.Event()

        class Hanging(ScriptedStream):
            def pictures(self) -> Iterator[Any]:
                yield ScriptedPicture(0)
                hang.wait(30)  # a decoder stuck in its native code

        decoder.open = lambda address, options: Hanging([])
        source = VideoSource(path, "ffmpeg", isolation="process", stall_timeout=5)
        async with source:
            await take(source, 1)
            began = time.monotonic()
        # Not the 2 x stall_timeout that declares it hung: the close's own grace only.
        assert time.monotonic() - began < video_process.CLOSE_GRACE + 1.0
        hang.set()

    async def test_a_loss_the_decoder_reports_keeps_its_reason(self, scripted: Any) -> None:
        decoder, path = scripted
        lost = VideoSourceError("video source 'x' was lost: eof", source="x", reason="lost",
                                retryable=True)  # fmt: skip
        decoder.scripts = [[ScriptedPicture(0), lost]]
        async with VideoSource(path, "ffmpeg", isolation="process", reconnect=False) as source:
            with pytest.raises(VideoSourceError, match="was lost: eof") as caught:
                async for _ in source:
                    pass
        assert (caught.value.reason, caught.value.retryable) == ("lost", True)

    async def test_a_codec_known_only_once_decoding_is_reported(self, scripted: Any) -> None:
        decoder, path = scripted

        class LateCodec(ScriptedStream):  # as GStreamer's decodebin learns it
            codec = "unknown"

            def pictures(self) -> Iterator[Any]:
                self.codec = "hevc"
                yield ScriptedPicture(0)

        decoder.open = lambda address, options: LateCodec([])
        async with VideoSource(path, "ffmpeg", isolation="process") as source:
            frames = [frame async for frame in source]
        assert len(frames) == 1
        assert source.statistics().codec == "hevc"
