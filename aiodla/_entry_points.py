"""Where ``cuda.bindings`` finds the C entry points of cuDLA and the CUDA driver, found
through public interfaces only: cuDLA's in the process's global scope, then in the
library that ``cuda.pathfinder`` located for the bindings (its lookup is cached, so it
answers the library they bound to); the driver's through ``cuGetProcAddress``.

The CUDA runtime makes some calls through them directly, keeping the GIL, and the GPU
stand-in checks that the bindings will find its own: both must look where the bindings
look, so this sits below the runtimes and the emulator. Nothing here loads a library.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

__all__ = ["cudla_entry", "cudla_library", "driver_entry", "loaded"]

_NOLOAD = getattr(os, "RTLD_NOLOAD", 4)
_CUDLA = "libcudla.so.1"
# The driver API version whose ABI the callers' prototypes declare (cuGetProcAddress
# answers the entry point of that version, whatever newer ones the driver has).
_DRIVER_API = 12000


def cudla_entry(name: str, prototype: Any) -> Any:
    """cuDLA's ``name`` where the bindings find it, or None: like them, in the process's
    global scope first (a library loaded with ``RTLD_GLOBAL``), then in the library
    that ``cuda.pathfinder`` located."""
    for library in (_global_scope(), cudla_library()):
        if library is not None and (entry := _symbol(library, name, prototype)) is not None:
            return entry
    return None


def _global_scope() -> ctypes.PyDLL | None:
    try:
        return ctypes.PyDLL(None)
    except (OSError, TypeError):  # a platform without a handle for the global scope
        return None


def cudla_library() -> ctypes.PyDLL | None:
    """The ``libcudla`` that ``cuda.pathfinder`` located for the bindings, if this process
    has it loaded (never loads one: the bindings decide which library that is)."""
    if loaded(_CUDLA) is None:
        return None
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        path = load_nvidia_dynamic_lib("cudla").abs_path
    except Exception:  # pathfinder without an answer: the library by its name
        path = None
    return loaded(path or _CUDLA)


def driver_entry(name: str, prototype: Any) -> Any:
    """The driver's ``name`` through ``cuGetProcAddress``, or None."""
    try:
        from cuda.bindings import driver

        flags = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM
        found = driver.cuGetProcAddress(name.encode(), _DRIVER_API, flags)
    except Exception:  # no driver to ask: the call stays with the bindings
        return None
    error, address = found[0], int(found[1] or 0)
    if error != driver.CUresult.CUDA_SUCCESS or not address:
        return None
    return prototype(address)


def _symbol(library: ctypes.PyDLL, name: str, prototype: Any) -> Any:
    return prototype((name, library)) if hasattr(library, name) else None


def loaded(soname: str) -> ctypes.PyDLL | None:
    """The library already in this process under ``soname`` or at that path (never
    loads one)."""
    try:
        return ctypes.PyDLL(soname, mode=_NOLOAD)
    except OSError:
        return None
