"""A host-only stand-in for the parts of ``cuda.bindings.runtime`` that aiodla uses.

For dry runs of tests/gpu on machines without a GPU (``AIODLA_GPU_TESTS=host-fake``):
paired with the host-fake build of the cuDLA stand-in, which runs each task on the
submitting thread, every call completes before it returns, so streams are plain
numbers, events are always complete, and copies are ``memmove``. Results have the
shapes of the real bindings' results: ``(cudaError_t,)`` or ``(cudaError_t, value)``.

A task failed with ``fail_next_task(..., on_stream=True)`` loses the fake's CUDA
context, as the real stand-in's trapping kernel loses a real one: from then on every
call that reaches the context returns the stand-in's sticky error
(``aiodlaStandinContextError``, cudaErrorLaunchFailure) and does nothing, so such tests
run in a child process here too.

It proves the test and runtime *logic* (handle flow, bytes, error mapping); anything
about concurrency, timing or the GPU itself needs the real run.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any

from cuda.bindings import runtime as _real

from aiodla.emulator._standin import StandinControls

cudaError_t = _real.cudaError_t
cudaMemcpyKind = _real.cudaMemcpyKind
cudaDeviceAttr = _real.cudaDeviceAttr
cudaStreamNonBlocking = _real.cudaStreamNonBlocking
cudaEventDisableTiming = _real.cudaEventDisableTiming
cudaEventDefault = _real.cudaEventDefault
cudaEventBlockingSync = _real.cudaEventBlockingSync
cudaHostAllocPortable = _real.cudaHostAllocPortable
cudaHostAllocDefault = _real.cudaHostAllocDefault

_OK = cudaError_t.cudaSuccess
_INVALID_VALUE = cudaError_t.cudaErrorInvalidValue
_INVALID_DEVICE = cudaError_t.cudaErrorInvalidDevice
_INVALID_HANDLE = cudaError_t.cudaErrorInvalidResourceHandle
_NO_MEMORY = cudaError_t.cudaErrorMemoryAllocation

_MAX_FAKE_ALLOCATION = 1 << 32


def _in_context(*, returns_value: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A call that reaches the CUDA context: once the context is lost it returns the
    sticky error (with a zero value where the call returns one), as real CUDA does."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(self: HostFakeRuntime, *args: Any) -> Any:
            lost = self._controls.context_error
            if lost:
                error = cudaError_t(lost)
                return (error, 0) if returns_value else (error,)
            return method(self, *args)

        return call

    return wrap


class HostFakeRuntime:
    """Module-like object: assign it to ``aiodla.runtime._cuda._rt``."""

    cudaError_t = cudaError_t
    cudaMemcpyKind = cudaMemcpyKind
    cudaDeviceAttr = cudaDeviceAttr
    cudaStreamNonBlocking = cudaStreamNonBlocking
    cudaEventDisableTiming = cudaEventDisableTiming
    cudaEventDefault = cudaEventDefault
    cudaEventBlockingSync = cudaEventBlockingSync
    cudaHostAllocPortable = cudaHostAllocPortable
    cudaHostAllocDefault = cudaHostAllocDefault
    cudaStreamCaptureMode = _real.cudaStreamCaptureMode

    def __init__(self, controls: StandinControls) -> None:
        self._controls = controls
        self._ids = itertools.count(0x5000)
        self._lock = threading.Lock()
        self.streams: set[int] = set()
        self.events: set[int] = set()
        self.timing_events: set[int] = set()
        self.device_memory: set[int] = set()
        self.host_memory: dict[int, Any] = {}

    def _new(self, table: set[int]) -> int:
        with self._lock:
            handle = next(self._ids)
            table.add(handle)
            return handle

    @staticmethod
    def _drop(table: set[int], handle: int) -> tuple[Any]:
        if handle not in table:
            return (_INVALID_HANDLE,)
        table.discard(handle)
        return (_OK,)

    # -- devices ---------------------------------------------------------------------

    def cudaGetDeviceCount(self) -> tuple[Any, int]:
        return (_OK, 1)

    @_in_context(returns_value=False)
    def cudaSetDevice(self, device: int) -> tuple[Any]:
        return (_OK,) if device == 0 else (_INVALID_DEVICE,)

    @_in_context(returns_value=False)
    def cudaDeviceSynchronize(self) -> tuple[Any]:
        return (_OK,)

    @_in_context(returns_value=True)
    def cudaDeviceGetAttribute(self, attribute: Any, device: int) -> tuple[Any, int]:
        return (_OK, 0)

    # -- streams and events ----------------------------------------------------------

    @_in_context(returns_value=True)
    def cudaStreamCreateWithFlags(self, flags: int) -> tuple[Any, int]:
        return (_OK, self._new(self.streams))

    @_in_context(returns_value=False)
    def cudaStreamDestroy(self, stream: int) -> tuple[Any]:
        return self._drop(self.streams, int(stream))

    def cudaStreamBeginCapture(self, stream: int, mode: Any) -> tuple[Any]:
        # Every call here runs as it is made: nothing could be recorded. The engine
        # then enqueues each call, as with a driver that cannot capture.
        return (cudaError_t.cudaErrorStreamCaptureUnsupported,)

    @_in_context(returns_value=False)
    def cudaStreamSynchronize(self, stream: int) -> tuple[Any]:
        return (_OK,) if int(stream) in self.streams or int(stream) == 0 else (_INVALID_HANDLE,)

    @_in_context(returns_value=True)
    def cudaEventCreateWithFlags(self, flags: int) -> tuple[Any, int]:
        event = self._new(self.events)
        if flags == cudaEventDefault:
            self.timing_events.add(event)
        return (_OK, event)

    @_in_context(returns_value=True)
    def cudaEventElapsedTime(self, start: int, end: int) -> tuple[Any, float]:
        # Host-fake tasks run on the submitting thread: no device time to measure.
        if not {int(start), int(end)} <= self.timing_events:
            return (_INVALID_HANDLE, 0.0)
        return (_OK, 0.0)

    @_in_context(returns_value=False)
    def cudaEventDestroy(self, event: int) -> tuple[Any]:
        return self._drop(self.events, int(event))

    @_in_context(returns_value=False)
    def cudaEventRecord(self, event: int, stream: int) -> tuple[Any]:
        return (_OK,) if int(event) in self.events else (_INVALID_HANDLE,)

    @_in_context(returns_value=False)
    def cudaEventQuery(self, event: int) -> tuple[Any]:
        return (_OK,) if int(event) in self.events else (_INVALID_HANDLE,)

    @_in_context(returns_value=False)
    def cudaEventSynchronize(self, event: int) -> tuple[Any]:
        return self.cudaEventQuery(event)

    # -- memory ----------------------------------------------------------------------

    @_in_context(returns_value=True)
    def cudaMalloc(self, nbytes: int) -> tuple[Any, int]:
        if nbytes <= 0:
            return (_OK, 0)
        if nbytes > _MAX_FAKE_ALLOCATION:
            return (_NO_MEMORY, 0)
        pointer = self._controls.fake_alloc(nbytes)
        with self._lock:
            self.device_memory.add(pointer)
        return (_OK, pointer)

    @_in_context(returns_value=False)
    def cudaFree(self, pointer: int) -> tuple[Any]:
        with self._lock:
            if pointer not in self.device_memory:
                return (_INVALID_VALUE,)
            self.device_memory.discard(pointer)
        self._controls.fake_free(pointer)
        return (_OK,)

    @_in_context(returns_value=True)
    def cudaHostAlloc(self, nbytes: int, flags: int) -> tuple[Any, int]:
        storage = (ctypes.c_ubyte * (nbytes + 64))()
        pointer = ctypes.addressof(storage)
        pointer += -pointer % 64
        with self._lock:
            self.host_memory[pointer] = storage
        return (_OK, pointer)

    @_in_context(returns_value=False)
    def cudaFreeHost(self, pointer: int) -> tuple[Any]:
        with self._lock:
            if self.host_memory.pop(pointer, None) is None:
                return (_INVALID_VALUE,)
        return (_OK,)

    @_in_context(returns_value=False)
    def cudaMemcpyAsync(
        self, dst: int, src: int, nbytes: int, kind: Any, stream: int
    ) -> tuple[Any]:
        ctypes.memmove(dst, src, nbytes)
        return (_OK,)

    def live(self) -> dict[str, int]:
        return {
            "streams": len(self.streams),
            "events": len(self.events),
            "device_memory": len(self.device_memory),
            "host_memory": len(self.host_memory),
        }
