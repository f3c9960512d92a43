"""The nvdec decoder's copy of a decoded picture, without a GPU: a fake PyNvVideoCodec
frame whose planes lie apart, at a pitch wider than the picture (as a pitched NVDEC
surface, or an odd height's extra row, leaves them), copied by the decoder's own code
through a stand-in for CUDA's copies that moves host bytes between the same addresses.
The result must be the dense NV12 picture ``VideoFrame`` states, whatever the pitch."""

from __future__ import annotations

import ctypes
import importlib
import sys
import types
from typing import Any

import numpy as np
import pytest
from cuda.bindings import runtime as rt

from aiodla import _video_device_buffers as device_buffers

_OK = (rt.cudaError_t.cudaSuccess,)


class HostCuda:
    """The runtime calls ``_video_nvdec`` makes, on host memory: "device" addresses are
    the addresses of numpy buffers this object keeps."""

    cudaMemcpyKind = rt.cudaMemcpyKind

    def __init__(self) -> None:
        self.buffers: dict[int, np.ndarray[Any, Any]] = {}

    def cudaMalloc(self, nbytes: int) -> tuple[Any, int]:
        buffer = np.full(nbytes, 0xAA, np.uint8)
        self.buffers[buffer.ctypes.data] = buffer
        return (rt.cudaError_t.cudaSuccess, buffer.ctypes.data)

    def cudaFree(self, pointer: int) -> tuple[Any]:
        del self.buffers[pointer]
        return _OK

    def cudaMemcpyAsync(
        self, dst: int, src: int, nbytes: int, kind: Any, stream: int
    ) -> tuple[Any]:
        ctypes.memmove(dst, src, nbytes)
        return _OK

    def cudaMemcpy2DAsync(
        self,
        dst: int,
        dpitch: int,
        src: int,
        spitch: int,
        width: int,
        height: int,
        kind: Any,
        stream: int,
    ) -> tuple[Any]:
        assert width <= dpitch and width <= spitch
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)
        return _OK

    def cudaStreamSynchronize(self, stream: int) -> tuple[Any]:
        return _OK


class PlaneView:
    def __init__(self, array: np.ndarray[Any, Any], shape: tuple[int, ...], pitch: int) -> None:
        self.array = array
        item = shape[2] if len(shape) == 3 else 1
        self.__cuda_array_interface__ = {
            "version": 3,
            "shape": shape,
            "strides": (pitch, item, 1),
            "typestr": "|u1",
            "data": (array.ctypes.data, False),
            "stream": 0,
        }


class PitchedFrame:
    """A PyNvVideoCodec DecodedFrame as far as aiodla reads it: two plane views, Y
    ``(H, W, 1)`` and UV ``(H/2, W/2, 2)``, each ``pitch`` bytes a row, in separate
    allocations; padding bytes hold 0xEE, which must never reach the copy."""

    def __init__(self, y: np.ndarray[Any, Any], uv: np.ndarray[Any, Any], pitch: int) -> None:
        height, width = y.shape
        self.luma = np.full((height, pitch), 0xEE, np.uint8)
        self.luma[:, :width] = y
        self.chroma = np.full((height // 2, pitch), 0xEE, np.uint8)
        self.chroma[:, :width] = uv
        self.views = [
            PlaneView(self.luma, (height, width, 1), pitch),
            PlaneView(self.chroma, (height // 2, width // 2, 2), pitch),
        ]

    def cuda(self) -> list[PlaneView]:
        return self.views


@pytest.fixture
def nvdec(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, HostCuda]:
    """``aiodla._video_nvdec`` imported against a stand-in PyNvVideoCodec, its CUDA
    runtime calls going to host memory; both gone again after the test."""
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", types.ModuleType("PyNvVideoCodec"))
    monkeypatch.delitem(sys.modules, "aiodla._video_nvdec", raising=False)
    module = importlib.import_module("aiodla._video_nvdec")
    monkeypatch.delitem(sys.modules, "aiodla._video_nvdec")  # restored as absent afterwards
    cuda = HostCuda()
    monkeypatch.setattr(module, "_rt", cuda)
    monkeypatch.setattr(device_buffers, "_rt", cuda)  # the pool's allocations too
    return module, cuda


def dense_copy(module: Any, cuda: HostCuda, frame: PitchedFrame, width: int, height: int) -> Any:
    pool = device_buffers.DevicePool(width * height * 3 // 2)
    array = module._copied(frame, pool, width, height)
    interface = array.__cuda_array_interface__
    assert interface["shape"] == (height * 3 // 2, width) and interface["strides"] is None
    copied = np.array(cuda.buffers[interface["data"][0]]).reshape(height * 3 // 2, width)
    del array  # its buffer goes back to the pool
    pool.close()
    return copied


@pytest.mark.parametrize(
    ("width", "height", "pitch"),
    [(160, 120, 256), (150, 90, 160), (64, 48, 64)],
    ids=["pitched", "pitch-not-a-power-of-two", "dense-rows-planes-apart"],
)
def test_an_nvdec_picture_is_copied_from_its_planes_at_their_pitch(
    nvdec: tuple[Any, HostCuda], width: int, height: int, pitch: int
) -> None:
    module, cuda = nvdec
    rng = np.random.default_rng(width)
    y = rng.integers(0, 256, (height, width), np.uint8)
    uv = rng.integers(0, 256, (height // 2, width), np.uint8)
    frame = PitchedFrame(y, uv, pitch)
    copied = dense_copy(module, cuda, frame, width, height)
    np.testing.assert_array_equal(copied[:height], y)
    np.testing.assert_array_equal(copied[height:], uv)
    assert not cuda.buffers  # the pool freed its buffer on close


def test_an_odd_heights_extra_row_is_left_out(nvdec: tuple[Any, HostCuda]) -> None:
    # A 64 x 49 picture: the decoder's Y plane has 49 rows; aiodla's frame is 48 rows
    # high, and its chroma comes from the UV plane, not from the Y plane's last row.
    module, cuda = nvdec
    rng = np.random.default_rng(7)
    y = rng.integers(0, 256, (49, 64), np.uint8)
    uv = rng.integers(0, 256, (25, 64), np.uint8)
    frame = PitchedFrame(y, uv[:24], 64)
    frame.luma = np.ascontiguousarray(np.vstack([y, uv]))  # UV right after all 49 Y rows
    frame.views = [
        PlaneView(frame.luma, (49, 64, 1), 64),
        PlaneView(frame.luma[49:], (25, 32, 2), 64),
    ]
    copied = dense_copy(module, cuda, frame, 64, 48)
    np.testing.assert_array_equal(copied[:48], y[:48])
    np.testing.assert_array_equal(copied[48:], uv[:24])


def test_a_picture_without_two_planes_is_refused(nvdec: tuple[Any, HostCuda]) -> None:
    module, cuda = nvdec
    frame = PitchedFrame(np.zeros((4, 4), np.uint8), np.zeros((2, 4), np.uint8), 4)
    frame.views = frame.views[:1]
    pool = device_buffers.DevicePool(24)
    with pytest.raises(TypeError, match="two planes; the decoder gave 1"):
        module._copied(frame, pool, 4, 4)
    pool.close()
    assert not cuda.buffers  # nothing was taken for it


class FakeDecoder:
    """A PyNvVideoCodec decoder as far as aiodla drives it: one pitched picture a packet;
    ``fail_at`` makes that packet's Decode raise, as a lost stream does."""

    def __init__(self, fail_at: int | None) -> None:
        self.fail_at = fail_at
        self.packets = 0

    def Decode(self, packet: int) -> list[PitchedFrame]:
        self.packets += 1
        if self.packets == self.fail_at:
            raise RuntimeError("the demuxer's connection dropped")
        frame = PitchedFrame(np.full((8, 16), packet, np.uint8), np.zeros((4, 16), np.uint8), 32)
        frame.getPTS = lambda: packet  # type: ignore[attr-defined]
        return [frame]

    def GetWidth(self) -> int:
        return 16

    def GetHeight(self) -> int:
        return 8


class FakeDemuxer:
    def __init__(self, packets: int) -> None:
        self.packets = packets

    def __iter__(self) -> Any:
        return iter(range(self.packets))

    def GetNvCodecId(self) -> str:
        return "cudaVideoCodec.H264"

    def GetTimebaseNum(self) -> int:
        return 1

    def GetTimebaseDen(self) -> int:
        return 30


@pytest.mark.parametrize("end", ["read to its end", "closed midway", "lost"])
def test_a_closed_stream_lets_its_decoder_go(
    nvdec: tuple[Any, HostCuda], tmp_path: Any, end: str
) -> None:
    """NVDEC's surfaces are the decoder's (PyNvVideoCodec frees them when its decoder is
    destroyed): once a stream is closed, however it ended, nothing of aiodla's may keep
    the decoder, not even the error a lost stream raised (its traceback's frames)."""
    import weakref

    from aiodla._errors import VideoSourceError
    from aiodla._video_address import parse_address
    from aiodla._video_decoders import OpenOptions

    module, cuda = nvdec
    made: list[FakeDecoder] = []

    def create_decoder(**options: Any) -> FakeDecoder:
        made.append(FakeDecoder(fail_at=3 if end == "lost" else None))
        return made[-1]

    module.nvc.CreateDemuxer = lambda uri: FakeDemuxer(5)
    module.nvc.CreateDecoder = create_decoder
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"")
    options = OpenOptions(transport="tcp", stall_timeout=5.0, gpu=0)
    stream = module.NvdecDecoder().open(parse_address(str(clip)), options)
    decoder = weakref.ref(made.pop())
    pictures = stream.pictures()
    kept: list[Any] = []
    error: VideoSourceError | None = None
    try:
        for picture in pictures:
            kept.append(picture)
            if end == "closed midway" and len(kept) == 2:
                break
    except VideoSourceError as exc:
        error = exc
    picture = None  # (the loop's last one)
    del pictures  # (the reader's loop lets its generator go as it returns)
    stream.close()
    del stream
    assert decoder() is None
    assert len(kept) == {"read to its end": 5, "closed midway": 2, "lost": 2}[end]
    assert (error is not None) == (end == "lost")
    del kept
    assert not cuda.buffers  # every picture's buffer went back to the closed pool, freed
