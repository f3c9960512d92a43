"""aiodla.testing's controls over an ``isolation="process"`` engine's worker.

The controls act in the worker's emulated runtime, over the engine's control channel,
before the test's next line; these tests open process-mode engines explicitly, so they
run in every CI run (``AIODLA_TEST_ISOLATION=process`` runs the other suites so too).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from typing import Any

import numpy as np
import pytest

from aiodla import AiodlaError, ConfigurationError, DeviceError, Engine, TaskError, WorkerLostError
from aiodla._isolation._channel import Channel, send_blocking
from aiodla.testing import DLAControls, EngineFactory, HandleLeakError
from aiodla.testing._remote import Workers

from support import X, affine_model, expected_affine, wait_until

ONES = np.ones(X.shape, np.float32)
TESTS = os.path.dirname(os.path.abspath(__file__))


async def process_engine(factory: EngineFactory, **options: Any) -> Engine:
    return await factory(affine_model(), isolation="process", **options)


def supervisor_of(engine: Engine) -> Any:
    return engine._device.supervisor  # type: ignore[attr-defined]


class TestControls:
    @pytest.mark.asyncio
    async def test_fail_next_lands_wherever_the_task_goes(
        self, aiodla_engine: EngineFactory, aiodla_controls: DLAControls
    ) -> None:
        engine = await process_engine(aiodla_engine)
        aiodla_controls.fail_next(count=2)
        for _ in range(2):
            with pytest.raises(TaskError):
                await engine.infer(ONES)
        np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))

    @pytest.mark.asyncio
    async def test_a_gate_holds_tasks_in_the_worker(
        self, aiodla_engine: EngineFactory, aiodla_controls: DLAControls
    ) -> None:
        engine = await process_engine(aiodla_engine, cores=[0])
        with aiodla_controls.hold(0) as gate:
            tasks = [asyncio.create_task(engine.infer(ONES)) for _ in range(2)]
            await gate.reached(2)
            assert gate.count == 2 and engine.statistics().in_flight == 2
            with pytest.raises(TimeoutError, match="2 of the 3 task"):
                await gate.reached(3, timeout=0.02)
        for task in tasks:
            np.testing.assert_array_equal(await task, expected_affine(ONES))

    @pytest.mark.asyncio
    async def test_a_delay_starts_the_task_late(
        self, aiodla_engine: EngineFactory, aiodla_controls: DLAControls
    ) -> None:
        engine = await process_engine(aiodla_engine)
        aiodla_controls.delay_next(0.05)
        started = time.monotonic()
        await engine.infer(ONES)
        assert time.monotonic() - started >= 0.05
        await engine.infer(ONES)  # the delay's gate went: the next task is not held

    @pytest.mark.asyncio
    async def test_runtime_gates_and_counters_are_the_workers(
        self, aiodla_engine: EngineFactory, runtime: Any
    ) -> None:
        engine = await process_engine(aiodla_engine, cores=[0])
        assert runtime.live_handles()["devices"] == 1  # the worker's, opened for core 0
        gate = runtime.hold(0)
        task = asyncio.create_task(engine.infer(ONES))
        await wait_until(lambda: gate.held == 1)
        assert runtime.core_tasks(0) == 0 and not gate.released
        gate.release()
        gate.release()  # idempotent
        await task
        assert runtime.core_tasks(0) == 1 and runtime.core_busy_time(0) > 0
        assert "released" in repr(gate)
        await engine.aclose()
        assert not any(runtime.live_handles().values())
        assert runtime.core_tasks(0) == 1  # a closed worker's counters outlive it

    @pytest.mark.asyncio
    async def test_poison_replaces_the_worker(
        self, aiodla_engine: EngineFactory, aiodla_controls: DLAControls
    ) -> None:
        engine = await process_engine(aiodla_engine)
        gate = aiodla_controls.hold()
        held = asyncio.create_task(engine.infer(ONES))
        await gate.reached(1)
        aiodla_controls.poison()
        with pytest.raises(WorkerLostError):
            await held
        np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))
        assert gate.count == 0  # the lost worker's gates went with it

    @pytest.mark.asyncio
    async def test_a_call_failure_armed_before_open_moves_to_the_worker(self, runtime: Any) -> None:
        runtime.fail_call("load_module", 7, core=1)  # cudlaErrorUmd
        with pytest.raises(DeviceError, match="core 1: load_module failed"):
            await Engine(affine_model(), runtime=runtime, isolation="process").open()
        async with Engine(affine_model(), runtime=runtime, isolation="process") as engine:
            await engine.infer(ONES)  # the failure was used there, not kept here

    @pytest.mark.asyncio
    async def test_a_compute_function_crosses_by_reference(
        self, aiodla_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The worker imports "support" as the application does: from its path.
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
        engine = await process_engine(aiodla_engine, compute="support:doubled")
        y = await engine.infer(ONES)
        np.testing.assert_array_equal(y, ONES.astype(np.float16).astype(np.float32) * 2)


class TestErrorPaths:
    @pytest.mark.asyncio
    async def test_a_compute_that_cannot_cross_is_refused(
        self, aiodla_engine: EngineFactory
    ) -> None:
        with pytest.raises(TypeError, match="cannot reach the worker process"):
            await process_engine(aiodla_engine, compute=lambda inputs: inputs)

    @pytest.mark.asyncio
    async def test_controls_from_another_thread_are_refused(
        self, aiodla_engine: EngineFactory, runtime: Any
    ) -> None:
        await process_engine(aiodla_engine)
        with pytest.raises(RuntimeError, match="from its loop's thread"):
            await asyncio.to_thread(runtime.hang_core, 0)

    @pytest.mark.asyncio
    async def test_controls_while_the_worker_is_replaced(
        self, aiodla_engine: EngineFactory, runtime: Any
    ) -> None:
        engine = await process_engine(aiodla_engine)
        gate = runtime.hold(0)
        os.kill(supervisor_of(engine).pid, signal.SIGKILL)
        await wait_until(lambda: engine.health().status == "restarting")
        with pytest.raises(WorkerLostError, match="restarting"):
            runtime.fail_next_task(0)
        assert runtime.core_tasks(0) == 0  # no worker serves: none counts
        assert gate.held == 0
        gate.release()  # its worker is gone: nothing left to release
        await wait_until(lambda: engine.health().status == "ok")
        await engine.infer(ONES)

    @pytest.mark.asyncio
    async def test_the_worker_refuses_what_is_not_a_control(
        self, aiodla_engine: EngineFactory, capfd: pytest.CaptureFixture[str]
    ) -> None:
        supervisor = supervisor_of(await process_engine(aiodla_engine))
        with pytest.raises(AiodlaError, match="no control 'close'"):
            supervisor.control(None, "close")
        with pytest.raises(AiodlaError, match="a gate has no control 'wait_for_held'"):
            supervisor.control(0, "wait_for_held")
        with pytest.raises(ConfigurationError, match="core=7 is not one of the 2 cores"):
            supervisor.control(None, "hold", (7, 0))  # no core 7: the runtime's own error
        # A gate the worker does not know (a lost worker's) is held by nobody.
        assert supervisor.control(99, "held") == 0
        assert supervisor.control(99, "released") is True
        assert supervisor.control(99, "release") is None
        # A control sent without waiting that fails is logged by the worker.
        supervisor.control(None, "hang_core", (7,), wait=False)
        supervisor.control(None, "core_tasks", (0,))  # answered after the one before
        assert "test control hang_core failed" in capfd.readouterr().err

    @pytest.mark.asyncio
    async def test_the_worker_refuses_a_setup_that_is_not_a_control(self, runtime: Any) -> None:
        runtime.worker_setup = lambda loadable: [("poison", (), {})]
        with pytest.raises(AiodlaError, match="no control 'poison'"):
            await Engine(affine_model(), runtime=runtime, isolation="process").open()

    @pytest.mark.asyncio
    async def test_a_worker_that_exits_with_handles_alive_is_reported(self) -> None:
        controls = DLAControls()
        try:
            factory = EngineFactory(controls)
            engine = await process_engine(factory, cores=[0], close_timeout=0.05)
            controls.runtime.hang_core(0)
            task = asyncio.create_task(engine.infer(ONES))
            await wait_until(lambda: engine.statistics().in_flight == 1)
            await engine.aclose()  # the hung task keeps its handles: the worker exits 5
            with pytest.raises(AiodlaError):  # closed, or failed: either is fine
                await task
            with pytest.raises(HandleLeakError, match="1 worker process"):
                controls.check_released()
        finally:
            controls.close()

    def test_a_worker_lost_while_its_counters_are_read_counts_nothing(self) -> None:
        class Lost:
            def control(self, *args: object) -> None:
                raise WorkerLostError("the worker was lost: it ended")

        workers = Workers(2)
        workers._keep_counters(Lost())  # type: ignore[arg-type]
        assert workers.closed_tasks == [0, 0] and workers.closed_busy_time == [0.0, 0.0]


class TestBlockingRoundTrip:
    @pytest.mark.asyncio
    async def test_messages_before_the_reply_are_delivered_in_order(self) -> None:
        mine, theirs = socket.socketpair()
        delivered: list[Any] = []
        channel = Channel(mine, asyncio.get_running_loop(), delivered.extend, lambda why: None)
        try:
            send_blocking(theirs, ("done", 1))
            send_blocking(theirs, ("reply", 2))
            send_blocking(theirs, ("done", 3))  # read with the reply: kept as well
            reply = channel.call_blocking(("ask",), lambda m: m[0] == "reply", 1.0)
            assert reply == ("reply", 2) and delivered == []
            await asyncio.sleep(0)
            assert delivered == [("done", 1), ("done", 3)]
        finally:
            channel.close()
            theirs.close()

    @pytest.mark.asyncio
    async def test_no_answer_and_a_gone_peer(self) -> None:
        mine, theirs = socket.socketpair()
        closed: list[str] = []
        channel = Channel(mine, asyncio.get_running_loop(), lambda m: None, closed.append)
        try:
            with pytest.raises(TimeoutError, match="no answer from the worker within"):
                channel.call_blocking(("ask",), lambda m: False, 0.02)
            theirs.close()
            # (a write to the gone peer fails first, or the read finds the end)
            with pytest.raises(EOFError, match="control channel"):
                channel.call_blocking(("ask",), lambda m: False, 1.0)
            await wait_until(lambda: channel.closed)  # the loop's reader saw it too
            assert closed
            with pytest.raises(EOFError, match="closed"):
                channel.call_blocking(("ask",), lambda m: False, 1.0)
        finally:
            channel.close()
