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
from ._draws import _G, _MASK, _OUTPUT_STEP, _finalize, _finalize_int, _stream
from ._format import EmulatorModel

__all__ = [
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
        from ._detector import detect_heads  # (it builds on this module's draws)

        image = stored[0] if stored else None
        return detect_heads(model.outputs, (mix or _Mix(model)).digest(stored), image)
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
    """The digest ``D`` of the format's op mix, over every input's stored values."""
    return _Mix(model).digest(stored)


# Elements drawn per pass: the scratch stays in the CPU's cache, whatever the tensor.
_CHUNK = 1 << 15


@functools.lru_cache(maxsize=16)
def _tables(
    input_sizes: tuple[int, ...], output_sizes: tuple[int, ...]
) -> tuple[tuple[np.ndarray[Any, Any], ...], tuple[np.ndarray[Any, Any], ...]]:
    """The input weights ``w[t]`` and the outputs' ``(i + 1) * G``: they depend on the
    sizes only, so every task of every model of these sizes shares them (read-only)."""
    weights = []
    for t, size in enumerate(input_sizes):
        w = _stream(_finalize_int(_INPUT_SEED + t), size)
        _finalize(w, np.empty_like(w))
        np.bitwise_or(w, np.uint64(1), out=w)
        weights.append(w)
    steps = [_stream(0, size) for size in output_sizes]
    for array in (*weights, *steps):
        array.flags.writeable = False
    return tuple(weights), tuple(steps)


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


class _Mix:
    """The op mix for one model, with its own scratch (one per task: tasks of several
    cores run at once)."""

    def __init__(self, model: EmulatorModel) -> None:
        self.model = model
        self._weights, self._steps = _tables(
            tuple(math.prod(spec.shape) for spec in model.inputs),
            tuple(math.prod(spec.shape) for spec in model.outputs),
        )
        self._values = [
            mix_values(spec.numpy_dtype, model.scale, model.bias) for spec in model.outputs
        ]
        self._draws = np.empty(_CHUNK, dtype=np.uint64)
        self._scratch = np.empty(_CHUNK, dtype=np.uint64)

    def digest(self, stored: Sequence[np.ndarray[Any, Any]]) -> int:
        digest = 0
        for x, weights, spec in zip(stored, self._weights, self.model.inputs, strict=True):
            if x.shape != spec.shape:
                raise ValueError(f"input {spec.name!r}: shape {x.shape}, expected {spec.shape}")
            terms = _bits(x).astype(np.uint64)
            np.multiply(terms, weights, out=terms)
            total = int(terms.sum(dtype=np.uint64))  # wraps: the sum is mod 2**64
            digest = _finalize_int((digest + total + _G) & _MASK)
        return digest

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
        self._mix = _Mix(model) if model.op in ("mix", "detect") else None

    def __call__(self) -> None:
        if self.model.op == "detect" and self._mix is not None:
            # sparse: the heads' background bytes, then the object cells (_detector)
            from ._detector import logical_picture, write_heads

            stored = [source.read(dequantize=False) for source in self._sources]
            digest = self._mix.digest(stored)
            picture = logical_picture(stored[0]) if stored else None
            raws = [target.raw for target in self._targets]
            write_heads(raws, self.model.outputs, digest, picture)
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
