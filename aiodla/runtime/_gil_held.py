"""The calls of a request's hot path, made without releasing the GIL.

``cuda.bindings`` releases the GIL around every call. For a call of a few microseconds
that release is what costs: while the loop thread is in ``cudaGraphLaunch`` the poller
thread takes the GIL, and the loop waits to get it back, a thread hand-off each time
(about 10 us on the H200's host, against 2 to 6 us for the calls themselves; see the
README's performance section). The calls a request makes on the loop thread (its two
graph launches and ``cudlaSubmitTask``) and the poller's event query are short and never
wait for the device, so they are made here through ``ctypes`` prototypes that keep the
GIL (``PYFUNCTYPE``), on the entry points the bindings use: the ``cudlaSubmitTask`` they
resolved, and the driver's ``cuGraphLaunch`` and ``cuEventQuery`` (a
runtime graph, stream or event *is* the driver's handle).

The caller keeps the rest of the runtime's form for failures: a cuDLA status raises what
the bindings raise; a driver call that fails is made again through the bindings, which
name the error as every other call does (a call that failed enqueued nothing, so nothing
runs twice, and a sticky error fails again).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

__all__ = ["NONE", "EntryPoints", "entry_points"]

# (device, tasks, number of tasks, stream, flags) -> cudlaStatus
SubmitTask = Callable[[int, int, int, int, int], int]
# (graph_exec, stream) -> CUresult
GraphLaunch = Callable[[int, int], int]
# (event) -> CUresult
EventQuery = Callable[[int], int]
DriverCalls = tuple[GraphLaunch, EventQuery]
EntryPoints = tuple[SubmitTask | None, GraphLaunch | None, EventQuery | None]
NONE: EntryPoints = (None, None, None)

_NOLOAD = getattr(os, "RTLD_NOLOAD", 4)
_u32, _pointer = ctypes.c_uint32, ctypes.c_void_p
_SUBMIT = ctypes.PYFUNCTYPE(ctypes.c_int, _pointer, _pointer, _u32, _pointer, _u32)
_LAUNCH = ctypes.PYFUNCTYPE(ctypes.c_int, _pointer, _pointer)
_QUERY = ctypes.PYFUNCTYPE(ctypes.c_int, _pointer)


def _loaded(soname: str) -> ctypes.PyDLL | None:
    """The library already in this process under ``soname`` (never loads one)."""
    try:
        return ctypes.PyDLL(soname, mode=_NOLOAD)
    except OSError:
        return None


def submit_task() -> SubmitTask | None:
    """The ``cudlaSubmitTask`` that ``cuda.bindings.cudla`` calls (call it once the
    bindings have made a cuDLA call), or None."""
    try:
        from cuda.bindings._internal import cudla as bound

        address = int(bound._inspect_function_pointer("__cudlaSubmitTask"))
    except Exception:  # bindings without the inspection hook: the library by its name
        library = _loaded("libcudla.so.1")
        if library is None or not hasattr(library, "cudlaSubmitTask"):
            return None
        address = ctypes.cast(library.cudlaSubmitTask, ctypes.c_void_p).value or 0
    if not address:
        return None
    call: SubmitTask = _SUBMIT(address)
    return call


def driver_calls() -> DriverCalls | None:
    """The driver's ``cuGraphLaunch`` and ``cuEventQuery``, or None (no driver loaded)."""
    library = _loaded("libcuda.so.1")
    if library is None or not all(hasattr(library, n) for n in ("cuGraphLaunch", "cuEventQuery")):
        return None
    return _LAUNCH(("cuGraphLaunch", library)), _QUERY(("cuEventQuery", library))


def entry_points(*, driver: bool) -> EntryPoints:
    """``cudlaSubmitTask``, ``cuGraphLaunch`` and ``cuEventQuery`` keeping the GIL, each
    None where not found; the driver's two only when ``driver``."""
    calls = driver_calls() if driver else None
    return (submit_task(), *(calls or (None, None)))
