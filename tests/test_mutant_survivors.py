"""Bugs a mutation audit put into the engine one at a time that the rest of the suite let
through (issue 34): each test here fails on its bug and names the behaviour it holds.

They drive the engine through its public API and aiodla.testing's controls, and read
what a user reads (``statistics()``, the next ``infer``), so they hold whatever the
flow, the device layer and the worker process look like inside.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
from typing import Any

import numpy as np
import pytest

from aiodla import (
    DeviceError,
    EmulatedRuntime,
    Engine,
    Histogram,
    TaskError,
    TensorSpec,
    WorkerLostError,
)
from aiodla._statistics import HistogramRecorder
from aiodla.testing import EngineFactory

from support import (
    HeldRequest,
    X,
    affine_model,
    all_idle,
    counts_add_up,
    expected_affine,
    wait_until,
    worker_pid,
)

ONES = np.ones(X.shape, np.float32)


def slots_of(engine: Engine) -> tuple[int, int]:
    """(busy, idle) slots over all cores, as statistics() reports them."""
    cores = engine.statistics().cores
    return sum(c.busy_slots for c in cores), sum(c.idle_slots for c in cores)


# -- a request cancelled in flight, its outputs unpacked in a worker thread -------------------


class TestCancelledWhileItsOutputsWouldUnpackOffTheLoop:
    @pytest.mark.asyncio
    async def test_the_slot_comes_back_and_the_next_request_is_served(
        self, held_offloaded_request: HeldRequest
    ) -> None:
        # Every request's outputs are unpacked in a worker thread. A completion for a
        # request its caller gave up must not hand it that step (its future is done):
        # the slot goes straight back to the pool.
        engine, gate, task = held_offloaded_request
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert slots_of(engine) == (1, 0)  # the DLA still runs its task
        gate.release()
        await wait_until(lambda: all_idle(engine))
        assert slots_of(engine) == (0, 1)
        np.testing.assert_array_equal(await engine.infer(ONES * 3), expected_affine(ONES * 3))
        stats = engine.statistics()
        assert (stats.cancelled, stats.completed) == (1, 1) and counts_add_up(stats)


# -- isolation="process": the worker lost while a request packs in a thread --------------------


class _HeldInput(np.ndarray):  # type: ignore[type-arg]
    """An input whose packing, off the event loop's thread, waits for ``go``: the engine
    packs it in a worker thread (offload_bytes=0), so the test decides when that ends.

    Its views (the blocks the packer slices) wait on first creation off the loop; on
    the loop's thread (validation) nothing waits.
    """

    packing: threading.Event
    go: threading.Event
    loop_thread: int

    def __array_finalize__(self, obj: Any) -> None:
        if obj is None or not isinstance(obj, _HeldInput):
            return
        self.packing, self.go, self.loop_thread = obj.packing, obj.go, obj.loop_thread
        if threading.get_ident() != self.loop_thread:
            self.packing.set()
            self.go.wait(30)


def held_input(value: float) -> _HeldInput:
    array = np.full(X.shape, value, np.float32).view(_HeldInput)
    array.packing, array.go = threading.Event(), threading.Event()
    array.loop_thread = threading.get_ident()
    return array


class TestWorkerLostWhileAnInputPacks:
    @pytest.mark.asyncio
    async def test_cancelling_its_caller_afterwards_returns_the_slot(self) -> None:
        # The loss decides the request's outcome while its coroutine packs; the caller
        # cancelled afterwards never takes that outcome, so cancelling must give back
        # the slot the packing step held, or one slot is lost for good each time.
        async with Engine(
            affine_model(),
            runtime="emulated",
            isolation="process",
            cores=[0],
            streams_per_core=2,
            offload_bytes=0,
        ) as engine:
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))
            x = held_input(2.0)
            task = asyncio.ensure_future(engine.infer(x))
            await asyncio.to_thread(x.packing.wait, 10)
            assert x.packing.is_set(), "the input never started packing"
            os.kill(worker_pid(engine), signal.SIGKILL)
            await wait_until(lambda: engine.statistics().worker.restarts == 1, timeout=20)  # type: ignore[union-attr]
            assert engine.health().status == "ok"
            task.cancel()
            x.go.set()
            with pytest.raises((asyncio.CancelledError, WorkerLostError)):
                await task
            await wait_until(lambda: all_idle(engine))
            assert slots_of(engine) == (0, 2)
            twice = await asyncio.gather(engine.infer(ONES * 3), engine.infer(ONES * 4))
            for value, y in zip((3, 4), twice):
                np.testing.assert_array_equal(y, expected_affine(ONES * value))
            assert counts_add_up(engine.statistics())


# -- a failed submission whose end mark also failed ----------------------------------------


class TestASlotWhoseEndCannotBeMarked:
    @pytest.mark.asyncio
    async def test_stays_out_of_the_pool(self, leaky_runtime: EmulatedRuntime) -> None:
        # submit_task failed, then recording the slot's end event failed: copies may
        # still be queued on its stream, so the slot is never handed out again (on a
        # DLA the next request's inputs could be overwritten under them). Its handles
        # stay allocated at close for the same reason: hence the leaky runtime.
        async with Engine(
            affine_model(),
            runtime=leaky_runtime,
            cores=[0],
            streams_per_core=2,
            close_timeout=0.2,
        ) as engine:
            await asyncio.gather(engine.infer(ONES), engine.infer(ONES))  # both slots used
            leaky_runtime.fail_call("submit_task", 1)
            leaky_runtime.fail_call("record_event", 1)
            with pytest.raises(DeviceError, match="submitting"):
                await engine.infer(ONES * 2)
            # Requests after it run on the one slot left; each completion the poller
            # hands over ends a sweep in which a pooled retired slot would have come back.
            for value in range(3, 8):
                np.testing.assert_array_equal(
                    await engine.infer(ONES * value), expected_affine(ONES * value)
                )
                assert slots_of(engine) == (1, 1)
            stats = engine.statistics()
            assert (stats.failed, stats.completed) == (1, 7) and counts_add_up(stats)
            assert "1 busy slots, 1 idle" in repr(engine), repr(engine)


# -- a DLA status that cannot be read ------------------------------------------------------


class _UnreadableStatus(EmulatedRuntime):
    """``get_last_error`` raises a plain RuntimeError (not a cuDLA error) once armed."""

    def __init__(self, cores: int = 2) -> None:
        super().__init__(cores)
        self.armed = 0

    def get_last_error(self, device: int) -> int:
        if self.armed:
            self.armed -= 1
            raise RuntimeError("the status could not be read")
        return super().get_last_error(device)


class TestAnUnreadableTaskStatus:
    # A runtime instance of the test's own: in-process only (an instance does not
    # cross into the worker of isolation="process").
    @pytest.mark.in_process
    @pytest.mark.asyncio
    async def test_fails_the_request_as_a_task_error(self) -> None:
        runtime = _UnreadableStatus()
        async with Engine(affine_model(), runtime=runtime, cores=[0], streams_per_core=1) as engine:
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))
            runtime.armed = 1
            with pytest.raises(TaskError) as caught:
                await engine.infer(ONES * 2)
            assert caught.value.core == 0 and caught.value.status != 0
            np.testing.assert_array_equal(await engine.infer(ONES * 3), expected_affine(ONES * 3))
            stats = engine.statistics()
            assert (stats.failed, stats.completed) == (1, 2)
            assert stats.cores[0].failed == 1 and counts_add_up(stats)
        assert all(count == 0 for count in runtime.live_handles().values())


# -- float16's overflow band in large blocks ------------------------------------------------


class TestFloat16OverflowInLargeBlocks:
    @pytest.mark.parametrize("value", [65520.0, 65536.0, 70000.0, 131071.0, -70000.0])
    @pytest.mark.parametrize("source", ["float32", "float64"])
    def test_values_past_the_range_become_infinity(self, value: float, source: str) -> None:
        # 16,384 elements: the vectorized kernels' path (numpy's casts take small blocks).
        spec = TensorSpec("x", (1, 1, 128, 128), "float16", "nchw")
        array = np.full(spec.shape, value, source)
        packed = spec.pack(array, validate=False).view(np.float16)
        assert np.isinf(packed).all() and (np.sign(packed) == np.sign(value)).all()

    @pytest.mark.asyncio
    async def test_an_engine_with_same_kind_casting_stores_infinity(
        self, aiodla_engine: EngineFactory
    ) -> None:
        spec = TensorSpec("x", (1, 1, 128, 128), "float16", "nchw")
        out = TensorSpec("y", spec.shape, "float32", "nchw")
        engine = await aiodla_engine(
            inputs=[spec], outputs=[out], scale=1.0, bias=0.0, casting="same_kind"
        )
        y = await engine.infer(np.full(spec.shape, 70000.0, np.float32))
        assert np.isposinf(y).all()


# -- histograms: a bound's own duration, and the +Inf bucket ----------------------------------


class TestHistogramBuckets:
    def test_a_duration_on_a_bound_counts_in_that_bucket(self) -> None:
        recorder = HistogramRecorder((0.001, 0.002))
        for seconds in (0.001, 0.002, 0.0015, 0.003):
            recorder.add(seconds)
        snapshot = recorder.snapshot()
        # le="0.001" holds 0.001 itself (Prometheus' buckets are "less or equal").
        assert snapshot.counts == (1, 3) and snapshot.count == 4

    def test_the_inf_bucket_counts_durations_past_the_last_bound(self) -> None:
        pytest.importorskip("prometheus_client")
        from aiodla.metrics import _buckets

        recorder = HistogramRecorder((1.0,))
        recorder.add(20.0)
        buckets, total = _buckets(recorder.snapshot())
        assert buckets == [("1.0", 0), ("+Inf", 1)] and total == 20.0

    @pytest.mark.asyncio
    async def test_a_scrape_gives_inf_equal_to_count(
        self, aiodla_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        pytest.importorskip("prometheus_client")
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        from aiodla.metrics import EngineCollector

        engine = await aiodla_engine(affine_model())
        await engine.infer(ONES)
        measured = engine.statistics()
        # One request of 20 s, past the last bound of 1 s: what statistics() says is
        # what the scrape must say.
        long = Histogram(bounds=(1.0,), counts=(0,), count=1, sum=20.0)
        monkeypatch.setattr(
            engine, "statistics", lambda: dataclasses.replace(measured, latency_histogram=long)
        )
        registry = CollectorRegistry()
        registry.register(EngineCollector({"m": engine}))
        text = generate_latest(registry).decode()
        samples = {
            (s.name, s.labels.get("le")): s.value
            for family in text_string_to_metric_families(text)
            if family.name == "aiodla_request_duration_seconds"
            for s in family.samples
        }
        assert samples[("aiodla_request_duration_seconds_bucket", "1.0")] == 0
        assert samples[("aiodla_request_duration_seconds_bucket", "+Inf")] == 1
        assert samples[("aiodla_request_duration_seconds_count", None)] == 1
        assert samples[("aiodla_request_duration_seconds_sum", None)] == 20.0
