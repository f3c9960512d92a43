"""Batch assembly's edges (issue 44's mutation run of ``_batching``): a model of several
inputs and outputs, items by name, each caller's rows of every output; the refusals
word for word (a full queue, a model that cannot be batched, the options batching does
not take, an item of the wrong shape, device output)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from aiodla import (
    Batching,
    ConfigurationError,
    Engine,
    EngineClosedError,
    InputError,
    InputValueError,
    QueueFullError,
    RequestTimeoutError,
    TensorSpec,
)
from aiodla._batching import Batcher, open_batcher
from aiodla.emulator import make_loadable
from aiodla.testing import DLAControls

from support import wait_until

N = 4
A = TensorSpec("a", (N, 3, 2, 2), "float16", "nchw")
B = TensorSpec("b", (N, 1, 2, 2), "float16", "nchw")
OUT_A = TensorSpec("out_a", (N, 3, 2, 2), "float32", "nchw")
OUT_B = TensorSpec("out_b", (N, 1, 2, 2), "float32", "nchw")


def two_inputs() -> bytes:
    """Batch 4, two inputs: each output is its input, doubled, plus one."""
    return make_loadable([A, B], [OUT_A, OUT_B], "affine", 0.001, scale=2.0, bias=1.0)


async def _never(arrays: Any) -> Any:
    raise AssertionError("nothing runs here")


def item(value: float) -> dict[str, Any]:
    return {
        "a": np.full((1, 3, 2, 2), value, np.float32),
        "b": np.full((1, 1, 2, 2), -value, np.float32),
    }


class TestSeveralInputs:
    @pytest.mark.asyncio
    async def test_each_caller_gets_its_own_row_of_every_output(
        self, aiodla_controls: DLAControls
    ) -> None:
        async with Engine(
            two_inputs(), runtime=aiodla_controls.runtime, batch=Batching(max_delay=10.0)
        ) as engine:
            # Six items: a full task of four, then two that go at once by flush.
            began = time.monotonic()
            calls = [engine.infer_nowait(item(k)) for k in range(6)]
            engine._batcher.flush()  # type: ignore[union-attr]
            results = await asyncio.gather(*calls)
            elapsed = time.monotonic() - began
            stats = engine.statistics().batching
        for k, got in enumerate(results):
            assert set(got) == {"out_a", "out_b"}
            np.testing.assert_array_equal(
                got["out_a"], np.full((1, 3, 2, 2), 2 * k + 1, np.float32)
            )
            np.testing.assert_array_equal(
                got["out_b"], np.full((1, 1, 2, 2), 1 - 2 * k, np.float32)
            )
        assert stats is not None and dict(stats.sizes) == {2: 1, 4: 1}
        # Each item's latency: from its call to its row, within the test's own time.
        assert stats.latency.count == 6 and 0 < stats.latency.max <= elapsed

    @pytest.mark.asyncio
    async def test_a_whole_batch_by_name_runs_as_it_is(self, aiodla_controls: DLAControls) -> None:
        async with Engine(
            two_inputs(), runtime=aiodla_controls.runtime, batch=Batching(max_delay=10.0)
        ) as engine:
            whole = {"a": np.ones(A.shape, np.float32), "b": np.zeros(B.shape, np.float32)}
            got = await engine.infer(whole)
            stats = engine.statistics().batching
        np.testing.assert_array_equal(got["out_a"], np.full(A.shape, 3, np.float32))
        np.testing.assert_array_equal(got["out_b"], np.ones(B.shape, np.float32))
        assert stats is not None and stats.items == 0


class TestRefusals:
    @pytest.mark.asyncio
    async def test_a_full_queue_says_how_full_and_of_what(
        self, aiodla_controls: DLAControls
    ) -> None:
        async with Engine(
            two_inputs(),
            runtime=aiodla_controls.runtime,
            cores=[0],
            streams_per_core=1,
            max_queue=2,
            batch=Batching(max_delay=10.0),
        ) as engine:
            with aiodla_controls.hold(0) as gate:
                running = [engine.infer_nowait(item(k)) for k in range(N)]
                await gate.reached(1)
                waiting = [engine.infer_nowait(item(k)) for k in range(2 * N)]  # two tasks' worth
                with pytest.raises(QueueFullError) as refused:
                    engine.infer_nowait(item(0))
                assert str(refused.value) == (
                    "the batching queue is full (8 items waiting for a task, "
                    "max_queue=2 tasks of 4)"
                )
            await asyncio.gather(*running, *waiting)

    @pytest.mark.asyncio
    async def test_a_model_without_one_batch_size_is_refused_naming_its_shapes(
        self, aiodla_controls: DLAControls
    ) -> None:
        mixed = make_loadable(
            [A], [TensorSpec("out_a", (2, 3, 2, 2), "float32", "nchw")], "mix", 0.001
        )
        for model, shapes in (
            (mixed, "{'a': (4, 3, 2, 2), 'out_a': (2, 3, 2, 2)}"),
            (
                make_loadable(
                    [TensorSpec("x", (1, 3, 2, 2), "float16", "nchw")],
                    [TensorSpec("y", (1, 3, 2, 2), "float32", "nchw")],
                    "affine",
                ),
                "{'x': (1, 3, 2, 2), 'y': (1, 3, 2, 2)}",
            ),
        ):
            engine = Engine(model, runtime=aiodla_controls.runtime, batch=Batching())
            with pytest.raises(ConfigurationError) as refused:
                await engine.open()
            assert str(refused.value) == (
                "batch=Batching(...) needs a model whose inputs and outputs all have one "
                f"batch size N > 1; this one has {shapes}"
            )
            assert engine.state.value == "closed"

    @pytest.mark.parametrize(
        "options",
        [{"postprocess": object()}, {"preprocess": {"a": object()}}],
        ids=["postprocess", "preprocess"],
    )
    def test_postprocess_and_preprocess_are_refused(self, options: dict[str, Any]) -> None:
        # (An engine's Detect and ImagePreprocess refuse a batch-N model first, each for
        # its own reason; the batcher refuses them again, should either learn batches.)
        model = SimpleNamespace(inputs=(A, B), outputs=(OUT_A, OUT_B), slots=[0, 1])
        with pytest.raises(ConfigurationError) as refused:
            open_batcher(
                Batching(), model, _never, "same_kind", max_queue=4, latency_window=8, **options
            )
        assert str(refused.value) == (
            "batch=Batching(...) with postprocess= or preprocess=: not in this version"
        )
        batcher = open_batcher(
            Batching(), model, _never, "same_kind", max_queue=4, latency_window=8,
            postprocess=None, preprocess={},
        )  # fmt: skip
        assert batcher is not None and batcher.size == N

    @pytest.mark.asyncio
    async def test_an_item_of_the_wrong_shape_names_both_shapes_a_batch_may_have(
        self, aiodla_controls: DLAControls
    ) -> None:
        async with Engine(
            two_inputs(), runtime=aiodla_controls.runtime, batch=Batching(max_delay=10.0)
        ) as engine:
            wrong = {"a": np.ones((2, 3, 2, 2), np.float32), "b": np.ones((2, 1, 2, 2), np.float32)}
            with pytest.raises(InputValueError) as refused:
                await engine.infer(wrong)
            message = str(refused.value)
            assert message.endswith(
                " (a batched engine takes one item, or a whole batch [(4, 3, 2, 2), (4, 1, 2, 2)])"
            )
            assert refused.value.__cause__ is not None
            assert message.startswith(str(refused.value.__cause__))
            assert engine.statistics().submitted == 0

    @pytest.mark.in_process
    @pytest.mark.asyncio
    async def test_device_output_of_an_item_is_refused_saying_why(
        self, aiodla_controls: DLAControls
    ) -> None:
        async with Engine(
            two_inputs(), runtime=aiodla_controls.runtime, batch=Batching(max_delay=10.0)
        ) as engine:
            with pytest.raises(ConfigurationError) as refused:
                await engine.infer(item(0), output="device")
            assert str(refused.value) == "output='device' takes whole batches, not items"
            assert engine.statistics().batching.items == 0  # type: ignore[union-attr]


class TestEndings:
    @pytest.mark.asyncio
    async def test_a_timed_out_item_and_a_closed_batchers_items_say_why(
        self, aiodla_controls: DLAControls
    ) -> None:
        engine = Engine(two_inputs(), runtime=aiodla_controls.runtime, batch=Batching(10.0))
        await engine.open()
        expiring = engine.infer_nowait(item(1), timeout=0)
        with pytest.raises(RequestTimeoutError) as timed_out:
            await expiring
        assert str(timed_out.value) == "the item's timeout passed before its result was ready"
        waiting = engine.infer_nowait(item(2))
        await engine.aclose()
        with pytest.raises(EngineClosedError) as closed:
            await waiting
        assert str(closed.value) == "the engine was closed while the item waited for its batch"

    @pytest.mark.asyncio
    async def test_a_closed_batcher_admits_nothing_and_assembles_nothing(self) -> None:
        # (An engine refuses its calls once closing, before its batcher; the batcher
        # holds to it as well, so that nothing it has reaches a closed engine.)
        ran: list[Any] = []

        async def run(arrays: Any) -> Any:
            ran.append(arrays)
            return {"out_a": np.zeros(OUT_A.shape), "out_b": np.zeros(OUT_B.shape)}

        batcher = Batcher(
            Batching(max_delay=0), (A, B), (OUT_A, OUT_B), run, "same_kind",
            slots=1, max_queue=4, latency_window=8,
        )  # fmt: skip
        arrays = batcher.item(item(1))
        assert arrays is not None
        batcher.close()
        with pytest.raises(EngineClosedError) as refused:
            batcher.admit(arrays, None)
        assert str(refused.value) == "the engine is closed"
        batcher.flush()
        await asyncio.sleep(0.01)
        assert ran == [] and batcher.statistics().items == 0

    @pytest.mark.asyncio
    async def test_finished_waits_out_a_withdrawn_task_without_raising(self) -> None:
        # Every item of a running task ended (here: cancelled), so the task is
        # withdrawn; a close that waits for the batcher's tasks at that moment sees it
        # end cancelled, and goes on.
        started = asyncio.Event()

        async def run(arrays: Any) -> Any:
            started.set()
            await asyncio.Event().wait()  # the engine never answers: only a cancel ends it

        batcher = Batcher(
            Batching(max_delay=0), (A, B), (OUT_A, OUT_B), run, "same_kind",
            slots=1, max_queue=4, latency_window=8,
        )  # fmt: skip
        for _ in range(2):
            started.clear()
            arrays = batcher.item(item(1))
            assert arrays is not None
            admitted = batcher.admit(arrays, None)
            await started.wait()
            batcher.end(admitted, "cancelled")
            await asyncio.wait_for(batcher.finished(), 5)
        stats = batcher.statistics()
        assert (stats.withdrawn, stats.cancelled, stats.running, stats.tasks) == (2, 2, 0, 2)


@pytest.mark.asyncio
async def test_the_smallest_batch_two_assembles_items(aiodla_controls: DLAControls) -> None:
    x = TensorSpec("x", (2, 1, 2, 2), "float16", "nchw")
    y = TensorSpec("y", (2, 1, 2, 2), "float32", "nchw")
    model = make_loadable([x], [y], "affine", 0.001, scale=2.0, bias=1.0)
    async with Engine(
        model, runtime=aiodla_controls.runtime, batch=Batching(max_delay=10.0)
    ) as engine:
        rows = await asyncio.gather(
            *(engine.infer(np.full((1, 1, 2, 2), k, np.float32)) for k in (3, 5))
        )
        stats = engine.statistics().batching
    for k, row in zip((3, 5), rows, strict=True):
        np.testing.assert_array_equal(row, np.full((1, 1, 2, 2), 2 * k + 1, np.float32))
    assert stats is not None and dict(stats.sizes) == {2: 1}


@pytest.mark.asyncio
async def test_an_item_after_a_full_task_waits_its_own_delay() -> None:
    # The first item's look at its delay is armed once: a task sent full (by count)
    # takes it away, so an item that comes later waits its own max_delay (the timers
    # arm at most half of it early), not what was left of the first item's.
    loop = asyncio.get_running_loop()
    ran_at: list[float] = []

    async def run(arrays: Any) -> Any:
        ran_at.append(loop.time())
        return {"out_a": np.zeros(OUT_A.shape), "out_b": np.zeros(OUT_B.shape)}

    delay = 0.4
    batcher = Batcher(
        Batching(max_delay=delay), (A, B), (OUT_A, OUT_B), run, "same_kind",
        slots=4, max_queue=4, latency_window=8,
    )  # fmt: skip

    def admit(value: float) -> Any:
        arrays = batcher.item(item(value))
        assert arrays is not None
        return batcher.admit(arrays, None)

    full = []
    for k in range(N):  # a loop turn between items: each admission looks again
        full.append(admit(k))
        await asyncio.sleep(0)
    await asyncio.gather(*(i.result() for i in full))
    await asyncio.sleep(0.75 * delay)
    arrived = loop.time()
    await admit(N).result()
    assert len(ran_at) == 2 and ran_at[1] - arrived >= delay / 2


class TestItemsChecked:
    @pytest.mark.asyncio
    async def test_by_the_engines_casting(self, aiodla_controls: DLAControls) -> None:
        # 1e6 does not fit float16: "safe" refuses it, "same_kind" takes it (as inf).
        big = {"a": np.full((1, 3, 2, 2), 1e6, np.float32), "b": np.zeros((1, 1, 2, 2), np.float32)}
        for casting in ("safe", "same_kind"):
            async with Engine(
                two_inputs(),
                runtime=aiodla_controls.runtime,
                batch=Batching(max_delay=0),
                casting=casting,
            ) as engine:
                if casting == "safe":
                    with pytest.raises(InputValueError, match="a batched engine takes one item"):
                        await engine.infer(big)
                else:  # (quietly, as the engine's own conversion: the tests' warnings fail)
                    got = await asyncio.wait_for(engine.infer(big), 10)
                    assert np.isinf(got["out_a"]).all()

    @pytest.mark.asyncio
    async def test_an_empty_mapping_or_a_list_is_an_input_error(
        self, aiodla_controls: DLAControls
    ) -> None:
        async with Engine(
            two_inputs(), runtime=aiodla_controls.runtime, batch=Batching(max_delay=0)
        ) as engine:
            with pytest.raises(InputError, match="'a'"):
                await engine.infer({})
            listed = {"a": [[[[1.0, 2.0], [3.0, 4.0]]] * 3], "b": np.zeros((1, 1, 2, 2))}
            got = await engine.infer(listed)  # a nested list is an array as well
            np.testing.assert_array_equal(got["out_a"][0, 1], [[3.0, 5.0], [7.0, 9.0]])
            assert engine.statistics().batching.completed == 1  # type: ignore[union-attr]


class TestAssemblyOrder:
    @staticmethod
    def batcher(ran: list[Any], delay: float = 10.0) -> Batcher:
        async def run(arrays: Any) -> Any:
            ran.append(arrays["a"][:, 0, 0, 0].tolist())
            return {"out_a": np.zeros(OUT_A.shape), "out_b": np.zeros(OUT_B.shape)}

        return Batcher(
            Batching(max_delay=delay), (A, B), (OUT_A, OUT_B), run, "same_kind",
            slots=4, max_queue=4, latency_window=8,
        )  # fmt: skip

    @staticmethod
    def admit(batcher: Batcher, value: float) -> Any:
        arrays = batcher.item(item(value))
        assert arrays is not None
        return batcher.admit(arrays, None)

    @pytest.mark.asyncio
    async def test_an_item_that_ended_while_waiting_is_skipped_not_a_stop(self) -> None:
        ran: list[Any] = []
        batcher = self.batcher(ran)
        items = [self.admit(batcher, k) for k in range(3)]
        batcher.end(items[1], "cancelled")  # its caller gave up: it stays in line, ended
        items += [self.admit(batcher, k) for k in (3, 4)]  # four wait: a task goes
        await asyncio.wait_for(asyncio.gather(*(i.future for i in items if i is not items[1])), 5)
        assert ran == [[0.0, 2.0, 3.0, 4.0]]
        await batcher.finished()
        assert not batcher._tasks  # (an ended task is not kept)

    @pytest.mark.asyncio
    async def test_an_item_whose_caller_just_gave_up_is_skipped_not_a_stop(self) -> None:
        # Its caller's cancellation cancelled its future; the caller has not run since
        # (to end the item) when the task is assembled.
        ran: list[Any] = []
        batcher = self.batcher(ran)
        items = [self.admit(batcher, k) for k in range(3)]
        items[1].future.cancel()
        items.append(self.admit(batcher, 3))  # four in line: a task goes, of three
        kept = [i.future for i in items if i is not items[1]]
        await asyncio.wait_for(asyncio.gather(*kept), 5)
        assert ran == [[0.0, 2.0, 3.0, 0.0]]
        stats = batcher.statistics()
        assert (stats.cancelled, stats.completed, stats.tasks) == (1, 3, 1)

    @pytest.mark.asyncio
    async def test_the_item_left_after_a_full_task_waits_for_its_delay(self) -> None:
        # One slot: while a task runs, N + 1 items wait; when it ends, N of them go as a
        # task and the one left waits for its own delay, even once that task ends too.
        ran: list[Any] = []
        answers: list[asyncio.Event] = []

        async def run(arrays: Any) -> Any:
            ran.append(arrays["a"][:, 0, 0, 0].tolist())
            answers.append(asyncio.Event())
            await answers[-1].wait()
            return {"out_a": np.zeros(OUT_A.shape), "out_b": np.zeros(OUT_B.shape)}

        batcher = Batcher(
            Batching(max_delay=10.0), (A, B), (OUT_A, OUT_B), run, "same_kind",
            slots=1, max_queue=4, latency_window=8,
        )  # fmt: skip
        items = [self.admit(batcher, k) for k in range(2 * N + 1)]
        for task in (1, 2):
            await wait_until(lambda: len(answers) == task)  # noqa: B023 (awaited here)
            answers[-1].set()
        await asyncio.wait_for(asyncio.gather(*(i.future for i in items[: 2 * N])), 5)
        for _ in range(5):
            await asyncio.sleep(0)
        stats = batcher.statistics()
        assert (stats.tasks, stats.waiting, len(ran)) == (2, 1, 2)
        batcher.flush()  # (rather than wait out the delay)
        await wait_until(lambda: len(answers) == 3)
        answers[-1].set()
        await asyncio.wait_for(items[-1].future, 5)
        assert ran[2] == [8.0, 0.0, 0.0, 0.0]


class TestATaskThatEndsWithoutRows:
    @staticmethod
    def batcher(run: Any) -> Batcher:
        return Batcher(
            Batching(max_delay=10.0), (A, B), (OUT_A, OUT_B), run, "same_kind",
            slots=1, max_queue=4, latency_window=8,
        )  # fmt: skip

    @pytest.mark.asyncio
    async def test_cancelled_from_outside_its_items_end_cancelled(self) -> None:
        # As at the loop's shutdown: the task is cancelled while every item waits for
        # its row; each item ends cancelled, once, and the task ends cancelled itself.
        async def run(arrays: Any) -> Any:
            await asyncio.Event().wait()

        batcher = self.batcher(run)
        items = [TestAssemblyOrder.admit(batcher, k) for k in range(N)]
        (task,) = batcher._tasks
        await asyncio.sleep(0)  # (the task awaits its run)
        task.cancel()
        await batcher.finished()
        assert task.cancelled() and all(i.future.cancelled() for i in items)
        stats = batcher.statistics()
        assert (stats.cancelled, stats.running, stats.withdrawn, stats.failed) == (N, 0, 0, 0)

    @pytest.mark.asyncio
    async def test_failed_its_items_fail_and_the_task_ends_cleanly(self) -> None:
        async def run(arrays: Any) -> Any:
            raise RuntimeError("the engine broke")

        batcher = self.batcher(run)
        items = [TestAssemblyOrder.admit(batcher, k) for k in range(N)]
        (task,) = batcher._tasks
        await batcher.finished()
        assert task.done() and not task.cancelled() and task.exception() is None
        for each in items:
            with pytest.raises(RuntimeError, match="the engine broke"):
                each.future.result()
        stats = batcher.statistics()
        assert (stats.failed, stats.running, stats.withdrawn) == (N, 0, 0)
