"""BlockingEngine: the async engine for synchronous code, its loop in one thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiodla
from aiodla import (
    AiodlaError,
    BlockingEngine,
    ConfigurationError,
    EngineClosedError,
    InputValueError,
    RequestTimeoutError,
)
from aiodla.testing import DLAControls

from support import X, affine_model, counts_add_up, expected_affine


def threads_left(before: set[threading.Thread]) -> set[threading.Thread]:
    """Threads started since ``before`` still alive once each had time to end (anyio's
    worker threads end as their loop's run ends, a moment after the portal's)."""
    started = set(threading.enumerate()) - before
    for thread in started:
        thread.join(timeout=10)
    return {thread for thread in started if thread.is_alive()}


def settle(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until the engine's observable state satisfies ``predicate``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the engine never reached the state waited for"
        time.sleep(0.001)


def frame(seed: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal(X.shape).astype(np.float32)


class TestThreads:
    def test_eight_threads_each_a_thousand_requests(self) -> None:
        threads, per_thread = 8, 1000
        wrong: list[tuple[int, int]] = []
        with BlockingEngine(affine_model(latency=0.0), cores=[0, 1]) as engine:

            def client(index: int) -> None:
                rng = np.random.default_rng(index)
                for i in range(per_thread):
                    x = rng.standard_normal(X.shape).astype(np.float32)
                    if not np.array_equal(engine.infer(x), expected_affine(x)):
                        wrong.append((index, i))

            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                for done in [pool.submit(client, t) for t in range(threads)]:
                    done.result()
            stats = engine.statistics()
        assert wrong == []
        assert stats.submitted == stats.completed == threads * per_thread
        assert counts_add_up(stats)
        assert sum(core.completed for core in stats.cores) == threads * per_thread
        assert all(core.completed > 0 for core in stats.cores)  # both cores served
        final = engine.statistics()  # after close, read without the loop thread
        assert final.state == "closed" and counts_add_up(final)

    def test_infer_future_is_a_concurrent_future_of_the_result(self) -> None:
        with BlockingEngine(affine_model(), cores=[0, 1]) as engine:
            xs = [frame(seed) for seed in range(20)]
            futures = [engine.infer_future(x) for x in xs]
            assert all(isinstance(f, concurrent.futures.Future) for f in futures)
            for x, future in zip(xs, futures, strict=True):
                np.testing.assert_array_equal(future.result(timeout=10), expected_affine(x))

    def test_the_loop_thread_ends_with_the_engine(self) -> None:
        before = set(threading.enumerate())
        with BlockingEngine(affine_model(), cores=[0]) as engine:
            engine.infer(frame(0))
            assert len(set(threading.enumerate()) - before) >= 1
        assert threads_left(before) == set()


class TestErrors:
    def test_bad_input_is_the_async_engines_error(self) -> None:
        with BlockingEngine(affine_model(), cores=[0]) as engine:
            with pytest.raises(InputValueError, match="shape"):
                engine.infer(np.zeros((1, 3, 4, 4), np.float32))
            np.testing.assert_array_equal(engine.infer(frame(1)), expected_affine(frame(1)))
            stats = engine.statistics()
        assert stats.completed == 1 and counts_add_up(stats)

    def test_bad_option_fails_at_construction(self) -> None:
        with pytest.raises(ConfigurationError, match="streams_per_core"):
            BlockingEngine(affine_model(), streams_per_core=0)

    def test_timeout_is_the_engines(self) -> None:
        controls = DLAControls(2)
        with BlockingEngine(affine_model(), cores=[0], runtime=controls.runtime) as engine:
            with controls.hold(0), pytest.raises(RequestTimeoutError):
                engine.infer(frame(0), timeout=0.01)
            stats = engine.statistics()
        assert stats.timed_out == 1 and counts_add_up(stats)
        controls.close()
        assert controls.leak_report() is None

    def test_a_call_after_close_raises_engine_closed(self) -> None:
        engine = BlockingEngine(affine_model(), cores=[0])
        with pytest.raises(EngineClosedError, match="not open"):
            engine.infer(frame(0))
        with engine:
            engine.infer(frame(0))
        assert engine.closed
        with pytest.raises(EngineClosedError, match="closed"):
            engine.infer(frame(0))
        with pytest.raises(EngineClosedError, match="closed"):
            engine.infer_future(frame(0))
        with pytest.raises(EngineClosedError, match="reopen"):
            engine.open()
        engine.close()  # idempotent

    def test_a_failed_open_ends_the_loop_thread(self) -> None:
        before = set(threading.enumerate())
        engine = BlockingEngine(b"not a loadable", runtime="emulated")
        with pytest.raises(aiodla.RuntimeUnavailableError):
            engine.open()
        assert threads_left(before) == set()
        with pytest.raises(EngineClosedError):
            engine.infer(frame(0))


class TestEventLoop:
    def test_blocking_calls_from_a_running_loop_say_so(self) -> None:
        with BlockingEngine(affine_model(), cores=[0]) as engine:

            async def inside() -> Any:
                with pytest.raises(AiodlaError, match="running event loop"):
                    engine.infer(frame(0))
                with pytest.raises(AiodlaError, match="running event loop"):
                    BlockingEngine(affine_model()).open()
                # infer_future never blocks: async code may await it.
                return await asyncio.wrap_future(engine.infer_future(frame(2)))

            result = asyncio.run(inside())
            np.testing.assert_array_equal(result, expected_affine(frame(2)))
            np.testing.assert_array_equal(engine.infer(frame(3)), expected_affine(frame(3)))


class TestClose:
    def test_keyboard_interrupt_in_the_block_drains_and_closes(self) -> None:
        controls = DLAControls(2)
        model = affine_model(latency=0.05)
        before = set(threading.enumerate())
        xs = [frame(seed) for seed in range(4)]
        futures: list[concurrent.futures.Future[Any]] = []
        engine = BlockingEngine(model, cores=[0], streams_per_core=1, runtime=controls.runtime)

        def interrupted_block() -> None:
            with engine:
                gate = controls.hold(0)
                futures.extend(engine.infer_future(x) for x in xs)
                asyncio.run(gate.reached(1))  # the first is on the DLA, the rest queued
                gate.release()
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            interrupted_block()
        assert all(f.done() for f in futures)
        # The request on the DLA drains; the queued ones fail as closed (or, on a slow
        # machine, finish before the close reached them).
        np.testing.assert_array_equal(futures[0].result(), expected_affine(xs[0]))
        for x, future in zip(xs[1:], futures[1:], strict=True):
            error = future.exception()
            if error is None:
                np.testing.assert_array_equal(future.result(), expected_affine(x))
            else:
                assert isinstance(error, EngineClosedError)
        stats = engine.statistics()
        assert stats.state == "closed" and stats.submitted == 4 and counts_add_up(stats)
        assert stats.completed + stats.failed == 4
        assert threads_left(before) == set()
        controls.close()
        assert controls.leak_report() is None

    def test_cancelling_a_future_cancels_its_request(self) -> None:
        controls = DLAControls(2)
        with BlockingEngine(
            affine_model(), cores=[0], streams_per_core=1, runtime=controls.runtime
        ) as engine:
            with controls.hold(0) as gate:
                first = engine.infer_future(frame(0))
                queued = engine.infer_future(frame(1))
                asyncio.run(gate.reached(1))
                settle(lambda: engine.statistics().queued == 1)
                assert queued.cancel()
                # Seen by the engine before the DLA frees the slot the request waits for.
                settle(lambda: engine.statistics().cancelled == 1)
            np.testing.assert_array_equal(first.result(timeout=10), expected_affine(frame(0)))
            np.testing.assert_array_equal(engine.infer(frame(2)), expected_affine(frame(2)))
            stats = engine.statistics()
        assert stats.cancelled == 1 and stats.completed == 2 and counts_add_up(stats)
        assert controls.runtime.core_tasks(0) == 2  # the cancelled one never ran
        controls.close()

    def test_a_request_running_at_close_ends_closed_not_cancelled(self) -> None:
        controls = DLAControls(2)
        engine = BlockingEngine(
            affine_model(), cores=[0], streams_per_core=1, close_timeout=0.05,
            runtime=controls.runtime,
        )  # fmt: skip
        engine.open()
        with controls.hold(0) as gate:
            running = engine.infer_future(frame(0))
            asyncio.run(gate.reached(1))
            engine.close()  # the drain gives up after close_timeout, the task still held
            # The engine failed the request as closed; its outcome reached the caller
            # before the loop thread ended (which would have cancelled it).
            assert not running.cancelled()
            assert isinstance(running.exception(timeout=0), EngineClosedError)
        stats = engine.statistics()
        assert (stats.failed, stats.failures["closed"], stats.cancelled) == (1, 1, 0)
        assert counts_add_up(stats)
        # The held core kept its handles past the close; they go once its task ends.
        settle(lambda: controls.leak_report() is None)
        controls.close()

    def test_a_call_cancelled_before_it_reaches_the_loop_is_never_admitted(self) -> None:
        controls = DLAControls(2)
        with BlockingEngine(affine_model(), cores=[0], runtime=controls.runtime) as engine:
            # Keep the loop thread busy so the call waits in the hand-over to it.
            loop = engine._running.loop  # type: ignore[union-attr]
            busy, free = threading.Event(), threading.Event()

            def hold_the_loop() -> None:
                busy.set()
                free.wait(10)

            loop.call_soon_threadsafe(hold_the_loop)
            assert busy.wait(10)
            cancelled = engine.infer_future(frame(0))
            assert cancelled.cancel()
            free.set()
            # Handed over after the cancelled one: once answered, the loop has seen both.
            np.testing.assert_array_equal(engine.infer(frame(1)), expected_affine(frame(1)))
            stats = engine.statistics()
        assert (stats.submitted, stats.completed, stats.cancelled) == (1, 1, 0)
        assert controls.runtime.core_tasks(0) == 1
        controls.close()
        assert controls.leak_report() is None

    def test_health_and_repr(self) -> None:
        with BlockingEngine(affine_model(), cores=[0, 1]) as engine:
            assert engine.health().status == "ok"
            assert "Engine open" in repr(engine)
            assert [s.name for s in engine.inputs] == ["x"]
            assert [s.name for s in engine.outputs] == ["y"]
        assert engine.health().status == "closed"


EXAMPLE = Path(__file__).parent.parent / "examples" / "blocking_threads.py"


def test_the_two_thread_example_runs_every_frame_on_both_cores() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--frames", "40"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "frames per camera: {'camera0': 40, 'camera1': 40}" in result.stdout
    match = re.search(
        r"per core: \[(\d+), (\d+)\] tasks; completed 80 of 80, failed 0", result.stdout
    )
    assert match is not None, result.stdout
    assert int(match[1]) > 0 and int(match[2]) > 0


def test_an_engine_dropped_open_warns_and_closes_first() -> None:
    before = set(threading.enumerate())
    engine = BlockingEngine(affine_model(), cores=[0])
    engine.open()
    np.testing.assert_array_equal(engine.infer(frame(0)), expected_affine(frame(0)))
    inner = engine.engine
    with pytest.warns(ResourceWarning, match="unclosed <BlockingEngine"):
        del engine  # no cycle holds it: collected here
    assert threads_left(before) == set()
    assert inner.state.value == "closed"


def in_a_forked_child(work: Callable[[], str], timeout: float = 20.0) -> tuple[int, str]:
    """Run ``work`` in a child made by ``os.fork`` of this (multi-threaded) process;
    return its exit status and what ``work`` returned. A child still running after
    ``timeout`` is killed (status -SIGKILL): a hang fails the test instead of the run."""
    read, write = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a multi-threaded process may deadlock: the
        # case this test is about.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        os.close(read)
        code = 1
        try:
            os.write(write, work().encode())
            code = 0
        except BaseException as exc:
            os.write(write, f"{type(exc).__name__}: {exc}".encode())
        finally:
            os._exit(code)
    os.close(write)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            return -signal.SIGKILL, "the child hung"
        time.sleep(0.01)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    return os.waitstatus_to_exitcode(status), said


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX only")
class TestFork:
    def test_a_forked_child_is_refused_at_once_and_the_parent_serves_on(self) -> None:
        controls = DLAControls(2)
        with BlockingEngine(affine_model(), cores=[0], runtime=controls.runtime) as engine:
            engine.infer(frame(0))

            def child() -> str:
                said = []
                for call in (
                    lambda: engine.infer(frame(1), timeout=3),
                    lambda: engine.infer_future(frame(1)),
                    engine.statistics,
                ):
                    try:
                        call()
                    except AiodlaError as exc:
                        said.append(str(exc))
                engine.close()  # drops the child's copy; the parent's loop is untouched
                assert engine.closed
                return "\n".join(said)

            status, said = in_a_forked_child(child)
            assert status == 0, said
            lines = said.splitlines()
            assert len(lines) == 3, said
            assert all(
                re.search(rf"opened in process {os.getpid()}.*forked child", line) for line in lines
            ), said
            np.testing.assert_array_equal(engine.infer(frame(2)), expected_affine(frame(2)))
            stats = engine.statistics()
        assert stats.submitted == stats.completed == 2  # nothing of the child's counted
        controls.close()
        assert controls.leak_report() is None
