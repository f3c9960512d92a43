"""The emulator loadable's operations, computed exactly as the format defines them.

Used by the emulated runtime; the GPU stand-in implements the same arithmetic in CUDA
and the shared test vectors hold both to the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._tensors import TensorSpec
from ._format import EmulatorModel

__all__ = ["ModelRunner", "compute_logical", "run_model", "to_storage"]


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
    """Output ``index`` in binary64 from the stored values of input ``index``."""
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


def run_model(model: EmulatorModel, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
    """Run one task: read each input buffer, write each output buffer in its layout."""
    ModelRunner(model, inputs, outputs)()


class ModelRunner:
    """One task's buffers, bound once; calling it runs the model on them."""

    def __init__(self, model: EmulatorModel, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
        self.model = model
        self._pairs = [
            (_raw(source).bind(inputs[i], zero=False), _raw(target).bind(outputs[i], zero=False))
            for i, (source, target) in enumerate(zip(model.inputs, model.outputs, strict=True))
        ]
        # Device buffers are shared with copies on the stream, so a task writes every
        # byte of its outputs each time (padding as zeros), as the format says.
        self._padded = [not target.spec._is_dense() for _, target in self._pairs]

    def __call__(self) -> None:
        model = self.model
        for index, (source, target) in enumerate(self._pairs):
            stored = source.read(dequantize=False)
            result = compute_logical(model, index, stored)
            if self._padded[index]:
                target.raw[:] = 0
            target.write(to_storage(result, target.spec.numpy_dtype))


def _raw(spec: TensorSpec) -> TensorSpec:
    # Results are already stored values: packing must not quantize them again.
    return spec if spec.scale is None else spec.with_scale(None)
