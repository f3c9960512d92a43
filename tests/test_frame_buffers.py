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
