"""How the CUDA runtime names a failed ``cuda.bindings.runtime`` call: one unwrapper
of the bindings' ``(err, value)`` tuples that raises :class:`CudaCallError` with the
error's name (the CUDA runtime and its graphs share it)."""

from __future__ import annotations

from typing import Any

from ._protocol import CUDA_ERROR_NAMES, CudaCallError

__all__ = ["check_cuda", "cuda_error", "error_name"]

_SUCCESS = 0


def error_name(error: Any) -> str:
    name = getattr(error, "name", None)
    if isinstance(name, str) and name:
        return name
    return CUDA_ERROR_NAMES.get(int(error), f"cudaError {int(error)}")


def cuda_error(call: str, error: Any) -> CudaCallError:
    """The :class:`CudaCallError` for ``error`` (a ``cudaError_t`` or its int) in ``call``."""
    return CudaCallError(call, int(error), error_name(error))


def check_cuda(call: str, result: Any) -> Any:
    """Unwrap a ``cuda.bindings.runtime`` result: ``(err,)`` gives None, ``(err, value)``
    gives value, longer tuples the rest as a tuple; a failing ``err`` raises
    :class:`CudaCallError` naming ``call`` and the error."""
    error = result[0]
    if error != _SUCCESS:
        raise cuda_error(call, error)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return tuple(result[1:])
