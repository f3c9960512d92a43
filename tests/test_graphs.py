"""Graphs (``aiodla._graphs``): a slot's work around its task captured once per kind of
request and launched whole after that, on the emulated runtime, whose capture records
the calls and whose launch makes them again (the CUDA graphs run in tests/gpu).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import sys
import threading
import weakref
from typing import Any

import numpy as np
import pytest

from aiodla import AiodlaError, DeviceError, Engine, ImagePreprocess, TensorSpec
from aiodla._data_path import DevicePath
from aiodla._graphs import MAX_GRAPHS, Graphs
from aiodla.emulator import make_loadable
from aiodla.runtime import CudaCallError, EmulatedRuntime

from support import X, affine_model, all_idle, counts_add_up, expected_affine, the_one_failure

pytestmark = pytest.mark.asyncio

IMAGE_IN = TensorSpec("image", (1, 3, 8, 8), "float16", "chw16")
IMAGE_OUT = TensorSpec("out", (1, 3, 8, 8), "float16", "nchw")


def inputs(count: int, dtype: Any = np.float32) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(count)
    return [rng.normal(0, 3, size=X.shape).astype(dtype) for _ in range(count)]


def one_slot(**options: Any) -> dict[str, Any]:
    return {"cores": [0], "streams_per_core": 1, **options}


def graphs_of(engine: Engine) -> Graphs:
    graphs = engine._device.graphs
    assert graphs is not None
    return graphs


@pytest.mark.parametrize("convert", ["host", "device"])
async def test_captured_once_then_launched(convert: str) -> None:
    runtime = EmulatedRuntime()
    xs = inputs(12)
    async with Engine(affine_model(), runtime=runtime, convert=convert, **one_slot()) as e:
        launches = _count(runtime, "launch_graph")
        ys = [await e.infer(x) for x in xs]
        # One graph before the task and one after, captured by the first request.
        assert graphs_of(e).captured == 2
        assert runtime.live_handles()["graphs"] == 2
        assert launches.calls == 2 * len(xs)
        assert counts_add_up(e.statistics())
    for x, y in zip(xs, ys, strict=True):
        np.testing.assert_array_equal(y, expected_affine(x))
    assert runtime.live_handles()["graphs"] == 0
    assert runtime.invalid_releases == 0


@pytest.mark.parametrize("convert", ["host", "device"])
async def test_the_same_transfers_as_each_call(convert: str) -> None:
    """A launch makes the calls the capture recorded: the same copies and conversions
    per request as with graphs=False."""
    made = {}
    for graphs in (True, False):
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime, convert=convert, graphs=graphs) as e:
            await e.infer(inputs(1)[0])
            before = dataclasses.replace(runtime.counts)
            await asyncio.gather(*(e.infer(x) for x in inputs(9)))
            after = runtime.counts
            made[graphs] = {
                f.name: getattr(after, f.name) - getattr(before, f.name)
                for f in dataclasses.fields(after)
            }
    assert made[True] == made[False]
    assert made[True]["copies_to_device"] == 9


async def test_graphs_false_captures_nothing() -> None:
    runtime = EmulatedRuntime()
    async with Engine(affine_model(), runtime=runtime, graphs=False) as e:
        await asyncio.gather(*(e.infer(x) for x in inputs(8)))
        assert e._device.graphs is None
        assert runtime.live_handles()["graphs"] == 0


async def test_one_graph_per_kind_of_request() -> None:
    """Another source dtype packs with another kernel: a graph of its own, and each
    kind goes on replaying its own graph."""
    runtime = EmulatedRuntime()
    xs32, xs16 = inputs(4), inputs(4, np.float16)
    async with Engine(affine_model(), runtime=runtime, convert="device", **one_slot()) as e:
        ys = [await e.infer(x) for pair in zip(xs32, xs16, strict=True) for x in pair]
        slot = e._device.slots[0]
        assert len(slot.graphs_in) == 2  # float32 and float16 sources
        assert len(slot.graphs_out) == 1  # the outputs are the same for both
    for x, y in zip([x for pair in zip(xs32, xs16, strict=True) for x in pair], ys, strict=True):
        np.testing.assert_array_equal(y, expected_affine(x.astype(np.float32)))


async def test_camera_frames_of_each_size() -> None:
    """A frame's size is part of its kind: each size has its graph, and each result is
    the one of its own frame."""
    model = make_loadable([IMAGE_IN], [IMAGE_OUT], "affine", 0.001, scale=1.0, bias=0.0)
    pre = ImagePreprocess(source="rgb", order="rgb", resize="letterbox", max_frame=(16, 16))
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 255, size=(h, w, 3), dtype=np.uint8) for h, w in [(8, 8), (16, 12)]]
    expected = {}
    async with Engine(model, runtime="emulated", convert="host", preprocess={"image": pre}) as e:
        for index, frame in enumerate(frames):
            expected[index] = await e.infer(frame)
    runtime = EmulatedRuntime()
    async with Engine(
        model, runtime=runtime, convert="device", preprocess={"image": pre}, **one_slot()
    ) as e:
        for _ in range(2):
            for index, frame in enumerate(frames):
                np.testing.assert_array_equal(await e.infer(frame), expected[index])
        assert len(e._device.slots[0].graphs_in) == 2


async def test_stage_times_are_measured_call_by_call() -> None:
    runtime = EmulatedRuntime()
    async with Engine(affine_model(), runtime=runtime, stage_times=True, **one_slot()) as e:
        await asyncio.gather(*(e.infer(x) for x in inputs(4)))
        assert runtime.live_handles()["graphs"] == 0
        assert e.statistics().stages is not None


async def test_what_changes_with_each_request_is_not_captured() -> None:
    """A device array's pointer and producer, and pool memory for device outputs, are
    new with each request: no kind, so each call is enqueued."""
    runtime = EmulatedRuntime()
    async with Engine(affine_model(), runtime=runtime, convert="device", **one_slot()) as e:
        path = e._device.path
        assert isinstance(path, DevicePath)
        slot = e._device.slots[0]
        staged = (0x1000, np.dtype(np.float32), (1, 1, 1, 1), None)
        slot.reads = [staged]
        assert path.graph_kinds(slot, False)[0] == (staged,)
        slot.reads = [(0x2000, np.dtype(np.float32), (1, 1, 1, 1), 0)]  # after a stream
        assert path.graph_kinds(slot, False)[0] is None
        assert path.graph_kinds(slot, device=False)[1] == ()
        runtime.has_device_memory = True  # as the CUDA runtime: device outputs are pooled
        assert path.graph_kinds(slot, device=True)[1] is None
        slot.reads = []


async def test_a_slot_keeps_at_most_max_graphs() -> None:
    runtime = EmulatedRuntime()
    async with Engine(affine_model(), runtime=runtime, **one_slot()) as e:
        slot = e._device.slots[0]
        graphs = graphs_of(e)
        event = runtime.create_event()
        table: dict[Any, Any] = {}
        for kind in range(MAX_GRAPHS + 3):
            graphs.enqueue_new(slot, table, kind, runtime.record_event, event, slot.stream)
        assert len(table) == MAX_GRAPHS
        assert runtime.live_handles()["graphs"] == MAX_GRAPHS
        assert graphs.enabled
        # Each enqueue recorded the event once: by its graph's launch, or directly.
        assert runtime._timeline.events[event].recorded == MAX_GRAPHS + 3
        runtime.synchronize_stream(slot.stream)
        runtime.destroy_event(event)


class TestCaptureFails:
    @pytest.mark.parametrize("call", ["begin_capture", "end_capture"])
    async def test_each_call_is_enqueued_from_then_on(
        self, call: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        runtime = EmulatedRuntime()
        runtime.fail_call(call, 900)  # cudaErrorStreamCaptureUnsupported
        xs = inputs(10)
        with caplog.at_level(logging.WARNING, logger="aiodla"):
            async with Engine(affine_model(), runtime=runtime) as e:
                ys = await asyncio.gather(*(e.infer(x) for x in xs))
                assert not graphs_of(e).enabled
                assert runtime.live_handles()["graphs"] == 0
                stats = e.statistics()
                assert stats.completed == len(xs)
                assert stats.failed == 0
        for x, y in zip(xs, ys, strict=True):
            np.testing.assert_array_equal(y, expected_affine(x))
        assert "enqueuing each call from now on" in caplog.text
        assert runtime.invalid_releases == 0
        assert set(runtime.live_handles().values()) == {0}

    async def test_the_warning_keeps_no_request_alive(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The capture's failure is logged by its text: the exception's traceback holds
        the frames that submitted the first request, and through them its result, which
        a log handler that keeps records (pytest's own, a memory handler) would keep
        for as long as it keeps the record: device outputs never freed."""
        runtime = EmulatedRuntime()
        runtime.fail_call("begin_capture", 900)
        with caplog.at_level(logging.WARNING, logger="aiodla"):
            async with Engine(affine_model(), runtime=runtime, **one_slot()) as e:
                y = await e.infer(inputs(1)[0])
                assert not graphs_of(e).enabled
                result = weakref.ref(y)
                del y
                await asyncio.sleep(0)  # (the loop's handle that woke this task holds it)
                gc.collect()
                assert result() is None
        (record,) = [r for r in caplog.records if "enqueuing each call" in r.getMessage()]
        assert not any(isinstance(arg, BaseException) for arg in record.args or ())
        assert "begin_capture failed" in record.getMessage()

    @pytest.mark.parametrize(
        "point", ["begin_capture", "in_the_capture", "end_capture", "ending_a_refused_capture"]
    )
    async def test_a_kept_error_keeps_no_request_alive(self, point: str) -> None:
        """A runtime, or its bindings, may keep the error it raised (a cached last
        error, an error object made once): its traceback must not hold the frames that
        submitted the request, which hold the request and its result (pool memory on a
        GPU, never freed). Each place a capture can fail, with device outputs (and, as
        on CUDA, a capture a refused call invalidated failing to end); the slot, the
        statistics and every request are unharmed."""
        runtime = EmulatedRuntime()
        kept = CudaCallError(point, 900)  # cudaErrorStreamCaptureUnsupported
        xs = inputs(4)
        async with Engine(affine_model(), runtime=runtime, **one_slot()) as e:
            if point in ("in_the_capture", "ending_a_refused_capture"):
                path = e._device.path
                assert path is not None
                real = path.enqueue_inputs
                raised: list[BaseException] = []
                refusal = kept
                if point == "ending_a_refused_capture":
                    refusal = CudaCallError("cudaMemcpyAsync", 900)
                    runtime.fail_call("end_capture", kept)  # (CUDA: 901, invalidated)

                def refused(slot: Any) -> None:
                    if not raised:
                        raised.append(refusal)
                        raise refusal
                    real(slot)

                path.enqueue_inputs = refused  # type: ignore[method-assign]
            else:
                runtime.fail_call(point, kept)
            ys = [await e.infer(x, output="device") for x in xs]
            assert not graphs_of(e).enabled
            for x, y in zip(xs, ys, strict=True):
                np.testing.assert_array_equal(y.to_host(), expected_affine(x))
            results = [weakref.ref(y) for y in ys]
            del ys, y
            await asyncio.sleep(0)  # (the loop's handle that woke this task holds one)
            gc.collect()
            assert [ref() for ref in results if ref() is not None] == []
            stats = e.statistics()
            assert (stats.completed, stats.failed) == (len(xs), 0)
            assert counts_add_up(stats)
            assert all_idle(e)
        assert runtime.live_handles()["graphs"] == 0
        assert runtime.invalid_releases == 0

    @pytest.mark.parametrize("point", ["begin_capture", "in_the_capture", "end_capture"])
    async def test_nothing_called_after_a_failure_sees_it_handled(self, point: str) -> None:
        """What the engine calls once a capture failed (ending the capture, the log's
        handlers) runs after the failure's handling ended: a binding or a handler that
        keeps the exception being handled (``sys.exc_info()``: its traceback object
        itself, which dropping the exception's ``__traceback__`` does not free) keeps
        no request's frames, and so no result."""
        runtime = EmulatedRuntime()
        seen: list[Any] = []

        class Keeping(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                seen.append(sys.exc_info())

        xs = inputs(4)
        handler = Keeping(logging.WARNING)
        logging.getLogger("aiodla").addHandler(handler)
        try:
            async with Engine(affine_model(), runtime=runtime, **one_slot()) as e:
                if point == "in_the_capture":
                    path = e._device.path
                    assert path is not None
                    real, end = path.enqueue_inputs, runtime.end_capture
                    refusals = [CudaCallError("cudaMemcpyAsync", 900)]

                    def refused(slot: Any) -> None:
                        if refusals:
                            raise refusals.pop()
                        real(slot)

                    def ending(stream: int) -> Any:
                        seen.append(sys.exc_info())
                        return end(stream)

                    path.enqueue_inputs = refused  # type: ignore[method-assign]
                    runtime.end_capture = ending  # type: ignore[method-assign]
                else:
                    runtime.fail_call(point, 900)
                ys = [await e.infer(x, output="device") for x in xs]
                assert not graphs_of(e).enabled
                results = [weakref.ref(y) for y in ys]
                del ys
                await asyncio.sleep(0)  # (the loop's handle that woke this task holds one)
                gc.collect()
                assert [ref() for ref in results if ref() is not None] == []
                assert counts_add_up(e.statistics())
        finally:
            logging.getLogger("aiodla").removeHandler(handler)
        assert seen  # the handler, and the end of the capture, were called
        assert runtime.live_handles()["graphs"] == 0

    async def test_a_call_the_capture_refuses_runs_outside_it(self) -> None:
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime, **one_slot()) as e:
            graphs = graphs_of(e)
            slot = e._device.slots[0]
            attempts = []

            def work() -> None:
                attempts.append(1)
                if len(attempts) == 1:
                    raise CudaCallError("cudaMemcpyAsync", 900)  # not in a capture

            graphs.enqueue_new(slot, {}, "kind", work)
            assert attempts == [1, 1]
            assert not graphs.enabled
            assert runtime.live_handles()["graphs"] == 0
            x = inputs(1)[0]
            np.testing.assert_array_equal(await e.infer(x), expected_affine(x))

    async def test_a_call_failing_for_its_own_reason_fails_the_request(self) -> None:
        """Recorded or not, a failing call fails its request alone; the next request of
        the kind captures its graph."""
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime, **one_slot()) as e:
            path = e._device.path
            assert path is not None
            real = path.enqueue_inputs
            failures = [ValueError("a launch failed")]

            def failing(slot: Any) -> None:
                if failures:
                    raise failures.pop()
                real(slot)

            path.enqueue_inputs = failing  # type: ignore[method-assign]
            x = inputs(1)[0]
            with pytest.raises(AiodlaError, match="a launch failed"):
                await e.infer(x)
            np.testing.assert_array_equal(await e.infer(x), expected_affine(x))
            assert graphs_of(e).enabled
            assert runtime.live_handles()["graphs"] == 2
            stats = e.statistics()
            assert (stats.completed, stats.failed) == (1, 1)
            assert counts_add_up(stats)


class TestLaunchFails:
    async def test_only_that_request_fails(self) -> None:
        runtime = EmulatedRuntime()
        xs = inputs(20)
        async with Engine(affine_model(), runtime=runtime) as e:
            await e.infer(xs[0])  # the slot's graphs exist
            runtime.fail_call("launch_graph", 2, after=5)  # cudaErrorMemoryAllocation
            outcomes = await asyncio.gather(*(e.infer(x) for x in xs), return_exceptions=True)
            failure = the_one_failure(xs, outcomes)
            assert isinstance(failure, DeviceError)
            assert "launch_graph" in str(failure)
            await asyncio.sleep(0.05)
            assert all_idle(e)
            stats = e.statistics()
            assert counts_add_up(stats)
            assert stats.failed == 1
        assert set(runtime.live_handles().values()) == {0}

    async def test_a_recorded_copy_fails_at_launch(self) -> None:
        """As on CUDA, a recorded call is checked when it runs."""
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime, **one_slot()) as e:
            x = inputs(1)[0]
            await e.infer(x)
            runtime.fail_call("copy_to_device", 2)
            with pytest.raises(DeviceError, match="copy_to_device"):
                await e.infer(x)
            np.testing.assert_array_equal(await e.infer(x), expected_affine(x))
            assert counts_add_up(e.statistics())


class TestEmulatedCapture:
    async def test_calls_are_recorded_not_run_and_run_at_each_launch(self) -> None:
        runtime = EmulatedRuntime()
        stream, event = runtime.create_stream(), runtime.create_event()
        runtime.begin_capture(stream)
        runtime.record_event(event, stream)
        graph = runtime.end_capture(stream)
        assert runtime.query_event(event)  # recorded, never run: nothing to wait for
        for _ in range(2):
            runtime.launch_graph(graph, stream)
            runtime.synchronize_stream(stream)
            assert runtime.query_event(event)
        runtime.destroy_graph(graph)
        runtime.destroy_event(event)
        runtime.destroy_stream(stream)
        assert set(runtime.live_handles().values()) == {0}

    async def test_launch_on_another_stream_runs_there(self) -> None:
        runtime = EmulatedRuntime()
        first, second = runtime.create_stream(), runtime.create_stream()
        event = runtime.create_event()
        runtime.begin_capture(first)
        runtime.record_event(event, first)
        graph = runtime.end_capture(first)
        runtime.launch_graph(graph, second)
        assert runtime._timeline.events[event].stream is runtime._timeline.streams[second]
        runtime.destroy_graph(graph)

    async def test_another_threads_calls_are_not_recorded(self) -> None:
        runtime = EmulatedRuntime()
        stream, event = runtime.create_stream(), runtime.create_event()
        runtime.begin_capture(stream)
        thread = threading.Thread(target=runtime.record_event, args=(event, stream))
        thread.start()
        thread.join()
        graph = runtime.end_capture(stream)
        assert runtime._graphs.graphs[graph] == ()
        assert runtime._timeline.events[event].recorded == 1
        runtime.destroy_graph(graph)

    async def test_misuse_is_refused(self) -> None:
        runtime = EmulatedRuntime()
        stream = runtime.create_stream()
        with pytest.raises(CudaCallError, match="end_capture"):
            runtime.end_capture(stream)
        runtime.begin_capture(stream)
        with pytest.raises(CudaCallError, match="begin_capture"):
            runtime.begin_capture(stream)
        graph = runtime.end_capture(stream)
        runtime.destroy_graph(graph)
        with pytest.raises(CudaCallError, match="launch_graph"):
            runtime.launch_graph(graph, stream)
        with pytest.raises(CudaCallError, match="destroy_graph"):
            runtime.destroy_graph(graph)
        assert runtime.invalid_releases == 1
        with pytest.raises(CudaCallError, match="begin_capture"):
            runtime.begin_capture(12345)


class _Counter:
    def __init__(self) -> None:
        self.calls = 0


def _count(runtime: EmulatedRuntime, name: str) -> _Counter:
    """Count calls of one runtime method (an instance attribute over the class's)."""
    counter = _Counter()
    method = getattr(runtime, name)

    def counted(*args: Any) -> Any:
        counter.calls += 1
        return method(*args)

    setattr(runtime, name, counted)
    return counter
