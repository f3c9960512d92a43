"""The calls the submitter thread makes for a runtime, as C entry points.

The submitter thread (``aiodla._handoff``) makes a request's enqueue calls in C: launch
a graph, submit a cuDLA task, and, when a call failed, record the slot's event. For the
CUDA runtime over the real driver those are the driver's ``cuGraphLaunch`` and
``cuEventRecord`` and the ``cudlaSubmitTask`` that ``cuda.bindings`` resolved, and the
thread makes the engine's CUDA context its own with ``cuCtxSetCurrent``: no Python runs
per request. For any other runtime (the emulated one, a test's fake) they are ctypes
callbacks into the runtime's own methods: the same thread, queue and failure handling,
each call taking the GIL, so CI exercises what the GPU runs.

A call's failure is reported by number (the CUresult or cudlaStatus); ``failure`` turns
it into the exception the runtime's own call raises.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _gil_held
from ._protocol import CudaCallError

if TYPE_CHECKING:
    from ._cuda import CudaRuntime
    from ._protocol import Runtime

__all__ = [
    "CALL_BIND",
    "CALL_NAMES",
    "CALL_SUBMIT",
    "HandoffCalls",
    "driver_calls",
    "python_calls",
]

# Which call failed, as ``failure`` is told: binding the thread's context, or one of a
# slot's calls (submitter.c's CALL_* numbers).
CALL_BIND, CALL_LAUNCH_BEFORE, CALL_SUBMIT, CALL_LAUNCH_AFTER = 0, 1, 2, 3
CALL_NAMES = {
    CALL_BIND: "binding the thread's device",
    CALL_LAUNCH_BEFORE: "the graph before the task",
    CALL_SUBMIT: "cudlaSubmitTask",
    CALL_LAUNCH_AFTER: "the graph after the task",
}
# Where python_calls keeps a failure of the thread's bind (no stream has -1).
_BIND_KEY = -1

_u32, _u64 = ctypes.c_uint32, ctypes.c_uint64
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, _u64, _u64)
SUBMIT = ctypes.CFUNCTYPE(ctypes.c_int, _u64, _u64, _u32, _u64, _u32)
RECORD = ctypes.CFUNCTYPE(ctypes.c_int, _u64, _u64)
BIND = ctypes.CFUNCTYPE(ctypes.c_int, _u64)


class HandoffCalls(NamedTuple):
    """What the submitter thread calls, and how the engine speaks of it."""

    launch: int  # address: int (graph, stream)
    submit: int  # address: int (device, task, count, stream, flags)
    record: int  # address: int (event, stream)
    bind: int  # address: int (argument), run once on the thread; 0 for none
    bind_argument: int
    graph_handle: Callable[[Any], int]  # what ``launch`` takes for a runtime's graph
    task_handle: Callable[[Any], int]  # what ``submit`` takes for a runtime's task
    launched: Callable[[Any], None] | None  # bookkeeping of a launch made by the thread
    failure: Callable[[int, int, int], Exception]  # (CALL_*, status, stream) -> error
    keep: tuple[Any, ...] = ()  # the callbacks the addresses point into
    native: bool = False  # no Python runs per request


def python_calls(runtime: Runtime) -> HandoffCalls:
    """Callbacks into ``runtime``'s own methods: for a runtime without C entry points.

    Handles are the ids of the graphs and tasks handed over, each kept here while the
    calls last (a slot's graphs and task live as long as the engine). A failing call's
    exception is kept by stream (one slot's calls are in flight per stream at a time)
    until ``failure`` hands it to the engine.
    """
    objects: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def handle(thing: Any) -> int:
        objects[id(thing)] = thing
        return id(thing)

    def guarded(stream: int, call: Callable[[], None]) -> int:
        try:
            call()
        except BaseException as exc:  # a callback must not raise into C
            errors.setdefault(stream, exc)  # the first failure of the slot's calls
            return -1
        return 0

    def launch(graph: int, stream: int) -> int:
        return guarded(stream, lambda: runtime.launch_graph(objects[graph], stream))

    def submit(device: int, task: int, count: int, stream: int, flags: int) -> int:
        return guarded(stream, lambda: runtime.submit_task(device, objects[task], stream))

    def record(event: int, stream: int) -> int:
        return guarded(stream, lambda: runtime.record_event(event, stream))

    def bind(argument: int) -> int:
        return guarded(_BIND_KEY, runtime.make_current)

    def failure(call: int, code: int, stream: int) -> Exception:
        error = errors.pop(_BIND_KEY if call == CALL_BIND else stream, None)
        if isinstance(error, Exception):
            return error
        return CudaCallError(CALL_NAMES.get(call, f"call {call}"), code, detail=repr(error))

    keep = (LAUNCH(launch), SUBMIT(submit), RECORD(record), BIND(bind))
    launch_at, submit_at, record_at, bind_at = (_address(f) for f in keep)
    return HandoffCalls(
        launch_at, submit_at, record_at, bind_at, 0, handle, handle, None, failure, keep
    )


def _address(function: Any) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value or 0


def driver_calls(runtime: CudaRuntime) -> HandoffCalls | None:
    """The driver's and cuDLA's entry points for ``runtime``'s context (current on the
    calling thread), or None where one is missing."""
    driver = _gil_held.loaded("libcuda.so.1")
    submit = _gil_held.cudla_entry("cudlaSubmitTask", _gil_held.SUBMIT)
    names = ("cuGraphLaunch", "cuEventRecord", "cuCtxSetCurrent", "cuCtxGetCurrent")
    if driver is None or submit is None or not all(hasattr(driver, n) for n in names):
        return None
    context = ctypes.c_void_p()
    get_current = driver.cuCtxGetCurrent
    get_current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    if get_current(ctypes.byref(context)) != 0 or not context.value:
        return None

    return HandoffCalls(
        _address(driver.cuGraphLaunch),
        _address(submit),
        _address(driver.cuEventRecord),
        _address(driver.cuCtxSetCurrent),
        context.value,
        graph_handle=lambda graph: int(graph.executable),
        task_handle=lambda task: int(task.ptr),
        launched=runtime.count_launch,
        failure=_driver_failure,
        keep=(submit,),
        native=True,
    )


def _driver_failure(call: int, code: int, stream: int) -> Exception:
    """What the runtime's own call raises for ``code``: a cudlaStatus for the submit; a
    CUresult otherwise (the same numbers as the cudaError_t the engine reasons about)."""
    from ._cuda import cuda_error, cudla_failure

    if call == CALL_SUBMIT:
        error: Exception = cudla_failure("cudlaSubmitTask", code)
        return error
    return cuda_error("cuCtxSetCurrent" if call == CALL_BIND else "cuGraphLaunch", code)
