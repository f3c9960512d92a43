"""Graphs on the emulated runtime: a stream's work recorded once and made again.

The CUDA runtime captures a slot's copies, conversions and completion event into a
CUDA graph and enqueues the graph, one call, for each request (``_cuda_graphs``).
Here the calls made on a capturing stream, by the thread that began the capture, are
recorded instead of run, and a launch makes them again, in order, on the launch
stream. The engine drives both runtimes through the same calls, so CI covers when it
captures, which work it replays, and what it does when a capture fails.

As on CUDA, a recorded call is checked when it runs (at launch), not when it is
recorded: an injected failure of ``copy_to_device`` fails the launch.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from ._protocol import CudaCallError

if TYPE_CHECKING:
    from ._timeline import _Stream

__all__ = ["EmulatedGraphs", "records_stream_work"]

_INVALID_VALUE = 1
_INVALID_HANDLE = 400
_CAPTURE_ILLEGAL = 900  # cudaErrorStreamCaptureUnsupported: already capturing

_Call = tuple[Callable[..., None], int, tuple[Any, ...]]
_Class = TypeVar("_Class", bound=type)


class _Recording:
    __slots__ = ("calls", "thread")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.calls: list[_Call] = []


def records_stream_work(**stream_at: int) -> Callable[[_Class], _Class]:
    """Class decorator: each named method enqueues work on the stream passed at that
    position, and is recorded instead while that stream captures."""

    def decorate(cls: _Class) -> _Class:
        for name, position in stream_at.items():
            setattr(cls, name, _recorded(getattr(cls, name), position))
        return cls

    return decorate


def _recorded(method: Callable[..., None], position: int) -> Callable[..., None]:
    @functools.wraps(method)
    def call(self: EmulatedGraphs, *args: Any) -> None:
        recordings = self._recordings
        if recordings:
            recording = recordings.get(args[position])
            if recording is not None and recording.thread == threading.get_ident():
                recording.calls.append((method, position, args))
                return
        method(self, *args)

    return call


class EmulatedGraphs:
    """Mixed into :class:`~aiodla.runtime.EmulatedRuntime` (whose state it uses)."""

    _recordings: dict[int, _Recording]
    _graphs: dict[int, tuple[_Call, ...]]
    _ids: Iterator[int]
    _lock: threading.RLock

    if TYPE_CHECKING:  # provided by the runtime's other layers (declared for mypy only)

        def _cuda(self, call: str) -> None: ...
        def _stream(self, stream: int, call: str) -> _Stream: ...
        def _bad_release(self, call: str) -> None: ...
        def _released(self, call: str) -> None: ...

    def begin_capture(self, stream: int) -> None:
        self._cuda("begin_capture")
        self._stream(stream, "begin_capture")
        with self._lock:
            if stream in self._recordings:
                raise CudaCallError("begin_capture", _CAPTURE_ILLEGAL)
            # Copied, not changed in place: the recording check reads it unlocked.
            self._recordings = {**self._recordings, stream: _Recording()}

    def end_capture(self, stream: int) -> int:
        with self._lock:
            recording = self._recordings.get(stream)
            if recording is None or recording.thread != threading.get_ident():
                raise CudaCallError("end_capture", _INVALID_VALUE)
            self._recordings = {s: r for s, r in self._recordings.items() if s != stream}
        self._cuda("end_capture")  # failing, it ends the capture all the same, as CUDA's
        with self._lock:
            handle = next(self._ids)
            self._graphs[handle] = tuple(recording.calls)
        return handle

    def launch_graph(self, graph: int, stream: int) -> None:
        self._cuda("launch_graph")
        calls = self._graphs.get(graph)
        if calls is None:
            raise CudaCallError("launch_graph", _INVALID_HANDLE)
        self._stream(stream, "launch_graph")
        for method, position, args in calls:
            if args[position] != stream:
                args = (*args[:position], stream, *args[position + 1 :])
            method(self, *args)

    def destroy_graph(self, graph: int) -> None:
        with self._lock:
            if self._graphs.pop(graph, None) is None:
                self._bad_release("destroy_graph")
        self._released("destroy_graph")
