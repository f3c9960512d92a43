"""Block planning and bound tensors: how a tensor's element lanes in a DLA buffer are
cut into blocks of about ``_BLOCK`` elements, each with its numpy view, and how
:class:`BoundTensor` writes and reads them through the conversions of :mod:`aiodla._convert`.

The views follow the element offset formula of :mod:`aiodla._descriptors`. Packing
writes every byte of a fresh buffer: element lanes with the converted values;
padding lanes, row, surface and batch padding and the tail with zeros. A
:class:`BoundTensor` zeroes its buffer once and from then on stores element lanes
only, so padding stays zero however often it is reused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

# _BLOCK and _SMALL are read through the module, never imported by name: tests shrink
# them to run tiny tensors through many blocks, and one assignment must reach both.
from . import _convert
from ._convert import _SCRATCH, _Convert, _read_conversion, _write_conversion, refuse_nan
from ._errors import InputTypeError, InputValueError
from ._spec_facts import SpecFacts


class Laid(SpecFacts, Protocol):
    """What a layout is planned from (a :class:`~aiodla.TensorSpec`)."""

    @property
    def scale(self) -> float | None: ...
    @property
    def lanes(self) -> int: ...
    @property
    def groups(self) -> int: ...
    @property
    def is_integer(self) -> bool: ...


__all__ = ["BoundTensor", "Laid"]

_Array = np.ndarray[Any, Any]


def _chunks(shape: tuple[int, ...]) -> Iterator[tuple[Any, ...]]:
    """Index tuples that cover an array of ``shape`` in pieces of about _BLOCK elements."""
    if not shape:
        yield ()
        return
    inner, block = math.prod(shape[1:]), _convert._BLOCK
    if inner <= block:
        step = max(1, block // max(inner, 1))
        for start in range(0, shape[0], step):
            yield (slice(start, start + step),)
        return
    for index in range(shape[0]):
        for rest in _chunks(shape[1:]):
            yield (index, *rest)


# -- buffers and bound tensors ------------------------------------------------------------

# Channel groups of at most this many channels are copied one channel plane at a time:
# numpy would otherwise run its innermost loop over the few lanes of each pixel.
_PER_CHANNEL_MAX = 4


class _Block(NamedTuple):
    """A piece of the tensor converted and copied in one go."""

    # (n, channels, rows) of the logical array; () for a block that is the whole tensor
    where: tuple[int, slice, slice] | tuple[()]
    lanes: _Array  # its elements in the buffer, shape (channels, rows, w), or the tensor's
    per_channel: bool  # copy channel by channel (few lanes per pixel)


def _raw_bytes(buffer: Any, spec: Laid) -> _Array:
    if isinstance(buffer, np.ndarray):
        if not (buffer.flags.c_contiguous or buffer.flags.f_contiguous):
            raise InputValueError(
                f"tensor {spec.name!r}: the buffer must be contiguous, got an array with "
                f"strides {buffer.strides}"
            )
        raw: _Array = np.ravel(buffer, order="K").view(np.uint8)
    else:
        try:
            raw = np.frombuffer(buffer, dtype=np.uint8)
        except (TypeError, ValueError) as exc:
            raise InputValueError(
                f"tensor {spec.name!r}: expected a contiguous buffer of at least "
                f"{spec.size} bytes, got {type(buffer).__name__} ({exc})"
            ) from None
    if raw.nbytes < spec.size:
        raise InputValueError(
            f"tensor {spec.name!r}: buffer of {raw.nbytes} bytes < the {spec.size} it needs"
        )
    return raw[: spec.size]


def _plan(spec: Laid, raw: _Array) -> tuple[_Block, ...]:
    """Cut the tensor into blocks of about _BLOCK elements, each with its buffer view.

    nchw tensors are cut into whole channel planes (or row bands of one plane); the
    lane formats into row bands of one channel group, so each block fills whole
    pixels and every cache line of the buffer is fetched once per write.
    """
    assert spec.strides is not None
    pixel, line, surface, batch = spec.strides
    n, c, h, w = spec.shape
    lanes, esize = spec.lanes, spec.numpy_dtype.itemsize
    block, small = _convert._BLOCK, _convert._SMALL
    view: _Array = np.ndarray(
        shape=(n, spec.groups, h, w, lanes),
        dtype=spec.numpy_dtype,
        buffer=raw,
        strides=(batch, surface, line, pixel, esize),
    )
    # (first channel, channels, view of shape (n, channels, h, w), rows and channels per block)
    segments: list[tuple[int, int, _Array, int, int]] = []
    if lanes == 1:
        plane = h * w
        if plane <= block:
            chans, rows = max(1, min(c, block // plane)), h
        else:
            chans, rows = 1, max(1, block // w)
        segments.append((0, c, view[..., 0], chans, rows))
    else:
        for group in range(spec.groups):
            first = group * lanes
            count = min(lanes, c - first)
            rows = max(1, min(h, block // (count * w)))
            lane_view = view[:, group, :, :, :count].transpose(0, 3, 1, 2)
            segments.append((first, count, lane_view, count, rows))
    blocks: list[_Block] = []
    for image in range(n):
        for first, count, lane_view, chans, rows in segments:
            few_lanes = lanes > 1 and count <= _PER_CHANNEL_MAX
            for c0 in range(0, count, chans):
                c1 = min(count, c0 + chans)
                for h0 in range(0, h, rows):
                    h1 = min(h, h0 + rows)
                    where = (image, slice(first + c0, first + c1), slice(h0, h1))
                    # one numpy call beats several for a small block, whatever its order
                    per_channel = few_lanes and (c1 - c0) * (h1 - h0) * w >= small
                    blocks.append(_Block(where, lane_view[image, c0:c1, h0:h1], per_channel))
    if len(blocks) == 1 and not blocks[0].per_channel and n == 1:
        # One block is the whole tensor (small tensors, the common case on the request
        # path): shaped as the tensor, a write or read is one numpy call, no indexing.
        whole = blocks[0].lanes[np.newaxis]
        if whole.shape == spec.shape:
            return (_Block((), whole, False),)
    return tuple(blocks)


def _store(lanes: _Array, values: _Array, per_channel: bool) -> None:
    if per_channel:
        for channel in range(values.shape[0]):
            np.copyto(lanes[channel], values[channel])
    else:
        np.copyto(lanes, values)


def _load(lanes: _Array, into: _Array, per_channel: bool) -> None:
    if per_channel:
        for channel in range(into.shape[0]):
            np.copyto(into[channel], lanes[channel])
    else:
        np.copyto(into, lanes)


_S = TypeVar("_S", bound=Laid)


class BoundTensor(Generic[_S]):
    """A TensorSpec fixed to one buffer, its element views computed once.

    The tensor is cut into blocks (see ``_plan``); each block knows its view of the
    element lanes in the buffer, so a write or read is a short loop of numpy copies
    and, where the types differ, conversions: straight into the lanes for small
    blocks, through per-thread scratch arrays for large ones.
    Padding bytes are zeroed once (``zero=True``) and never written again, since only
    element lanes are ever stored through the views.
    """

    __slots__ = ("_blocks", "_reads", "_writes", "raw", "spec")

    def __init__(self, spec: _S, buffer: Any, *, zero: bool = True) -> None:
        self.spec = spec
        self.raw = _raw_bytes(buffer, spec)
        if zero:
            if not self.raw.flags.writeable:
                raise InputValueError(f"tensor {spec.name!r}: the buffer is read-only")
            self.raw[:] = 0
        self._blocks = _plan(spec, self.raw)
        # The conversion for the last source dtype written / result dtype read: the
        # engine writes and reads the same types request after request.
        self._writes: tuple[np.dtype[Any], _Convert | None] | None = None
        self._reads: dict[
            tuple[bool, np.dtype[Any] | None], tuple[np.dtype[Any], _Convert | None]
        ] = {}

    def write(self, source: _Array, *, checked: bool = False) -> None:
        """Store a validated logical array (see :meth:`TensorSpec.check_array`).

        Floats into integer tensors are quantized; other types are converted as
        :mod:`aiodla._convert` says. Only element lanes are written. ``checked=True`` says
        :meth:`TensorSpec.check_array` already passed it, so the NaN scan it made is
        not made twice.
        """
        spec = self.spec
        if source.shape != spec.shape:
            raise InputValueError(
                f"input {spec.name!r}: expected shape {spec.shape} (n, c, h, w), got {source.shape}"
            )
        cached = self._writes
        if cached is not None and cached[0] == source.dtype:
            convert = cached[1]
        else:
            convert = self._write_conversion(source.dtype)
            self._writes = (source.dtype, convert)
        if convert is None:
            for where, lanes, per_channel in self._blocks:
                _store(lanes, source[where], per_channel)
            return
        target = spec.numpy_dtype
        if target.kind in "iu" and not checked:
            refuse_nan(spec.name, spec.dtype, source)
        small = _convert._SMALL
        with np.errstate(all="ignore"):  # overflow to float16 infinity is by design
            for where, lanes, per_channel in self._blocks:
                if lanes.size < small:  # numpy's casts, straight into the lanes
                    convert(source[where], lanes)
                    continue
                staged = _SCRATCH.array("stage", target, lanes.shape)
                convert(source[where], staged)
                _store(lanes, staged, per_channel)

    def _write_conversion(self, source: np.dtype[Any]) -> _Convert | None:
        spec = self.spec
        if not self.raw.flags.writeable:
            raise InputValueError(f"tensor {spec.name!r}: the buffer is read-only")
        target = spec.numpy_dtype
        if source.kind in "iub" and target.kind in "iu" and not np.can_cast(source, target, "safe"):
            raise InputTypeError(f"input {spec.name!r}: {source} cannot be cast safely to {target}")
        if source.kind == "f" and target.kind in "iu" and spec.scale is None:
            raise InputTypeError(
                f"input {spec.name!r}: a {source} array for an {target} tensor needs a "
                "quantization scale"
            )
        return _write_conversion(source, target, spec.scale)

    def read(self, *, dequantize: bool = True, dtype: npt.DTypeLike | None = None) -> _Array:
        """A fresh logical array of the stored values (dequantized when a scale is set).

        ``dtype`` as in :meth:`TensorSpec.unpack`.
        """
        key = (dequantize, None if dtype is None else np.dtype(dtype))
        decided = self._reads.get(key)
        if decided is None:
            decided = self._reads[key] = self._read_conversion(*key)
        result_dtype, convert = decided
        spec = self.spec
        result = np.empty(spec.shape, result_dtype)
        if convert is None:
            for where, lanes, per_channel in self._blocks:
                _load(lanes, result[where], per_channel)
            return result
        stored, small = spec.numpy_dtype, _convert._SMALL
        with np.errstate(all="ignore"):
            for where, lanes, per_channel in self._blocks:
                if lanes.size < small:
                    convert(lanes, result[where])
                    continue
                staged = _SCRATCH.array("stage", stored, lanes.shape)
                _load(lanes, staged, per_channel)
                convert(staged, result[where])
        return result

    def _read_conversion(
        self, dequantize: bool, dtype: np.dtype[Any] | None
    ) -> tuple[np.dtype[Any], _Convert | None]:
        spec = self.spec
        stored = spec.numpy_dtype
        scale = spec.scale if dequantize and spec.is_integer else None
        if dtype is None:
            dtype = np.dtype(np.float32) if scale is not None else stored
        elif scale is not None and dtype.kind != "f":
            raise InputTypeError(
                f"tensor {spec.name!r}: dequantized values need a float dtype, got {dtype}"
            )
        elif scale is None and not np.can_cast(stored, dtype, "safe"):
            raise InputTypeError(
                f"tensor {spec.name!r}: stored {stored} values do not cast safely to {dtype}"
            )
        return dtype, _read_conversion(stored, dtype, scale)
