"""An engine with the submitter thread (``Engine(submit_thread=True)``) on the emulated
runtime: the thread makes the runtime's calls as Python callbacks, through the same C
queue, states and failure paths as the driver's entry points on a GPU (tests/gpu).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodla._handoff
from aiodla import AiodlaError, ConfigurationError, DeviceError, Engine, EngineDeadError
from aiodla._handoff import _library
from aiodla.runtime import EmulatedRuntime
from aiodla.runtime._handoff_calls import python_calls

from support import (
    X,
    affine_model,
    all_idle,
    busy_slots,
    counts_add_up,
    expected_affine,
    needs_cc,
    the_one_failure,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.in_process]  # the thread is in-process


@pytest.fixture(autouse=True)
def hand_everything(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Every request goes over, even one alone, one that finds the thread asleep, or
    one whose core is fed ahead."""
    monkeypatch.setattr(aiodla._handoff, "QUIET", 0.0)
    monkeypatch.setattr(aiodla._handoff, "FEED_BELOW", float("inf"))
    monkeypatch.setattr(aiodla._handoff, "WAITING_AT_LEAST", 0)
    monkeypatch.setenv("AIODLA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "handoff"))


def inputs(count: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(count)
    return [rng.normal(0, 3, size=X.shape).astype(np.float32) for _ in range(count)]


class Watched(EmulatedRuntime):
    """Notes which threads submit tasks; can hold submissions at a gate."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.submitters: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()

    def submit_task(self, device: int, task: Any, stream: int) -> None:
        self.gate.wait(5)
        self.submitters.add(threading.current_thread().name)
        super().submit_task(device, task, stream)


def one_slot(runtime: EmulatedRuntime) -> Engine:
    """An engine of one core and one slot, whose requests go to the submitter thread."""
    return Engine(
        affine_model(), runtime=runtime, submit_thread=True, cores=[0], streams_per_core=1
    )


def handed(engine: Engine) -> int:
    handoff = engine._cores.handoff  # type: ignore[attr-defined]
    assert handoff is not None
    return handoff.counts()["handed"]


@needs_cc
class TestResults:
    @pytest.mark.parametrize("convert", ["host", "device"])
    async def test_every_result_is_right(self, convert: str) -> None:
        runtime = Watched()
        xs = inputs(200)
        async with Engine(
            affine_model(1e-4),
            runtime=runtime,
            submit_thread=True,
            convert=convert,
            streams_per_core=4,
        ) as e:
            outputs = await asyncio.gather(*(e.infer(x) for x in xs))
            assert handed(e) >= 190  # all but each slot's first (which captures)
            await asyncio.sleep(0.01)
            assert all_idle(e)
            assert counts_add_up(e.statistics())
            assert e.statistics().completed == 200
        for x, y in zip(xs, outputs, strict=True):
            np.testing.assert_array_equal(y, expected_affine(x))
        assert runtime.submitters - {"MainThread"}  # the submitter thread's (a C thread)
        assert set(runtime.live_handles().values()) == {0}

    async def test_the_poller_waits_for_the_calls(self) -> None:
        """A slot whose calls are not made yet is not done, though its event (recorded
        by its last request) reads complete."""
        runtime = Watched()
        async with Engine(
            affine_model(1e-4), runtime=runtime, submit_thread=True, cores=[0], streams_per_core=1
        ) as e:
            first, second = inputs(2)
            await e.infer(first)  # captures the slot's graphs
            runtime.gate.clear()
            task = asyncio.ensure_future(e.infer(second))
            await asyncio.sleep(0.1)
            assert not task.done()
            runtime.gate.set()
            np.testing.assert_array_equal(await task, expected_affine(second))
            assert handed(e) == 1


@needs_cc
class TestFailures:
    @pytest.mark.parametrize("call", ["launch_graph", "submit_task"])
    async def test_only_that_request_fails(self, call: str) -> None:
        runtime = Watched()
        xs = inputs(40)
        async with Engine(
            affine_model(1e-4), runtime=runtime, submit_thread=True, streams_per_core=4
        ) as e:
            await asyncio.gather(*(e.infer(x) for x in xs[:8]))  # every slot's graphs
            before = handed(e)
            runtime.fail_call(call, 2, after=5)
            outcomes = await asyncio.gather(*(e.infer(x) for x in xs), return_exceptions=True)
            assert handed(e) - before == 40
            failure = the_one_failure(xs, outcomes)
            assert isinstance(failure, AiodlaError)
            assert call in str(failure)
            await asyncio.sleep(0.05)
            assert all_idle(e)
            stats = e.statistics()
            assert counts_add_up(stats)
            assert (stats.failed, stats.completed) == (1, 47)
        assert set(runtime.live_handles().values()) == {0}

    async def test_a_failed_launch_is_a_device_error(self) -> None:
        runtime = Watched()
        async with one_slot(runtime) as e:
            x = inputs(1)[0]
            await e.infer(x)
            runtime.fail_call("launch_graph", 2)  # cudaErrorMemoryAllocation
            with pytest.raises(DeviceError, match="launch_graph"):
                await e.infer(x)
            np.testing.assert_array_equal(await e.infer(x), expected_affine(x))
            assert handed(e) == 2
            assert counts_add_up(e.statistics())

    async def test_a_slot_whose_end_cannot_be_marked_is_lost(self) -> None:
        runtime = Watched()
        engine = Engine(
            affine_model(),
            runtime=runtime,
            submit_thread=True,
            cores=[0],
            streams_per_core=2,
            close_timeout=0.2,
        )
        async with engine as e:
            xs = inputs(4)
            await asyncio.gather(e.infer(xs[0]), e.infer(xs[1]))  # both slots' graphs
            await asyncio.sleep(0.01)
            runtime.fail_call("submit_task", 1)
            runtime.fail_call("record_event", 1)  # the thread's end mark
            with pytest.raises(AiodlaError, match="submitting"):
                await e.infer(xs[2])
            await asyncio.sleep(0.05)
            assert busy_slots(e) == 1  # kept out of the pool: it may never be safe
            np.testing.assert_array_equal(await e.infer(xs[3]), expected_affine(xs[3]))
            stats = e.statistics()
            assert counts_add_up(stats)
            assert (stats.failed, stats.completed) == (1, 3)

    async def test_a_sticky_error_kills_the_engine(self) -> None:
        runtime = Watched()
        async with one_slot(runtime) as e:
            x = inputs(1)[0]
            await e.infer(x)
            runtime.fail_call("launch_graph", 700)  # cudaErrorIllegalAddress
            with pytest.raises(EngineDeadError):
                await e.infer(x)
            assert e.dead

    async def test_a_request_cancelled_meanwhile_still_frees_its_slot(self) -> None:
        runtime = Watched()
        async with one_slot(runtime) as e:
            xs = inputs(2)
            await e.infer(xs[0])
            runtime.gate.clear()
            runtime.fail_call("submit_task", 1)
            task = asyncio.ensure_future(e.infer(xs[1]))
            await asyncio.sleep(0.02)
            task.cancel()
            runtime.gate.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.05)
            assert all_idle(e)
            np.testing.assert_array_equal(await e.infer(xs[1]), expected_affine(xs[1]))
            stats = e.statistics()
            assert counts_add_up(stats)
            assert stats.cancelled == 1


@needs_cc
class TestWhatGoesOver:
    """Which requests the thread carries (``FEED_BELOW`` and ``WAITING_AT_LEAST``)."""

    @pytest.fixture(autouse=True)
    def the_defaults(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(aiodla._handoff, "FEED_BELOW", 200e-6)
        monkeypatch.setattr(aiodla._handoff, "WAITING_AT_LEAST", 1)

    async def serve(self, latency: float, xs: list[Any], *, one_at_a_time: bool) -> int:
        """Serve ``xs`` (checking every result); how many the thread carried."""
        runtime = Watched()
        async with Engine(
            affine_model(latency), runtime=runtime, submit_thread=True, streams_per_core=4
        ) as e:
            if one_at_a_time:
                outputs = [await e.infer(x) for x in xs]
            else:
                outputs = await asyncio.gather(*(e.infer(x) for x in xs))
            carried = handed(e)
        for x, y in zip(xs, outputs, strict=True):
            np.testing.assert_array_equal(y, expected_affine(x))
        assert (runtime.submitters == {"MainThread"}) == (carried == 0)
        return carried

    async def test_a_core_fed_ahead_makes_its_calls_on_the_loop(self) -> None:
        # Each request after a core's first finds 5 ms tasks queued ahead of it.
        assert await self.serve(5e-3, inputs(40), one_at_a_time=False) <= 2

    async def test_a_core_waiting_on_the_loop_hands_over(self) -> None:
        assert await self.serve(1e-6, inputs(200), one_at_a_time=False) >= 150

    async def test_a_request_with_none_waiting_behind_it_stays_on_the_loop(self) -> None:
        assert await self.serve(1e-6, inputs(40), one_at_a_time=True) == 0


class TestChoosing:
    async def test_by_default_not_for_the_emulated_runtime(self) -> None:
        async with Engine(affine_model(), runtime="emulated") as e:
            assert e._cores.handoff is None  # type: ignore[attr-defined]

    @pytest.mark.parametrize(
        "options", [{"submit_thread": False}, {"graphs": False}, {"stage_times": True}]
    )
    async def test_not_when_it_would_carry_nothing(self, options: dict[str, Any]) -> None:
        offering = Offering()
        async with Engine(affine_model(), runtime=offering, **options) as e:
            assert e._cores.handoff is None  # type: ignore[attr-defined]
            x = inputs(1)[0]
            np.testing.assert_array_equal(await e.infer(x), expected_affine(x))

    @needs_cc
    async def test_by_default_where_the_runtime_offers_entry_points(self) -> None:
        async with Engine(affine_model(), runtime=Offering()) as e:
            assert e._cores.handoff is not None  # type: ignore[attr-defined]
            assert not e._cores.handoff.native  # type: ignore[attr-defined]

    async def test_a_wrong_value_is_refused(self) -> None:
        with pytest.raises(ConfigurationError, match="submit_thread='yes'"):
            Engine(affine_model(), runtime="emulated", submit_thread="yes")

    async def test_asked_for_but_unbuildable_is_an_error(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        monkeypatch.setattr(_library, "_loaded", {})
        monkeypatch.setenv("AIODLA_CC", "/nonexistent/cc")
        runtime = EmulatedRuntime()
        with pytest.raises(ConfigurationError, match="submit_thread=True, but no C compiler"):
            async with Engine(affine_model(), runtime=runtime, submit_thread=True):
                pass
        assert set(runtime.live_handles().values()) == {0}

    async def test_by_default_unbuildable_warns_and_enqueues_on_the_loop(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        monkeypatch.setattr(_library, "_loaded", {})
        monkeypatch.setenv("AIODLA_CC", "/nonexistent/cc")
        with caplog.at_level(logging.WARNING, logger="aiodla"):
            async with Engine(affine_model(), runtime=Offering()) as e:
                assert e._cores.handoff is None  # type: ignore[attr-defined]
                x = inputs(1)[0]
                np.testing.assert_array_equal(await e.infer(x), expected_affine(x))
        assert "enqueueing on the event loop instead: no C compiler" in caplog.text


class Offering(EmulatedRuntime):
    """A runtime that offers the thread entry points of its own, as the CUDA runtime
    does (here its own methods as callbacks)."""

    def handoff_calls(self) -> Any:
        return python_calls(self)
