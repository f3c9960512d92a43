"""Frame buffers with ``isolation="process"``: shared memory of the application that the
worker maps, so a request on one sends only where its frame lies. Results equal those of
ordinary arrays, the slot's staging is never written (the frame is read where it lies),
a replaced worker maps the same buffers, the in-process close rules hold, a buffer the
worker cannot map fails its requests alone, and nothing is left behind."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import sys
import threading
from typing import Any

import numpy as np
import pytest

from aiodla import (
    AiodlaError,
    EmulatedRuntime,
    Engine,
    EngineClosedError,
    ImagePreprocess,
    LatestFrameStream,
    TensorSpec,
)
from aiodla._bindings import FrameRead
from aiodla._frame_buffers import FrameBuffers
from aiodla._isolation import inject_fault
from aiodla._isolation._channel import Channel, parse_frames, receive_with_fds
from aiodla._isolation._shared_frames import MappedFrames, SharedFrameMemory, send_frames
from aiodla.emulator import make_loadable
from aiodla.testing import DLAControls, EngineFactory

from support import StepThreads, counts_add_up, open_fds, wait_until, worker_pid

IMAGES = TensorSpec("images", (1, 3, 48, 64), "float16", "chw16")
OUT = TensorSpec("out", (1, 3, 48, 64), "float32", "nchw")
LETTERBOX = ImagePreprocess(source="bgr", order="rgb", resize="letterbox", std=0.25)
SHAPE = (120, 160, 3)
SENTINEL = 0xA5
# Descriptors a mapping keeps of its own until it is unmapped (none from Python 3.13).
MAP_FDS = 0 if sys.version_info >= (3, 13) else 1


def camera_model() -> bytes:
    return make_loadable([IMAGES], [OUT], "affine", 0.0005, scale=1.0, bias=0.0)


def process_engine(**options: Any) -> Engine:
    options.setdefault("convert", "device")
    return Engine(
        camera_model(),
        runtime="emulated",
        isolation="process",
        preprocess={"images": LETTERBOX},
        **options,
    )


def frame(seed: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 256, shape).astype(np.uint8)


def mark_staging(engine: Engine) -> list[np.ndarray[Any, Any]]:
    """Every slot's input staging (shared with the worker), filled with a sentinel."""
    views = [slot.inputs[0].host.array for slot in engine._device.slots]  # type: ignore[attr-defined]
    for view in views:
        view[:] = SENTINEL
    return views


def untouched(views: list[np.ndarray[Any, Any]]) -> bool:
    return all(bool((view == SENTINEL).all()) for view in views)


def spy_reads(engine: Engine) -> list[Any]:
    """What each submission sends the worker: the slot's number and its reads."""
    cores = engine._device  # type: ignore[attr-defined]
    sent: list[Any] = []
    real = cores.submission

    def submission(slot: Any) -> Any:
        entry = real(slot)
        sent.append(entry)
        return entry

    cores.submission = submission
    return sent


def by_reference(entry: Any, buffer: np.ndarray[Any, Any]) -> bool:
    """True when a submission names a frame buffer and the offset in it where
    ``buffer``'s frame lies (the application's reads hold offsets)."""
    _, reads = entry
    (read,) = reads
    first = int(buffer.__array_interface__["data"][0])
    return isinstance(read, FrameRead) and read.source and read.source + read.pointer == first


def memfd_maps(name: str = "aiodla-frames") -> int:
    with open("/proc/self/maps") as maps:
        return sum(f"/memfd:{name}" in line for line in maps)


def memfd_fds(name: str = "aiodla-frames") -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += f"/memfd:{name}" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    return count


class TestByReference:
    @pytest.mark.parametrize("zero_copy", [False, True])
    @pytest.mark.asyncio
    async def test_results_equal_and_staging_stays_untouched(self, zero_copy: bool) -> None:
        async with (
            Engine(camera_model(), runtime="emulated", isolation="thread") as other,
            process_engine(zero_copy=zero_copy) as engine,
        ):
            (foreign,) = other.frame_buffers(1, SHAPE)  # another engine's buffer
            foreign[:] = frame(9)
            buffers = engine.frame_buffers(2, SHAPE)
            for k, buffer in enumerate(buffers):
                buffer[:] = frame(k)
            sent = spy_reads(engine)
            staging = mark_staging(engine)
            crop = buffers[1][10:100, 20:150]  # a view: found with its offset
            for view in (buffers[0], buffers[1], crop):
                got = await engine.infer(view)
                assert by_reference(sent[-1], view), sent[-1]
                assert untouched(staging)  # no byte of the frame went through staging
                want = await engine.infer(view.copy())  # an ordinary array: staged
                assert not by_reference(sent[-1], view) and not untouched(staging)
                np.testing.assert_array_equal(got, want)
                staging = mark_staging(engine)
            # Read where it lies only where the kernel can follow its rows: a view that
            # skips pixels is staged dense, as in-process; another engine's buffer is
            # an ordinary array here.
            skipping = buffers[0][:, ::2]
            for view in (skipping, foreign):
                got = await engine.infer(view)
                assert not by_reference(sent[-1], view) and not untouched(staging)
                np.testing.assert_array_equal(got, await engine.infer(np.ascontiguousarray(view)))
                staging = mark_staging(engine)
            assert counts_add_up(engine.statistics())

    @pytest.mark.asyncio
    async def test_a_frame_sent_by_reference_is_staged_on_the_loop(self) -> None:
        async with process_engine() as engine:
            (buffer,) = engine.frame_buffers(1, (720, 1280, 3))
            buffer[:] = frame(80, (720, 1280, 3))
            on_loop = StepThreads(engine, "write_inputs").on_loop
            got = await engine.infer(buffer)  # a reference: nothing to move on the host
            want = await engine.infer(buffer.copy())  # 2.8 MB copied: in a thread
            assert on_loop == [True, False]
            np.testing.assert_array_equal(got, want)

    @pytest.mark.asyncio
    async def test_made_by_another_thread(self) -> None:
        async with process_engine() as engine:
            channel = engine._device.supervisor._channel  # type: ignore[attr-defined]
            writers: list[bool] = []
            real, loop_thread = channel.send, threading.current_thread()

            def send(*args: Any) -> None:
                writers.append(threading.current_thread() is loop_thread)
                real(*args)

            channel.send = send
            (buffer,) = await asyncio.to_thread(engine.frame_buffers, 1, SHAPE)  # a reader's
            buffer[:] = frame(90)
            sent = spy_reads(engine)
            got = await engine.infer(buffer)
            assert by_reference(sent[-1], buffer)
            assert writers and all(writers)  # the channel is the loop's alone
            np.testing.assert_array_equal(got, await engine.infer(buffer.copy()))

    @pytest.mark.asyncio
    async def test_host_conversion_packs_from_them(self) -> None:
        async with process_engine(convert="host") as engine:
            buffers = engine.frame_buffers(2, SHAPE)
            for k, buffer in enumerate(buffers):
                buffer[:] = frame(k + 5)
            for buffer in buffers:
                np.testing.assert_array_equal(
                    await engine.infer(buffer), await engine.infer(buffer.copy())
                )
            # The worker never reads them: nothing to map there.
            assert engine._device.shared_frames() == []  # type: ignore[attr-defined]

    @pytest.mark.asyncio
    async def test_a_latest_frame_stream_fills_them(self) -> None:
        async with process_engine() as engine, LatestFrameStream(engine, name="cam") as cam:
            sent = spy_reads(engine)
            for k in range(4):
                buffer = cam.frame_buffer(SHAPE)
                buffer[:] = frame(20 + k)
                cam.submit(buffer, context=k)
                result = await cam.receive()
                assert result.error is None and result.context == k
                assert by_reference(sent[-1], buffer)
                np.testing.assert_array_equal(result.output, await engine.infer(frame(20 + k)))
            assert cam.statistics().completed == 4


class TestRestart:
    @pytest.mark.asyncio
    async def test_a_new_worker_maps_the_same_buffers(self) -> None:
        async with process_engine() as engine:
            before = engine.frame_buffers(2, SHAPE)
            for k, buffer in enumerate(before):
                buffer[:] = frame(30 + k)
            expected = [await engine.infer(b.copy()) for b in before]
            os.kill(worker_pid(engine), signal.SIGKILL)
            await wait_until(lambda: engine.health().status == "restarting")
            (during,) = engine.frame_buffers(1, SHAPE)  # made with no worker serving
            during[:] = frame(40)
            expected.append(await engine.infer(during.copy()))  # waits for the new worker
            assert engine.statistics().worker.restarts == 1  # type: ignore[union-attr]
            sent = spy_reads(engine)
            staging = mark_staging(engine)  # the new worker's staging
            for buffer, want in zip([*before, during], expected, strict=True):
                np.testing.assert_array_equal(await engine.infer(buffer), want)
                assert by_reference(sent[-1], buffer)
            assert untouched(staging)


class TestRules:
    @pytest.mark.asyncio
    async def test_close_refuses_them_and_frees_them_with_the_last_array(self) -> None:
        gc.collect()
        fds, maps = open_fds(), memfd_maps()
        engine = process_engine()
        async with engine:
            kept, *dropped = engine.frame_buffers(3, SHAPE)
            kept[:] = frame(50)
            view = kept[5:60]
            want = await engine.infer(kept.copy())
            np.testing.assert_array_equal(await engine.infer(kept), want)
            del dropped
            gc.collect()
            assert memfd_maps() == maps + 3  # freed at close
            assert memfd_fds() == 3 * (1 + MAP_FDS)
        assert engine._device.supervisor.exit_status == 0  # type: ignore[attr-defined]  # unlocked
        assert memfd_fds() == MAP_FDS  # no worker is left to hand them to
        assert memfd_maps() == maps + 1  # only the buffer with arrays left
        for target in (kept, view):
            with pytest.raises(EngineClosedError, match="belongs to an engine that was closed"):
                target[...] = 1
        with pytest.raises(EngineClosedError):
            await engine.infer(kept)
        assert kept[0, 0].tolist() == frame(50)[0, 0].tolist()  # still readable
        del kept, view, target
        gc.collect()
        assert memfd_maps() == maps
        assert open_fds() == fds

    @pytest.mark.asyncio
    async def test_dropping_buffers_while_their_requests_run(
        self, aiodla_engine: EngineFactory, aiodla_controls: DLAControls
    ) -> None:
        engine = await aiodla_engine(
            camera_model(),
            isolation="process",
            convert="device",
            preprocess={"images": LETTERBOX},
            cores=[0],
        )
        buffers = engine.frame_buffers(3, SHAPE)
        expected = []
        for k, buffer in enumerate(buffers):
            buffer[:] = frame(60 + k)
            expected.append(await engine.infer(buffer.copy()))
        with aiodla_controls.hold(0) as gate:
            pending = [engine.infer_nowait(b) for b in buffers]
            await gate.reached(1)  # the first is in the worker's hands, the rest queued
            del buffer, buffers  # the requests hold the frames they read
            gc.collect()
        for future, want in zip(pending, expected, strict=True):
            np.testing.assert_array_equal(await future, want)
        assert counts_add_up(engine.statistics())

    @pytest.mark.asyncio
    async def test_a_buffer_the_worker_cannot_map_fails_its_requests_alone(self) -> None:
        async with process_engine() as engine:
            (good,) = engine.frame_buffers(1, SHAPE)
            await inject_fault(engine, "fail_call", "host_register", 2)  # 2: cudaErrorMemory...
            (bad,) = engine.frame_buffers(1, SHAPE)
            good[:], bad[:] = frame(70), frame(71)
            results = await asyncio.gather(
                engine.infer(bad), engine.infer(good), return_exceptions=True
            )
            assert isinstance(results[0], AiodlaError), results[0]
            assert "is not mapped in the worker" in str(results[0])
            assert "host_register" in str(results[0])  # with why
            np.testing.assert_array_equal(results[1], await engine.infer(good.copy()))
            stats = engine.statistics()
            assert stats.failed == 1 and counts_add_up(stats)
            # The same frame as an ordinary array serves.
            np.testing.assert_array_equal(
                await engine.infer(bad.copy()), await engine.infer(frame(71))
            )


class TestNothingLeaks:
    def test_fifty_cycles_leave_no_descriptor_or_mapping(self) -> None:
        gc.collect()
        fds, maps = open_fds(), memfd_maps()
        runtime = EmulatedRuntime()
        handles = runtime.live_handles()["host_memory"]
        for cycle in range(50):
            memory = SharedFrameMemory()
            buffers = FrameBuffers(memory, mapped=False)
            arrays = buffers.create(2, (16, 24, 3))
            arrays[0][:] = cycle
            shared = memory.take_new()
            mapped = MappedFrames(runtime, mapped=cycle % 2 == 1)
            # What the channel would do: the descriptors as the worker receives them.
            mapped.add([(k, n) for k, n, _ in shared], [os.dup(fd) for *_, fd in shared])
            # Told twice (a buffer made as a new worker is adopted): mapped once.
            mapped.add([(k, n) for k, n, _ in shared], [os.dup(fd) for *_, fd in shared])
            assert len(mapped) == 2
            here = mapped.buffer_at(shared[0][0])
            assert here.array[:3].tolist() == [cycle] * 3  # the same memory
            assert (here.device_ptr != 0) == (cycle % 2 == 1)
            kept = arrays[1][2:4] if cycle % 3 == 0 else None  # an array past close
            del arrays
            mapped.close()
            buffers.close()
            memory.close()
            del kept, here, mapped
        gc.collect()
        assert open_fds() == fds and memfd_maps() == maps
        assert runtime.live_handles()["host_memory"] == handles
        assert runtime.invalid_releases == 0
        runtime.close()

    def test_an_unknown_buffer_is_named(self) -> None:
        runtime = EmulatedRuntime()
        mapped = MappedFrames(runtime, mapped=False)
        mapped.add([(0x1000, 64)], [])  # its descriptor never came
        with pytest.raises(AiodlaError, match="0x1000 is not mapped in the worker: its desc"):
            mapped.buffer_at(0x1000)
        with pytest.raises(AiodlaError, match="never shared it"):
            mapped.buffer_at(0x2000)
        runtime.close()

    @pytest.mark.asyncio
    async def test_descriptors_go_with_their_message_through_a_full_socket(self) -> None:
        ours, theirs = socket.socketpair()
        memory = SharedFrameMemory()
        sizes = [4096 * (k + 1) for k in range(20)]
        for size in sizes:
            memory.host_alloc(size)
        closed: list[str] = []
        channel = Channel(ours, asyncio.get_running_loop(), lambda m: None, closed.append)
        big = b"x" * (4 << 20)  # more than the socket holds: the rest waits for the loop
        channel.send(("big", big))
        send_frames(channel, memory.take_new())  # 16, then 4 descriptors
        channel.send(("after", 1))
        received: list[tuple[Any, list[int]]] = []

        def read() -> None:
            incoming, fds = bytearray(), []
            while len(received) < 4:
                data, more = receive_with_fds(theirs)
                incoming += data
                fds += more
                for message in parse_frames(incoming):
                    count = len(message[1]) if message[0] == "frames" else 0
                    received.append((message, fds[:count]))
                    del fds[:count]

        reader = threading.Thread(target=read)
        reader.start()
        await wait_until(lambda: not reader.is_alive(), timeout=20)
        reader.join()
        kinds = [message[0] for message, _ in received]
        assert kinds == ["big", "frames", "frames", "after"] and not closed
        arrived = [
            (entry, fd)
            for message, fds in received[1:3]
            for entry, fd in zip(message[1], fds, strict=True)
        ]
        assert [n for (_, n), _ in arrived] == sizes
        for (_, nbytes), fd in arrived:  # each descriptor is its own entry's memory
            assert os.fstat(fd).st_size == nbytes
            os.close(fd)
        channel.close()
        theirs.close()
        memory.close()
