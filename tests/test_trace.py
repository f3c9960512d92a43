"""engine.trace(): the timeline's events, their format, and what they must agree with
(the runtime's own task counts, statistics()), its bounded memory and its errors."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodla import (
    ConfigurationError,
    Cores,
    EmulatedRuntime,
    Engine,
    EngineClosedError,
    RequestTimeoutError,
)
from aiodla._trace import TraceRecorder, core_tid, stream_tid
from aiodla.testing import EngineFactory

from support import X, affine_model, wait_until
from trace_format import check_trace_format

ONES = np.ones(X.shape, np.float32)


def slices(document: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [e for e in document["traceEvents"] if e["ph"] == "X" and e["name"] == name]


def track_names(document: dict[str, Any]) -> dict[int, str]:
    return {
        e["tid"]: e["args"]["name"]
        for e in document["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


class TestTimeline:
    @pytest.mark.asyncio
    async def test_one_dla_slice_per_request_on_its_core(
        self, engine: Engine, runtime: EmulatedRuntime, tmp_path: Path
    ) -> None:
        path = tmp_path / "run.json"
        async with engine.trace(path, name="affine"):
            await asyncio.gather(*(engine.infer(ONES) for _ in range(60)))
        document = json.loads(path.read_text())
        check_trace_format(document)
        tasks = slices(document, "DLA task")
        assert sorted(t["args"]["request"] for t in tasks) == list(range(60))
        assert {t["args"]["model"] for t in tasks} == {"affine"}
        names = track_names(document)
        for core in (0, 1):
            on_core = [t for t in tasks if names[t["tid"]].startswith(f"core {core} stream ")]
            # The runtime's own count of the tasks each core ran.
            assert len(on_core) == runtime.core_tasks(core) > 0
            assert {t["tid"] for t in on_core} <= {stream_tid(core, s) for s in (0, 1)}
            assert slices(document, "busy")  # and the core's busy spans
            busy = [b for b in slices(document, "busy") if b["tid"] == core_tid(core)]
            assert busy and sum(b["dur"] for b in busy) >= sum(t["dur"] for t in on_core) - 1

    @pytest.mark.asyncio
    async def test_a_single_core_engine_puts_every_task_on_that_core(
        self, aiodla_engine: EngineFactory
    ) -> None:
        engine = await aiodla_engine(affine_model(), cores=[1])
        async with engine.trace() as recorder:
            await asyncio.gather(*(engine.infer(ONES) for _ in range(10)))
        document = recorder.trace_events()
        check_trace_format(document)
        tasks = slices(document, "DLA task")
        assert len(tasks) == 10
        assert {t["tid"] for t in tasks} <= {stream_tid(1, 0), stream_tid(1, 1)}

    @pytest.mark.asyncio
    async def test_queue_waits_match_statistics(self, aiodla_engine: EngineFactory) -> None:
        engine = await aiodla_engine(affine_model(0.002))
        async with engine.trace() as recorder:
            await asyncio.gather(*(engine.infer(ONES) for _ in range(40)))
        document = recorder.trace_events()
        begins = {e["id"]: e["ts"] for e in document["traceEvents"] if e["ph"] == "b"}
        ends = {e["id"]: e["ts"] for e in document["traceEvents"] if e["ph"] == "e"}
        waits = sorted((ends[i] - begins[i]) * 1e-6 for i in begins)
        stats = engine.statistics().queue_wait
        resolution = 1e-6  # microsecond timestamps; both come from time.monotonic
        assert stats.count == len(waits) == 40
        assert max(waits) == pytest.approx(stats.max, abs=resolution)
        assert float(np.mean(waits)) == pytest.approx(stats.mean, abs=resolution)
        assert float(np.percentile(waits, 50)) == pytest.approx(stats.p50, abs=resolution)
        assert max(waits) > 0.002  # most of them waited for a slot: a real comparison

    @pytest.mark.asyncio
    async def test_every_step_of_a_request_in_order(self, engine: Engine) -> None:
        async with engine.trace() as recorder:
            await asyncio.gather(*(engine.infer(ONES) for _ in range(8)))
        (record, *_) = [r for r in map(_record, recorder.requests) if r.number == 0]
        steps = [
            record.queued,
            record.assigned,
            record.packed,
            record.submitted,
            record.seen,
            record.handled,
            record.returned,
        ]
        assert None not in steps and steps == sorted(steps)
        assert record.outcome == "completed"
        sweeps = list(recorder.sweeps)
        assert sweeps and sum(found for _, _, found, _ in sweeps) >= 8
        document = recorder.trace_events()
        flows = collections.Counter(
            e["ph"] for e in document["traceEvents"] if e.get("cat") == "request"
        )
        assert flows == {"s": 8, "t": 8, "f": 8}

    @pytest.mark.asyncio
    async def test_requests_that_never_ran_show_their_wait(
        self, engine: Engine, runtime: EmulatedRuntime
    ) -> None:
        gates = [runtime.hold(0), runtime.hold(1)]
        async with engine.trace() as recorder:
            running = [asyncio.create_task(engine.infer(ONES)) for _ in range(4)]
            await wait_until(lambda: engine.statistics().in_flight == 4)
            waiting = asyncio.create_task(engine.infer(ONES))
            await wait_until(lambda: engine.statistics().queued == 1)
            with pytest.raises(RequestTimeoutError):
                await engine.infer(ONES, timeout=0.05)  # times out in line
            waiting.cancel()
            for gate in gates:
                gate.release()
            await asyncio.gather(*running)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        outcomes = collections.Counter(_record(r).outcome for r in recorder.requests)
        assert outcomes == {"completed": 4, "cancelled": 1, "timed_out": 1}
        never = [_record(r) for r in recorder.requests if _record(r).assigned is None]
        assert len(never) == 2
        document = recorder.trace_events()
        check_trace_format(document)
        assert len(slices(document, "DLA task")) == 4

    @pytest.mark.asyncio
    async def test_steps_in_worker_threads_stay_off_the_loop_track(
        self, aiodla_engine: EngineFactory
    ) -> None:
        # Every input and output larger than offload_bytes: packed and unpacked in
        # worker threads while the loop goes on.
        engine = await aiodla_engine(affine_model(), offload_bytes=1)
        async with engine.trace() as recorder:
            await asyncio.gather(*(engine.infer(ONES) for _ in range(12)))
        document = recorder.trace_events()
        check_trace_format(document)
        off_loop = [e for e in document["traceEvents"] if e.get("cat") == "off-loop"]
        assert {e["name"] for e in off_loop} >= {"pack"}
        assert sum(e["ph"] == "b" and e["name"] == "pack" for e in off_loop) == 12
        assert track_names(document)[off_loop[0]["tid"]] == "off-loop steps"
        assert len(slices(document, "DLA task")) == 12

    @pytest.mark.asyncio
    async def test_off_after_the_block(self, engine: Engine) -> None:
        async with engine.trace() as recorder:
            await engine.infer(ONES)
        flow = engine._flow  # type: ignore[attr-defined]
        assert flow.trace is None and flow.poller.trace is None
        await engine.infer(ONES)
        assert recorder.recorded == 1


class TestSweepTracks:
    def test_the_pollers_sweeps_and_the_loops_harvests_have_their_own_tracks(self) -> None:
        """A sweep made on the recorder's (the loop's) thread is a harvest, drawn on
        'loop harvests'; one from any other thread is the poller's, on 'poller'."""
        times = iter(float(t) for t in range(100))
        recorder = TraceRecorder("r", clock=lambda: next(times))

        def poller() -> None:
            recorder.sweep(10.0, [("slot a", 0), ("slot b", 0)])

        thread = threading.Thread(target=poller)
        thread.start()
        thread.join()
        recorder.sweep(20.0, [("slot c", 0)])
        document = recorder.trace_events()
        check_trace_format(document)
        names = track_names(document)
        found = {names[e["tid"]]: e["args"]["found"] for e in slices(document, "sweep")}
        assert found == {"poller": 2, "loop harvests": 1}

    @pytest.mark.asyncio
    async def test_an_engines_sweeps_come_from_its_poller_thread(self, engine: Engine) -> None:
        async with engine.trace() as recorder:
            await asyncio.gather(*(engine.infer(ONES) for _ in range(20)))
        document = recorder.trace_events()
        names = track_names(document)
        by_track = collections.Counter(names[e["tid"]] for e in slices(document, "sweep"))
        # The poller thread found every completion that the loop did not harvest itself.
        found = sum(e["args"]["found"] for e in slices(document, "sweep"))
        assert found == 20
        assert by_track["poller"] > 0
        assert set(by_track) <= {"poller", "loop harvests"}


class TestBounds:
    @pytest.mark.asyncio
    async def test_memory_is_a_ring_of_capacity(self, engine: Engine) -> None:
        async with engine.trace(capacity=10) as recorder:
            await asyncio.gather(*(engine.infer(ONES) for _ in range(50)))
        assert len(recorder.requests) == 10 and recorder.recorded == 50
        assert len(recorder.sweeps) <= 10
        assert len(recorder._open) == 0  # nothing kept for ended requests
        document = recorder.trace_events()
        check_trace_format(document)
        assert document["otherData"]["requests_dropped"] == 40
        assert len(slices(document, "DLA task")) == 10
        # The newest are kept.
        kept = sorted(e["args"]["request"] for e in slices(document, "DLA task"))
        assert kept == list(range(40, 50))

    def test_a_recorder_holds_capacity_records_whatever_it_is_fed(self) -> None:
        recorder = TraceRecorder(capacity=3)

        class Req:
            started = 0.0

        for _ in range(100):
            recorder.ended(Req(), "cancelled")
            recorder.sweep(0.0, [])
        assert len(recorder.requests) == 3 and len(recorder.sweeps) == 3
        assert recorder.trace_events()["otherData"]["sweeps_dropped"] == 97


class TestErrors:
    @pytest.mark.parametrize("capacity", [0, -1, 1.5, True])
    def test_a_bad_capacity_is_refused(self, capacity: Any) -> None:
        with pytest.raises(ConfigurationError, match="capacity"):
            TraceRecorder(capacity=capacity)

    @pytest.mark.asyncio
    async def test_one_trace_at_a_time(self, engine: Engine) -> None:
        async with engine.trace():
            with pytest.raises(ConfigurationError, match="already being traced"):
                async with engine.trace():
                    pass
            await engine.infer(ONES)  # the first one still records

    @pytest.mark.asyncio
    async def test_a_closed_engine_cannot_be_traced(self, engine: Engine) -> None:
        await engine.aclose()
        with pytest.raises(EngineClosedError, match="open engine"):
            engine.trace()

    @pytest.mark.asyncio
    async def test_the_file_is_written_when_the_block_fails(
        self, engine: Engine, tmp_path: Path
    ) -> None:
        path = tmp_path / "failed.json"

        async def fail_in_the_block() -> None:
            async with engine.trace(path):
                await engine.infer(ONES)
                raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            await fail_in_the_block()
        check_trace_format(json.loads(path.read_text()))


def dla_tasks_in(path: Path) -> list[dict[str, Any]]:
    document = json.loads(path.read_text())
    check_trace_format(document)
    return slices(document, "DLA task")


# DLA task slices come from the in-process device layer's hooks (a worker process's
# device layer has none).
@pytest.mark.in_process
class TestEngineTraceOption:
    """``Engine(..., trace=path)``: the engine's whole life, written at close."""

    @pytest.mark.asyncio
    async def test_the_whole_life_is_written_at_close(
        self, runtime: EmulatedRuntime, tmp_path: Path
    ) -> None:
        model = tmp_path / "detector.bin"
        model.write_bytes(affine_model())
        path = tmp_path / "run.json"
        engine = Engine(model, runtime=runtime, trace=path)
        assert not path.exists()  # nothing before open
        async with engine:
            assert dla_tasks_in(path) == []  # at open: a valid, empty trace
            await asyncio.gather(*(engine.infer(ONES) for _ in range(20)))
            assert dla_tasks_in(path) == []  # written at close, not before
            await asyncio.gather(*(engine.infer(ONES) for _ in range(5)))
        document = json.loads(path.read_text())
        check_trace_format(document)
        tasks = slices(document, "DLA task")
        assert sorted(t["args"]["request"] for t in tasks) == list(range(25))
        assert {t["args"]["model"] for t in tasks} == {"detector"}  # the model file's name
        assert document["otherData"]["requests_dropped"] == 0
        assert sum(runtime.core_tasks(core) for core in (0, 1)) == 25
        assert engine._flow.trace is None  # type: ignore[union-attr]  # off once written

    @pytest.mark.asyncio
    async def test_memory_is_a_ring_of_trace_capacity(
        self, aiodla_engine: EngineFactory, tmp_path: Path
    ) -> None:
        path = tmp_path / "run.json"
        engine = await aiodla_engine(affine_model(), trace=path, trace_capacity=5)
        for _ in range(6):
            await asyncio.gather(*(engine.infer(ONES) for _ in range(5)))
        recorder = engine._trace.recorder  # type: ignore[attr-defined]
        assert len(recorder.requests) == 5 and recorder.recorded == 30
        assert len(recorder.sweeps) <= 5
        await engine.aclose()
        document = json.loads(path.read_text())
        check_trace_format(document)
        assert document["otherData"]["capacity"] == 5
        assert document["otherData"]["requests_dropped"] == 25
        kept = sorted(t["args"]["request"] for t in slices(document, "DLA task"))
        assert kept == list(range(25, 30))  # the newest

    @pytest.mark.asyncio
    async def test_requests_failed_by_close_are_in_the_file(
        self, aiodla_engine: EngineFactory, aiodla_controls: Any, tmp_path: Path
    ) -> None:
        path = tmp_path / "run.json"
        engine = await aiodla_engine(affine_model(), trace=path, cores=[0], streams_per_core=1)
        gate = aiodla_controls.hold(0)
        running = asyncio.ensure_future(engine.infer(ONES))
        waiting = asyncio.ensure_future(engine.infer(ONES))
        await wait_until(lambda: engine.statistics().queued == 1)
        closing = asyncio.ensure_future(engine.aclose())
        with pytest.raises(EngineClosedError):
            await waiting  # failed by the close while it waited
        gate.release()
        await closing
        await running  # in flight: finished within close_timeout
        document = json.loads(path.read_text())
        check_trace_format(document)
        assert document["otherData"]["requests_recorded"] == 2

    @pytest.mark.asyncio
    async def test_engine_trace_is_refused_while_the_engine_traces_itself(
        self, aiodla_engine: EngineFactory, tmp_path: Path
    ) -> None:
        engine = await aiodla_engine(affine_model(), trace=tmp_path / "run.json")
        with pytest.raises(ConfigurationError, match="already being traced"):
            async with engine.trace():
                pass
        await engine.infer(ONES)
        await engine.aclose()
        assert len(dla_tasks_in(tmp_path / "run.json")) == 1

    @pytest.mark.asyncio
    @pytest.mark.parametrize("where", ["no such folder", "a folder"])
    async def test_a_path_that_cannot_be_written_fails_the_open(
        self, runtime: EmulatedRuntime, tmp_path: Path, where: str
    ) -> None:
        path = tmp_path / "missing" / "run.json" if where == "no such folder" else tmp_path
        engine = Engine(affine_model(), runtime=runtime, trace=path)
        with pytest.raises(ConfigurationError, match=rf"trace='{path}' cannot be written"):
            await engine.open()
        assert engine.state.value == "closed"
        # It failed before any device opened: nothing to release.
        assert not any(runtime.live_handles().values())
        assert not runtime.core_tasks(0)

    @pytest.mark.parametrize(
        ("options", "match"),
        [
            ({"trace": 3}, "trace=3 must be a file path"),
            ({"trace": ""}, "trace='' must be a file path"),
            ({"trace": "run.json", "trace_capacity": 0}, "trace_capacity=0 must be an int >= 1"),
            ({"trace": "run.json", "trace_capacity": 2.5}, "trace_capacity=2.5 must be an int"),
        ],
    )
    def test_bad_trace_options_are_refused_at_construction(
        self, options: dict[str, Any], match: str
    ) -> None:
        with pytest.raises(ConfigurationError, match=match):
            Engine(affine_model(), **options)

    @pytest.mark.asyncio
    async def test_a_write_that_fails_at_close_still_closes_the_engine(
        self, runtime: EmulatedRuntime, tmp_path: Path
    ) -> None:
        folder = tmp_path / "gone"
        folder.mkdir()
        engine = Engine(affine_model(), runtime=runtime, trace=folder / "run.json")
        await engine.open()
        await engine.infer(ONES)
        (folder / "run.json").unlink()
        folder.rmdir()  # removed while the engine ran
        with pytest.raises(
            ConfigurationError,
            match=rf"trace='{folder / 'run.json'}' cannot be written at close: No such file",
        ):
            await engine.aclose()
        assert engine.state.value == "closed"
        await asyncio.wait_for(engine.wait_closed(), 5)
        assert not any(runtime.live_handles().values())


class TestTracePaths:
    """A trace path is written as a regular file or not at all: never through a final
    symbolic link (which could point at any file of the user's), never into a FIFO or
    a device (whose open would wait for a reader, or whose writes go elsewhere)."""

    @pytest.mark.asyncio
    async def test_a_final_symlink_is_not_followed_at_open(
        self, runtime: EmulatedRuntime, tmp_path: Path
    ) -> None:
        victim = tmp_path / "precious.txt"
        victim.write_text("keep me")
        link = tmp_path / "run.json"
        link.symlink_to(victim)
        engine = Engine(affine_model(), runtime=runtime, trace=link)
        with pytest.raises(ConfigurationError, match="a symbolic link: not followed"):
            await engine.open()
        assert victim.read_text() == "keep me" and link.is_symlink()
        assert not any(runtime.live_handles().values())

    @pytest.mark.asyncio
    async def test_a_final_symlink_is_not_followed_by_a_traced_block(
        self, engine: Engine, tmp_path: Path
    ) -> None:
        victim = tmp_path / "precious.txt"
        victim.write_text("keep me")
        link = tmp_path / "run.json"
        link.symlink_to(victim)
        with pytest.raises(
            ConfigurationError, match=r"engine\.trace\(.*run\.json.\) cannot be written"
        ):
            async with engine.trace(link):
                await engine.infer(ONES)
        assert victim.read_text() == "keep me"
        await engine.infer(ONES)  # the engine is not disturbed

    @pytest.mark.asyncio
    async def test_a_symlinked_folder_is_followed(
        self, runtime: EmulatedRuntime, tmp_path: Path
    ) -> None:
        # Only the final component is refused as a link: a folder reached through one
        # (a home directory on another disk) is a user's ordinary choice.
        real = tmp_path / "real"
        real.mkdir()
        (tmp_path / "linked").symlink_to(real)
        async with Engine(
            affine_model(), runtime=runtime, trace=tmp_path / "linked" / "run.json"
        ) as e:
            await e.infer(ONES)
        assert len(dla_tasks_in(real / "run.json")) == 1

    @pytest.mark.asyncio
    @pytest.mark.timeout(20)
    @pytest.mark.parametrize("kind", ["fifo", "device"])
    async def test_a_fifo_or_a_device_is_refused_at_once(
        self, runtime: EmulatedRuntime, tmp_path: Path, kind: str
    ) -> None:
        if kind == "fifo":
            path = tmp_path / "run.json"
            os.mkfifo(path)
            match = r"a FIFO \(named pipe\), not a regular file: not written"
        else:
            path = Path(os.devnull)
            match = "a character device, not a regular file: not written"
        engine = Engine(affine_model(), runtime=runtime, trace=path)
        with pytest.raises(ConfigurationError, match=match):
            await engine.open()
        assert engine.state.value == "closed"
        assert not any(runtime.live_handles().values())

    def test_an_existing_regular_file_is_replaced_whole(self, tmp_path: Path) -> None:
        path = tmp_path / "run.json"
        path.write_text("x" * 100_000)  # longer than the trace: nothing of it may remain
        TraceRecorder("r").write(path)
        assert json.loads(path.read_text())["otherData"]["requests_recorded"] == 0


class TestCoresTrace:
    """dla.trace(): every engine on one Cores on one timeline, each named."""

    @pytest.mark.asyncio
    async def test_two_models_on_one_timeline_with_their_names(
        self, runtime: EmulatedRuntime, tmp_path: Path
    ) -> None:
        path = tmp_path / "cores.json"
        async with (
            Cores([0, 1], runtime=runtime) as dla,
            Engine(affine_model(0.002), cores=dla, priority=1) as detector,
            Engine(affine_model(0.001), cores=dla) as classifier,
        ):
            names = {detector: "detector", classifier: "classifier"}
            async with dla.trace(path, names=names) as trace:
                await asyncio.gather(
                    *(detector.infer(ONES) for _ in range(12)),
                    *(classifier.infer(ONES) for _ in range(30)),
                )
            assert [r.name for r in trace.recorders] == ["detector", "classifier"]
            await detector.infer(ONES)  # after the block: not recorded
        document = json.loads(path.read_text())
        check_trace_format(document)  # ids unique across engines, tracks well formed
        processes = {
            e["pid"]: e["args"]["name"]
            for e in document["traceEvents"]
            if e["name"] == "process_name"
        }
        assert sorted(processes.values()) == ["aiodla: classifier", "aiodla: detector"]
        threads = {
            (e["pid"], e["tid"]): e["args"]["name"]
            for e in document["traceEvents"]
            if e["name"] == "thread_name"
        }
        tasks = slices(document, "DLA task")
        by_model = collections.Counter(t["args"]["model"] for t in tasks)
        assert by_model == {"detector": 12, "classifier": 30}
        for task in tasks:
            # The engine's name on its track, and its process is that engine's.
            track = threads[(task["pid"], task["tid"])]
            assert track.startswith("core ") and track.endswith(f": {task['args']['model']}")
            assert processes[task["pid"]] == f"aiodla: {task['args']['model']}"
        # Both engines' requests share one clock: each ran within the block's span.
        assert document["otherData"]["engine"] == "detector + classifier"
        counts = {e["name"]: e["requests_recorded"] for e in document["otherData"]["engines"]}
        assert counts == {"detector": 12, "classifier": 30}

    @pytest.mark.asyncio
    async def test_engines_sharing_a_poller_each_get_its_sweeps(
        self, runtime: EmulatedRuntime
    ) -> None:
        """A Cores' engines share one poller thread: tracing one engine, then another,
        then ending the first, each recorder keeps seeing the sweeps (the second trace
        used to take the poller's hook from the first)."""
        async with (
            Cores([0, 1], runtime=runtime) as dla,
            Engine(affine_model(), cores=dla) as one,
            Engine(affine_model(), cores=dla) as two,
        ):
            async with one.trace() as first:
                async with two.trace() as second:
                    await asyncio.gather(*(e.infer(ONES) for e in (one, two) for _ in range(10)))
                assert first.swept > 0 and second.swept > 0
                swept = second.swept
                await asyncio.gather(*(one.infer(ONES) for _ in range(10)))
                assert second.swept == swept  # its block ended: it records no more
            before = first.swept
            await asyncio.gather(*(one.infer(ONES) for _ in range(10)))
            assert first.swept == before  # and neither does the first after its block
        for recorder in (first, second):
            document = recorder.trace_events()
            check_trace_format(document)
            assert slices(document, "sweep"), recorder.name

    @pytest.mark.asyncio
    async def test_trace_plot_draws_both_models_on_the_core_rows(
        self, runtime: EmulatedRuntime, tmp_path: Path
    ) -> None:
        pytest.importorskip("matplotlib")
        from aiodla._trace_plot import plot_trace

        async with (
            Cores([0, 1], runtime=runtime) as dla,
            Engine(affine_model(), cores=dla) as one,
            Engine(affine_model(), cores=dla) as two,
            dla.trace() as trace,
        ):
            await asyncio.gather(*(e.infer(ONES) for e in (one, two) for _ in range(6)))
        # Unnamed, both models are bytes: "engine" and "engine 2".
        assert [r.name for r in trace.recorders] == ["engine", "engine 2"]
        out = plot_trace(trace.trace_events(), tmp_path / "cores.svg")
        svg = out.read_text()
        assert "DLA: engine" in svg and "DLA: engine 2" in svg
        assert "core 0" in svg and "core 1" in svg

    @pytest.mark.asyncio
    async def test_errors(self, runtime: EmulatedRuntime, tmp_path: Path) -> None:
        dla = Cores([0, 1], runtime=runtime)
        with pytest.raises(EngineClosedError, match="open them first"):
            dla.trace()
        async with dla, Engine(affine_model(), cores=dla) as engine:
            other = object()
            with pytest.raises(ConfigurationError, match="not engines open on these cores"):
                dla.trace(names={other: "x"})
            with pytest.raises(ConfigurationError, match="capacity=0"):
                dla.trace(capacity=0)
            async with engine.trace():
                with pytest.raises(ConfigurationError, match="one trace at a time"):
                    async with dla.trace():
                        pass
            async with dla.trace() as trace:  # nothing was left installed by the refusal
                await engine.infer(ONES)
            assert trace.recorders[0].recorded == 1
            link = tmp_path / "link.json"
            link.symlink_to(tmp_path / "target.json")
            with pytest.raises(ConfigurationError, match="symbolic link"):
                async with dla.trace(link):
                    await engine.infer(ONES)
            assert not (tmp_path / "target.json").exists()


def _record(raw: tuple[Any, ...]) -> Any:
    from aiodla._trace import RequestRecord

    return RequestRecord(*raw)
