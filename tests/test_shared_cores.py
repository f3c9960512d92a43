"""Several engines on one aiodla.Cores: one dispatcher, one poller, one record per
core, priorities, weights, and every request of every engine ending exactly once while the others keep serving.

States are reached through the emulated DLA's controls (held cores, injected faults);
orders are read from what completes, never from the wall clock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

import aiodla
from aiodla import (
    ConfigurationError,
    Cores,
    EmulatedRuntime,
    Engine,
    EngineClosedError,
    RequestTimeoutError,
    TaskError,
)
from aiodla._dispatch import DEPTH, TOP_DEPTH
from aiodla.testing import DLAControls

from support import X, affine_model, all_idle, counts_add_up, expected_affine, wait_until

# A shared Cores hands its runtime instance to its engines: in-process only.
pytestmark = [pytest.mark.in_process, pytest.mark.usefixtures("engines_add_up")]

ONES = np.ones(X.shape, np.float32)


@pytest_asyncio.fixture
async def dla(runtime: EmulatedRuntime) -> AsyncIterator[Cores]:
    async with Cores([0, 1], runtime=runtime) as shared:
        yield shared
    assert shared.engines == 0


def held_tasks(dla: Cores) -> list[int]:
    return [dla.dispatcher.held(n) for n in dla.cores]


async def settle(*engines: Engine) -> None:
    await wait_until(lambda: all(all_idle(e) for e in engines))


class TestServing:
    @pytest.mark.asyncio
    async def test_two_models_share_the_cores_and_the_runtime(self, dla: Cores) -> None:
        async with (
            Engine(affine_model(0.001), cores=dla) as a,
            Engine(affine_model(0.002, scale=3.0), cores=dla) as b,
        ):
            assert a.runtime is b.runtime is dla.runtime
            assert a.shared_cores is b.shared_cores is dla
            xs = [ONES * i for i in range(20)]
            ya, yb = await asyncio.gather(
                asyncio.gather(*(a.infer(x) for x in xs)),
                asyncio.gather(*(b.infer(x) for x in xs)),
            )
            for x, y, z in zip(xs, ya, yb, strict=True):
                np.testing.assert_array_equal(y, expected_affine(x))
                np.testing.assert_array_equal(z, expected_affine(x, scale=3.0))
            assert a.statistics().completed == b.statistics().completed == 20
            assert dla.engines == 2
        assert dla.engines == 0

    @pytest.mark.asyncio
    async def test_engines_of_the_top_priority_fill_a_core_to_top_depth(
        self, dla: Cores, aiodla_controls: DLAControls
    ) -> None:
        async with (
            Engine(affine_model(), cores=dla, streams_per_core=4) as a,
            Engine(affine_model(), cores=dla, streams_per_core=4) as b,
        ):
            with aiodla_controls.hold() as gate:
                calls = [asyncio.ensure_future(e.infer(ONES)) for e in (a, b) for _ in range(10)]
                await gate.reached(2 * TOP_DEPTH)
                assert held_tasks(dla) == [TOP_DEPTH, TOP_DEPTH]
                assert a.statistics().queued + b.statistics().queued == 20 - 2 * TOP_DEPTH
            await asyncio.gather(*calls)
            assert held_tasks(dla) == [0, 0]

    @pytest.mark.asyncio
    async def test_below_the_top_priority_a_core_holds_one_queued_task(
        self, dla: Cores, aiodla_controls: DLAControls
    ) -> None:
        # The detector has nothing to do: its priority alone keeps the classifiers'
        # queued work short, so its next request waits for at most two of their tasks.
        async with (
            Engine(affine_model(), cores=dla, priority=1),
            Engine(affine_model(), cores=dla, streams_per_core=4) as a,
            Engine(affine_model(), cores=dla, streams_per_core=4) as b,
        ):
            with aiodla_controls.hold() as gate:
                calls = [asyncio.ensure_future(e.infer(ONES)) for e in (a, b) for _ in range(10)]
                await gate.reached(2 * DEPTH)
                await wait_until(lambda: a.statistics().queued + b.statistics().queued == 16)
                assert held_tasks(dla) == [DEPTH, DEPTH]
            await asyncio.gather(*calls)

    @pytest.mark.asyncio
    async def test_subset_puts_an_engine_on_some_cores(
        self, dla: Cores, runtime: EmulatedRuntime
    ) -> None:
        async with Engine(affine_model(), cores=dla.subset([1])) as one:
            assert [c.core for c in one.statistics().cores] == [1]
            await asyncio.gather(*(one.infer(ONES) for _ in range(4)))
        assert runtime.core_tasks(0) == 0 and runtime.core_tasks(1) == 4


class TestPriority:
    @pytest.mark.asyncio
    async def test_waiting_high_priority_work_goes_before_any_lower(
        self,
        runtime: EmulatedRuntime,
        aiodla_controls: DLAControls,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        # One core: its tasks run in the order they were submitted, so the order of
        # the submissions (by device handle: one per engine) is the order of the runs.
        submitted: list[int] = []
        submit = runtime.submit_task

        def recording(device: int, task: Any, stream: int) -> None:
            submitted.append(device)
            submit(device, task, stream)

        monkeypatch.setattr(runtime, "submit_task", recording)
        async with (
            Cores([0], runtime=runtime) as dla,
            Engine(affine_model(), cores=dla, priority=0) as low,
            Engine(affine_model(), cores=dla, priority=1) as high,
        ):
            with aiodla_controls.hold(0) as gate:
                lows = [asyncio.ensure_future(low.infer(ONES)) for _ in range(6)]
                await gate.reached(DEPTH)
                highs = [asyncio.ensure_future(high.infer(ONES)) for _ in range(4)]
                await wait_until(lambda: high.statistics().submitted == 4)
            await asyncio.gather(*lows, *highs)
        by = {submitted[0]: "low", next(d for d in submitted if d != submitted[0]): "high"}
        # The two lows already on the core run; then every high before any other low.
        order = [by[d] for d in submitted]
        assert order == ["low"] * DEPTH + ["high"] * 4 + ["low"] * (6 - DEPTH)

    @pytest.mark.asyncio
    async def test_urgent_work_goes_to_the_core_whose_running_task_started_first(
        self, dla: Cores, aiodla_controls: DLAControls
    ) -> None:
        # Each core holds one classifier task of the same model, core 0's given 10 ms
        # before core 1's: core 0 frees first, although each holds as much work. (The
        # detector used core 0 once before, so a tie would send it to core 1.)
        async with (
            Engine(affine_model(0.001), cores=dla, priority=1) as detector,
            Engine(affine_model(0.2), cores=dla, priority=0) as classifier,
        ):
            await detector.infer(ONES)
            assert [c.completed for c in detector.statistics().cores] == [1, 0]
            with aiodla_controls.hold() as gate:
                first = asyncio.ensure_future(classifier.infer(ONES))
                await gate.reached(1)
                await asyncio.sleep(0.01)
                second = asyncio.ensure_future(classifier.infer(ONES))
                await gate.reached(2)
                assert held_tasks(dla) == [1, 1]
                urgent = asyncio.ensure_future(detector.infer(ONES))
                await gate.reached(3)
            await asyncio.gather(first, second, urgent)
            assert [c.completed for c in classifier.statistics().cores] == [1, 1]
            assert [c.completed for c in detector.statistics().cores] == [2, 0]

    @pytest.mark.asyncio
    async def test_lower_priority_takes_a_core_the_higher_cannot_use(self, dla: Cores) -> None:
        async with (
            Engine(affine_model(), cores=dla.subset([0]), priority=5) as high,
            Engine(affine_model(), cores=dla, priority=0) as low,
        ):
            await asyncio.gather(
                *(high.infer(ONES) for _ in range(20)), *(low.infer(ONES) for _ in range(20))
            )
            assert low.statistics().cores[1].completed > 0  # core 1 never idled for it

    @pytest.mark.asyncio
    async def test_a_higher_priority_completion_is_taken_while_a_lower_engine_floods(
        self, dla: Cores, aiodla_controls: DLAControls
    ) -> None:
        # The detector's task is held past its expected end while the classifier keeps
        # the loop busy with batches on the other core: the cores' one poller still
        # sees the detector's task done and returns it.
        async with (
            Engine(affine_model(0.003), cores=dla.subset([0]), priority=1) as detector,
            Engine(affine_model(0.001), cores=dla.subset([1])) as classifier,
        ):
            with aiodla_controls.hold(0) as gate:
                urgent = asyncio.ensure_future(detector.infer(ONES * 2))
                await gate.reached(1)
                await asyncio.sleep(0.02)  # past the expected end
            for _ in range(500):  # about a second of the classifier's batches
                await asyncio.gather(*(classifier.infer(ONES) for _ in range(2)))
                if urgent.done():
                    break
            assert urgent.done(), "the detector's completion was not taken"
            np.testing.assert_array_equal(await urgent, expected_affine(ONES * 2))
            assert detector.statistics().completed == 1


def poller_threads() -> int:
    return sum(t.name == "aiodla-poller" and t.is_alive() for t in threading.enumerate())


class TestOneOwner:
    @pytest.mark.asyncio
    async def test_three_engines_on_two_cores_run_one_poller_and_the_handles_stated(
        self, runtime: EmulatedRuntime
    ) -> None:
        # docs/design.md: one poller thread for every engine on a Cores; per engine and
        # core, one device handle (a module each: its status latch is its own) and its
        # ring of streams_per_core streams (its own option, 2 unless told otherwise).
        before = poller_threads()
        async with Cores([0, 1], runtime=runtime) as dla:
            engines = [
                Engine(affine_model(), cores=dla, priority=p, graphs=False) for p in (1, 0, 0)
            ]
            for engine in engines:
                await engine.open()
            results = await asyncio.gather(*(e.infer(ONES * 2) for e in engines for _ in range(8)))
            for result in results:
                np.testing.assert_array_equal(result, expected_affine(ONES * 2))
            assert dla.pollers == 1 and poller_threads() == before + 1
            handles = runtime.live_handles()
            assert handles["devices"] == 3 * 2 and handles["modules"] == 3 * 2
            assert handles["streams"] == 3 * 2 * 2
            assert all(e.options.streams_per_core == 2 for e in engines)
            # One record per physical core, shared by every engine's lane on it.
            for engine in engines:
                lanes = engine._device.lanes
                assert [lane.record for lane in lanes] == [dla.records[0], dla.records[1]]
            for engine in engines:
                await engine.aclose()
            assert dla.pollers == 1  # the cores' thread outlives their engines
        assert poller_threads() == before

    @pytest.mark.asyncio
    async def test_the_cores_record_counts_every_engines_tasks(
        self, dla: Cores, aiodla_controls: DLAControls
    ) -> None:
        async with (
            Engine(affine_model(), cores=dla.subset([0]), streams_per_core=4) as a,
            Engine(affine_model(), cores=dla.subset([0]), streams_per_core=4) as b,
        ):
            with aiodla_controls.hold(0) as gate:
                calls = [asyncio.ensure_future(e.infer(ONES)) for e in (a, b) for _ in range(2)]
                await gate.reached(4)
                assert dla.records[0].held == 4 and held_tasks(dla) == [4, 0]
                assert dla.records[0].expected_free > 0
            await asyncio.gather(*calls)
            await settle(a, b)
            assert held_tasks(dla) == [0, 0]


def busy_time(engine: Engine) -> float:
    """Seconds of DLA time the engine's completed tasks took."""
    return sum(core.busy_time for core in engine.statistics().cores)


class TestWeights:
    async def shares(self, runtime: EmulatedRuntime, engines: list[dict[str, Any]]) -> list[float]:
        """Each engine's share of the grants made while all of them had work."""
        async with Cores([0, 1], runtime=runtime) as dla:
            opened = [Engine(model, cores=dla, **options) for model, options in engines]
            for engine in opened:
                await engine.open()
            calls = [asyncio.ensure_future(e.infer(ONES)) for e in opened for _ in range(240)]
            await wait_until(lambda: sum(e.statistics().submitted for e in opened) == len(calls))
            first = [busy_time(e) for e in opened]
            # Until the first engine has no request left waiting, all of them have work.
            await wait_until(lambda: min(e.statistics().queued for e in opened) == 0)
            time = [busy_time(e) - t for e, t in zip(opened, first, strict=True)]
            await asyncio.gather(*calls)
            for engine in opened:
                await engine.aclose()
        return [t / sum(time) for t in time]

    @pytest.mark.asyncio
    async def test_shares_are_each_engines_by_its_order_of_opening(self, dla: Cores) -> None:
        async with Engine(affine_model(), cores=dla) as a, Engine(affine_model(), cores=dla) as b:
            await asyncio.gather(*(a.infer(ONES) for _ in range(3)))
            await asyncio.gather(*(b.infer(ONES) for _ in range(5)))
            shares = dla.shares()
            assert sorted(shares) == [0, 1]
            assert (shares[0][0], shares[1][0]) == (3, 5)
            assert shares[0][1] > 0 and shares[1][1] > 0

    @pytest.mark.asyncio
    async def test_core_time_follows_the_weights(self, runtime: EmulatedRuntime) -> None:
        model = affine_model()
        even = await self.shares(runtime, [(model, {}), (model, {})])
        assert even == pytest.approx([0.5, 0.5], abs=0.05)
        twice = await self.shares(runtime, [(model, {"weight": 2}), (model, {"weight": 1})])
        assert twice == pytest.approx([2 / 3, 1 / 3], abs=0.05)

    @pytest.mark.asyncio
    async def test_shares_are_of_core_time_not_of_tasks(self, runtime: EmulatedRuntime) -> None:
        # 1 ms and 3 ms tasks at equal weights: three short tasks for each long one.
        share = await self.shares(runtime, [(affine_model(0.001), {}), (affine_model(0.003), {})])
        assert share == pytest.approx([0.5, 0.5], abs=0.05)


class TestExactlyOnce:
    @pytest.mark.asyncio
    async def test_cancel_timeout_and_fault_of_one_engine_leave_the_other_serving(
        self, dla: Cores, aiodla_controls: DLAControls
    ) -> None:
        async with (
            Engine(affine_model(), cores=dla, streams_per_core=4) as a,
            Engine(affine_model(), cores=dla, streams_per_core=4) as b,
        ):
            room = 2 * TOP_DEPTH  # (a fills both cores; b's requests wait for room)
            with aiodla_controls.hold() as gate:
                running = [asyncio.ensure_future(a.infer(ONES * i)) for i in range(room)]
                await gate.reached(room)
                queued = asyncio.ensure_future(a.infer(ONES))
                expiring = asyncio.ensure_future(a.infer(ONES, timeout=0))
                others = [asyncio.ensure_future(b.infer(ONES * i)) for i in range(6)]
                await wait_until(lambda: b.statistics().queued == 6)
                queued.cancel()
                running[0].cancel()
                with pytest.raises(RequestTimeoutError):
                    await expiring
                aiodla_controls.fail_next()
            outcomes = await asyncio.gather(*running, queued, *others, return_exceptions=True)
            assert isinstance(outcomes[0], asyncio.CancelledError)
            assert isinstance(outcomes[room], asyncio.CancelledError)
            failed = [o for o in outcomes if isinstance(o, TaskError)]
            assert len(failed) == 1
            await settle(a, b)
            sa, sb = a.statistics(), b.statistics()
            assert sa.cancelled == 2 and sa.timed_out == 1
            assert sa.failed + sb.failed == 1
            assert sa.completed + sb.completed == room - 1 + 6 - 1
            assert counts_add_up(sa) and counts_add_up(sb)
            # Both engines serve on afterwards.
            y = await asyncio.gather(a.infer(ONES), b.infer(ONES))
            np.testing.assert_array_equal(y[0], expected_affine(ONES))

    @pytest.mark.asyncio
    async def test_a_lost_context_ends_every_engines_requests_once(
        self, dla: Cores, aiodla_controls: DLAControls
    ) -> None:
        # One CUDA context under the shared cores: a sticky error is every engine's.
        async with (
            Engine(affine_model(), cores=dla) as a,
            Engine(affine_model(), cores=dla) as b,
        ):
            with aiodla_controls.hold() as gate:
                calls = [asyncio.ensure_future(e.infer(ONES)) for e in (a, b) for _ in range(5)]
                await gate.reached(4)
                aiodla_controls.poison()
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            assert all(isinstance(o, aiodla.EngineDeadError) for o in outcomes)
            for engine in (a, b):
                stats = engine.statistics()
                assert stats.failed == 5 and counts_add_up(stats)
                assert engine.health().status == "dead"
        assert dla.engines == 0 and held_tasks(dla) == [0, 0]

    @pytest.mark.asyncio
    async def test_a_sticky_error_seen_by_one_engine_kills_the_idle_others(
        self, dla: Cores, runtime: EmulatedRuntime
    ) -> None:
        # Only the first engine meets the error (its packing step on the device): the
        # other, idle, has nothing that would fail, yet the context under it is lost.
        async with (
            Engine(affine_model(), cores=dla, convert="device") as meets,
            Engine(affine_model(), cores=dla) as idle,
        ):
            await idle.infer(ONES)
            runtime.fail_call("pack", 700)  # cudaErrorIllegalAddress: the context is lost
            with pytest.raises(aiodla.EngineDeadError):
                await meets.infer(ONES)
            assert meets.dead and idle.dead
            assert idle.health().status == "dead"
            assert idle._life.dead_cause is meets._life.dead_cause
            with pytest.raises(aiodla.EngineDeadError):
                await idle.infer(ONES)

    @pytest.mark.asyncio
    async def test_a_failed_submission_gives_its_slot_back_and_counts_no_task(
        self, dla: Cores, runtime: EmulatedRuntime
    ) -> None:
        # Two engines: the dispatcher pairs each request with its slot (no lone fast
        # path); the slot whose submission failed comes back with no request.
        async with Engine(affine_model(), cores=dla) as a, Engine(affine_model(), cores=dla) as b:
            runtime.fail_call("submit_task", 2)  # cudlaErrorOutOfResources, once
            with pytest.raises(aiodla.DeviceError, match="submitting the request failed"):
                await a.infer(ONES)
            await settle(a, b)
            assert [(c.completed, c.failed) for c in a.statistics().cores] == [(0, 0)] * 2
            assert held_tasks(dla) == [0, 0]
            y = await asyncio.gather(a.infer(ONES), b.infer(ONES))
            np.testing.assert_array_equal(y[0], expected_affine(ONES))
            assert sum(c.completed for c in a.statistics().cores) == 1

    @pytest.mark.asyncio
    async def test_closing_one_engine_leaves_the_others_slots_and_handles(
        self, dla: Cores, runtime: EmulatedRuntime, aiodla_controls: DLAControls
    ) -> None:
        async with Engine(affine_model(), cores=dla) as stays:
            alone = dict(runtime.live_handles())
            goes = Engine(affine_model(), cores=dla)
            await goes.open()
            with aiodla_controls.hold() as gate:
                mine = [asyncio.ensure_future(stays.infer(ONES * i)) for i in range(3)]
                theirs = [asyncio.ensure_future(goes.infer(ONES)) for _ in range(8)]
                await gate.reached(4)
                closing = asyncio.ensure_future(goes.aclose())
                await wait_until(lambda: goes.statistics().queued == 0)
            await closing
            outcomes = await asyncio.gather(*theirs, return_exceptions=True)
            ended = [o for o in outcomes if isinstance(o, BaseException)]
            assert all(isinstance(o, EngineClosedError) for o in ended)
            for i, y in enumerate(await asyncio.gather(*mine)):
                np.testing.assert_array_equal(y, expected_affine(ONES * i))
            # (its slots captured graphs of their first requests meanwhile: its own)
            assert {**runtime.live_handles(), "graphs": 0} == {**alone, "graphs": 0}
            assert len(dla.dispatcher.clients) == 1
            stats = stays.statistics()
            ring = stays.options.streams_per_core
            assert stats.completed == 3 and all(c.idle_slots == ring for c in stats.cores)
            assert counts_add_up(goes.statistics())
            await stays.infer(ONES)

    @pytest.mark.asyncio
    async def test_closing_the_cores_closes_their_engines(
        self, runtime: EmulatedRuntime, aiodla_controls: DLAControls
    ) -> None:
        async with Cores([0, 1], runtime=runtime) as dla:
            a = Engine(affine_model(), cores=dla, streams_per_core=4)
            b = Engine(affine_model(), cores=dla, streams_per_core=4)
            await a.open()
            await b.open()
            with aiodla_controls.hold() as gate:
                calls = [asyncio.ensure_future(e.infer(ONES)) for e in (a, b) for _ in range(6)]
                await gate.reached(2 * TOP_DEPTH)
                waiting = asyncio.ensure_future(dla.aclose())
                await wait_until(lambda: a.statistics().queued + b.statistics().queued == 0)
            await waiting
        assert a.state is b.state is aiodla.EngineState.CLOSED
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert sum(not isinstance(o, BaseException) for o in outcomes) == 2 * TOP_DEPTH
        assert all(n == 0 for n in runtime.live_handles().values())

    @pytest.mark.asyncio
    async def test_no_leak_after_100_engines_opened_and_closed(
        self, dla: Cores, runtime: EmulatedRuntime
    ) -> None:
        # (graphs=False: its slots capture nothing as they go, so its handles stay put)
        async with Engine(affine_model(), cores=dla, graphs=False) as stays:
            before = dict(runtime.live_handles())
            for i in range(100):
                async with Engine(affine_model(), cores=dla, priority=i % 3) as engine:
                    await asyncio.gather(engine.infer(ONES), stays.infer(ONES))
            assert runtime.live_handles() == before
            assert len(dla.dispatcher.clients) == 1 and dla.engines == 1
            assert held_tasks(dla) == [0, 0]
            assert stays.statistics().completed == 100


class TestConfiguration:
    @pytest.mark.asyncio
    async def test_closed_cores_are_refused_before_anything_opens(
        self, runtime: EmulatedRuntime
    ) -> None:
        dla = Cores([0, 1], runtime=runtime)
        unopened = Engine(affine_model(), cores=dla)
        with pytest.raises(EngineClosedError, match="open them first"):
            await unopened.open()
        async with dla:
            pass
        with pytest.raises(EngineClosedError, match="shared cores are closed"):
            Engine(affine_model(), cores=dla)
        assert all(n == 0 for n in runtime.live_handles().values())

    @pytest.mark.asyncio
    async def test_cores_outside_the_set_are_refused(self, dla: Cores) -> None:
        with pytest.raises(ConfigurationError, match=r"core\(s\) \[2\] are not among"):
            dla.subset([1, 2])

    @pytest.mark.parametrize("priority", [1.0, "1", None, True])
    def test_priority_must_be_an_int(self, priority: Any) -> None:
        with pytest.raises(ConfigurationError, match=r"priority=.* must be an int"):
            Engine(affine_model(), priority=priority)

    @pytest.mark.parametrize("weight", [0, -1, float("nan"), "2", True, 1e-16, 0.0009, 1001])
    def test_weight_must_be_a_positive_number_in_its_range(self, weight: Any) -> None:
        with pytest.raises(ConfigurationError, match=r"weight=.* must be a number > 0, from"):
            Engine(affine_model(), weight=weight)

    @pytest.mark.parametrize("weight", [0.001, 1000])
    def test_the_range_of_weights_holds_its_ends(self, weight: float) -> None:
        assert Engine(affine_model(), weight=weight).options.weight == weight

    @pytest.mark.asyncio
    async def test_an_engines_own_streams_per_core_is_kept(self, dla: Cores) -> None:
        async with (
            Engine(affine_model(), cores=dla, streams_per_core=1) as own,
            Engine(affine_model(), cores=dla) as default,
        ):
            assert own.options.streams_per_core == 1
            assert [c.idle_slots for c in own.statistics().cores] == [1, 1]
            assert [c.idle_slots for c in default.statistics().cores] == [
                default.options.streams_per_core
            ] * 2
            await asyncio.gather(*(e.infer(ONES) for e in (own, default) for _ in range(6)))

    @pytest.mark.asyncio
    async def test_closing_the_cores_leaves_a_runtime_passed_in_open(
        self, runtime: EmulatedRuntime, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        closes: list[str] = []
        monkeypatch.setattr(runtime, "close", lambda: closes.append("caller's"))
        async with (
            Cores([0, 1], runtime=runtime) as dla,
            Engine(affine_model(), cores=dla) as engine,
        ):
            await engine.infer(ONES)
        assert closes == []  # the caller still owns it
        async with (
            Cores([0, 1], runtime="emulated") as made,
            Engine(affine_model(), cores=made) as engine,
        ):
            await engine.infer(ONES)
            close = made.runtime.close
            monkeypatch.setattr(made.runtime, "close", lambda: (closes.append("made"), close()))
        assert closes == ["made"]  # the one the cores made, they close

    @pytest.mark.asyncio
    async def test_the_runtime_is_the_cores_choice(self, dla: Cores) -> None:
        with pytest.raises(ConfigurationError, match=r"aiodla\.Cores"):
            Engine(affine_model(), cores=dla, runtime="emulated")
        engine = Engine(affine_model(), cores=dla, trust_compute=True)
        with pytest.raises(ConfigurationError, match="trust_compute"):
            await engine.open()
        assert engine.state is aiodla.EngineState.CLOSED and dla.engines == 0

    @pytest.mark.asyncio
    async def test_the_cores_trust_compute_reaches_the_runtime_they_make(self) -> None:
        for trust in (True, False):
            async with (
                Cores([0, 1], runtime="emulated", trust_compute=trust) as made,
                Engine(affine_model(), cores=made) as engine,
            ):
                await engine.infer(ONES)
                assert isinstance(made.runtime, EmulatedRuntime)
                assert made.runtime.trust_compute is trust

    def test_cores_checks_its_numbers(self) -> None:
        with pytest.raises(ConfigurationError, match="names a core twice"):
            Cores([0, 0])


class TestProcessIsolation:
    @pytest.mark.asyncio
    async def test_an_isolated_engine_takes_its_turn_on_the_shared_cores(self) -> None:
        async with (
            Cores([0, 1], runtime="emulated") as dla,
            Engine(affine_model(), cores=dla, isolation="process") as isolated,
            Engine(affine_model(), cores=dla) as local,
        ):
            xs = [ONES * i for i in range(8)]
            results = await asyncio.gather(
                *(isolated.infer(x) for x in xs), *(local.infer(x) for x in xs)
            )
            for x, y in zip(xs + xs, results, strict=True):
                np.testing.assert_array_equal(y, expected_affine(x))
            assert len(dla.dispatcher.clients) == 2

    @pytest.mark.asyncio
    async def test_a_runtime_instance_cannot_reach_a_worker(self, dla: Cores) -> None:
        engine = Engine(affine_model(), cores=dla, isolation="process")
        with pytest.raises(ConfigurationError, match="runtime by name"):
            await engine.open()
