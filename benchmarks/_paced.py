"""A camera's pace for the stream benchmarks: frames taken on a 30 Hz clock, newest wins.

A stream takes a frame at each slot of its clock (its capture time is the slot, so a
decoder's own latency does not count, its throughput does) and starts its request
without awaiting the previous one's, up to ``PIPELINE`` in flight, as a camera app that
awaits each result in its own task does. A slot missed while the stream's coroutine was
late (the loop woke a whole interval late, or the source had no frame ready) is dropped
and counted as ``late``; a frame captured while ``PIPELINE`` are in flight is dropped
and counted as ``full``. What a stream delivered is its latencies from capture to result;
``waits`` are how long each ``take()`` took (a source with no frame ready makes its
stream late, as a late loop does), and ``woke`` how late the stream's coroutine woke for
each slot (the loop's share of its lateness: a whole interval drops a frame).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

FPS = 30
PIPELINE = 3  # frames in flight a stream, at most: a p99 target of three intervals


async def paced(
    take: Callable[[], Awaitable[Any]],
    infer: Callable[[Any], Awaitable[Any]],
    begin: float,
    end: float,
) -> dict[str, Any]:
    """One stream from ``begin`` to ``end`` (``time.perf_counter()``): each slot's
    frame from ``take()`` into ``infer(frame)``. Its latencies (seconds), and the frames
    dropped ``late`` and ``full``, how long each ``take()`` waited (``waits``) and how
    late the stream woke for each slot (``woke``, seconds)."""
    latencies: list[float] = []
    waits: list[float] = []
    woke: list[float] = []
    late_drops = full_drops = 0
    in_flight: set[asyncio.Future[None]] = set()

    async def one(frame: Any, due: float) -> None:
        await infer(frame)
        latencies.append(time.perf_counter() - due)

    slot = 0
    while (due := begin + slot / FPS) < end:
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        lateness = time.perf_counter() - due
        woke.append(lateness)
        late = int(lateness * FPS)  # whole slots missed
        if late:  # newest wins: the frames of the slots missed are dropped
            late_drops += late
            slot += late
            continue
        slot += 1
        if len(in_flight) >= PIPELINE:  # newest wins over a full pipeline
            full_drops += 1
            continue
        asked = time.perf_counter()
        frame = await take()
        waits.append(time.perf_counter() - asked)
        task = asyncio.ensure_future(one(frame, due))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    await asyncio.gather(*in_flight)
    return {
        "latencies": latencies,
        "late": late_drops,
        "full": full_drops,
        "waits": waits,
        "woke": woke,
    }


async def cores_busy(engine: Any, begin: float, end: float) -> list[float]:
    """Each of ``engine``'s cores' busy time from ``begin`` to ``end`` (the streams'
    window, ``time.perf_counter()``) over that window's length: aiodla's accounting,
    in which a task counts until its completion is seen."""
    await asyncio.sleep(max(0.0, begin - time.perf_counter()))
    before = [core.busy_time for core in engine.statistics().cores]
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    after = [core.busy_time for core in engine.statistics().cores]
    return [(b - a) / (end - begin) for a, b in zip(before, after, strict=True)]
