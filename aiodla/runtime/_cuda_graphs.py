"""CUDA graphs for the CUDA runtime: a slot's stream work captured once, launched whole.

A request's copies in, conversion kernels, copies out and completion event are the same
calls on the same buffers for every request of a kind on a slot; launching them as one
captured graph costs the host one call instead of four to six (each a binding call, a
driver entry and its Python around it). The engine decides what to capture
(``aiodla._graphs``); this mixin is the capture itself: ``cudaStreamBeginCapture`` in
thread-local mode (the poller's queries on other threads go on meanwhile), the stream's
calls, ``cudaStreamEndCapture`` and ``cudaGraphInstantiate``.

An event recorded while capturing becomes an external record node
(``cudaEventRecordWithFlags(..., cudaEventRecordExternal)``): the graph records it each
time it runs, so the poller's query sees it. The transfer counts a capture made (its
calls ran nothing) are taken back and added again at each launch, so the counts say what
the device did.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import _cuda
from ._gil_held import EntryPoints
from ._protocol import TransferCounts

__all__ = ["CudaGraph", "CudaGraphs"]

_COUNTS = tuple(field.name for field in dataclasses.fields(TransferCounts))


def _cudart() -> Any:
    """The bindings ``_cuda`` calls (which the GPU tests' host fake replaces there)."""
    return vars(_cuda)["_rt"]


class CudaGraph:
    """An instantiated graph and the transfers each launch makes."""

    __slots__ = ("address", "counts", "executable")

    def __init__(
        self, executable: Any, counts: tuple[tuple[str, int], ...], address: int = 0
    ) -> None:
        self.executable = executable
        self.counts = counts
        self.address = address  # the driver's CUgraphExec, for a launch keeping the GIL


class CudaGraphs:
    """Mixed into :class:`~aiodla.runtime.CudaRuntime`."""

    counts: TransferCounts
    _held: EntryPoints
    # The streams this runtime captures now, each with the counts when capture began.
    _capturing: dict[int, TransferCounts]

    def begin_capture(self, stream: int) -> None:
        rt = _cudart()
        mode = rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        _cuda.check_cuda("cudaStreamBeginCapture", rt.cudaStreamBeginCapture(stream, mode))
        self._capturing[stream] = dataclasses.replace(self.counts)

    def end_capture(self, stream: int) -> CudaGraph:
        rt = _cudart()
        before = self._capturing.pop(stream, None)
        # The counts go back first: whether the capture ends well or not, nothing ran.
        counts = self.counts
        made: tuple[tuple[str, int], ...] = ()
        if before is not None:
            made = tuple(
                (name, getattr(counts, name) - getattr(before, name))
                for name in _COUNTS
                if getattr(counts, name) != getattr(before, name)
            )
            for name, _ in made:
                setattr(counts, name, getattr(before, name))
        graph = _cuda.check_cuda("cudaStreamEndCapture", rt.cudaStreamEndCapture(stream))
        try:
            executable = _cuda.check_cuda("cudaGraphInstantiate", rt.cudaGraphInstantiate(graph, 0))
        finally:
            _cuda.check_cuda("cudaGraphDestroy", rt.cudaGraphDestroy(graph))
        return CudaGraph(executable, made, int(executable) if self._held.graph_launch else 0)

    def launch_graph(self, graph: CudaGraph, stream: int) -> None:
        held = self._held.graph_launch
        # A launch that fails through the driver is made again through the bindings,
        # which name the error (it enqueued nothing, so nothing runs twice).
        if held is None or held(graph.address, stream) != 0:
            (error,) = _cudart().cudaGraphLaunch(graph.executable, stream)
            if error != 0:
                raise _cuda.cuda_error("cudaGraphLaunch", error)
        self.count_launch(graph)

    def count_launch(self, graph: CudaGraph) -> None:
        """Add one launch's transfers to the counts."""
        counts = self.counts
        for name, made in graph.counts:  # (per request: the fields a launch changes)
            setattr(counts, name, getattr(counts, name) + made)

    def destroy_graph(self, graph: CudaGraph) -> None:
        _cuda.check_cuda("cudaGraphExecDestroy", _cudart().cudaGraphExecDestroy(graph.executable))

    def _record_captured(self, event: int, stream: int) -> bool:
        """Record ``event`` as a node of the graph ``stream`` captures, if it captures."""
        if stream not in self._capturing:
            return False
        rt = _cudart()
        _cuda.check_cuda(
            "cudaEventRecordWithFlags",
            rt.cudaEventRecordWithFlags(event, stream, rt.cudaEventRecordExternal),
        )
        return True
