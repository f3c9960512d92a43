"""The emulator loadable's operations, computed exactly as the format defines them.

Used by the emulated runtime; the GPU stand-in implements the same arithmetic in CUDA
and the shared test vectors hold both to the same bytes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._tensors import TensorSpec
from . import _detector
from ._draws import _G, _MASK, _OUTPUT_STEP, _finalize, _finalize_int, _stream
from ._elements import element_offsets, laid_bits
from ._format import EmulatorModel

__all__ = [
    "DETECT_GRID",
    "ModelRunner",
    "compute_logical",
    "compute_outputs",
    "mix_digest",
    "run_model",
    "to_storage",
]

_INPUT_SEED = 0x41494F444C41  # "AIODLA"
_FLOAT_MAX = {"float16": 65504.0, "float32": float(np.finfo(np.float32).max)}


def to_storage(values: np.ndarray[Any, Any], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """binary64 results to the stored element type, by the format's rounding rules."""
    if dtype.kind == "f":
        # Overflow to inf is the format's defined result, not an error.
        with np.errstate(over="ignore", invalid="ignore"):
            stored: np.ndarray[Any, Any] = values.astype(dtype)
        return stored
    info = np.iinfo(dtype)
    rounded = np.rint(np.where(np.isnan(values), 0.0, values))
    saturated: np.ndarray[Any, Any] = np.clip(rounded, info.min, info.max).astype(dtype)
    return saturated


def compute_logical(
    model: EmulatorModel, index: int, stored: np.ndarray[Any, Any]
) -> np.ndarray[Any, Any]:
    """Output ``index`` in binary64 from the stored values of input ``index`` (affine
    and mean_hw, which pair them; mix takes every input: :func:`compute_outputs`)."""
    if model.op == "mix":
        raise ValueError("op 'mix' reads every input: use compute_outputs")
    x = stored.astype(np.float64)
    if model.op == "mean_hw":
        n, c, h, w = x.shape
        # cumsum adds sequentially, so the order matches the stand-in's loop exactly.
        total = np.cumsum(x.reshape(n, c, h * w), axis=2)[:, :, -1]
        x = (total / float(h * w)).reshape(n, c, 1, 1)
    # Two separate roundings, never a fused multiply-add (the format says so).
    scaled = np.multiply(x, model.scale)
    result: np.ndarray[Any, Any] = np.add(scaled, model.bias)
    return result


def compute_outputs(
    model: EmulatorModel, stored: Sequence[np.ndarray[Any, Any]], mix: _Mix | None = None
) -> list[np.ndarray[Any, Any]]:
    """Every output, in its stored type and logical shape, from every input's stored
    values (logical shape, stored type): the whole task, without the layouts."""
    if model.op == "mix":
        return (mix or _Mix(model))(stored)
    if model.op == "detect":
        image = stored[0] if stored else None
        return _detector.detect_heads(model.outputs, _Digest(model)(stored), image)
    return [
        to_storage(compute_logical(model, index, x), target.numpy_dtype)
        for index, (x, target) in enumerate(zip(stored, model.outputs, strict=True))
    ]


# -- mix ----------------------------------------------------------------------------------


def _bits(stored: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The stored elements' bits, row-major, as unsigned integers of their width."""
    flat = np.ascontiguousarray(stored).reshape(-1)
    return flat.view(np.dtype(f"<u{flat.dtype.itemsize}"))


def mix_digest(model: EmulatorModel, stored: Sequence[np.ndarray[Any, Any]]) -> int:
    """The digest ``D`` of the format's op mix (or detect's, on its grid), over every
    input's stored values."""
    return _Digest(model)(stored)


#: The detect op's digest reads input elements whose h and w are multiples of this
#: (the format's definition): a detector's finest head looks at the picture in 8 x 8
#: cells, and reading one element in 64 keeps a task's host cost far below the DLA's
#: time while every frame still gets objects of its own.
DETECT_GRID = 8

# Elements drawn per pass: the scratch stays in the CPU's cache, whatever the tensor.
_CHUNK = 1 << 15


def _grid(model: EmulatorModel) -> int:
    return DETECT_GRID if model.op == "detect" else 1


@functools.lru_cache(maxsize=32)
def _grid_offsets(spec: TensorSpec, grid: int) -> np.ndarray[Any, Any]:
    """Byte offsets of the elements the digest reads, in row-major order (read-only)."""
    n, c, h, w = spec.shape
    at = element_offsets(
        spec,
        np.arange(n)[:, None, None, None],
        np.arange(c)[None, :, None, None],
        np.arange(0, h, grid)[None, None, :, None],
        np.arange(0, w, grid)[None, None, None, :],
    ).reshape(-1)
    at.flags.writeable = False
    return at


@functools.lru_cache(maxsize=16)
def _weights(shape: tuple[int, int, int, int], t: int, grid: int) -> np.ndarray[Any, Any]:
    """The weights ``w[t, j]`` of input ``t``'s elements on the grid, in row-major order:
    they depend on the shape only, so every task of every model shares them (read-only)."""
    n, c, h, w = shape
    after = np.arange(1, n * c * h * w + 1, dtype=np.uint64).reshape(shape)  # j + 1
    weights = np.ascontiguousarray(after[:, :, ::grid, ::grid]).reshape(-1)
    np.multiply(weights, np.uint64(_G), out=weights)  # wraps mod 2**64
    np.add(weights, np.uint64(_finalize_int(_INPUT_SEED + t)), out=weights)
    _finalize(weights, np.empty_like(weights))
    np.bitwise_or(weights, np.uint64(1), out=weights)
    weights.flags.writeable = False
    return weights


@functools.lru_cache(maxsize=16)
def _steps(size: int) -> np.ndarray[Any, Any]:
    """An output's ``(i + 1) * G``, shared by every task (read-only)."""
    steps = _stream(0, size)
    steps.flags.writeable = False
    return steps


def mix_values(dtype: np.dtype[Any], scale: float, bias: float) -> np.ndarray[Any, Any]:
    """The stored output for each of the 65536 values of ``k``: a draw's top 16 bits
    decide its element, so one lookup replaces the arithmetic and the rounding."""
    k = np.arange(1 << 16, dtype=np.float64)
    if dtype.kind == "f":
        v = k * 2.0**-15 - 1.0  # exact, both steps
    else:
        v = np.floor(k / 256.0) if dtype.itemsize == 1 else k  # k >> 8, exactly
        if dtype.kind == "i":
            v -= float(1 << (8 * dtype.itemsize - 1))
    y = np.add(np.multiply(v, scale), bias)  # two roundings, never fused
    if dtype.kind == "f":
        limit = _FLOAT_MAX[dtype.name]
        np.clip(y, -limit, limit, out=y)
    return to_storage(y, dtype)


class _Digest:
    """The digest ``D`` of one model's inputs (op mix: every element; op detect: the
    elements on its grid), from their logical arrays or straight from their buffers."""

    def __init__(self, model: EmulatorModel) -> None:
        self._inputs = model.inputs
        self._grid = _grid(model)
        self._weights = [_weights(spec.shape, t, self._grid) for t, spec in enumerate(model.inputs)]

    def __call__(self, stored: Sequence[np.ndarray[Any, Any]]) -> int:
        """From every input's stored values in their logical shape."""
        grid = self._grid
        bits = []
        for x, spec in zip(stored, self._inputs, strict=True):
            if x.shape != spec.shape:
                raise ValueError(f"input {spec.name!r}: shape {x.shape}, expected {spec.shape}")
            bits.append(_bits(x if grid == 1 else x[:, :, ::grid, ::grid]))
        return self._fold(bits)

    def laid(self, raws: Sequence[np.ndarray[Any, Any]]) -> int:
        """From every input's buffer (uint8, the tensor's layout): only the elements the
        digest reads are touched, never the whole tensor."""
        return self._fold(
            [
                laid_bits(raw, spec, _grid_offsets(spec, self._grid))
                for raw, spec in zip(raws, self._inputs, strict=True)
            ]
        )

    def _fold(self, bits: Sequence[np.ndarray[Any, Any]]) -> int:
        digest = 0
        for b, weights in zip(bits, self._weights, strict=True):
            terms = b.astype(np.uint64)
            np.multiply(terms, weights, out=terms)
            total = int(terms.sum(dtype=np.uint64))  # wraps: the sum is mod 2**64
            digest = _finalize_int((digest + total + _G) & _MASK)
        return digest


class _Mix:
    """The op mix for one model, with its own scratch (one per task: tasks of several
    cores run at once)."""

    def __init__(self, model: EmulatorModel) -> None:
        self.model = model
        self.digest = _Digest(model)
        self._steps = [_steps(math.prod(spec.shape)) for spec in model.outputs]
        self._values = [
            mix_values(spec.numpy_dtype, model.scale, model.bias) for spec in model.outputs
        ]
        self._draws = np.empty(_CHUNK, dtype=np.uint64)
        self._scratch = np.empty(_CHUNK, dtype=np.uint64)

    def __call__(self, stored: Sequence[np.ndarray[Any, Any]]) -> list[np.ndarray[Any, Any]]:
        digest = self.digest(stored)
        results = []
        for o, (spec, steps, values) in enumerate(
            zip(self.model.outputs, self._steps, self._values, strict=True)
        ):
            key = np.uint64(_finalize_int((digest + (o + 1) * _OUTPUT_STEP) & _MASK))
            result = np.empty(len(steps), dtype=spec.numpy_dtype)
            for start in range(0, len(steps), _CHUNK):
                end = min(start + _CHUNK, len(steps))
                draws, scratch = self._draws[: end - start], self._scratch[: end - start]
                np.add(steps[start:end], key, out=draws)
                _finalize(draws, scratch)
                np.right_shift(draws, np.uint64(48), out=draws)
                np.take(values, draws.view(np.int64), out=result[start:end])
            results.append(result.reshape(spec.shape))
        return results


def run_model(model: EmulatorModel, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
    """Run one task: read each input buffer, write each output buffer in its layout."""
    ModelRunner(model, inputs, outputs)()


class ModelRunner:
    """One task's buffers, bound once; calling it runs the model on them."""

    def __init__(self, model: EmulatorModel, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
        self.model = model
        self._sources = [
            _raw(spec).bind(inputs[i], zero=False) for i, spec in enumerate(model.inputs)
        ]
        self._targets = [
            _raw(spec).bind(outputs[i], zero=False) for i, spec in enumerate(model.outputs)
        ]
        # Device buffers are shared with copies on the stream, so a task writes every
        # byte of its outputs each time (padding as zeros), as the format says.
        self._padded = [not target.spec._is_dense() for target in self._targets]
        self._mix = _Mix(model) if model.op == "mix" else None
        self._digest = _Digest(model) if model.op == "detect" else None

    def __call__(self) -> None:
        if self._digest is not None:
            # Sparse, from the buffers as they lie: the digest's grid and the picture's
            # cell corners are all it reads of the input, then the heads' background
            # and the object cells are written (_detector).
            raws = [source.raw for source in self._sources]
            digest = self._digest.laid(raws)
            picture = _detector.laid_picture(self.model.inputs[0], raws[0]) if raws else None
            targets = [target.raw for target in self._targets]
            _detector.write_heads(targets, self.model.outputs, digest, picture)
            return
        if self._mix is not None:
            stored = [source.read(dequantize=False) for source in self._sources]
            for index, result in enumerate(compute_outputs(self.model, stored, self._mix)):
                self._write(index, result)
            return
        for index, source in enumerate(self._sources):
            result = compute_logical(self.model, index, source.read(dequantize=False))
            self._write(index, to_storage(result, self._targets[index].spec.numpy_dtype))

    def _write(self, index: int, result: np.ndarray[Any, Any]) -> None:
        target = self._targets[index]
        if self._padded[index]:
            target.raw[:] = 0
        target.write(result)


def _raw(spec: TensorSpec) -> TensorSpec:
    # Results are already stored values: packing must not quantize them again.
    return spec if spec.scale is None else spec.with_scale(None)
