"""The element types the device conversion kernels read: one pack kernel per tensor
and source type, so a device array (or a host array staged as it is) must be one of
these, and castable to its tensor's type as the engine's casting rule allows."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._errors import InputTypeError

if TYPE_CHECKING:
    from ._tensors import TensorSpec

__all__ = ["SOURCE_DTYPES", "WIDEST", "accepted_dtypes", "device_dtype_check"]

#: Element types the conversion kernels read (one kernel per tensor and type).
SOURCE_DTYPES: tuple[np.dtype[Any], ...] = tuple(
    np.dtype(name)
    for name in (
        "float64",
        "float32",
        "float16",
        "int32",
        "uint32",
        "int16",
        "uint16",
        "int8",
        "uint8",
        "bool",
    )
)
WIDEST = max(dtype.itemsize for dtype in SOURCE_DTYPES)


def device_dtype_check(spec: TensorSpec) -> Callable[[np.dtype[Any]], None]:
    """What a device array's dtype must be for ``spec`` (its values are not looked at:
    that would need the GPU to finish first). Raises :class:`InputTypeError`."""

    def check(dtype: np.dtype[Any]) -> None:
        if dtype not in SOURCE_DTYPES:
            raise InputTypeError(
                f"input {spec.name!r}: a device array of {dtype} cannot be converted on the "
                f"GPU; pass one of {[str(d) for d in SOURCE_DTYPES]}"
            )
        target = spec.numpy_dtype
        if spec.is_integer:
            if dtype.kind == "f" and spec.scale is None:
                raise InputTypeError(
                    f"input {spec.name!r}: a {dtype} array for an {spec.dtype} tensor needs "
                    f"a quantization scale (Engine(..., scales={{{spec.name!r}: ...}}))"
                )
            if dtype.kind != "f" and not np.can_cast(dtype, target, "safe"):
                raise InputTypeError(
                    f"input {spec.name!r}: {dtype} cannot be cast safely to {spec.dtype}"
                )
        elif not np.can_cast(dtype, target, "same_kind"):
            raise InputTypeError(f"input {spec.name!r}: {dtype} cannot be cast to {spec.dtype}")

    return check


def accepted_dtypes(spec: TensorSpec) -> list[np.dtype[Any]]:
    """The source types a tensor's pack kernels are made for: those it can take."""
    check = device_dtype_check(spec)
    accepted = []
    for dtype in SOURCE_DTYPES:
        try:
            check(dtype)
        except InputTypeError:
            continue
        accepted.append(dtype)
    return accepted
