"""Elements read straight from a tensor's buffer in its layout, by the format's one
addressing formula (:mod:`aiodla.emulator._format`): for the ops that read a few
elements of a large tensor (the detect op's digest grid and cell corners), where
unpacking the whole tensor would cost more than the op."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._tensors import TensorSpec

__all__ = ["element_offsets", "laid_bits"]


def element_offsets(spec: TensorSpec, n: Any, c: Any, h: Any, w: Any) -> np.ndarray[Any, Any]:
    """Byte offsets of elements (n, c, h, w) (broadcast integer arrays) in the tensor's
    layout, by the format's one addressing formula."""
    assert spec.strides is not None
    pixel, line, surface, batch = spec.strides
    lanes, esize = spec.lanes, spec.numpy_dtype.itemsize
    c = np.asarray(c, np.int64)
    at: np.ndarray[Any, Any] = (
        np.asarray(n, np.int64) * batch
        + (c // lanes) * surface
        + np.asarray(h, np.int64) * line
        + np.asarray(w, np.int64) * pixel
        + (c % lanes) * esize
    )
    return at


def laid_bits(raw: np.ndarray[Any, Any], spec: TensorSpec, offsets: np.ndarray[Any, Any]) -> Any:
    """The stored bits of the elements at byte ``offsets`` of ``raw`` (the tensor's
    buffer, uint8), as unsigned integers of their width, shaped as ``offsets``."""
    esize = spec.numpy_dtype.itemsize
    picked = raw.take(offsets[..., np.newaxis] + np.arange(esize))
    return picked.view(np.dtype(f"<u{esize}"))[..., 0]
