"""Camera frames in device memory (an NVDEC surface, a CUDA array holding a decoded
frame): taken by protocol, checked as a frame of an input's pre-processing, and read
by the pre-processing kernel where they lie, on the slot's stream.

A device frame is one uint8 array shaped as the host frames of its ``source`` are
((H*3/2) x W for nv12 and i420, H x W x C for the packed formats), its pixels packed
within a row and its rows ascending with any pitch: what the kernel's ``Frame`` reads
(one base pointer and a row pitch; the chroma rows follow the Y rows at that pitch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._bindings import FrameRead
from ._device_arrays import DeviceSource, import_device_array
from ._errors import InputTypeError, InputValueError
from ._frame_plan import _PLANAR

if TYPE_CHECKING:
    from ._preprocess import ImagePreprocess
    from ._tensors import TensorSpec

__all__ = ["device_frame_read", "import_device_frame"]


def import_device_frame(
    value: Any,
    spec: TensorSpec,
    pre: ImagePreprocess,
    device: int,
    stream: int,
    locate: Callable[[int], int],
) -> DeviceSource:
    """A device frame for input ``spec``, checked as ``pre.check_frame`` checks a host
    frame and as the kernel must read it, its DLPack export ordered before ``stream``
    (:func:`~aiodla._device_arrays.import_device_array`). An InputError names what is
    wrong, with nothing held."""
    name = spec.name

    def uint8_only(dtype: np.dtype[Any]) -> None:
        if dtype != np.uint8:
            raise InputTypeError(f"input {name!r}: a {pre.source} frame must be uint8, got {dtype}")

    source = import_device_array(
        value,
        name=name,
        shape=functools.partial(pre.check_frame_shape, spec=spec),
        accepts=uint8_only,
        device=device,
        stream=stream,
        locate=locate,
    )
    shape, strides = source.shape, source.strides  # (uint8: strides are bytes)
    row = shape[1] * (shape[2] if len(shape) == 3 else 1)
    packed = strides[-1] == 1 and (len(shape) == 2 or strides[1] == shape[2])
    problem = None
    if not packed or strides[0] < row:
        problem = (
            f"its strides {strides} (bytes) are not a frame's: pixels packed within a "
            f"row and rows at least {row} bytes apart"
        )
    elif source.pointer == 0:
        problem = "its data pointer is null"
    if problem is not None:
        source.release()  # a kernel following such a frame would read outside it
        raise InputValueError(f"input {name!r}: the device frame cannot be read: {problem}")
    return source


def device_frame_read(pre: ImagePreprocess, source: DeviceSource) -> FrameRead:
    """The pre-processing kernel's read of a frame :func:`import_device_frame` took: in
    place, after its producer's stream (0: the ingest stream, as for DLPack)."""
    shape, pitch = source.shape, source.strides[0]
    height, width = shape[0], shape[1]
    if pre.source in _PLANAR:
        height = height * 2 // 3
    span = (shape[0] - 1) * pitch + width * (shape[2] if len(shape) == 3 else 1)
    return FrameRead(source.pointer, height, width, pitch, span, wait=source.wait_stream or 0)
