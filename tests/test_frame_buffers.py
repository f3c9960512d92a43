"""Frame buffers: engine-owned pinned memory handed out as numpy arrays, found again by
address for any view into them, and freed once at close."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiodla import EmulatedRuntime
from aiodla._errors import ConfigurationError
from aiodla._frame_buffers import FrameBuffer, FrameBuffers


@pytest.fixture
def buffers() -> Any:
    runtime = EmulatedRuntime()
    made = FrameBuffers(runtime, mapped=False)
    yield made, runtime
    made.close()


def test_arrays_are_the_runtimes_pinned_memory(buffers: Any) -> None:
    made, runtime = buffers
    before = runtime.counts.allocations
    frames = made.create(3, (1080, 1920, 3))
    assert runtime.counts.allocations == before + 3 and len(made) == 3
    for frame in frames:
        assert frame.shape == (1080, 1920, 3) and frame.dtype == np.uint8
        assert frame.flags.writeable and frame.flags.c_contiguous
        frame[:] = 7  # an ordinary numpy array
        found = made.find(frame)
        assert found is not None and found[1] == 0
    assert made.create(1, 16, np.float32)[0].shape == (16,)


def test_views_are_found_with_their_offset(buffers: Any) -> None:
    made, _ = buffers
    first, second = made.create(2, (120, 160, 3))
    crop = second[10:50, 20:100]
    found = made.find(crop)
    assert found is not None
    buffer, offset = found
    assert offset == 10 * 160 * 3 + 20 * 3
    assert buffer.array[offset : offset + 3].tobytes() == crop[0, 0].tobytes()
    flipped = first[::-1]  # negative strides: still every byte inside the buffer
    assert made.find(flipped) is not None
    assert made.find(np.zeros((120, 160, 3), np.uint8)) is None  # elsewhere
    assert made.find(first.copy()) is None


def test_close_frees_everything_once(buffers: Any) -> None:
    made, runtime = buffers
    made.create(2, (8, 8, 3))
    made.close()
    assert len(made) == 0 and made.find(np.zeros(1)) is None
    made.close()  # idempotent: nothing freed twice
    assert runtime.counts.allocations >= 2


@pytest.mark.parametrize(
    ("count", "shape", "dtype", "message"),
    [
        (0, (8, 8, 3), np.uint8, "count=0 must be within"),
        (2.0, (8, 8, 3), np.uint8, "count=2.0 must be an integer"),
        (1, (), np.uint8, "must be a non-empty sequence"),
        (1, (8, 0, 3), np.uint8, "must hold positive integers"),
        (1, (8, True), np.uint8, "must hold positive integers"),
        (1, (8, 8), object, "cannot live in device-visible memory"),
        (1, (8, 8), "nonsense", "is not a numpy dtype"),
    ],
)
def test_refusals(buffers: Any, count: Any, shape: Any, dtype: Any, message: str) -> None:
    made, _ = buffers
    with pytest.raises(ConfigurationError, match=message):
        made.create(count, shape, dtype)
    assert len(made) == 0


def test_close_refuses_writes_and_frees_once_the_last_array_goes() -> None:
    import gc

    from aiodla import EngineClosedError

    runtime = EmulatedRuntime()
    made = FrameBuffers(runtime, mapped=False)
    kept, dropped = made.create(2, (8, 8, 3))
    before_view = kept[2:4]
    del dropped
    gc.collect()
    held = runtime.live_handles()["host_memory"]
    made.close()
    # the buffer nobody holds is freed at once; the held one stays readable
    assert runtime.live_handles()["host_memory"] == held - 1
    assert int(kept.sum()) == 0 and kept[0, 0].tolist() == [0, 0, 0]
    for target in (kept, before_view, kept[1:3]):
        with pytest.raises(EngineClosedError, match="belongs to an engine that was closed"):
            target[...] = 1
    with pytest.raises(ValueError, match="read-only"):  # writes past __setitem__ too
        np.copyto(kept, 1)
    with pytest.raises(EngineClosedError, match="makes no more frame buffers"):
        made.create(1, (8, 8, 3))
    assert type(kept * 2) is FrameBuffer and (kept * 2)._frames is None  # a result, no buffer
    del kept, before_view, target
    gc.collect()
    assert runtime.live_handles()["host_memory"] == held - 2  # the last array freed it
    assert runtime.invalid_releases == 0
    runtime.close()


class TestEdges:
    """What the mutation run of the module showed untested: the byte range of strided
    views, the whole refusal messages, the listeners of a close, reads another process
    made, the warning of a late free that fails, and the largest count."""

    def test_the_bytes_a_view_reads(self) -> None:
        from aiodla._frame_buffers import _bounds

        a = np.zeros((4, 10), np.uint32)
        p = a.__array_interface__["data"][0]
        assert _bounds(a) == (p, p, p + 160)
        assert _bounds(a[1:2, 3:4]) == (p + 52, p + 52, p + 56)  # one element
        assert _bounds(a[:, ::3]) == (p, p, p + 160)  # its last element: row 3, column 9
        assert _bounds(a[:3, :7:2]) == (p, p, p + 2 * 40 + 6 * 4 + 4)
        # negative strides: its first element is the highest
        assert _bounds(a[::-1, ::-2]) == (p + 3 * 40 + 9 * 4, p + 4, p + 160)
        empty = a[2:2]
        q = empty.__array_interface__["data"][0]
        assert _bounds(empty) == (q, q, q)  # nothing
        assert _bounds(a[:1]) == (p, p, p + 40)  # a leading size-1 dimension
        assert _bounds(a[1:3]) == (p + 40, p + 40, p + 120)  # contiguous, not at the start
        assert _bounds(a[2:3, ::3]) == (p + 80, p + 80, p + 120)  # one row, strided
        empty_strided = a[:, 2:2]
        r = empty_strided.__array_interface__["data"][0]
        assert _bounds(empty_strided) == (r, r, r)  # nothing, not contiguous

    def test_a_view_that_reaches_past_its_buffer_is_not_found(self, buffers: Any) -> None:
        made, _ = buffers
        (frame,) = made.create(1, (10, 10), np.uint8)
        inside = np.lib.stride_tricks.as_strided(frame, shape=(5,), strides=(20,))
        found = made.find(inside)
        assert found is not None and found[1] == 0
        flat = frame.reshape(-1)
        last = np.lib.stride_tricks.as_strided(flat[19:], shape=(5,), strides=(20,))
        assert made.find(last) is not None  # bytes 19, 39, ..., 99: the last one
        past = np.lib.stride_tricks.as_strided(flat[21:], shape=(5,), strides=(20,))
        assert made.find(past) is None  # bytes 21, ..., 101 of 100 (never read)
        found = made.find(frame[9:, ::-3])
        assert found is not None and found[1] == 99  # the first element is the last byte

    def test_whole_refusal_messages(self, buffers: Any) -> None:
        from aiodla import EngineClosedError

        made, _ = buffers
        (frame,) = made.create(1, (4, 4), np.uint8)
        made.close()
        with pytest.raises(
            EngineClosedError,
            match=r"^this frame buffer belongs to an engine that was closed: it takes no more "
            r"frames \(make frame buffers of the engine you use now\)$",
        ):
            frame[0] = 1
        with pytest.raises(
            EngineClosedError, match=r"^the engine is closed: it makes no more frame buffers$"
        ):
            made.create(1, 4)

    def test_assignment_writes_what_it_names(self, buffers: Any) -> None:
        made, _ = buffers
        (frame,) = made.create(1, (4, 4), np.uint8)
        frame[1:3, 2] = 9
        assert frame.sum() == 18 and frame[1, 2] == frame[2, 2] == 9

    def test_the_largest_count(self, buffers: Any) -> None:
        made, _ = buffers
        assert len(made.create(256, 16)) == 256
        with pytest.raises(ConfigurationError, match=r"count=257 must be within 1\.\.256"):
            made.create(257, 16)

    def test_listeners_of_the_close(self, buffers: Any) -> None:
        from aiodla._frame_buffers import when_closed

        made, runtime = buffers
        (frame,) = made.create(1, 8)
        heard: list[int] = []
        when_closed(frame, lambda: heard.append(runtime.live_handles()["host_memory"]))
        when_closed(frame[2:], lambda: heard.append(-1))  # a view: the same engine
        held = runtime.live_handles()["host_memory"]
        del frame
        made.close()
        assert heard == [held, -1]  # before the buffers are freed
        with pytest.raises(ValueError, match=r"^not an engine's frame buffer$"):
            when_closed(np.zeros(8), heard.clear)

    def test_a_listener_after_the_close_is_called_at_once(self, buffers: Any) -> None:
        from aiodla._frame_buffers import when_closed

        made, _ = buffers
        (frame,) = made.create(1, 8)
        made.close()
        heard: list[str] = []
        when_closed(frame, lambda: heard.append("closed"))
        assert heard == ["closed"]

    @pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "copied"])
    def test_a_read_another_process_made(self, mapped: bool) -> None:
        """A worker's read of the application's buffer: at the buffer's device address
        where it is mapped (the span from the frame's offset), else into the staging."""
        from aiodla._bindings import FrameRead
        from aiodla._frame_buffers import read_in_buffer

        runtime = EmulatedRuntime()
        made = FrameBuffers(runtime, mapped=mapped)
        (frame,) = made.create(1, (8, 8, 3))
        buffer, _ = made.find(frame) or (None, 0)
        assert buffer is not None and (buffer.device_ptr != 0) == mapped
        read = FrameRead(pointer=24, height=7, width=8, pitch=24, nbytes=192, source=buffer.ptr)
        local = read_in_buffer(made, read, staging=0x10000, mapped=mapped)
        if mapped:
            assert (local.pointer, local.nbytes, local.source) == (buffer.device_ptr + 24, 168, 0)
        else:
            assert (local.pointer, local.nbytes, local.source) == (0x10000 + 24, 192, buffer.ptr)
        assert (local.height, local.width, local.pitch) == (7, 8, 24)
        with pytest.raises(KeyError):
            read_in_buffer(made, read._replace(source=buffer.ptr + 1), 0, mapped)
        del frame
        made.close()
        runtime.close()

    def test_a_late_free_that_fails_is_logged(self, caplog: pytest.LogCaptureFixture) -> None:
        import gc
        import logging

        runtime = EmulatedRuntime()
        made = FrameBuffers(runtime, mapped=False)
        (frame,) = made.create(1, 8)
        made.close()

        def broken(buffer: Any) -> None:
            raise RuntimeError("the driver went away")

        runtime.host_free = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, logger="aiodla"):
            del frame
            gc.collect()
        assert [r.getMessage() for r in caplog.records] == [
            "aiodla: freeing a closed engine's frame buffer failed: the driver went away"
        ]
