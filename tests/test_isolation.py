"""Engine(isolation="process"): the runtime in a supervised worker process.

Every engine here runs the emulated runtime inside a spawned worker; faults are armed
there through the test control ``inject_fault``, or by signalling the worker itself.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodla import (
    AiodlaError,
    ConfigurationError,
    DeviceError,
    EmulatedRuntime,
    Engine,
    EngineDeadError,
    InputTypeError,
    LatestFrameStream,
    ProcessIsolation,
    QueueFullError,
    RequestTimeoutError,
    TaskError,
    WorkerLostError,
)
from aiodla._isolation import _supervisor as supervisor_module
from aiodla._isolation import inject_fault
from aiodla._isolation._channel import Channel, frame
from aiodla._isolation._worker import CONTEXT_LOST_EXIT, transportable

from support import (
    FakeCudaArray,
    X,
    affine_model,
    alive,
    all_idle,
    counts_add_up,
    expected_affine,
    open_fds,
    shm_entries,
    two_pair_model,
    wait_until,
    worker_pid,
)

ENGINE_TIMEOUT = 0x40000006
ONES = np.ones(X.shape, np.float32)
SLOTS = 4  # two cores, two streams each: at most this many requests in flight


def process_engine(model: bytes | None = None, **options: Any) -> Engine:
    """``options`` may hold ProcessIsolation's settings beside the engine's."""
    settings = {name: options.pop(name) for name in _SETTINGS.intersection(options)}
    isolation = ProcessIsolation(**settings)
    return Engine(model or affine_model(), runtime="emulated", isolation=isolation, **options)


_SETTINGS = {"max_restarts", "restart_window", "heartbeat_timeout"}


async def outcome(engine: Engine, x: np.ndarray[Any, Any]) -> Any:
    """The result checked against the model, or the error the request ended with."""
    try:
        y = await engine.infer(x)
    except AiodlaError as error:
        return error
    np.testing.assert_array_equal(y, expected_affine(x))
    return "ok"


async def load_then(engine: Engine, fault: Any, count: int = 200) -> list[Any]:
    """``count`` requests admitted at once, ``fault`` applied while the first run."""
    tasks = [asyncio.ensure_future(outcome(engine, ONES * i)) for i in range(count)]
    await wait_until(lambda: engine.statistics().in_flight > 0)
    await fault()
    return await asyncio.gather(*tasks)


def lost_only_in_flight(results: list[Any]) -> list[WorkerLostError]:
    lost = [r for r in results if r != "ok"]
    assert all(isinstance(r, WorkerLostError) for r in lost), lost
    assert 1 <= len(lost) <= SLOTS, lost  # only what the worker held; the queue survived
    return lost  # type: ignore[return-value]


class TestRoundTrip:
    @pytest.mark.asyncio
    async def test_results_equal_in_process(self) -> None:
        rng = np.random.default_rng(0)
        xs = [rng.standard_normal(X.shape).astype(np.float32) for _ in range(8)]
        async with Engine(affine_model(), runtime="emulated") as threaded:
            expected = [await threaded.infer(x) for x in xs]
        async with process_engine() as engine:
            assert engine.state.value == "open"
            for x, y in zip(xs, expected):
                np.testing.assert_array_equal(await engine.infer(x), y)
            assert engine.inputs[0].name == "x" and engine.stated_service_time == 0.001

    @pytest.mark.asyncio
    @pytest.mark.parametrize("convert", ["host", "device"])
    async def test_several_inputs_and_outputs(self, convert: str) -> None:
        rng = np.random.default_rng(1)
        inputs = {
            "a": rng.standard_normal((1, 4, 6, 6)).astype(np.float16),
            "b": rng.standard_normal((2, 3, 5, 7)).astype(np.float32),
        }
        async with Engine(two_pair_model(), runtime="emulated", convert=convert) as threaded:
            expected = await threaded.infer(inputs)
        async with process_engine(two_pair_model(), convert=convert) as engine:
            got = await engine.infer(inputs)
        assert set(got) == set(expected)
        for name in got:
            np.testing.assert_array_equal(got[name], expected[name])

    @pytest.mark.asyncio
    async def test_many_concurrent_requests(self) -> None:
        async with process_engine(affine_model(0.0002), streams_per_core=4) as engine:
            results = await asyncio.gather(*(engine.infer(ONES * (i % 50)) for i in range(600)))
            for i, y in enumerate(results):
                np.testing.assert_array_equal(y, expected_affine(ONES * (i % 50)))
            stats = engine.statistics()
            assert stats.completed == 600 and stats.failed == 0 and counts_add_up(stats)
            assert sum(core.completed for core in stats.cores) == 600
            assert all(core.completed > 0 for core in stats.cores)  # both cores served
            assert stats.worker is not None and stats.worker.restarts == 0


class TestBehavesAsInProcess:
    @pytest.mark.asyncio
    async def test_timeout_while_in_flight(self) -> None:
        async with process_engine(affine_model(0.3), cores=[0], streams_per_core=1) as engine:
            with pytest.raises(RequestTimeoutError):
                await engine.infer(ONES, timeout=0.05)
            await wait_until(lambda: all_idle(engine))  # the slot came back when it ran
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))
            stats = engine.statistics()
            assert stats.timed_out == 1 and stats.completed == 1 and counts_add_up(stats)

    @pytest.mark.asyncio
    async def test_cancel_while_queued_and_in_flight(self) -> None:
        async with process_engine(affine_model(0.05), cores=[0], streams_per_core=1) as engine:
            running = asyncio.ensure_future(engine.infer(ONES))
            queued = asyncio.ensure_future(engine.infer(ONES * 2))
            await wait_until(lambda: engine.statistics().in_flight == 1)
            queued.cancel()
            running.cancel()
            await asyncio.gather(running, queued, return_exceptions=True)
            await wait_until(lambda: all_idle(engine))
            stats = engine.statistics()
            assert stats.cancelled == 2 and stats.cores[0].completed <= 1 and counts_add_up(stats)
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))

    @pytest.mark.asyncio
    async def test_backpressure(self) -> None:
        async with process_engine(
            affine_model(0.05), cores=[0], streams_per_core=1, max_queue=1
        ) as engine:
            first = engine.infer_nowait(ONES)
            second = engine.infer_nowait(ONES)
            with pytest.raises(QueueFullError):
                engine.infer_nowait(ONES)
            await asyncio.gather(first, second)
            stats = engine.statistics()
            assert stats.rejected == 1 and stats.completed == 2 and counts_add_up(stats)

    @pytest.mark.asyncio
    async def test_stage_times(self) -> None:
        async with process_engine(stage_times=True, cores=[0]) as engine:
            for _ in range(5):
                await engine.infer(ONES)
            stats = engine.statistics()
        assert stats.stages is not None and stats.stages.dla.count == 5
        assert 0.0005 < stats.stages.dla.p50 < 0.1  # the 1 ms task, as the worker timed it
        dla = stats.cores[0].dla_time
        assert dla is not None and dla.count == 5

    @pytest.mark.asyncio
    async def test_a_latest_frame_stream(self) -> None:
        async with process_engine() as engine, LatestFrameStream(engine, name="cam") as cam:
            for i in range(5):
                cam.submit(ONES * i, context=i)
                result = await cam.receive()
                assert result.error is None and result.context == i
                np.testing.assert_array_equal(result.output, expected_affine(ONES * i))
            assert cam.statistics().completed == 5

    @pytest.mark.asyncio
    async def test_a_task_fault_fails_only_its_request(self) -> None:
        async with process_engine(cores=[0]) as engine:
            await inject_fault(engine, "fail_next_task", 0, ENGINE_TIMEOUT)
            with pytest.raises(AiodlaError, match=r"ERR_ENGINE_TIMEOUT|ErrEngineTimeout"):
                await engine.infer(ONES)
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))
            stats = engine.statistics()
            assert stats.failures["task"] == 1 and stats.cores[0].failed == 1
            assert stats.worker is not None and stats.worker.restarts == 0  # not a loss

    @pytest.mark.asyncio
    async def test_a_failed_submission_fails_only_its_request(self) -> None:
        async with process_engine(cores=[0]) as engine:
            await inject_fault(engine, "fail_call", "submit_task", 1)
            with pytest.raises(DeviceError, match="submitting the request") as caught:
                await engine.infer(ONES)
            assert caught.value.status == 1
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))
            assert engine.health().status == "ok"


class TestRecovery:
    @pytest.mark.asyncio
    async def test_sticky_fault_costs_only_in_flight_requests(self) -> None:
        async with process_engine() as engine:
            first = worker_pid(engine)
            health: list[str] = []

            async def fault() -> None:
                await inject_fault(engine, "fail_next_task", 0, ENGINE_TIMEOUT, on_stream=True)
                await wait_until(lambda: engine.health().status == "restarting")
                health.append(engine.health().status)

            results = await load_then(engine, fault)
            lost = lost_only_in_flight(results)
            assert (
                "CUDA context was lost" in lost[0].cause
                and "cudaErrorExternalDevice" in lost[0].cause
            )
            assert lost[0].exit_status == CONTEXT_LOST_EXIT
            assert isinstance(lost[0], EngineDeadError)  # the subclassing
            assert health == ["restarting"] and engine.health().status == "ok"
            stats = engine.statistics()
            assert stats.worker is not None and stats.worker.restarts == 1
            assert len(stats.worker.restart_times) == 1 and 0 < stats.worker.restart_times[0] < 10
            assert stats.worker.pid != first and not alive(first)
            assert stats.failed == len(lost) and counts_add_up(stats)
            assert stats.failures["worker_lost"] == len(lost) and stats.failures["dead"] == 0
            assert not engine.dead

    @pytest.mark.asyncio
    async def test_sigkill_costs_only_in_flight_requests(self) -> None:
        async with process_engine() as engine:
            first = worker_pid(engine)

            async def fault() -> None:
                os.kill(first, signal.SIGKILL)

            lost = lost_only_in_flight(await load_then(engine, fault))
            assert lost[0].exit_status == -signal.SIGKILL and "SIGKILL" in str(lost[0])
            assert engine.statistics().worker.restarts == 1  # type: ignore[union-attr]
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))

    @pytest.mark.asyncio
    async def test_sigkill_while_packing_and_unpacking_in_threads(self) -> None:
        # offload_bytes=0: every request packs and unpacks in a worker thread, so a
        # loss finds requests there; their slots come back only when the thread is done.
        async with process_engine(offload_bytes=0) as engine:
            pid = worker_pid(engine)

            async def fault() -> None:
                os.kill(pid, signal.SIGKILL)

            lost_only_in_flight(await load_then(engine, fault))
            await wait_until(lambda: all_idle(engine))
            stats = engine.statistics()
            assert counts_add_up(stats) and stats.worker.restarts == 1  # type: ignore[union-attr]
            assert sum(core.busy_slots for core in stats.cores) == 0

    @pytest.mark.asyncio
    async def test_hung_worker_is_detected_by_heartbeat(self) -> None:
        async with process_engine(heartbeat_timeout=0.3) as engine:
            first = worker_pid(engine)

            async def fault() -> None:
                os.kill(first, signal.SIGSTOP)  # alive, silent: hung

            started = time.monotonic()
            lost = lost_only_in_flight(await load_then(engine, fault))
            assert "stopped answering" in lost[0].cause and lost[0].exit_status == -signal.SIGKILL
            assert time.monotonic() - started < 5
            assert not alive(first)

    @pytest.mark.asyncio
    async def test_back_off_only_for_workers_that_never_served(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A back-off well above a worker's start on a loaded machine (seen at 1.6 s),
        # so that a start without one cannot be read as one.
        monkeypatch.setattr(supervisor_module, "FIRST_BACKOFF", 4.0)
        monkeypatch.setattr(supervisor_module, "MAX_BACKOFF", 4.0)
        async with process_engine() as engine:
            await engine.infer(ONES)  # this worker served: its replacement starts at once
            os.kill(worker_pid(engine), signal.SIGKILL)
            await wait_until(lambda: engine.statistics().worker.restarts == 1)  # type: ignore[union-attr]
            os.kill(worker_pid(engine), signal.SIGKILL)  # lost before serving: back off
            await wait_until(lambda: engine.statistics().worker.restarts == 2, timeout=20)  # type: ignore[union-attr]
            first, second = engine.statistics().worker.restart_times  # type: ignore[union-attr]
            assert first < 4.0 <= second
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))

    @pytest.mark.asyncio
    async def test_a_held_up_loop_is_not_taken_for_a_hung_worker(self) -> None:
        async with process_engine(heartbeat_timeout=0.1) as engine:
            for _ in range(3):
                time.sleep(0.3)  # noqa: ASYNC251 - the loop stalls, as under a blocking call
                await asyncio.sleep(0.06)
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))
            assert engine.statistics().worker.restarts == 0  # type: ignore[union-attr]

    @pytest.mark.asyncio
    async def test_past_max_restarts_the_engine_is_dead(self) -> None:
        async with process_engine(max_restarts=1, restart_window=30) as engine:
            os.kill(worker_pid(engine), signal.SIGKILL)
            await wait_until(lambda: engine.statistics().worker.restarts == 1)  # type: ignore[union-attr]
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))
            queued = [asyncio.ensure_future(engine.infer(ONES)) for _ in range(20)]
            await wait_until(lambda: engine.statistics().in_flight > 0)
            os.kill(worker_pid(engine), signal.SIGKILL)
            results = await asyncio.gather(*queued, return_exceptions=True)
            errors = [r for r in results if not isinstance(r, np.ndarray)]
            assert all(isinstance(r, EngineDeadError) for r in errors), errors
            # Past the policy the queue is failed too, not only what the worker held.
            assert len([r for r in errors if not isinstance(r, WorkerLostError)]) > SLOTS
            assert engine.dead and engine.health().status == "dead"
            assert engine.statistics().worker.state == "failed"  # type: ignore[union-attr]
            with pytest.raises(EngineDeadError) as caught:
                await engine.infer(ONES)
            assert isinstance(caught.value.__cause__, WorkerLostError)


class TestNothingLeaks:
    @pytest.mark.asyncio
    async def test_close_leaves_no_process_segment_or_descriptor(self) -> None:
        gc.collect()
        fds, segments = open_fds(), shm_entries()
        engine = process_engine()
        async with engine:
            pid = worker_pid(engine)
            await engine.infer(ONES)
            os.kill(pid, signal.SIGKILL)  # a replacement too must leave nothing
            await wait_until(lambda: engine.statistics().worker.restarts == 1)  # type: ignore[union-attr]
            pid = worker_pid(engine)
            await engine.infer(ONES)
        assert not alive(pid)
        supervisor = engine._device.supervisor  # type: ignore[attr-defined]
        assert supervisor.exit_status == 0  # the worker closed with no handle left alive
        gc.collect()
        assert shm_entries() == segments
        assert open_fds() == fds

    @pytest.mark.asyncio
    async def test_a_failed_open_leaves_no_process(self, monkeypatch: pytest.MonkeyPatch) -> None:
        spawned: list[int] = []
        spawn = supervisor_module._spawn

        def recording_spawn() -> Any:
            process, sock = spawn()
            spawned.append(process.pid)
            return process, sock

        monkeypatch.setattr(supervisor_module, "_spawn", recording_spawn)
        gc.collect()
        fds = open_fds()
        engine = process_engine(b"not a loadable")
        with pytest.raises(AiodlaError, match="emulator loadables only"):
            await engine.open()
        assert engine.state.value == "closed"
        assert len(spawned) == 1 and not alive(spawned[0])
        gc.collect()
        assert open_fds() == fds

    def test_the_worker_dies_with_its_parent_and_cuda_stays_out(self, tmp_path: Path) -> None:
        script = tmp_path / "parent.py"
        script.write_text(
            textwrap.dedent(
                f"""
                import asyncio, sys
                sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
                from support import affine_model
                from aiodla import Engine

                async def main():
                    async with Engine(affine_model(), runtime="auto", isolation="process") as e:
                        # The CUDA runtime API is never loaded here: CUDA cannot start.
                        cuda = {{"cuda.bindings.runtime", "aiodla.runtime._cuda"}} & set(sys.modules)
                        print(e.statistics().worker.pid, sorted(cuda), flush=True)
                        await asyncio.sleep(60)

                asyncio.run(main())
                """
            )
        )
        parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        try:
            assert parent.stdout is not None
            pid, cuda = parent.stdout.readline().split(maxsplit=1)
            assert cuda.strip() == "[]"  # the application's process never initializes CUDA
            pid = int(pid)
            assert alive(pid)
            parent.kill()
            parent.wait()
            deadline = time.monotonic() + 5
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not alive(pid)
        finally:
            parent.kill()
            parent.wait()
            if parent.stdout is not None:
                parent.stdout.close()


class TestRefused:
    @pytest.mark.asyncio
    async def test_device_arrays_are_refused_saying_why(self) -> None:
        async with process_engine() as engine:
            with pytest.raises(InputTypeError, match="CUDA IPC is unavailable on Tegra"):
                await engine.infer(FakeCudaArray(X.shape))
            with pytest.raises(ConfigurationError, match="isolation='process'"):
                await engine.infer(ONES, output="device")
            with pytest.raises(ConfigurationError, match="lives in the worker process"):
                _ = engine.runtime
            assert engine.statistics().submitted == 0

    @pytest.mark.asyncio
    async def test_a_runtime_instance_is_refused(self) -> None:
        runtime = EmulatedRuntime()
        try:
            engine = process_engine()
            engine._runtime_choice = runtime  # as Engine(..., runtime=runtime) stores it
            with pytest.raises(ConfigurationError, match="not a runtime instance"):
                await engine.open()
        finally:
            runtime.close()

    def test_options(self) -> None:
        with pytest.raises(ConfigurationError, match="isolation='fork'"):
            Engine(affine_model(), isolation="fork")
        with pytest.raises(ConfigurationError, match="max_restarts=-1"):
            ProcessIsolation(max_restarts=-1)
        with pytest.raises(ConfigurationError, match="restart_window=0"):
            ProcessIsolation(restart_window=0)
        with pytest.raises(ConfigurationError, match="heartbeat_timeout"):
            ProcessIsolation(heartbeat_timeout=float("nan"))

    @pytest.mark.asyncio
    async def test_an_unknown_fault_control_is_refused(self) -> None:
        async with process_engine() as engine:
            with pytest.raises(AiodlaError, match="no control 'close'"):
                await inject_fault(engine, "close")
        with pytest.raises(TypeError, match="isolation='process'"):
            await inject_fault(Engine(affine_model()), "poison")


class TestErrorPaths:
    @pytest.mark.asyncio
    async def test_replacements_that_fail_to_open_count_against_max_restarts(self) -> None:
        async with process_engine(max_restarts=2) as engine:
            supervisor = engine._device.supervisor  # type: ignore[attr-defined]
            _, runtime, fields, standins, setup = supervisor._open_message
            # From now on a new worker cannot open the model (as if the device were gone).
            supervisor._open_message = (b"not a loadable", runtime, fields, standins, setup)
            os.kill(worker_pid(engine), signal.SIGKILL)
            await wait_until(lambda: engine.dead, timeout=10)
            with pytest.raises(EngineDeadError) as caught:
                await engine.infer(ONES)
            assert isinstance(caught.value.__cause__, WorkerLostError)
            assert engine.statistics().worker.restarts == 0  # type: ignore[union-attr]

    def test_errors_that_do_not_pickle_cross_as_aiodla_errors(self) -> None:
        task_error = TaskError("the DLA task failed", status=1, core=0)  # keyword-only init
        crossed = transportable(task_error)
        assert type(crossed) is AiodlaError and "TaskError: the DLA task failed" in str(crossed)
        device_error = DeviceError("submitting failed", status=7)
        assert transportable(device_error) is device_error

    @pytest.mark.asyncio
    async def test_a_message_larger_than_the_socket_buffer(self) -> None:
        loop = asyncio.get_running_loop()
        mine, theirs = socket.socketpair()
        received: list[Any] = []
        hung_up: list[str] = []
        sender = Channel(mine, loop, received.extend, hung_up.append)
        reader = Channel(theirs, loop, received.extend, hung_up.append)
        big = bytes(8 << 20)  # far more than a socket buffer: written as it drains
        sender.send(("model", big))
        sender.send(("after",))
        await wait_until(lambda: len(received) == 2)
        assert received[0] == ("model", big) and received[1] == ("after",)
        sender.close()
        await wait_until(lambda: bool(hung_up))
        assert reader.closed and hung_up == ["the worker closed the control channel"]
        sender.send(("ignored",))  # a closed channel drops what it is given

    @pytest.mark.asyncio
    async def test_a_failed_send_reads_the_peers_last_words_first(self) -> None:
        # The worker says why it goes, then exits; the application, sending meanwhile,
        # fails first. The cause must still be the worker's own words, not a guess.
        loop = asyncio.get_running_loop()
        mine, theirs = socket.socketpair()
        events: list[Any] = []
        channel = Channel(mine, loop, events.extend, lambda why: events.append(("closed", why)))
        loop.remove_reader(mine.fileno())  # the send comes before the loop reads
        theirs.sendall(frame(("lost", "the CUDA context was lost: poisoned")))
        theirs.close()
        channel.send(("submit", [0]))  # EPIPE: the peer is gone
        assert events == []  # nothing decided inside the sender
        await wait_until(lambda: channel.closed)
        assert events[0] == ("lost", "the CUDA context was lost: poisoned")
        assert events[1][0] == "closed" and len(events) == 2
