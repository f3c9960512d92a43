"""A request's own coroutine: awaiting its outcome, and the steps it takes in a worker
thread for large tensors.

Packing an input or unpacking an output that moves more than ``offload_bytes`` on the
host (a camera frame's copy and pre-processing included; a device array, a frame read in
place from a frame buffer, or detections decoded on the stream move next to nothing)
would hold the event loop for milliseconds: the flow hands the request
back to its coroutine instead (``PACKING`` before its submission, ``UNPACKING`` after its
completion), which does the step in a worker thread and then gives the request back to
the flow. An outcome the flow decided meanwhile (a timeout, a closed engine) waits in
``request.late`` until the step is over, since the step still holds the slot.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio

from ._errors import AiodlaError, PostprocessError
from ._flow import Flow
from ._life import EngineState
from ._scheduler import Request, RequestState

__all__ = ["drive"]


async def drive(flow: Flow, request: Request) -> Any:
    """Await the request's outcome, doing the steps the loop hands back to it."""
    try:
        value = await request.future
        while request.state is not RequestState.DONE:
            if request.state is RequestState.PACKING:
                value = await pack(flow, request)
            else:
                value = await unpack(flow, request)
        if request.late is not None:
            return flow.take_late(request)
        return value
    except asyncio.CancelledError:
        flow.abandon(request)
        raise
    finally:
        if request.timer is not None:
            request.timer.cancel()


async def pack(flow: Flow, request: Request) -> Any:
    """Pack ``request``'s inputs off the loop, then submit it and await its outcome."""
    slot = request.slot
    assert slot is not None  # (PACKING: the request holds its slot)
    try:
        await anyio.to_thread.run_sync(flow.device.write_inputs, slot, request.arrays)
    except Exception as exc:
        if request.state is RequestState.DONE:
            return flow.take_late(request)
        flow.release(slot)
        error = flow.finish(request, error=AiodlaError(f"packing the input failed: {exc}"))
        flow.transition()
        raise _ended(error) from exc
    if request.state is RequestState.DONE:
        return flow.take_late(request)
    loop = flow.loop
    serving = flow.life.state is EngineState.OPEN
    if not serving or (request.deadline is not None and loop.time() >= request.deadline):
        flow.release(slot)
        if serving:
            error = flow.finish(request, timed_out=True)
        else:
            error = flow.finish(request, error=flow.life.not_serving_error())
        flow.transition()
        raise _ended(error)
    request.future = loop.create_future()
    flow.submit(slot, request)
    return await request.future


async def unpack(flow: Flow, request: Request) -> Any:
    """Unpack ``request``'s outputs off the loop, then end it with them."""
    slot = request.slot
    assert slot is not None  # (UNPACKING: the request holds its slot)
    try:
        result = await anyio.to_thread.run_sync(flow.read_results, slot)
    except Exception as exc:  # this request's outputs only: it fails alone
        if request.state is RequestState.DONE:
            return flow.take_late(request)
        flow.release(slot)
        if isinstance(exc, PostprocessError):
            error: BaseException = exc
        else:  # (a bug, kept to this request: the slot still comes back)
            error = AiodlaError(f"reading the outputs failed: {exc}")
        flow.finish(request, error=error)
        flow.transition()
        if error is exc:
            raise
        raise error from exc
    if request.state is RequestState.DONE:
        return flow.take_late(request)
    flow.release(slot)
    flow.finish(request, result=result)
    flow.transition()
    return result


def _ended(error: BaseException | None) -> BaseException:
    """The error that ended a request its coroutine held (never None: nothing else
    could end it while the step ran, as the DONE checks above show)."""
    assert error is not None
    return error
