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

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._protocol import CudaCallError

if TYPE_CHECKING:
    from ._timeline import Timeline

__all__ = ["EmulatedGraphs"]

_INVALID_VALUE = 1
_INVALID_HANDLE = 400
_CAPTURE_ILLEGAL = 900  # cudaErrorStreamCaptureUnsupported: already capturing

_Call = tuple[Callable[..., None], int, tuple[Any, ...]]


class _Recording:
    __slots__ = ("calls", "thread")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.calls: list[_Call] = []


class EmulatedGraphs:
    """The emulated runtime's graphs: the recordings of capturing streams, and the
    graphs made of them. The runtime takes each call that enqueues stream work
    through :meth:`recorded`."""

    def __init__(self, timeline: Timeline) -> None:
        self._timeline = timeline
        # Replaced, not changed in place: the recording check reads it unlocked.
        self._recordings: dict[int, _Recording] = {}
        self.graphs: dict[int, tuple[_Call, ...]] = {}

    def recorded(self, method: Callable[..., None], position: int) -> Callable[..., None]:
        """``method``, which enqueues work on the stream passed at ``position``, made
        to be recorded instead while that stream captures (on the capturing thread)."""
        graphs = self

        def call(*args: Any) -> None:
            recordings = graphs._recordings
            if recordings:
                recording = recordings.get(args[position])
                if recording is not None and recording.thread == threading.get_ident():
                    recording.calls.append((method, position, args))
                    return
            method(*args)

        call.__name__ = call.__qualname__ = method.__name__
        call.__doc__ = method.__doc__
        return call

    def begin_capture(self, stream: int) -> None:
        timeline = self._timeline
        timeline.cuda("begin_capture")
        timeline.stream(stream, "begin_capture")
        with timeline.lock:
            if stream in self._recordings:
                raise CudaCallError("begin_capture", _CAPTURE_ILLEGAL)
            self._recordings = {**self._recordings, stream: _Recording()}

    def end_capture(self, stream: int) -> int:
        timeline = self._timeline
        with timeline.lock:
            recording = self._recordings.get(stream)
            if recording is None or recording.thread != threading.get_ident():
                raise CudaCallError("end_capture", _INVALID_VALUE)
            self._recordings = {s: r for s, r in self._recordings.items() if s != stream}
        timeline.cuda("end_capture")  # failing, it ends the capture all the same, as CUDA's
        with timeline.lock:
            handle = next(timeline.ids)
            self.graphs[handle] = tuple(recording.calls)
        return handle

    def launch_graph(self, graph: int, stream: int) -> None:
        timeline = self._timeline
        timeline.cuda("launch_graph")
        calls = self.graphs.get(graph)
        if calls is None:
            raise CudaCallError("launch_graph", _INVALID_HANDLE)
        timeline.stream(stream, "launch_graph")
        for method, position, args in calls:
            if args[position] != stream:
                args = (*args[:position], stream, *args[position + 1 :])
            method(*args)

    def destroy_graph(self, graph: int) -> None:
        timeline = self._timeline
        with timeline.lock:
            if self.graphs.pop(graph, None) is None:
                timeline.bad_release("destroy_graph")
        timeline.released("destroy_graph")
