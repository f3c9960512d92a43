"""VideoFrame: the layouts its docstring states, and the frames it refuses."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import aiodla
from aiodla import InputValueError, VideoFrame


def frame(
    array: object, fmt: str = "nv12", width: int = 8, height: int = 4, **kw: object
) -> VideoFrame:
    fields: dict[str, object] = {
        "array": array,
        "format": fmt,
        "width": width,
        "height": height,
        "source": "clip.mp4",
        "index": 0,
        "pts": 0.0,
        "captured_at": 1.0,
        "on_device": False,
    }
    fields.update(kw)
    return VideoFrame(**fields)  # type: ignore[arg-type]


def test_is_public_frozen_and_slotted() -> None:
    assert "VideoFrame" in aiodla.__all__
    f = frame(np.zeros((6, 8), np.uint8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.index = 1  # type: ignore[misc]
    assert not hasattr(f, "__dict__")
    assert [field.name for field in dataclasses.fields(VideoFrame)] == [
        "array",
        "format",
        "width",
        "height",
        "source",
        "index",
        "pts",
        "captured_at",
        "on_device",
        "color_range",
    ]


class TestPlanes:
    def test_nv12_is_y_then_interleaved_uv_rows(self) -> None:
        y = np.arange(32, dtype=np.uint8).reshape(4, 8)
        u = np.full((2, 4), 100, np.uint8)
        v = np.full((2, 4), 200, np.uint8)
        uv = np.stack([u, v], axis=-1).reshape(2, 8)
        got_y, got_uv = frame(np.vstack([y, uv])).planes()
        np.testing.assert_array_equal(got_y, y)
        np.testing.assert_array_equal(got_uv[..., 0], u)
        np.testing.assert_array_equal(got_uv[..., 1], v)

    def test_i420_is_y_then_packed_u_then_packed_v(self) -> None:
        y = np.zeros((4, 8), np.uint8)
        u = np.arange(8, dtype=np.uint8).reshape(2, 4)
        v = np.arange(8, 16, dtype=np.uint8).reshape(2, 4)
        array = np.concatenate([y.reshape(-1), u.reshape(-1), v.reshape(-1)]).reshape(6, 8)
        got_y, got_u, got_v = frame(array, "i420").planes()
        np.testing.assert_array_equal(got_y, y)
        np.testing.assert_array_equal(got_u, u)
        np.testing.assert_array_equal(got_v, v)
        assert np.shares_memory(got_u, array)

    def test_a_device_frame_has_no_host_planes(self) -> None:
        class Device:
            @property
            def __cuda_array_interface__(self) -> dict[str, object]:
                return {}

        with pytest.raises(InputValueError, match="on the device"):
            frame(Device(), on_device=True).planes()


class TestRefused:
    @pytest.mark.parametrize(
        ("kw", "match"),
        [
            ({"fmt": "bgr"}, "format='bgr'"),
            ({"width": 7}, "even width"),
            ({"height": 0}, "even width"),
            ({"on_device": True}, "host NumPy array"),
        ],
    )
    def test_bad_fields(self, kw: dict[str, Any], match: str) -> None:
        with pytest.raises(InputValueError, match=match):
            frame(np.zeros((6, 8), np.uint8), **kw)

    @pytest.mark.parametrize("array", [np.zeros((4, 8), np.uint8), np.zeros((6, 8), np.float32)])
    def test_a_host_array_of_the_wrong_shape_or_type(self, array: np.ndarray) -> None:
        with pytest.raises(InputValueError, match=r"needs a uint8 array of shape \(6, 8\)"):
            frame(array)
