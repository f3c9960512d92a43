"""The nvdec decoder on the GPU machine: PyNvVideoCodec's NV12 surfaces, left on the
device, equal the ffmpeg decoder's pixels (H.264 and H.265 decoding is exact, so the
two must agree byte for byte), stay valid while held (a surface the decoder reused
would show as another frame's pixels), and go into ``engine.infer`` as VideoFrames
with no byte copied from the host.

Needs PyNvVideoCodec (``pip install 'aiodla[nvdec]'``; the GPU machine takes the
carried wheel) and PyAV; skipped, saying which, without them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodla import Engine, ImagePreprocess, TensorSpec, VideoFrame, VideoSource
from aiodla.emulator import make_loadable
from aiodla.runtime._cuda import CudaRuntime

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.asyncio,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("real_gpu"),
]

pytest.importorskip("PyNvVideoCodec", reason="no PyNvVideoCodec (pip install 'aiodla[nvdec]')")
pytest.importorskip("av", reason="no PyAV (pip install 'aiodla[video]')")

from aiodla.testing import encode_clip  # noqa: E402


def to_host(frame: VideoFrame) -> np.ndarray[Any, Any]:
    from cuda.bindings import runtime as rt

    interface = frame.array.__cuda_array_interface__
    rows, width = interface["shape"]
    assert interface["strides"] is None and interface["typestr"] == "|u1"
    out = np.empty((rows, width), np.uint8)
    (error,) = rt.cudaMemcpy(
        out.ctypes.data, interface["data"][0], out.nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
    )
    assert error == rt.cudaError_t.cudaSuccess, error
    return out


def as_nv12(i420: np.ndarray[Any, Any], width: int, height: int) -> np.ndarray[Any, Any]:
    chroma = i420[height:].reshape(-1)
    size = (width // 2) * (height // 2)
    u, v = chroma[:size], chroma[size:]
    uv = np.stack([u, v], axis=-1).reshape(height // 2, width)
    return np.vstack([i420[:height], uv])


@pytest.mark.parametrize(("codec", "suffix"), [("h264", "mp4"), ("h265", "mkv")])
# 330 x 186: no multiple of 16 (the coded picture is larger and cropped), so the
# surface's planes lie at a pitch and offset of the decoder's own, which the copy must
# follow (``tests/video/test_video_nvdec_planes.py`` holds that without a GPU).
@pytest.mark.parametrize("size", [(640, 360), (330, 186)], ids=["640x360", "330x186"])
# In a decoding process of its own, the pictures cross by CUDA IPC and are copied into
# the application's own buffers: they must stay valid after that process has gone.
@pytest.mark.parametrize("isolation", ["thread", "process"])
async def test_nvdec_pixels_equal_ffmpeg_and_stay_valid_while_held(
    tmp_path: Path, codec: Any, suffix: str, size: tuple[int, int], isolation: str
) -> None:
    clip = encode_clip(tmp_path / f"clip.{suffix}", codec, frames=40, size=size)
    async with VideoSource(clip, "ffmpeg", max_frames=64) as cpu:
        reference = [frame async for frame in cpu]
    async with VideoSource(clip, "nvdec", max_frames=64, isolation=isolation) as gpu:
        held = [frame async for frame in gpu]  # every frame kept until the end
        assert (gpu.statistics().decoder, gpu.statistics().isolation) == ("nvdec", isolation)
    assert len(held) == len(reference) == 40
    for got, want in zip(held, reference, strict=True):
        assert got.on_device and got.format == "nv12"
        assert (got.width, got.height) == (want.width, want.height)
        np.testing.assert_array_equal(to_host(got), as_nv12(want.array, want.width, want.height))


async def test_nvdec_frames_go_into_the_engine_without_a_host_copy(tmp_path: Path) -> None:
    clip = encode_clip(tmp_path / "clip.mp4", "h264", frames=10, size=(640, 360))
    images = TensorSpec("images", (1, 3, 96, 160), "float16", "chw16")
    out = TensorSpec("out", (1, 3, 96, 160), "float32", "nchw")
    model = make_loadable([images], [out], "affine", 0.001, scale=1.0, bias=0.0)
    pre = ImagePreprocess(source="nv12", order="rgb", resize="letterbox")
    runtime = CudaRuntime(0)
    async with Engine(
        model, runtime=runtime, convert="device", preprocess={"images": pre}
    ) as engine:
        async with VideoSource(clip, "ffmpeg", max_frames=16) as cpu:
            want = [await engine.infer(as_nv12(f.array, f.width, f.height)) async for f in cpu]
        async with VideoSource(clip, "nvdec", max_frames=16) as gpu:
            before = runtime.counts.bytes_to_device
            got = [await engine.infer(frame) async for frame in gpu]
            assert runtime.counts.bytes_to_device == before
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
