"""The shape of the ``detect`` op's outputs, which the loadable format checks and the
op's arithmetic (``_detector``) produces: detector heads of three anchors each."""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import ModelError
from .._tensors import TensorSpec

__all__ = ["ANCHORS", "check_detect_outputs"]

ANCHORS = 3


def check_detect_outputs(outputs: Sequence[TensorSpec]) -> None:
    """ModelError unless every output is a batch-1 float head of 3 x (5 + k) channels."""
    for spec in outputs:
        n, c, _, _ = spec.shape
        if spec.numpy_dtype.kind != "f" or n != 1 or c % ANCHORS or c // ANCHORS < 6:
            raise ModelError(
                f"op 'detect': output {spec.name!r} must be a float16/float32 head of shape "
                f"(1, 3*(5+k), H, W) with k >= 1 classes, got {spec.dtype} {spec.shape}"
            )
