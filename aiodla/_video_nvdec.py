"""The ``"nvdec"`` decoder: NVIDIA's PyNvVideoCodec, pictures left in device memory.

PyNvVideoCodec demuxes with its own FFmpeg (files and ``rtsp://``) and decodes on the
GPU's NVDEC into NV12 surfaces in device memory. Those surfaces are the decoder's own
and are overwritten by later ``Decode`` calls (PyNvVideoCodec's documentation: only
"locked" frames are kept), while a source decodes ahead of its reader. So each picture
is copied, device to device (a few microseconds of the GPU for 1080p), plane by plane
from where the decoder's views say each plane lies and at their pitch, into a buffer
of the stream's own pool, and handed on as a small object exposing
``__cuda_array_interface__`` over it (Y rows then interleaved UV rows,
``(height * 3 // 2, width)`` bytes; :mod:`aiodla._video_device_buffers`).
``ImagePreprocess(source="nv12")`` reads it there on the slot's stream, so the picture
never crosses to the host.

Not run on the development machine, which has no GPU:
``tests/gpu/test_video_nvdec_gpu.py`` holds it against the ffmpeg decoder's pixels,
frames kept while many more are decoded included, on the GPU machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import PyNvVideoCodec as nvc
from cuda.bindings import runtime as _rt

from ._errors import VideoSourceError
from ._video_address import Address
from ._video_decoders import DecodeTrouble, OpenOptions, Picture
from ._video_device_buffers import DeviceNV12, DevicePool
from .runtime._cuda_errors import check_cuda

__all__ = ["decoder"]


class _Picture:
    __slots__ = ("_array", "color_range", "format", "height", "on_device", "pts", "width")
    cpu_elsewhere = 0.0  # its own decoding threads' CPU goes uncounted (see decode_cpu)

    def __init__(self, array: DeviceNV12, width: int, height: int, pts: float | None) -> None:
        self._array = array
        self.format: Literal["nv12", "i420"] = "nv12"
        # H.264 and H.265 cameras send limited range; NVDEC keeps the stream's levels
        # and this version does not read a stream's full-range flag.
        self.color_range: Literal["limited", "full"] = "limited"
        self.width = width
        self.height = height
        self.pts = pts
        self.on_device = True

    def write_into(self, out: np.ndarray[Any, Any]) -> None:  # pragma: no cover
        raise TypeError("an NVDEC picture stays on the device")

    def device_array(self) -> Any:
        return self._array


def _copied(frame: Any, pool: DevicePool, width: int, height: int) -> DeviceNV12:
    """The decoder's surface copied into a buffer of ``pool`` (before the next Decode
    call can overwrite it): its Y plane, then its UV plane, each from where the decoder
    put it at the decoder's own pitch, into dense rows of ``width`` bytes."""
    (luma, luma_pitch), (chroma, chroma_pitch) = _planes(frame)
    pointer = pool.take()
    array = DeviceNV12(pool, pointer, width, height)  # gives the buffer back if we fail
    kind = _rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    # On the stream the decoder wrote on (0, its default), then waited for, so the
    # picture is whole for any stream that reads it afterwards.
    for source, pitch, at, rows in (
        (luma, luma_pitch, 0, height),
        (chroma, chroma_pitch, width * height, height // 2),
    ):
        check_cuda(
            "cudaMemcpy2DAsync",
            _rt.cudaMemcpy2DAsync(pointer + at, width, source, pitch, width, rows, kind, 0),
        )
    check_cuda("cudaStreamSynchronize", _rt.cudaStreamSynchronize(0))
    return array


def _planes(frame: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    """(address, pitch in bytes) of a decoded NV12 picture's Y plane and of its UV
    plane, from the CUDA array interface of each plane's view (``frame.cuda()``): the
    UV plane need not follow the Y rows, and rows may be padded past the width (an
    odd height's last Y row, a pitched surface), so neither is assumed."""
    views = frame.cuda()
    if len(views) < 2:
        raise TypeError(f"an NV12 picture has two planes; the decoder gave {len(views)}")
    found = []
    for view in views[:2]:
        interface = view.__cuda_array_interface__
        shape, strides = interface["shape"], interface.get("strides")
        # Dense rows when no strides are given: every element's bytes, one row after
        # another (Y: (H, W, 1); UV: (H/2, W/2, 2)).
        pitch = int(strides[0]) if strides else int(np.prod(shape[1:], dtype=np.int64))
        found.append((int(interface["data"][0]), pitch))
    return found[0], found[1]


def _error(address: Address, what: str, reason: str, retryable: bool) -> VideoSourceError:
    return VideoSourceError(
        f"video source {address.name!r} {what}",
        source=address.name,
        reason=reason,
        retryable=retryable,
    )


class _Stream:
    def __init__(self, address: Address, options: OpenOptions) -> None:
        self._address = address
        self._options = options
        if address.kind == "file" and not os.path.exists(address.uri):
            raise _error(address, "does not exist", "not found", False)
        try:
            self._demuxer: Any = nvc.CreateDemuxer(address.uri)
        except Exception as exc:  # PyNvVideoCodec raises plain exceptions with FFmpeg's text
            text = address.redact(str(exc))
            if "401" in text or "Unauthorized" in text:
                raise _error(
                    address, f"refused the credentials: {text}", "unauthorized", False
                ) from None
            if "404" in text:
                raise _error(
                    address, f"was not found on the server: {text}", "not found", False
                ) from None
            live = address.live
            raise _error(
                address, f"could not be opened: {text}", "lost" if live else "unreadable", live
            ) from None
        codec = self._demuxer.GetNvCodecId()
        # By the enum member's name (str() gives "cudaVideoCodec.H264"), as PyNvVideoCodec's
        # own samples read it.
        spelled = str(codec).rsplit(".", 1)[-1].upper()
        names = {"H264": "h264", "HEVC": "hevc"}
        if spelled not in names:
            raise _error(
                address,
                f"is {codec}, a codec aiodla does not read (it reads H.264 and H.265)",
                "unsupported codec",
                False,
            )
        self.codec = names[spelled]
        self._decoder: Any = nvc.CreateDecoder(
            gpuid=options.gpu, codec=codec, cudacontext=0, cudastream=0, usedevicememory=True
        )
        num, den = self._demuxer.GetTimebaseNum(), self._demuxer.GetTimebaseDen()
        self._time_base = num / den if den else 0.0
        self._pool: DevicePool | None = None

    def pictures(self) -> Iterator[Picture | DecodeTrouble]:
        address, stall = self._address, self._options.stall_timeout
        last = time.monotonic()
        decoder = self._decoder
        lost: VideoSourceError | None = None
        array: DeviceNV12 | None = None
        try:
            for packet in self._demuxer:
                if address.live and time.monotonic() - last > stall:
                    raise _error(address, f"gave no picture for {stall:g} s", "stalled", True)
                for frame in decoder.Decode(packet):
                    last = time.monotonic()
                    width, height = decoder.GetWidth(), decoder.GetHeight()
                    width, height = width - width % 2, height - height % 2
                    nbytes = width * height * 3 // 2
                    if self._pool is None or self._pool.nbytes != nbytes:
                        if self._pool is not None:
                            self._pool.close()
                        self._pool = DevicePool(nbytes)
                    pts = frame.getPTS()
                    seconds = None if pts is None or pts < 0 else pts * self._time_base
                    array = _copied(frame, self._pool, width, height)
                    yield _Picture(array, width, height, seconds)
        except VideoSourceError:
            raise
        except Exception as exc:
            lost = _error(address, f"was lost: {address.redact(str(exc))}", "lost", address.live)
        finally:
            # A lost stream's error holds this frame in its traceback, and the error is
            # kept (the source's health, the user's exception): not the decoder with it
            # (PyNvVideoCodec frees its surfaces only when it is destroyed), nor a picture.
            decoder = frame = array = None
        if lost is not None:
            raise lost  # outside the handler: no context holding the decoder's failure

    def close(self) -> None:
        # Both free their resources when collected; dropping them here frees NVDEC's
        # session now rather than at the next garbage collection.
        self._decoder = None
        self._demuxer = None
        if self._pool is not None:
            self._pool.close()  # buffers still in pictures are freed as those go


class NvdecDecoder:
    name: Literal["nvdec"] = "nvdec"

    def open(self, address: Address, options: OpenOptions) -> _Stream:
        return _Stream(address, options)


def decoder() -> NvdecDecoder:
    return NvdecDecoder()
