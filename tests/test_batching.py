"""Batch assembly: single items of many callers run as one task of a batch-N model.

Flushes are reached by count (N items admitted without yielding) or by a zero delay
(the next loop iteration); running tasks are held at the emulated cores' gates.
"""

from __future__ import annotations

import asyncio
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

        return Batcher(Batching(max_delay=delay), (XB,), (YB,), run, "safe")

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
