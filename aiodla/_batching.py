"""Batch assembly: single items from many callers, run as one task of a batch-N model.

A loadable built with batch N > 1 (its tensors' ``n``) runs N items per DLA task. With
``Engine(model, batch=aiodla.Batching(max_delay=0.002))`` a caller may pass one item
(the tensors' shapes with ``n = 1``): the :class:`Batcher` gathers waiting items and
sends them as one task when N are waiting, or when the first of them has waited
``max_delay`` seconds since it arrived (the rest of the batch is zeros): the timer for
that is armed early by the loop's own lateness (``_deadlines``), so the task goes by
then rather than a wake-up's lateness after. Each caller gets its own row of
the outputs (``n = 1`` again). An item's cancellation or timeout is its own: removed
while it waits; once its task runs, its row is computed and dropped, and the other
items of the task are not touched. A caller may still pass a whole batch (``n = N``),
which runs as one task of its own.

Only the event loop's thread touches this state.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import math
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from ._deadlines import DeadlineTimers
from ._errors import (
    ConfigurationError,
    EngineClosedError,
    InputError,
    RequestTimeoutError,
)
from ._statistics import BatchStatistics
from ._tensors import TensorSpec, inputs_in_order

__all__ = ["BatchStatistics", "Batcher", "Batching", "Item", "open_batcher"]


@dataclasses.dataclass(frozen=True)
class Batching:
    """``Engine(model, batch=Batching(max_delay=0.002))``: assemble single items into
    tasks of the model's batch N. ``max_delay``: seconds the first waiting item waits
    for others before its task goes with fewer than N (padded with zeros)."""

    max_delay: float = 0.002

    def __post_init__(self) -> None:
        delay = self.max_delay
        if (
            isinstance(delay, bool)
            or not isinstance(delay, (int, float))
            or not math.isfinite(delay)
            or delay < 0
        ):
            raise ConfigurationError(f"max_delay={delay!r} must be seconds >= 0")


class ItemState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


class Item:
    """One caller's item: its arrays (batch 1), its future, its timeout's timer."""

    __slots__ = ("arrays", "batcher", "future", "state", "timer")

    def __init__(self, batcher: Batcher, arrays: tuple[Any, ...], future: asyncio.Future[Any]):
        self.batcher = batcher
        self.arrays = arrays
        self.future = future
        self.state = ItemState.WAITING
        self.timer: asyncio.TimerHandle | None = None

    def on_done(self, task: asyncio.Task[Any]) -> None:
        """``infer_nowait``'s task was cancelled before it awaited the item: the same
        as a cancelled wait."""
        if task.cancelled():
            self.future.cancel()
            self.batcher.end(self, "cancelled")

    async def result(self) -> Any:
        """Await the item's row.

        Cancellation: a waiting item leaves its batch; a running one's row is dropped.
        """
        try:
            return await self.future
        except asyncio.CancelledError:
            self.batcher.end(self, "cancelled")
            raise
        finally:
            if self.timer is not None:
                self.timer.cancel()


class Batcher:
    """The items waiting for a task and the counts (see the module docstring).

    ``run`` runs a whole batch (the engine's own ``infer``). State: ``_waiting`` in
    arrival order (an item that ended while it waited stays until a flush skips it);
    ``_live``: how many of them have not ended; ``_timer``: the flush of the first
    waiting item at its ``max_delay`` (armed early by the loop's lateness: ``_timers``,
    made with the first item, on the loop); ``_tasks``: the tasks running now.
    """

    def __init__(
        self,
        batching: Batching,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        run: Callable[[Any], Awaitable[Any]],
        casting: Any,
    ) -> None:
        self.size = inputs[0].shape[0]
        self._delay = batching.max_delay
        self._inputs = inputs
        self._outputs = outputs
        self._items = tuple(
            dataclasses.replace(s, shape=(1, *s.shape[1:]), strides=None, nbytes=None)
            for s in inputs
        )
        self._names = frozenset(s.name for s in inputs)
        self._run = run
        self._casting = casting
        self._waiting: collections.deque[Item] = collections.deque()
        self._live = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timers: DeadlineTimers | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.counts: dict[str, int] = dict.fromkeys(
            ("items", "completed", "failed", "cancelled", "timed_out", "running", "tasks"), 0
        )
        self._sizes: collections.Counter[int] = collections.Counter()

    # -- admission ----------------------------------------------------------------------------

    def item(self, inputs: Any) -> tuple[Any, ...] | None:
        """The validated arrays of a single item, or None for a whole batch (which the
        engine runs as it is). A wrong shape is an :class:`InputError` naming both."""
        first = next(iter(inputs.values()), None) if isinstance(inputs, Mapping) else inputs
        shape = getattr(first, "shape", None)
        if shape is not None and len(shape) == 4 and shape[0] == self.size:
            return None
        values = inputs_in_order(self._items, self._names, inputs)
        try:
            return tuple(
                spec.check_array(value, casting=self._casting)
                for spec, value in zip(self._items, values, strict=True)
            )
        except InputError as exc:
            whole = [s.shape for s in self._inputs]
            raise type(exc)(
                f"{exc} (a batched engine takes one item, or a whole batch {whole})"
            ) from exc

    def admit(self, arrays: tuple[Any, ...], timeout: float | None) -> Item:
        if self._closed:
            raise EngineClosedError("the engine is closed")
        loop = asyncio.get_running_loop()
        item = Item(self, arrays, loop.create_future())
        self.counts["items"] += 1
        self._waiting.append(item)
        self._live += 1
        if timeout is not None:
            item.timer = loop.call_later(timeout, self._expire, item)
        if self._live >= self.size:
            self.flush()
        elif self._timer is None:
            self._arm()
        return item

    def _arm(self) -> None:
        """Flush by ``max_delay`` from now: the first waiting item arrived now (a flush
        takes every waiting item, since N waiting flush at once)."""
        loop = asyncio.get_running_loop()
        timers = self._timers
        if timers is None:
            # Early by at most half the delay: a lateness spike (a pause of the whole
            # process) must not make every later batch go nearly empty.
            timers = self._timers = DeadlineTimers(loop, cap=self._delay / 2)
        self._timer = timers.call_at(loop.time() + self._delay, self.flush)

    def _expire(self, item: Item) -> None:
        item.timer = None
        if item.state is not ItemState.DONE and not item.future.done():
            item.future.set_exception(
                RequestTimeoutError("the item's timeout passed before its result was ready")
            )
            self.end(item, "timed_out")

    def end(self, item: Item, outcome: str) -> None:
        """Count the item's one outcome (once; a second is ignored)."""
        state = item.state
        if state is ItemState.DONE:
            return
        if state is ItemState.WAITING:
            self._live -= 1
        else:
            self.counts["running"] -= 1
        item.state = ItemState.DONE
        item.arrays = ()
        self.counts[outcome] += 1

    # -- assembling -----------------------------------------------------------------------------

    def flush(self) -> None:
        """Send the first N waiting items (fewer, padded, when fewer wait) as one task;
        the next waiting item's delay starts now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        taken: list[Item] = []
        waiting = self._waiting
        while waiting and len(taken) < self.size:
            item = waiting.popleft()
            if item.state is ItemState.WAITING:
                taken.append(item)
        if taken:
            self._live -= len(taken)
            self.counts["running"] += len(taken)
            self.counts["tasks"] += 1
            self._sizes[len(taken)] += 1
            for item in taken:
                item.state = ItemState.RUNNING
            batch = self._assemble(taken)
            task = asyncio.get_running_loop().create_task(self._task(taken, batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if self._live >= self.size:
            self.flush()
        elif self._live and self._timer is None:
            self._arm()

    def _assemble(self, items: list[Item]) -> Any:
        """The batch's arrays in the tensors' own dtypes (so the engine's check of the
        batch converts nothing): each item's row copied in once, the padding zeroed."""
        arrays = []
        count = len(items)
        for k, spec in enumerate(self._inputs):
            batch = np.empty(spec.shape, spec.numpy_dtype)
            for row, item in enumerate(items):
                batch[row] = item.arrays[k][0]
            batch[count:] = 0
            arrays.append(batch)
        if len(arrays) == 1:
            return arrays[0]
        return {spec.name: a for spec, a in zip(self._inputs, arrays, strict=True)}

    async def _task(self, items: list[Item], batch: Any) -> None:
        try:
            result = await self._run(batch)
        except Exception as exc:
            for item in items:
                if item.state is not ItemState.DONE:
                    if not item.future.done():
                        item.future.set_exception(exc)
                    self.end(item, "failed")
            return
        for row, item in enumerate(items):
            if item.state is ItemState.DONE:
                continue  # cancelled or timed out meanwhile: its row is dropped
            item.future.set_result(_row(result, row))
            self.end(item, "completed")

    # -- closing and observing ------------------------------------------------------------------

    def close(self) -> None:
        """The engine closes: every waiting item fails; tasks running end with it."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        error = EngineClosedError("the engine was closed while the item waited for its batch")
        while self._waiting:
            item = self._waiting.popleft()
            if item.state is ItemState.WAITING:
                if not item.future.done():
                    item.future.set_exception(error)
                self.end(item, "failed")

    async def finished(self) -> None:
        """Wait until every task assembled here has delivered its rows."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def statistics(self) -> BatchStatistics:
        counts = self.counts
        return BatchStatistics(
            batch=self.size,
            items=counts["items"],
            completed=counts["completed"],
            failed=counts["failed"],
            cancelled=counts["cancelled"],
            timed_out=counts["timed_out"],
            waiting=self._live,
            running=counts["running"],
            tasks=counts["tasks"],
            sizes=MappingProxyType(dict(sorted(self._sizes.items()))),
        )


def _row(result: Any, row: int) -> Any:
    if isinstance(result, dict):
        return {name: value[row : row + 1].copy() for name, value in result.items()}
    return result[row : row + 1].copy()


def open_batcher(
    batching: Batching | None,
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...],
    run: Callable[[Any], Awaitable[Any]],
    casting: Any,
    *,
    postprocess: object = None,
    preprocess: Mapping[str, Any] | None = None,
) -> Batcher | None:
    """The engine's batcher for ``Engine(batch=...)``, or None; a model that cannot be
    batched so is a :class:`ConfigurationError` at open, before anything is queued."""
    if batching is None:
        return None
    sizes = {spec.shape[0] for spec in (*inputs, *outputs)}
    if len(sizes) != 1 or min(sizes) < 2:
        shapes = {spec.name: spec.shape for spec in (*inputs, *outputs)}
        raise ConfigurationError(
            "batch=Batching(...) needs a model whose inputs and outputs all have one "
            f"batch size N > 1; this one has {shapes}"
        )
    if postprocess is not None or preprocess:
        raise ConfigurationError(
            "batch=Batching(...) with postprocess= or preprocess=: not in this version"
        )
    return Batcher(batching, inputs, outputs, run, casting)
