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
import functools
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sized
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

from ._deadlines import DeadlineTimers
from ._errors import (
    ConfigurationError,
    EngineClosedError,
    InputError,
    QueueFullError,
    RequestTimeoutError,
)
from ._statistics import BatchStatistics, Durations
from ._tensors import TensorSpec, inputs_in_order

__all__ = ["Batch", "BatchStatistics", "Batcher", "Batching", "Item", "open_batcher"]


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
    WAITING = "waiting"  # in the batcher, for a task to be assembled
    RUNNING = "running"  # in a task handed to the engine
    DONE = "done"  # its one outcome is counted


class Item:
    """One caller's item: its arrays (batch 1), its future, its timeout's timer, the
    task it runs in (once assembled), and when it arrived (the loop's clock for the
    batch's delay, the monotonic clock for its latency)."""

    __slots__ = ("arrays", "arrived", "batch", "batcher", "future", "started", "state", "timer")

    def __init__(
        self,
        batcher: Batcher,
        arrays: tuple[Any, ...],
        future: asyncio.Future[Any],
        arrived: float,
    ) -> None:
        self.batcher = batcher
        self.arrays = arrays
        self.future = future
        self.arrived = arrived
        self.started = time.monotonic()
        self.state = ItemState.WAITING
        self.timer: asyncio.TimerHandle | None = None
        self.batch: Batch | None = None

    def on_done(self, task: asyncio.Task[Any]) -> None:
        """``infer_nowait``'s task was cancelled before it awaited the item: the same
        as a cancelled wait."""
        if task.cancelled():
            self.future.cancel()
            self.batcher.end(self, "cancelled")

    async def result(self) -> Any:
        """Await the item's row.

        Cancellation: a waiting item leaves its batch; a running one's row is dropped
        (and a task whose every item ended so is withdrawn: see :class:`Batcher`).
        """
        try:
            return await self.future
        except asyncio.CancelledError:
            self.batcher.end(self, "cancelled")
            raise
        finally:
            if self.timer is not None:
                self.timer.cancel()


class Batch:
    """Items handed to the engine as one task: ``live`` of them have not ended."""

    __slots__ = ("items", "live", "task")

    def __init__(self, items: list[Item]) -> None:
        self.items = items
        self.live = len(items)
        self.task: asyncio.Task[None] | None = None


class Batcher:
    """The items waiting for a task, the tasks handed to the engine, and the counts
    (see the module docstring).

    ``run`` runs a whole batch (the engine's own ``infer``). State, all written here:
    ``_waiting`` in arrival order (an item that ended while it waited stays until a
    look at the front skips it); ``_live``: how many of them have not ended;
    ``_batches``: the tasks handed to the engine and not ended, at most ``slots`` of
    them (the engine's slots: a further task would only queue in the engine, where
    its items could no longer leave it, so items wait here instead, as a batch of
    their own in the making); ``_due``: the first waiting item has waited
    ``max_delay``; ``_timer``: the look at the first waiting item at its ``max_delay``
    (armed early by the loop's lateness: ``_timers``, made with the first item).

    Every item ends exactly once (``end``), whatever ends first: its caller's
    cancellation, its timeout, its task's result or error, the engine's close. A task
    whose items have all ended before its result is withdrawn: cancelled as a request
    is, so one still queued in the engine never runs.
    """

    def __init__(
        self,
        batching: Batching,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
        run: Callable[[Any], Awaitable[Any]],
        casting: Any,
        *,
        slots: int,
        max_queue: int,
        latency_window: int,
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
        self._slots = slots
        # max_queue counts the engine's requests, which are tasks here: that many
        # tasks' worth of items (at least one task's) may wait.
        self.capacity = max(1, max_queue) * self.size
        self._waiting: collections.deque[Item] = collections.deque()
        self._live = 0
        self._due = False
        self._timer: asyncio.TimerHandle | None = None
        self._timers: DeadlineTimers | None = None
        self._batches: set[Batch] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "items", "completed", "failed", "cancelled", "timed_out", "running",
                "tasks", "withdrawn", "rejected",
            ),
            0,
        )  # fmt: skip
        self._sizes: collections.Counter[int] = collections.Counter()
        self.latency = Durations(latency_window)

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

    def admit(
        self,
        arrays: tuple[Any, ...],
        timeout: float | None,
        wait: bool = True,
        output: str = "host",
    ) -> Item:
        """Queue one item; with ``wait=False``, a full queue (``capacity`` items
        waiting) raises :class:`QueueFullError` instead (an awaiting caller's item
        waits its turn, as an engine's request does)."""
        if output != "host":
            raise ConfigurationError("output='device' takes whole batches, not items")
        if self._closed:
            raise EngineClosedError("the engine is closed")
        if not wait and self._live >= self.capacity:
            self.counts["rejected"] += 1
            raise QueueFullError(
                f"the batching queue is full ({self._live} items waiting for a task, "
                f"max_queue={self.capacity // self.size} tasks of {self.size})"
            )
        loop = asyncio.get_running_loop()
        item = Item(self, arrays, loop.create_future(), loop.time())
        self.counts["items"] += 1
        self._waiting.append(item)
        self._live += 1
        if timeout is not None:
            item.timer = loop.call_later(timeout, self._expire, item)
        self._dispatch()
        return item

    def _expire(self, item: Item) -> None:
        item.timer = None
        self._settle(
            item,
            "timed_out",
            error=RequestTimeoutError("the item's timeout passed before its result was ready"),
        )

    # -- ending -------------------------------------------------------------------------------

    def _settle(
        self, item: Item, outcome: str, *, result: Any = None, error: BaseException | None = None
    ) -> None:
        """Give ``item`` its outcome unless it has one. A future its caller cancelled
        meanwhile (the caller's coroutine has not run its ``except`` yet) ends the
        item as cancelled: a result is never set on it."""
        if item.state is ItemState.DONE:
            return
        future = item.future
        if future.cancelled():
            outcome = "cancelled"
        elif not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        self.end(item, outcome)

    def end(self, item: Item, outcome: str) -> None:
        """Count the item's one outcome (once; a second is ignored). A waiting item
        leaves the queue; the last item of a task to end withdraws the task."""
        state = item.state
        if state is ItemState.DONE:
            return
        item.state = ItemState.DONE
        item.arrays = ()
        self.counts[outcome] += 1
        if outcome == "completed":
            self.latency.add(time.monotonic() - item.started)
        if state is ItemState.WAITING:
            self._live -= 1
            return
        self.counts["running"] -= 1
        batch = item.batch
        if batch is not None:
            batch.live -= 1
            task = batch.task
            if batch.live == 0 and task is not None and not task.done():
                # Nobody waits for its rows: cancelled as a request is, so a task
                # still queued in the engine never reaches the DLA.
                self.counts["withdrawn"] += 1
                task.cancel()

    # -- assembling -----------------------------------------------------------------------------

    def flush(self) -> None:
        """Send what waits now, as if the first waiting item's delay had passed (up to
        the engine's slots; the rest goes as tasks end)."""
        self._due = bool(self._live)
        self._dispatch()

    def _on_delay(self) -> None:
        self._timer = None
        self._due = True
        self._dispatch()

    def _dispatch(self) -> None:
        """The one place that decides: hand the engine a task of the first N waiting
        items while it has a slot for one and N wait, or the first has waited
        ``max_delay``; then keep a timer for the first waiting item's delay."""
        if self._closed:
            return
        while self._live and len(self._batches) < self._slots:
            if self._live < self.size and not self._due:
                break
            self._send()
        front = self._front()
        if front is None:
            self._due = False
            self._disarm()
        elif self._timer is None and not self._due:
            self._arm(front)

    def _front(self) -> Item | None:
        """The first waiting item that has not ended (those that have are let go)."""
        waiting = self._waiting
        while waiting and waiting[0].state is not ItemState.WAITING:
            waiting.popleft()
        return waiting[0] if waiting else None

    def _arm(self, front: Item) -> None:
        """Look again when ``front`` (the first waiting item) has waited ``max_delay``."""
        loop = asyncio.get_running_loop()
        timers = self._timers
        if timers is None:
            # Early by at most half the delay: a lateness spike (a pause of the whole
            # process) must not make every later batch go nearly empty.
            timers = self._timers = DeadlineTimers(loop, cap=self._delay / 2)
        self._timer = timers.call_at(front.arrived + self._delay, self._on_delay)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _send(self) -> None:
        """Hand the first (up to) N waiting items to the engine as one task; the next
        waiting item's delay counts from its own arrival."""
        taken: list[Item] = []
        waiting = self._waiting
        while waiting and len(taken) < self.size:
            item = waiting.popleft()
            if item.state is not ItemState.WAITING:
                continue
            if item.future.done():  # cancelled by its caller, who has not run since
                self.end(item, "cancelled")
                continue
            taken.append(item)
        self._due = False
        self._disarm()
        if not taken:
            return
        self._live -= len(taken)
        self.counts["running"] += len(taken)
        self.counts["tasks"] += 1
        self._sizes[len(taken)] += 1
        batch = Batch(taken)
        for item in taken:
            item.state = ItemState.RUNNING
            item.batch = batch
        arrays = self._assemble(taken)
        task = asyncio.get_running_loop().create_task(self._task(batch, arrays))
        batch.task = task
        self._batches.add(batch)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._task_ended, batch))

    def _task_ended(self, batch: Batch, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._batches.discard(batch)
        self._dispatch()  # a slot for the next task

    def _assemble(self, items: list[Item]) -> Any:
        """The batch's arrays in the tensors' own dtypes (so the engine's check of the
        batch converts nothing): each item's row copied in once, the padding zeroed."""
        arrays = []
        count = len(items)
        for k, spec in enumerate(self._inputs):
            batch = np.empty(spec.shape, spec.numpy_dtype)
            # casting="same_kind" admitted values beyond the tensor's range: they become
            # infinity here, quietly, as in an engine's own conversion (a warning raised
            # as an error would leave the whole task's items waiting forever).
            with np.errstate(over="ignore"):
                for row, item in enumerate(items):
                    batch[row] = item.arrays[k][0]
            batch[count:] = 0
            arrays.append(batch)
        if len(arrays) == 1:
            return arrays[0]
        return {spec.name: a for spec, a in zip(self._inputs, arrays, strict=True)}

    async def _task(self, batch: Batch, arrays: Any) -> None:
        try:
            result = await self._run(arrays)
        except asyncio.CancelledError:
            batch.task = None  # (its items' ends below must not withdraw it again)
            # Withdrawn (its items had all ended), or the loop is shutting down: an
            # item still waiting for its row ends as cancelled.
            for item in batch.items:
                if item.state is not ItemState.DONE:
                    item.future.cancel()
                    self.end(item, "cancelled")
            raise
        except Exception as exc:
            batch.task = None
            for item in batch.items:
                self._settle(item, "failed", error=exc)
            return
        # Answered: the last row delivered must not withdraw (cancel) this very task.
        batch.task = None
        for row, item in enumerate(batch.items):
            # An item cancelled or timed out meanwhile has ended: its row is dropped.
            if item.state is not ItemState.DONE:
                self._settle(item, "completed", result=_row(result, row))

    # -- closing and observing ------------------------------------------------------------------

    def close(self) -> None:
        """The engine closes: every waiting item fails; tasks running end with it."""
        self._closed = True
        self._disarm()
        error = EngineClosedError("the engine was closed while the item waited for its batch")
        while self._waiting:
            item = self._waiting.popleft()
            self._settle(item, "failed", error=error)

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
            withdrawn=counts["withdrawn"],
            rejected=counts["rejected"],
            latency=self.latency.window.summary(),
            latency_histogram=self.latency.histogram.snapshot(),
        )


def _row(result: Any, row: int) -> Any:
    if isinstance(result, dict):
        return {name: value[row : row + 1].copy() for name, value in result.items()}
    return result[row : row + 1].copy()


class BatchedModel(Protocol):
    """What the batcher reads of the engine's opened cores."""

    @property
    def inputs(self) -> tuple[TensorSpec, ...]: ...
    @property
    def outputs(self) -> tuple[TensorSpec, ...]: ...
    @property
    def slots(self) -> Sized: ...


def open_batcher(
    batching: Batching | None,
    cores: BatchedModel,
    run: Callable[[Any], Awaitable[Any]],
    casting: Any,
    *,
    max_queue: int,
    latency_window: int,
    postprocess: object = None,
    preprocess: Mapping[str, Any] | None = None,
) -> Batcher | None:
    """The engine's batcher for ``Engine(batch=...)``, or None; a model that cannot be
    batched so is a :class:`ConfigurationError` at open, before anything is queued.
    ``run`` runs a whole batch as one of the engine's requests."""
    if batching is None:
        return None
    inputs, outputs = cores.inputs, cores.outputs
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
    return Batcher(
        batching,
        inputs,
        outputs,
        run,
        casting,
        slots=len(cores.slots),
        max_queue=max_queue,
        latency_window=latency_window,
    )
