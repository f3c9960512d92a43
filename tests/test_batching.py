"""Batch assembly: single items of many callers run as one task of a batch-N model.

Flushes are reached by count (N items admitted without yielding) or by a zero delay
(the next loop iteration); running tasks are held at the emulated cores' gates.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from aiodla import (
    Batching,
    BatchStatistics,
    ConfigurationError,
    Engine,
    EngineClosedError,
    InputValueError,
    QueueFullError,
    RequestTimeoutError,
    TaskError,
    TensorSpec,
)
from aiodla._batching import Batcher
from aiodla.emulator import make_loadable
from aiodla.testing import DLAControls

from support import affine_model, counts_add_up, wait_until

pytestmark = pytest.mark.usefixtures("engines_add_up")

N = 8
XB = TensorSpec("x", (N, 3, 8, 8), "float16", "chw16")
YB = TensorSpec("y", (N, 3, 1, 1), "float32", "nchw")


def batch_model(latency: float = 0.004) -> bytes:
    """A batch-8 'classifier': each row's output is the mean of its own input row."""
    return make_loadable([XB], [YB], "mean_hw", latency, scale=1.0, bias=0.0)


def item(value: float) -> np.ndarray[Any, Any]:
    return np.full((1, 3, 8, 8), value, np.float32)


def row_of(value: float) -> np.ndarray[Any, Any]:
    return np.full((1, 3, 1, 1), value, np.float32)


def items_add_up(stats: BatchStatistics) -> bool:
    ended = stats.completed + stats.failed + stats.cancelled + stats.timed_out
    return ended + stats.waiting + stats.running == stats.items


@pytest_asyncio.fixture
async def batched(aiodla_controls: DLAControls) -> AsyncIterator[Engine]:
    async with Engine(
        batch_model(), runtime=aiodla_controls.runtime, batch=Batching(max_delay=10.0)
    ) as engine:
        yield engine
        stats = engine.statistics()
        assert stats.batching is not None and items_add_up(stats.batching)


def batching(engine: Engine) -> BatchStatistics:
    stats = engine.statistics().batching
    assert stats is not None
    return stats


class TestAssembly:
    @pytest.mark.asyncio
    async def test_each_caller_gets_its_own_row(self, batched: Engine) -> None:
        calls = [batched.infer_nowait(item(i)) for i in range(4 * N)]
        rows = await asyncio.gather(*calls)
        for i, row in enumerate(rows):
            np.testing.assert_array_equal(row, row_of(i))
        stats = batching(batched)
        assert (stats.items, stats.completed, stats.tasks) == (4 * N, 4 * N, 4)
        assert dict(stats.sizes) == {N: 4}
        assert batched.statistics().completed == 4  # the engine's requests are tasks

    @pytest.mark.asyncio
    async def test_a_partial_batch_goes_after_max_delay_padded(
        self, aiodla_controls: DLAControls
    ) -> None:
        async with Engine(
            batch_model(), runtime=aiodla_controls.runtime, batch=Batching(max_delay=0)
        ) as engine:
            rows = await asyncio.gather(*(engine.infer(item(i + 1)) for i in range(3)))
            for i, row in enumerate(rows):
                np.testing.assert_array_equal(row, row_of(i + 1))
            assert dict(batching(engine).sizes) == {3: 1}

    @pytest.mark.asyncio
    async def test_a_whole_batch_runs_as_it_is(self, batched: Engine) -> None:
        whole = np.arange(N, dtype=np.float32).reshape(N, 1, 1, 1) * np.ones((N, 3, 8, 8))
        out = await batched.infer(whole)
        np.testing.assert_array_equal(out[:, :, 0, 0], whole[:, :, 0, 0])
        assert batching(batched).items == 0 and batched.statistics().completed == 1


class TestTheDelay:
    """The batcher itself, with a stand-in for the engine's ``infer``: when its flush is
    armed (the loop's time, read around the admission) and what a flush assembles."""

    @staticmethod
    def batcher(delay: float, ran: list[Any]) -> Batcher:
        async def run(batch: Any) -> Any:
            ran.append(batch)
            return np.zeros(YB.shape, np.float32)

        return Batcher(
            Batching(max_delay=delay),
            (XB,),
            (YB,),
            run,
            "safe",
            slots=4,
            max_queue=16,
            latency_window=64,
        )

    @staticmethod
    def armed_after(batcher: Batcher, value: float) -> tuple[float, float, float]:
        """Admit one item: (loop time before, the flush's armed time, loop time after)."""
        loop = asyncio.get_running_loop()
        arrays = batcher.item(item(value))
        assert arrays is not None
        before = loop.time()
        batcher.admit(arrays, None)
        after = loop.time()
        timer = batcher._timer
        assert timer is not None
        return before, timer.when(), after

    @pytest.mark.asyncio
    async def test_a_lone_item_goes_early_by_the_lateness_its_timers_showed(self) -> None:
        ran: list[Any] = []
        batcher = self.batcher(10.0, ran)
        before, when, after = self.armed_after(batcher, 1)
        assert before + 10.0 <= when <= after + 10.0  # no firing seen yet: at max_delay
        batcher.flush()
        assert batcher._timers is not None
        batcher._timers.observe(3e-3)  # as a firing 3 ms after its armed time reports
        before, when, after = self.armed_after(batcher, 2)
        assert before + 10.0 - 3e-3 <= when <= after + 10.0 - 3e-3
        batcher.flush()
        await batcher.finished()
        assert len(ran) == 2

    @pytest.mark.asyncio
    async def test_at_most_half_the_delay_early(self) -> None:
        batcher = self.batcher(10.0, [])
        self.armed_after(batcher, 1)
        assert batcher._timers is not None
        batcher._timers.observe(60.0)  # a pause of the whole process
        batcher.flush()
        before, when, after = self.armed_after(batcher, 2)
        assert before + 5.0 <= when <= after + 5.0
        batcher.close()
        await batcher.finished()

    @pytest.mark.asyncio
    async def test_a_partial_batch_is_its_items_rows_then_zeros(self) -> None:
        ran: list[Any] = []
        batcher = self.batcher(10.0, ran)
        for value in (1, 2, 3):
            self.armed_after(batcher, value)
        batcher.flush()
        await batcher.finished()
        (batch,) = ran
        assert batch.dtype == XB.numpy_dtype and batch.shape == XB.shape
        np.testing.assert_array_equal(batch[:3, 0, 0, 0], [1, 2, 3])
        assert not batch[3:].any()


class TestEndingsOfOneItem:
    @pytest.mark.asyncio
    async def test_a_cancelled_waiting_item_leaves_its_batch(self, batched: Engine) -> None:
        first = [batched.infer_nowait(item(i)) for i in range(3)]
        first[1].cancel()
        await wait_until(lambda: batching(batched).cancelled == 1)
        rest = [batched.infer_nowait(item(10 + i)) for i in range(N - 2)]
        rows = await asyncio.gather(first[0], first[2], *rest)
        for value, row in zip([0, 2, *range(10, 10 + N - 2)], rows, strict=True):
            np.testing.assert_array_equal(row, row_of(value))
        stats = batching(batched)
        assert dict(stats.sizes) == {N: 1} and stats.cancelled == 1

    @pytest.mark.asyncio
    async def test_a_cancelled_running_item_is_computed_and_dropped(
        self, batched: Engine, aiodla_controls: DLAControls
    ) -> None:
        with aiodla_controls.hold() as gate:
            calls = [batched.infer_nowait(item(i)) for i in range(N)]
            await gate.reached(1)
            calls[3].cancel()
            await wait_until(lambda: batching(batched).cancelled == 1)
        kept = await asyncio.gather(*(c for i, c in enumerate(calls) if i != 3))
        for value, row in zip([v for v in range(N) if v != 3], kept, strict=True):
            np.testing.assert_array_equal(row, row_of(value))
        stats = batching(batched)
        assert (stats.completed, stats.cancelled, stats.running) == (N - 1, 1, 0)
        assert batched.statistics().completed == 1  # the task ran whole

    @pytest.mark.asyncio
    async def test_a_timeout_ends_only_its_item(self, batched: Engine) -> None:
        expiring = batched.infer_nowait(item(1), timeout=0)
        with pytest.raises(RequestTimeoutError):
            await expiring
        rows = await asyncio.gather(*(batched.infer(item(i)) for i in range(N)))
        np.testing.assert_array_equal(rows[5], row_of(5))
        stats = batching(batched)
        assert stats.timed_out == 1 and dict(stats.sizes) == {N: 1}

    @pytest.mark.asyncio
    async def test_a_failed_task_fails_its_items_alone(
        self, batched: Engine, aiodla_controls: DLAControls
    ) -> None:
        aiodla_controls.fail_next()
        failing = await asyncio.gather(
            *(batched.infer(item(i)) for i in range(N)), return_exceptions=True
        )
        assert all(isinstance(o, TaskError) for o in failing)
        rows = await asyncio.gather(*(batched.infer(item(i)) for i in range(N)))
        np.testing.assert_array_equal(rows[2], row_of(2))
        stats = batching(batched)
        assert (stats.failed, stats.completed, stats.tasks) == (N, N, 2)

    @pytest.mark.asyncio
    async def test_closing_fails_the_waiting_items(self, aiodla_controls: DLAControls) -> None:
        engine = Engine(batch_model(), runtime=aiodla_controls.runtime, batch=Batching(10.0))
        await engine.open()
        with aiodla_controls.hold() as gate:
            running = [engine.infer_nowait(item(i)) for i in range(N)]
            waiting = [engine.infer_nowait(item(i)) for i in range(3)]
            await gate.reached(1)
            closing = asyncio.ensure_future(engine.aclose())
            await wait_until(lambda: batching(engine).waiting == 0)
        await closing
        for call in waiting:
            with pytest.raises(EngineClosedError):
                await call
        await asyncio.gather(*running)
        stats = batching(engine)
        assert (stats.completed, stats.failed) == (N, 3) and items_add_up(stats)
        assert counts_add_up(engine.statistics())


def one_slot(controls: DLAControls, **options: Any) -> Engine:
    """A batched engine of one slot (core 0, one stream): a second task waits."""
    options.setdefault("batch", Batching(max_delay=0))
    return Engine(batch_model(), runtime=controls.runtime, cores=[0], streams_per_core=1, **options)


class TestEveryItemEndsOnce:
    """Whatever ends first (the caller's cancellation, its timeout, the task's result),
    each item ends once and the other items of its task are answered."""

    @pytest.mark.asyncio
    async def test_a_caller_cancelled_as_its_task_answers_harms_no_other_item(self) -> None:
        # The task's result and one caller's cancellation land in the same loop
        # iteration, the task's wake-up first: it finds that caller's future
        # cancelled before the caller's own coroutine has run its except clause.
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        errors: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))

        async def run(batch: Any) -> Any:
            return await answer

        batcher = Batcher(
            Batching(max_delay=10.0), (XB,), (YB,), run, "safe",
            slots=1, max_queue=4, latency_window=64,
        )  # fmt: skip

        async def caller(value: float) -> Any:
            arrays = batcher.item(item(value))
            assert arrays is not None
            return await batcher.admit(arrays, None).result()

        callers = [asyncio.ensure_future(caller(i)) for i in range(N)]
        await wait_until(lambda: batcher.statistics().running == N)
        answer.set_result(np.arange(N, dtype=np.float32).reshape(N, 1, 1, 1) * np.ones(YB.shape))
        callers[3].cancel()
        outcomes = await asyncio.gather(*callers, return_exceptions=True)
        await batcher.finished()
        assert isinstance(outcomes[3], asyncio.CancelledError)
        for value, row in enumerate(outcomes):
            if value != 3:
                np.testing.assert_array_equal(row, row_of(value))
        stats = batcher.statistics()
        assert (stats.completed, stats.cancelled, stats.running) == (N - 1, 1, 0)
        assert items_add_up(stats) and errors == []

    @pytest.mark.asyncio
    async def test_a_storm_of_cancellations_and_timeouts_ends_every_item_once(
        self, aiodla_controls: DLAControls
    ) -> None:
        rng = random.Random(42)
        loop = asyncio.get_running_loop()
        errors: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _, context: errors.append(context))
        async with Engine(
            batch_model(latency=0.001),
            runtime=aiodla_controls.runtime,
            batch=Batching(max_delay=0.001),
        ) as engine:
            seen = {"rows": 0, "cancelled": 0, "timed_out": 0}
            for _ in range(40):
                calls = []
                for i in range(rng.randrange(1, 3 * N)):
                    timeout = rng.choice([None, None, 0.0, 0.001, 0.003])
                    call = engine.infer_nowait(item(i), timeout=timeout)
                    calls.append((i, call))
                    if rng.random() < 0.3:  # cancelled at once, or as its task runs
                        loop.call_later(rng.choice([0.0, 0.0005, 0.001, 0.002]), call.cancel)
                # Every caller is answered: a lost item would hang here.
                outcomes = await asyncio.wait_for(
                    asyncio.gather(*(c for _, c in calls), return_exceptions=True), 5
                )
                for (value, _), outcome in zip(calls, outcomes, strict=True):
                    if isinstance(outcome, asyncio.CancelledError):
                        seen["cancelled"] += 1
                    elif isinstance(outcome, RequestTimeoutError):
                        seen["timed_out"] += 1
                    else:
                        np.testing.assert_array_equal(outcome, row_of(value))
                        seen["rows"] += 1
            await wait_until(lambda: batching(engine).running == 0)
            stats = batching(engine)
        assert errors == []
        assert stats.items == sum(seen.values()) and items_add_up(stats)
        assert (stats.waiting, stats.running, stats.failed) == (0, 0, 0)
        # A caller cancelled after its row or its timeout was set sees the
        # cancellation; its item counts as completed or timed out (as a request does).
        assert stats.completed >= seen["rows"] and stats.timed_out >= seen["timed_out"]
        assert stats.cancelled <= seen["cancelled"]
        assert seen["rows"] and seen["cancelled"] and seen["timed_out"]


class TestItemsThatEndBeforeTheirTask:
    """A task is handed to the engine only while it has a slot for it; until then
    items wait in the batcher, where one that ends leaves its batch."""

    @pytest.mark.asyncio
    async def test_items_that_time_out_waiting_for_a_slot_never_run(
        self, aiodla_controls: DLAControls
    ) -> None:
        async with one_slot(aiodla_controls) as engine:
            with aiodla_controls.hold(0) as gate:
                first = [engine.infer_nowait(item(i)) for i in range(N)]
                await gate.reached(1)
                late = [engine.infer_nowait(item(i), timeout=0) for i in range(3)]
                gone = [engine.infer_nowait(item(i)) for i in range(2)]
                for call in gone:
                    call.cancel()
                for call in late:
                    with pytest.raises(RequestTimeoutError):
                        await call
                await wait_until(lambda: batching(engine).cancelled == 2)
                assert batching(engine).waiting == 0
            await asyncio.gather(*first)
            stats = batching(engine)
            assert (stats.timed_out, stats.cancelled, stats.completed) == (3, 2, N)
            assert stats.tasks == 1 and dict(stats.sizes) == {N: 1}
            assert engine.statistics().completed == 1
        assert aiodla_controls.runtime.core_tasks(0) == 1  # the DLA ran one task

    @pytest.mark.asyncio
    async def test_an_item_that_leaves_gives_its_row_to_the_next(
        self, aiodla_controls: DLAControls
    ) -> None:
        async with one_slot(aiodla_controls) as engine:
            with aiodla_controls.hold(0) as gate:
                first = [engine.infer_nowait(item(i)) for i in range(N)]
                await gate.reached(1)
                second = [engine.infer_nowait(item(10 + i)) for i in range(N)]
                second[0].cancel()
                await wait_until(lambda: batching(engine).cancelled == 1)
                second.append(engine.infer_nowait(item(99)))
            rows = await asyncio.gather(*first, *second[1:])
            expected = [*range(N), *range(11, 10 + N), 99]
            for value, row in zip(expected, rows, strict=True):
                np.testing.assert_array_equal(row, row_of(value))
            assert dict(batching(engine).sizes) == {N: 2}
        assert aiodla_controls.runtime.core_tasks(0) == 2

    @pytest.mark.asyncio
    async def test_a_queued_task_whose_items_all_ended_is_withdrawn(
        self, aiodla_controls: DLAControls
    ) -> None:
        whole = np.ones((N, 3, 8, 8), np.float32)
        async with one_slot(aiodla_controls) as engine:
            with aiodla_controls.hold(0) as gate:
                # A caller's whole batch holds the one slot: the items' task queues.
                blocking = asyncio.ensure_future(engine.infer(whole))
                await gate.reached(1)
                items = [engine.infer_nowait(item(i)) for i in range(3)]
                await wait_until(lambda: engine.statistics().queued == 1)
                for call in items:
                    call.cancel()
                await asyncio.gather(*items, return_exceptions=True)
                await wait_until(lambda: engine.statistics().queued == 0)
            await blocking
            stats = engine.statistics()
            assert stats.batching is not None
            assert (stats.batching.tasks, stats.batching.withdrawn) == (1, 1)
            assert (stats.completed, stats.cancelled) == (1, 1) and counts_add_up(stats)
        assert aiodla_controls.runtime.core_tasks(0) == 1  # the withdrawn task never ran


class TestBackpressure:
    @pytest.mark.asyncio
    async def test_infer_nowait_refuses_items_beyond_max_queue_tasks(
        self, aiodla_controls: DLAControls
    ) -> None:
        async with one_slot(aiodla_controls, max_queue=1) as engine:
            with aiodla_controls.hold(0) as gate:
                running = [engine.infer_nowait(item(i)) for i in range(N)]
                await gate.reached(1)
                queued = [engine.infer_nowait(item(i)) for i in range(N)]  # one task's worth
                with pytest.raises(QueueFullError, match=r"max_queue=1 tasks of 8"):
                    engine.infer_nowait(item(0))
                with pytest.raises(QueueFullError):
                    await engine.infer(item(0), wait=False)
                awaiting = asyncio.ensure_future(engine.infer(item(7)))  # waits its turn
                await wait_until(lambda: batching(engine).waiting == N + 1)
                assert not awaiting.done()
            await asyncio.gather(*running, *queued)
            np.testing.assert_array_equal(await awaiting, row_of(7))
            stats = batching(engine)
            assert (stats.rejected, stats.items, stats.completed) == (2, 2 * N + 1, 2 * N + 1)


class TestPerItemLatency:
    @pytest.mark.asyncio
    async def test_an_items_latency_counts_its_wait_for_a_task(
        self, aiodla_controls: DLAControls
    ) -> None:
        hold = 0.1
        async with one_slot(aiodla_controls) as engine:
            loop = asyncio.get_running_loop()
            with aiodla_controls.hold(0) as gate:
                first = [engine.infer_nowait(item(i)) for i in range(N)]
                await gate.reached(1)
                second = [engine.infer_nowait(item(i)) for i in range(N)]
                held_until = loop.time() + hold
                while loop.time() < held_until:  # the second task's items wait meanwhile
                    await asyncio.sleep(hold / 10)
            await asyncio.gather(*first, *second)
            stats = engine.statistics()
        assert stats.batching is not None
        per_item, per_task = stats.batching.latency, stats.latency
        assert (per_item.count, per_task.count) == (2 * N, 2)
        assert stats.batching.latency_histogram.count == 2 * N
        # Every item waited out the hold; the second task itself ran after it.
        assert per_item.p50 >= hold and per_item.max >= per_task.max
        assert per_task.p50 < hold


class TestConfiguration:
    @pytest.mark.asyncio
    async def test_a_wrong_item_shape_is_refused_before_anything_is_queued(
        self, batched: Engine
    ) -> None:
        with pytest.raises(InputValueError, match=r"one item, or a whole batch \[\(8, 3, 8, 8\)\]"):
            await batched.infer(np.ones((2, 3, 8, 8), np.float32))
        with pytest.raises(InputValueError):
            await batched.infer({"x": item(0), "z": item(0)})
        assert batching(batched).items == 0 and batched.statistics().submitted == 0

    @pytest.mark.asyncio
    async def test_a_model_of_batch_one_is_refused_at_open(
        self, aiodla_controls: DLAControls
    ) -> None:
        engine = Engine(affine_model(), runtime=aiodla_controls.runtime, batch=Batching())
        with pytest.raises(ConfigurationError, match="batch size N > 1"):
            await engine.open()

    @pytest.mark.parametrize("delay", [-1, float("nan"), "1", True])
    def test_max_delay_must_be_seconds(self, delay: Any) -> None:
        with pytest.raises(ConfigurationError, match="max_delay"):
            Batching(max_delay=delay)

    def test_batch_must_be_a_batching(self) -> None:
        with pytest.raises(ConfigurationError, match=r"aiodla\.Batching"):
            Engine(batch_model(), batch=0.002)  # type: ignore[arg-type]

    # (With isolation="process", output="device" is refused first, for its own reason.)
    @pytest.mark.in_process
    @pytest.mark.asyncio
    async def test_device_output_takes_whole_batches(self, batched: Engine) -> None:
        with pytest.raises(ConfigurationError, match="whole batches"):
            await batched.infer(item(0), output="device")


class TestMetrics:
    @pytest.mark.asyncio
    async def test_items_and_the_batch_size_histogram_are_exported(
        self, aiodla_controls: DLAControls
    ) -> None:
        from aiodla.metrics import EngineCollector

        async with Engine(
            batch_model(), runtime=aiodla_controls.runtime, batch=Batching(max_delay=0)
        ) as engine:
            await asyncio.gather(*(engine.infer_nowait(item(i)) for i in range(N + 3)))
            families = {f.name: f for f in EngineCollector({"cls": engine}).collect()}
            items = {s.labels["outcome"]: s.value for s in families["aiodla_batch_items"].samples}
            assert items == {"completed": N + 3, "failed": 0, "cancelled": 0, "timed_out": 0}
            sizes = {
                s.labels["le"]: s.value
                for s in families["aiodla_batch_size"].samples
                if s.name.endswith("_bucket")
            }
            assert sizes["2.0"] == 0 and sizes["3.0"] == 1 and sizes["8.0"] == sizes["+Inf"] == 2
            total = [s for s in families["aiodla_batch_size"].samples if s.name.endswith("_sum")]
            assert total[0].value == N + 3
            triton = EngineCollector({"cls": engine}, naming="triton").collect()
            count = next(f for f in triton if f.name == "nv_inference_count")
            assert count.samples[0].value == N + 3
