"""The slow reference for tensor layouts and conversions, written with loops, and the
strategies and block-size switch that tests/test_{descriptors,tensors,convert,layout}.py share.

The reference walks every element with explicit Python loops over n, c, h, w,
places it at the offset the docstring of aiodla._descriptors gives, and converts each value on its
own (numpy scalar casts for floats, Python's ``round`` on the binary64 quotient for
quantization). Every pack and unpack is compared with it byte for byte, on tiny
shapes, for every accepted (format, dtype) pair, with padded lanes, rows, surfaces,
batches and tails. ``small_blocks`` shrinks the block size so the same tiny tensors
also run through the multi-block plans and the vectorized kernels.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from aiodla import _convert, _descriptors
from aiodla._descriptors import FORMATS
from aiodla._tensors import TensorSpec

DTYPES = ("float32", "float16", "int16", "int8", "uint8", "uint16")
ACCEPTED = {fmt: sorted(_descriptors._ACCEPTED_DTYPES[fmt]) for fmt in FORMATS}
PAIRS = [(fmt, dtype) for fmt in FORMATS for dtype in ACCEPTED[fmt]]
REFUSED = [(fmt, dtype) for fmt in FORMATS for dtype in DTYPES if dtype not in ACCEPTED[fmt]]
ODD_CHANNELS = (1, 3, 15, 16, 17, 31, 33)
FIXED_LANES = {"nchw": 1, "chw16": 16, "chw32": 32, "hwc4": 4}

# -- the slow reference ------------------------------------------------------------------


def offset(spec: TensorSpec, n: int, c: int, h: int, w: int) -> int:
    """Byte offset of element (n, c, h, w): aiodla._descriptors' formula, from the
    strides alone."""
    assert spec.strides is not None
    pixel, line, surface, batch = spec.strides
    esize = np.dtype(spec.dtype).itemsize
    lanes = pixel // esize
    return n * batch + (c // lanes) * surface + h * line + w * pixel + (c % lanes) * esize


def element_bytes(spec: TensorSpec) -> set[int]:
    """Every byte of the buffer that belongs to some element."""
    esize = np.dtype(spec.dtype).itemsize
    n_, c_, h_, w_ = spec.shape
    owned: set[int] = set()
    for n in range(n_):
        for c in range(c_):
            for h in range(h_):
                for w in range(w_):
                    start = offset(spec, n, c, h, w)
                    owned.update(range(start, start + esize))
    return owned


def store_value(spec: TensorSpec, value: Any) -> Any:
    """One value as the tensor stores it (a numpy scalar of the tensor's type)."""
    target = np.dtype(spec.dtype)
    if target.kind in "iu" and np.asarray(value).dtype.kind == "f":
        assert spec.scale is not None
        quotient = float(value) / spec.scale  # binary64, rounded once
        info = np.iinfo(target)
        if math.isnan(quotient):
            raise AssertionError("NaN reached the reference quantizer")
        if math.isinf(quotient):
            stored = info.max if quotient > 0 else info.min
        else:
            stored = min(max(round(quotient), info.min), info.max)  # half to even
        return target.type(stored)
    with np.errstate(all="ignore"):
        return np.asarray(value).astype(target)[()]


def reference_pack(spec: TensorSpec, array: np.ndarray[Any, Any]) -> bytes:
    buffer = bytearray(spec.size)
    esize = np.dtype(spec.dtype).itemsize
    n_, c_, h_, w_ = spec.shape
    for n in range(n_):
        for c in range(c_):
            for h in range(h_):
                for w in range(w_):
                    start = offset(spec, n, c, h, w)
                    stored = store_value(spec, array[n, c, h, w])
                    buffer[start : start + esize] = np.asarray(stored).tobytes()
    return bytes(buffer)


def reference_unpack(
    spec: TensorSpec, buffer: bytes, *, dequantize: bool = True, dtype: Any = None
) -> np.ndarray[Any, Any]:
    stored_type = np.dtype(spec.dtype)
    scale = spec.scale if dequantize and stored_type.kind in "iu" else None
    if dtype is None:
        dtype = np.float32 if scale is not None else stored_type
    result = np.empty(spec.shape, dtype)
    esize = stored_type.itemsize
    n_, c_, h_, w_ = spec.shape
    for n in range(n_):
        for c in range(c_):
            for h in range(h_):
                for w in range(w_):
                    start = offset(spec, n, c, h, w)
                    stored = np.frombuffer(buffer[start : start + esize], stored_type)[0]
                    if scale is not None:
                        result[n, c, h, w] = np.dtype(dtype).type(float(stored) * scale)
                    else:
                        result[n, c, h, w] = stored
    return result


def same_bits(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    """Equal dtype, shape and bytes (so NaN payloads and signed zeros count)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@contextlib.contextmanager
def small_blocks(block: int = 24) -> Iterator[None]:
    """Tiny blocks, and the vectorized kernels even for a handful of elements."""
    saved = _convert._BLOCK, _convert._SMALL
    _convert._BLOCK, _convert._SMALL = block, 1
    try:
        yield
    finally:
        _convert._BLOCK, _convert._SMALL = saved


MODES = ("default", "small blocks")


def in_mode(mode: str) -> contextlib.AbstractContextManager[None]:
    return small_blocks() if mode == "small blocks" else contextlib.nullcontext()


# -- strategies --------------------------------------------------------------------------


@st.composite
def specs(
    draw: st.DrawFn,
    pairs: list[tuple[str, str]] = PAIRS,
    padded: bool = True,
    scale: bool = False,
) -> TensorSpec:
    """Tiny specs of any accepted pair, with padding anywhere the layout allows."""
    fmt, dtype = draw(st.sampled_from(pairs))
    esize = np.dtype(dtype).itemsize
    n = draw(st.integers(1, 2))
    c = draw(st.sampled_from((1, 3, 4) if fmt == "hwc4" else (*ODD_CHANNELS, 2, 4)))
    h = draw(st.integers(1, 4))
    w = draw(st.integers(1, 5))
    pad = (lambda most: draw(st.integers(0, most))) if padded else (lambda most: 0)
    lanes = FIXED_LANES.get(fmt) or c + pad(3)
    if fmt == "nhwc" and lanes == 4:
        lanes += 1  # four lanes in the IMAGE category would be hwc4; keep it plain
    pixel = lanes * esize
    line = w * pixel + pad(5)
    surface = h * line + pad(7)
    groups = math.ceil(c / lanes)
    batch = groups * surface + pad(9)
    extent = (n - 1) * batch + (groups - 1) * surface + (h - 1) * line + w * pixel
    chosen_scale = None
    if scale and np.dtype(dtype).kind in "iu":
        chosen_scale = draw(st.sampled_from((1.0, 0.5, 0.1, 0.0123, 3.0, 2.0**-7)))
    return TensorSpec(
        "t",
        (n, c, h, w),
        dtype,
        fmt,
        strides=(pixel, line, surface, batch),
        nbytes=extent + pad(11),
        scale=chosen_scale,
    )


def stored_arrays(spec: TensorSpec) -> st.SearchStrategy[np.ndarray[Any, Any]]:
    """Any values of the tensor's own type, NaN, inf and subnormals included."""
    return hnp.arrays(np.dtype(spec.dtype), spec.shape)


def float_arrays(spec: TensorSpec, dtype: Any, **kwargs: Any) -> st.SearchStrategy[Any]:
    return hnp.arrays(
        np.dtype(dtype), spec.shape, elements=hnp.from_dtype(np.dtype(dtype), **kwargs)
    )
