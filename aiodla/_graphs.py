"""A slot's stream work captured once as a graph and launched whole for each request.

Around its DLA task, every request on a slot enqueues the same work on the same
buffers: the copies and conversion kernels in, then the conversions and copies out and
the completion event. Only what the caller passes changes it (an input's source dtype,
a camera frame's size; device arrays and device outputs change pointers). So the first
request of each kind on a slot captures that work, before and after the task, into two
graphs (CUDA graphs on the CUDA runtime), and every later one enqueues each graph with
one runtime call instead of four to six calls and the Python around them: at short
service times that host work per request is what limits the rate.

The DLA task is submitted between the two graphs, as before: cuDLA does not document
capturing its tasks into a graph. Work that is not the same each time (a device array's
pointer, pool memory for device outputs) and stage timing are enqueued call by call. A
slot keeps at most ``MAX_GRAPHS`` of each; past that, a new kind is enqueued call by
call. If capturing fails (a runtime that cannot capture, a driver that refuses a call in
a capture), the engine logs it once, stops capturing, and enqueues call by call from
then on; a call that fails for its own reason while it is recorded fails its request,
as it would have outside a capture.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._resources import ResourceStack
    from ._slots import Slot
    from .runtime._protocol import GraphCapture

__all__ = ["CAPTURE_REFUSED", "MAX_GRAPHS", "Graphs"]

logger = logging.getLogger("aiodla")

#: Graphs a slot keeps for its work before the task, and as many for after it.
MAX_GRAPHS = 8
#: cudaError_t values of a call that stream capture does not allow (cudaErrorStreamCapture
#: Unsupported ... WrongThread): the work runs call by call from then on.
CAPTURE_REFUSED = range(900, 909)


class Graphs:
    """Captures and launches the slots' graphs of one engine (loop thread, or the
    worker's submitting thread with ``isolation="process"``)."""

    def __init__(self, runtime: GraphCapture, resources: ResourceStack) -> None:
        self.runtime = runtime  # the device layer launches the graphs it holds through it
        self._resources = resources
        self.enabled = True  # until a capture fails
        self.captured = 0

    def enqueue_new(
        self,
        slot: Slot,
        table: dict[Hashable, Any],
        key: Hashable | None,
        work: Callable[..., None],
        *args: Any,
    ) -> None:
        """Enqueue ``work(*args)`` on the slot's stream for a kind ``table`` has no graph
        of yet (the caller launches the graph when it has one): capture it into a new
        graph kept under ``key`` and launch that, or make the calls themselves when the
        work cannot be captured (``key`` None: it changes with each request), the slot
        keeps enough graphs, or capturing failed."""
        graph = None
        if key is not None and self.enabled and len(table) < MAX_GRAPHS:
            graph = self._capture(slot, work, args)
        if graph is None:
            work(*args)
            return
        core = slot.core.core
        runtime = self.runtime
        self._resources.push(
            f"core {core} slot {slot.index}: graph", core, runtime.destroy_graph, graph
        )
        table[key] = graph
        self.captured += 1
        runtime.launch_graph(graph, slot.stream)

    def _capture(self, slot: Slot, work: Callable[..., None], args: tuple[Any, ...]) -> Any:
        """The graph of ``work(*args)`` on the slot's stream; None when capturing failed
        (from then on this engine enqueues call by call).

        A failure is handled by its text, after its ``except`` ended: what runs then
        (ending the capture, the log's handlers) cannot keep the exception being handled
        (``sys.exc_info()``) and, through its traceback, this request (see
        :func:`forget_frames`)."""
        runtime = self.runtime
        stream = slot.stream
        failure = None
        try:
            runtime.begin_capture(stream)
        except Exception as exc:
            failure = forget_frames(exc)
        if failure is not None:
            self._give_up(slot, failure)
            return None
        try:
            work(*args)
        except Exception as exc:
            # Nothing ran (the calls were being recorded). A call the capture refused
            # runs outside it; any other failure is the request's own.
            if getattr(exc, "code", None) not in CAPTURE_REFUSED:
                self._end_quietly(stream)
                raise
            failure = forget_frames(exc)
        if failure is not None:
            self._end_quietly(stream)
            self._give_up(slot, failure)
            return None
        try:
            return runtime.end_capture(stream)
        except Exception as exc:
            failure = forget_frames(exc)
        self._give_up(slot, failure)
        return None

    def _end_quietly(self, stream: int) -> None:
        """Stop capturing after a failure, whatever state the capture is in."""
        failure = None
        try:
            graph = self.runtime.end_capture(stream)
        except Exception as exc:  # an invalidated capture has no graph to destroy
            forget_frames(exc)
            return
        try:
            self.runtime.destroy_graph(graph)
        except Exception as exc:
            failure = forget_frames(exc)
        if failure is not None:
            logger.debug("aiodla: destroying a graph of a failed capture: %s", failure)

    def _give_up(self, slot: Slot, failure: str) -> None:
        self.enabled = False
        # By its text: a record keeps its arguments (see forget_frames for why).
        logger.warning(
            "aiodla: capturing %s's stream work failed (%s); enqueuing each call from now on",
            repr(slot),
            failure,
        )


def forget_frames(exc: BaseException) -> str:
    """The text of a capture's failure that the engine handled, with its traceback
    (and those of the failures it happened during) dropped. A traceback holds the
    frames from where it was caught down, and each frame its callers (the submission
    of a request: the request, and so its result, device memory on a GPU). The runtime
    or its bindings may keep the error they raised (a last error, an error made once
    and raised again): through its traceback the request would never be freed."""
    seen: set[int] = set()
    failure: BaseException | None = exc
    while failure is not None and id(failure) not in seen:
        seen.add(id(failure))
        failure.__traceback__ = None
        failure = failure.__cause__ or failure.__context__
    return str(exc)
