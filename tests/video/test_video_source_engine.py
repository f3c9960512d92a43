"""VideoSource given an engine: frames written into its frame buffers, never refilled
under a reader; closing either side with frames in flight; open/close cycles that leak
nothing."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from video_support import take, wait_for

from aiodla import (
    EngineClosedError,
    ImagePreprocess,
    TensorSpec,
    VideoSource,
)
from aiodla.emulator import make_loadable
from aiodla.testing import DLAControls, EngineFactory

pytest.importorskip("av", reason="the video tests need PyAV (pip install 'aiodla[video]')")

pytestmark = pytest.mark.asyncio

IMAGES = TensorSpec("images", (1, 3, 48, 64), "float16", "chw16")
OUT = TensorSpec("out", (1, 3, 48, 64), "float32", "nchw")
I420 = ImagePreprocess(source="i420", order="rgb", resize="stretch")


async def camera_engine(aiodla_engine: EngineFactory) -> object:
    model = make_loadable([IMAGES], [OUT], "affine", 0.0005, scale=1.0, bias=0.0)
    return await aiodla_engine(model, preprocess={"images": I420}, cores=[0])


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class TestFrameBuffers:
    async def test_frames_lie_in_the_engines_buffers_and_infer_reads_them(
        self, clips: dict[str, Path], aiodla_engine: EngineFactory
    ) -> None:
        engine = await camera_engine(aiodla_engine)
        async with VideoSource(clips["h264.mp4"], "ffmpeg", engine=engine, max_frames=1) as source:
            frames = await take(source, 3)
            for frame in frames:
                assert not frame.array.flags.writeable
                got = await engine.infer(frame)  # the VideoFrame itself
                want = await engine.infer(np.array(frame.array))  # a plain copy, staged
                np.testing.assert_array_equal(got, want)
            assert source.statistics().unpooled == 0

    async def test_a_frame_held_is_never_refilled(
        self, clips: dict[str, Path], aiodla_engine: EngineFactory
    ) -> None:
        engine = await camera_engine(aiodla_engine)
        async with VideoSource(clips["h264.mp4"], "ffmpeg", engine=engine, max_frames=1) as source:
            (held,) = await take(source, 1)
            kept = np.array(held.array)
            addresses = set()
            for _ in range(40):  # many more frames through the same pool, each let go
                (later,) = await take(source, 1)
                assert not np.shares_memory(held.array, later.array)
                addresses.add(later.array.__array_interface__["data"][0])
                del later
            np.testing.assert_array_equal(held.array, kept)
            # Buffers of frames let go are reused: the pool stays small.
            assert len(addresses) <= 1 + 4
            assert source.statistics().unpooled == 0

    async def test_a_frame_in_each_of_the_engines_slots_stays_in_its_buffers(
        self,
        clips: dict[str, Path],
        aiodla_engine: EngineFactory,
        aiodla_controls: DLAControls,
    ) -> None:
        # Eight slots, each holding a request on a frame, while the source queues more
        # and the application takes two: all of them in the engine's buffers.
        model = make_loadable([IMAGES], [OUT], "affine", 0.0005, scale=1.0, bias=0.0)
        engine = await aiodla_engine(
            model, preprocess={"images": I420}, cores=[0, 1], streams_per_core=4
        )
        async with VideoSource(clips["h264.mp4"], "ffmpeg", engine=engine, max_frames=2) as source:
            with aiodla_controls.hold(0, 1) as gate:
                frames = await take(source, 8)
                pending = [asyncio.ensure_future(engine.infer(f)) for f in frames]
                await gate.reached(2)
                more = await take(source, 2)
                await wait_for(lambda: source.statistics().buffered == 2)
                stats = source.statistics()
            results = await asyncio.gather(*pending)
        assert stats.unpooled == 0
        for frame, got in zip(frames, results, strict=True):
            np.testing.assert_array_equal(got, await engine.infer(np.array(frame.array)))
        assert len({f.array.__array_interface__["data"][0] for f in frames + more}) == 10

    async def test_past_its_quota_a_source_falls_back_to_plain_arrays(
        self, clips: dict[str, Path], aiodla_engine: EngineFactory
    ) -> None:
        engine = await camera_engine(aiodla_engine)  # one core, two slots
        async with VideoSource(clips["h264.mp4"], "ffmpeg", engine=engine, max_frames=2) as source:
            kept = await take(source, 20)  # the application keeps every frame
            stats = source.statistics()
        assert stats.unpooled >= 20 - (2 * 2 + 2 + 3)
        pixels = [np.array(f.array) for f in kept]
        assert all(not np.array_equal(pixels[i], pixels[i + 1]) for i in range(19))

    async def test_a_request_holds_its_frame_until_it_ends(
        self,
        clips: dict[str, Path],
        aiodla_engine: EngineFactory,
        aiodla_controls: DLAControls,
    ) -> None:
        engine = await camera_engine(aiodla_engine)
        async with VideoSource(clips["h264.mp4"], "ffmpeg", engine=engine, max_frames=1) as source:
            (frame,) = await take(source, 1)
            want = await engine.infer(np.array(frame.array))
            with aiodla_controls.hold(0) as gate:
                pending = asyncio.ensure_future(engine.infer(frame.array))
                await gate.reached(1)
                del frame  # only the request holds it now
                gc.collect()
                await take(source, 30)  # the pool turns over meanwhile
            np.testing.assert_array_equal(await pending, want)


class TestClosing:
    async def test_closing_the_engine_under_a_source_ends_it_with_the_engines_error(
        self, clips: dict[str, Path], aiodla_engine: EngineFactory
    ) -> None:
        engine = await camera_engine(aiodla_engine)
        async with VideoSource(clips["h264.mp4"], "ffmpeg", engine=engine, repeat=True) as source:
            frame = (await take(source, 2))[-1]
            inflight = asyncio.ensure_future(engine.infer(frame.array))
            await engine.aclose()
            (answer,) = await asyncio.gather(inflight, return_exceptions=True)
            assert isinstance(answer, (np.ndarray, EngineClosedError)), answer  # drained or failed
            with pytest.raises(EngineClosedError):
                async for _ in source:
                    pass
            assert source.statistics().state == "failed"
        assert frame.array.shape == (180, 160)  # still readable after the close
        assert int(frame.array.sum()) > 0
        del frame, inflight, answer  # the engine's memory is freed with the last frame

    async def test_closing_a_source_with_requests_in_flight(
        self,
        clips: dict[str, Path],
        aiodla_engine: EngineFactory,
        aiodla_controls: DLAControls,
    ) -> None:
        engine = await camera_engine(aiodla_engine)
        with aiodla_controls.hold(0) as gate:
            async with VideoSource(clips["h264.mp4"], "ffmpeg", engine=engine) as source:
                frames = await take(source, 2)
                pending = [asyncio.ensure_future(engine.infer(f.array)) for f in frames]
                await gate.reached(1)
            expected = [np.array(f.array) for f in frames]
        for future, pixels in zip(pending, expected, strict=True):
            assert (await future).shape == OUT.shape
            del pixels
        assert engine.statistics().completed >= 2


class TestNoLeaks:
    async def test_a_hundred_open_close_cycles(
        self,
        clips: dict[str, Path],
        aiodla_engine: EngineFactory,
        aiodla_controls: DLAControls,
    ) -> None:
        engine = await camera_engine(aiodla_engine)
        counts = aiodla_controls.runtime.counts

        async def cycle() -> None:
            async with VideoSource(
                clips["h264.mov"], "ffmpeg", engine=engine, max_frames=1
            ) as source:
                await take(source, 3)
            assert source.statistics().state == "closed"

        for _ in range(5):  # the pool and FFmpeg's own caches settle
            await cycle()
        gc.collect()
        threads, fds, allocations = threading.active_count(), open_fds(), counts.allocations
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(100):
                await cycle()
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert threading.active_count() == threads
        # With isolation="process" each frame buffer is a shared-memory file: the pool's
        # growth (bounded as below) shows there; one leaked per cycle would be >= 100.
        assert open_fds() - fds <= 2 * 1 + 3 + 2
        # The pool may grow to what one source holds at once (its quota: 2 * max_frames
        # + 3 + the engine's two slots, reached when a cycle's frames are still in
        # flight as the next opens), never with the number of cycles: without the pool
        # it would be >= 100 buffers.
        assert counts.allocations - allocations <= 2 * 1 + 3 + 2
        assert grown < 512 * 1024, grown

    async def test_a_source_left_unclosed_warns(self, clips: dict[str, Path]) -> None:
        source = VideoSource(clips["h264.mp4"], "ffmpeg", repeat=True)
        await source.start()
        await take(source, 1)
        with pytest.warns(ResourceWarning, match="unclosed video source"):
            source.__del__()
        await wait_for(
            lambda: not any(t.name.startswith("aiodla video") for t in threading.enumerate())
        )
        await source.aclose()
