"""A request's own coroutine, which awaits its one outcome, and the steps the flow runs
in a worker thread for large tensors.

Packing an input or unpacking an output that moves more than ``offload_bytes`` on the
host (a camera frame's copy and pre-processing included; a device array, a frame read in
place from a frame buffer, or detections decoded on the stream move next to nothing)
would hold the event loop for milliseconds: the flow runs that step as a task of its own
instead (``PACKING`` before the submission, ``UNPACKING`` after the completion), which
does the work in a worker thread and ends with the step's outcome: the request
submitted, or ended (with its result, or why not). The request's future is resolved
once, with that outcome, whoever decides it: an outcome decided while the step ran (a
closed engine, a cancelled caller) is delivered at once, and the step, which still
holds the slot, gives it back when its thread is done.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import anyio

from ._errors import AiodlaError, PostprocessError
from ._life import EngineState, Life
from ._scheduler import Request, RequestState

__all__ = ["drive", "pack", "unpack"]


class Stepper(Protocol):
    """What a step asks of the flow that runs it."""

    life: Life
    loop: asyncio.AbstractEventLoop
    device: Any  # its DeviceLayer

    def read_results(self, slot: Any) -> Any: ...
    def give_back(self, request: Request) -> None: ...
    def finish(
        self,
        request: Request,
        *,
        result: Any = None,
        error: BaseException | None = None,
        timed_out: bool = False,
    ) -> BaseException | None: ...
    def submit(self, slot: Any, request: Request | None) -> None: ...
    def abandon(self, request: Request) -> None: ...


async def drive(flow: Stepper, request: Request) -> Any:
    """Await the request's outcome; a cancellation of the caller is the request's."""
    try:
        return await request.future
    except asyncio.CancelledError:
        flow.abandon(request)
        raise
    finally:
        if request.timer is not None:
            request.timer.cancel()


async def pack(flow: Stepper, request: Request, slot: Any) -> None:
    """Pack ``request``'s inputs into ``slot`` off the loop, then submit it, unless it
    ended meanwhile, its deadline passed or the engine stopped serving."""
    try:
        await anyio.to_thread.run_sync(flow.device.write_inputs, slot, request.arrays)
    except BaseException as exc:  # (a cancel: its caller gave up; it waits for the thread)
        if isinstance(exc, Exception):
            flow.finish(request, error=AiodlaError(f"packing the input failed: {exc}"))
        flow.give_back(request)
        if not isinstance(exc, Exception):
            raise
        return
    if request.state is RequestState.DONE:  # ended while it packed: the slot comes back
        flow.give_back(request)
        return
    serving = flow.life.state is EngineState.OPEN
    if not serving or (request.deadline is not None and flow.loop.time() >= request.deadline):
        if serving:
            flow.finish(request, timed_out=True)
        else:
            flow.finish(request, error=flow.life.not_serving_error())
        flow.give_back(request)
        return
    flow.submit(slot, request)


async def unpack(flow: Stepper, request: Request, slot: Any) -> None:
    """Unpack ``request``'s outputs off the loop, then end it with them (a request that
    ended meanwhile keeps its outcome: the result is dropped)."""
    try:
        result = await anyio.to_thread.run_sync(flow.read_results, slot)
    except BaseException as exc:  # this request's outputs only: it fails alone
        if isinstance(exc, PostprocessError):
            flow.finish(request, error=exc)
        elif isinstance(exc, Exception):  # (a bug, kept to this request)
            flow.finish(request, error=AiodlaError(f"reading the outputs failed: {exc}"))
        flow.give_back(request)
        if not isinstance(exc, Exception):
            raise
        return
    flow.finish(request, result=result)
    flow.give_back(request)
