"""The ``"nvdec"`` decoder: NVIDIA's PyNvVideoCodec, pictures left in device memory.

PyNvVideoCodec demuxes with its own FFmpeg (files and ``rtsp://``) and decodes on the
GPU's NVDEC into NV12 surfaces in device memory. A picture is handed on as a small
object exposing ``__cuda_array_interface__`` over the decoded surface (Y rows then
interleaved UV rows, ``(height * 3 // 2, width)`` bytes), which keeps the decoder's
frame alive for as long as the array lives; ``ImagePreprocess(source="nv12")`` reads it
there on the slot's stream, so the picture never crosses to the host.

Not verified here (this machine has no GPU): ``tests/gpu/test_video_nvdec_gpu.py``
holds it against the ffmpeg decoder's pixels on the GPU machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import PyNvVideoCodec as nvc

from ._errors import VideoSourceError
from ._video_address import Address
from ._video_decoders import DecodeTrouble, OpenOptions, Picture

__all__ = ["decoder"]


class _DeviceNV12:
    """A decoded NV12 surface as a CUDA array (and the frame that owns it)."""

    __slots__ = ("__cuda_array_interface__", "_frame")

    def __init__(self, frame: Any, width: int, height: int) -> None:
        self._frame = frame
        self.__cuda_array_interface__ = {
            "shape": (height * 3 // 2, width),
            "typestr": "|u1",
            "data": (int(frame.GetPtrToPlane(0)), False),
            "strides": None,
            "version": 3,
            # PyNvVideoCodec synchronizes its stream before it returns a frame.
            "stream": None,
        }


class _Picture:
    __slots__ = ("_frame", "format", "height", "on_device", "pts", "width")

    def __init__(self, frame: Any, width: int, height: int, time_base: float) -> None:
        self._frame = frame
        self.format: Literal["nv12", "i420"] = "nv12"
        self.width = width - width % 2
        self.height = height - height % 2
        pts = frame.getPTS()
        self.pts = None if pts is None or pts < 0 else pts * time_base
        self.on_device = True

    def write_into(self, out: np.ndarray[Any, Any]) -> None:  # pragma: no cover
        raise TypeError("an NVDEC picture stays on the device")

    def device_array(self) -> Any:
        return _DeviceNV12(self._frame, self.width, self.height)


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

    def pictures(self) -> Iterator[Picture | DecodeTrouble]:
        address, stall = self._address, self._options.stall_timeout
        last = time.monotonic()
        decoder = self._decoder
        try:
            for packet in self._demuxer:
                if address.live and time.monotonic() - last > stall:
                    raise _error(address, f"gave no picture for {stall:g} s", "stalled", True)
                for frame in decoder.Decode(packet):
                    last = time.monotonic()
                    yield _Picture(frame, decoder.GetWidth(), decoder.GetHeight(), self._time_base)
        except VideoSourceError:
            raise
        except Exception as exc:
            raise _error(
                address, f"was lost: {address.redact(str(exc))}", "lost", address.live
            ) from None

    def close(self) -> None:
        # Both free their resources when collected; dropping them here frees NVDEC's
        # session now rather than at the next garbage collection.
        self._decoder = None
        self._demuxer = None


class NvdecDecoder:
    name: Literal["nvdec"] = "nvdec"

    def open(self, address: Address, options: OpenOptions) -> _Stream:
        return _Stream(address, options)


def decoder() -> NvdecDecoder:
    return NvdecDecoder()
