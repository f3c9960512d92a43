"""A tensor's place in a slot: its registered DLA buffer, its staging, and what the
device path's pack kernels read for a request. The data path fills these; the slot
holds them."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from ._layout import BoundTensor
    from ._preprocess import ImagePreprocess
    from ._tensors import TensorSpec
    from .runtime import HostBuffer

__all__ = ["FrameRead", "Read", "Staging", "TensorBinding"]

_Array = np.ndarray[Any, Any]


class FrameRead(NamedTuple):
    """A staged camera frame for the fused pre-processing kernel."""

    pointer: int
    height: int  # the image's (nv12: its Y plane's)
    width: int
    pitch: int  # bytes from one row to the next
    nbytes: int
    # The engine frame buffer (its address) to copy from instead of the slot's staging:
    # 0 for the staging (see aiodla._frame_buffers)
    source: int = 0
    # A frame in device memory, read in place: the stream its producer's work is ordered
    # on (0: the ingest stream, as for DLPack exports); None for a frame the host staged
    wait: int | None = None


#: What a slot's pack step reads: (pointer, dtype, element strides, stream to wait for or
#: None), or a camera frame.
Read = tuple[int, np.dtype[Any], tuple[int, int, int, int], int | None] | FrameRead


@dataclasses.dataclass(eq=False)
class TensorBinding:
    """One tensor of one slot: its spec, its registered DLA buffer and its staging.

    Host conversion: ``host`` holds the DLA bytes and ``bound`` its layout views.
    Device conversion: ``host`` holds the caller's bytes (inputs) or the logical
    results (outputs); ``raw`` is their device copy, 0 when ``host`` is mapped and
    the kernels reach it in place.
    """

    spec: TensorSpec
    device_ptr: int
    registered: int
    host: HostBuffer
    bound: BoundTensor[TensorSpec] | None = None
    raw: int = 0
    # An input that takes camera frames: their pre-processing, and (host conversion)
    # where it writes the float32 model input before packing.
    preprocess: ImagePreprocess | None = None
    scratch: _Array | None = None
    # Device conversion, per request: the staging as a dense array of each source dtype
    # with the read the pack kernel makes from it (inputs), and the results' view
    # (outputs); views of ``host``, made once (see :meth:`rehost`).
    staged: dict[np.dtype[Any], Staging] = dataclasses.field(default_factory=dict)
    results: _Array | None = None

    def rehost(self, host: HostBuffer, bound: BoundTensor[TensorSpec] | None) -> None:
        """Stage in ``host`` from now on (a new worker's shared staging)."""
        self.host, self.bound = host, bound
        self.staged.clear()
        self.results = None


class Staging(NamedTuple):
    """A binding's staging as a dense array of one source dtype."""

    array: _Array
    read: Read  # what the pack kernel reads from it
    raw: memoryview  # its bytes, for a copy that keeps the GIL (see copy_small)
