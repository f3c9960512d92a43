"""The calls of a request's hot path, made without releasing the GIL.

``cuda.bindings`` releases the GIL around every call. For a call of a few microseconds
that release is what costs: while the loop thread is in ``cudaGraphLaunch`` the poller
thread takes the GIL, and the loop waits to get it back, a thread hand-off each time
(keeping the GIL took the host's CPU per request at zero service from 59.7 to 39.0 us
on the H200 stand-in; see the README's performance section). The calls a request
makes on the loop thread (its two graph launches and ``cudlaSubmitTask``) and on the
poller's (an event query and ``cudlaGetLastError``) are short and never wait for the
device, so they are made here through ``ctypes`` prototypes that keep the GIL
(``PYFUNCTYPE``), on the entry points the bindings use, found through public interfaces
only: cuDLA's in the library that ``cuda.pathfinder`` located for the bindings (its
lookup is cached, so it answers the library they bound to), and the driver's
``cuGraphLaunch`` and ``cuEventQuery`` through the driver's ``cuGetProcAddress`` (a
runtime graph, stream or event *is* the driver's handle).

The caller keeps the rest of the runtime's form for failures: a cuDLA status raises what
the bindings raise; a driver call that fails is made again through the bindings, which
name the error as every other call does (a call that failed enqueued nothing, so nothing
runs twice, and a sticky error fails again).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import NamedTuple

from .._entry_points import cudla_entry, cudla_library, driver_entry, loaded

__all__ = [
    "SUBMIT",
    "EntryPoints",
    "cudla_entry",
    "cudla_library",
    "driver_entry",
    "entry_points",
    "loaded",
]

# (device, tasks, number of tasks, stream, flags) -> cudlaStatus
SubmitTask = Callable[[int, int, int, int, int], int]
# (device) -> cudlaStatus; (graph_exec, stream) -> CUresult; (event) -> CUresult
LastError = Callable[[int], int]
GraphLaunch = Callable[[int, int], int]
EventQuery = Callable[[int], int]


class EntryPoints(NamedTuple):
    """The calls found, each None where not."""

    submit_task: SubmitTask | None = None
    last_error: LastError | None = None
    graph_launch: GraphLaunch | None = None
    event_query: EventQuery | None = None


_u32, _pointer = ctypes.c_uint32, ctypes.c_void_p
SUBMIT = ctypes.PYFUNCTYPE(ctypes.c_int, _pointer, _pointer, _u32, _pointer, _u32)
_LAST_ERROR = ctypes.PYFUNCTYPE(ctypes.c_int, _pointer)
_LAUNCH = ctypes.PYFUNCTYPE(ctypes.c_int, _pointer, _pointer)
_QUERY = ctypes.PYFUNCTYPE(ctypes.c_int, _pointer)


def entry_points(*, driver: bool) -> EntryPoints:
    """cuDLA's ``cudlaSubmitTask`` and ``cudlaGetLastError`` as ``cuda.bindings.cudla``
    calls them (ask once the bindings have made a cuDLA call), and with ``driver`` the
    driver's ``cuGraphLaunch`` and ``cuEventQuery`` (only where the process has already
    loaded the driver): each keeping the GIL."""
    launch = query = None
    if driver and loaded("libcuda.so.1") is not None:
        launch = driver_entry("cuGraphLaunch", _LAUNCH)
        query = driver_entry("cuEventQuery", _QUERY)
    return EntryPoints(
        cudla_entry("cudlaSubmitTask", SUBMIT),
        cudla_entry("cudlaGetLastError", _LAST_ERROR),
        launch,
        query,
    )
