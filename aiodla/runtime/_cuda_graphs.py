"""CUDA graphs for the CUDA runtime: a slot's stream work captured once, launched whole.

A request's copies in, conversion kernels, copies out and completion event are the same
calls on the same buffers for every request of a kind on a slot; launching them as one
captured graph costs the host one call instead of four to six (each a binding call, a
driver entry and its Python around it). The engine decides what to capture
(``aiodla._graphs``); :class:`CudaGraphs`, the CUDA runtime's collaborator, is the
capture itself: ``cudaStreamBeginCapture`` in thread-local mode (the poller's queries on
other threads go on meanwhile), the stream's calls, ``cudaStreamEndCapture`` and
``cudaGraphInstantiate``.

An event recorded while capturing becomes an external record node
(``cudaEventRecordWithFlags(..., cudaEventRecordExternal)``): the graph records it each
time it runs, so the poller's query sees it. The transfer counts a capture made (its
calls ran nothing) are taken back and added again at each launch, so the counts say what
the device did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ._cuda_errors import check_cuda, cuda_error
from ._gil_held import EntryPoints
from ._protocol import TransferCounts

__all__ = ["CudaGraph", "CudaGraphs"]

_COUNTS = tuple(field.name for field in dataclasses.fields(TransferCounts))


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
    """The graphs of one :class:`~aiodla.runtime.CudaRuntime`: its transfer ``counts``,
    its entry points that keep the GIL (``held``, set again when it finds them) and the
    bindings it calls (``cudart``, looked up at each call: tests replace them)."""

    def __init__(
        self, counts: TransferCounts, held: EntryPoints, cudart: Callable[[], Any]
    ) -> None:
        self.counts = counts
        self.held = held
        self._cudart = cudart
        # The streams captured now, each with the counts when capture began.
        self.capturing: dict[int, TransferCounts] = {}

    def begin_capture(self, stream: int) -> None:
        rt = self._cudart()
        mode = rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        check_cuda("cudaStreamBeginCapture", rt.cudaStreamBeginCapture(stream, mode))
        self.capturing[stream] = dataclasses.replace(self.counts)

    def end_capture(self, stream: int) -> CudaGraph:
        rt = self._cudart()
        before = self.capturing.pop(stream, None)
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
        graph = check_cuda("cudaStreamEndCapture", rt.cudaStreamEndCapture(stream))
        try:
            executable = check_cuda("cudaGraphInstantiate", rt.cudaGraphInstantiate(graph, 0))
        finally:
            check_cuda("cudaGraphDestroy", rt.cudaGraphDestroy(graph))
        return CudaGraph(executable, made, int(executable) if self.held.graph_launch else 0)

    def launch_graph(self, graph: CudaGraph, stream: int) -> None:
        held = self.held.graph_launch
        # A launch that fails through the driver is made again through the bindings,
        # which name the error (it enqueued nothing, so nothing runs twice).
        if held is None or held(graph.address, stream) != 0:
            (error,) = self._cudart().cudaGraphLaunch(graph.executable, stream)
            if error != 0:
                raise cuda_error("cudaGraphLaunch", error)
        self.count_launch(graph)

    def count_launch(self, graph: CudaGraph) -> None:
        """Add one launch's transfers to the counts."""
        counts = self.counts
        for name, made in graph.counts:  # (per request: the fields a launch changes)
            setattr(counts, name, getattr(counts, name) + made)

    def destroy_graph(self, graph: CudaGraph) -> None:
        check_cuda("cudaGraphExecDestroy", self._cudart().cudaGraphExecDestroy(graph.executable))

    def record_captured(self, event: int, stream: int) -> bool:
        """Record ``event`` as a node of the graph ``stream`` captures, if it captures."""
        if stream not in self.capturing:
            return False
        rt = self._cudart()
        check_cuda(
            "cudaEventRecordWithFlags",
            rt.cudaEventRecordWithFlags(event, stream, rt.cudaEventRecordExternal),
        )
        return True
