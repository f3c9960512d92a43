"""The trace's edges that mutation testing found untested (issue 44), on recorders fed
by hand with a clock the test sets: request ids unique across the engines of one
``Cores`` trace, one time zero for all of them, the off-loop steps' async slices, the
file's header, and frames counted one by one."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from aiodla import ConfigurationError, Engine
from aiodla._trace import (
    TraceRecorder,
    active_recorder,
    cores_trace,
    data_address,
    install,
    uninstall,
)
from aiodla._trace_events import FRAME_FLOW_BASE, TRACE_FORMAT, CoresTrace, stream_tid

from support import FakeCudaArray, X, affine_model
from trace_format import check_trace_format

ONES = np.ones(X.shape, np.float32)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Request:
    """What the recorder reads of a request (hashable, as the engine's are)."""

    def __init__(self, started: float, arrays: tuple[Any, ...] = ()) -> None:
        self.started = started
        self.arrays = arrays
        self.sources: tuple[Any, ...] = ()


class Slot:
    def __init__(self, core: int, index: int) -> None:
        self.core = SimpleNamespace(core=core)
        self.index = index


def slot(core: int, index: int) -> Slot:
    return Slot(core, index)


def run_request(
    recorder: TraceRecorder, clock: Clock, at: float, *, core: int = 0, off_loop: bool = False
) -> None:
    """One request through every hook: queued at ``at``, each step a millisecond."""
    request = Request(at)
    where = slot(core, 0)
    recorder.assigned(request, where, at + 0.001)
    clock.now = at + 0.002
    if off_loop:  # packed in a worker thread
        thread = threading.Thread(target=recorder.packed, args=(request,))
        thread.start()
        thread.join()
    else:
        recorder.packed(request)
    clock.now = at + 0.003
    recorder.submitted(request)
    clock.now = at + 0.005
    recorder.sweep(at + 0.004, [(where, 0)])
    clock.now = at + 0.006
    recorder.completed(request, where)
    clock.now = at + 0.007
    recorder.ended(request, "completed")


def recorded(name: str, origin: float, starts: list[float], **kw: Any) -> TraceRecorder:
    clock = Clock(origin)
    recorder = TraceRecorder(name, clock=clock)
    for at in starts:
        run_request(recorder, clock, at, **kw)
    return recorder


def ids_by_request(document: dict[str, Any], pid: int, cat: str) -> dict[int, set[int]]:
    found: dict[int, set[int]] = {}
    for event in document["traceEvents"]:
        if event.get("cat") == cat and event["pid"] == pid and event["ph"] == "b":
            found.setdefault(event["args"]["request"], set()).add(event["id"])
    return found


class TestCoresTraceOfThree:
    def test_ids_are_unique_and_every_engine_shares_the_earliest_time_zero(self) -> None:
        first = recorded("a", 100.0, [100.01, 100.02])
        second = recorded("b", 99.0, [100.03, 100.04, 100.05])
        third = recorded("c", 101.0, [101.01])
        document = CoresTrace([first, second, third]).trace_events()
        check_trace_format(document)
        assert document["displayTimeUnit"] == "ms"
        # Each engine's queued slices: the request numbers after the engines before it.
        assert ids_by_request(document, 1, "queue") == {0: {0}, 1: {1}}
        assert ids_by_request(document, 2, "queue") == {0: {2}, 1: {3}, 2: {4}}
        assert ids_by_request(document, 3, "queue") == {0: {5}}
        # One clock: the earliest recorder's start (99.0) is time zero for all three.
        returned = {
            (e["pid"], e["args"]["request"]): e["ts"]
            for e in document["traceEvents"]
            if e["name"] == "returned"
        }
        assert returned[(1, 0)] == round((100.017 - 99.0) * 1e6, 3)
        assert returned[(3, 0)] == round((101.017 - 99.0) * 1e6, 3)
        other = document["otherData"]
        assert other["format"] == TRACE_FORMAT and other["version"] == 1
        assert other["clock"] == "time.monotonic, microseconds from the first recorder's start"
        assert [e["name"] for e in other["engines"]] == ["a", "b", "c"]
        assert [e["requests_recorded"] for e in other["engines"]] == [2, 3, 1]

    def test_no_engine_is_an_empty_trace(self) -> None:
        # An open Cores with no engine on it yet may be traced: nothing to draw.
        document = CoresTrace([]).trace_events()
        assert document["traceEvents"] == []
        assert document["otherData"]["engines"] == []


class TestTrackOrder:
    def test_cores_are_drawn_in_order_each_above_its_streams(self) -> None:
        clock = Clock(0.0)
        recorder = TraceRecorder("r", clock=clock)
        for at, core in ((1.0, 1), (2.0, 0), (3.0, 2)):
            run_request(recorder, clock, at, core=core)
        document = recorder.trace_events()
        check_trace_format(document)
        names = {
            e["tid"]: e["args"]["name"]
            for e in document["traceEvents"]
            if e["name"] == "thread_name"
        }
        order = sorted(
            (e["args"]["sort_index"], names[e["tid"]])
            for e in document["traceEvents"]
            if e["name"] == "thread_sort_index"
        )
        assert [name for _, name in order] == [
            "event loop", "loop harvests", "poller",
            "core 0", "core 0 stream 0", "core 1", "core 1 stream 0",
            "core 2", "core 2 stream 0",
        ]  # fmt: skip


class TestOffLoopSteps:
    def test_a_pack_in_a_worker_thread_is_an_async_slice_of_its_request(self) -> None:
        first = recorded("a", 0.0, [1.0])
        second = recorded("b", 0.0, [2.0, 3.0], off_loop=True)
        alone = second.trace_events()  # one engine's own trace, as engine.trace() writes
        check_trace_format(alone)
        assert alone["displayTimeUnit"] == "ms"
        assert alone["otherData"] == {
            "format": TRACE_FORMAT,
            "version": 1,
            "engine": "b",
            "clock": "time.monotonic, microseconds from the recorder's start",
            "capacity": second.capacity,
            "requests_recorded": 2,
            "requests_dropped": 0,
            "sweeps_dropped": 0,
        }
        assert [e["id"] for e in alone["traceEvents"] if e["name"] == "pack"] == [0, 0, 1, 1]
        document = CoresTrace([first, second]).trace_events()
        check_trace_format(document)
        packs = [e for e in document["traceEvents"] if e["name"] == "pack" and e["pid"] == 2]
        assert {e["ph"] for e in packs} == {"b", "e"}
        begins = sorted((e for e in packs if e["ph"] == "b"), key=lambda e: e["ts"])
        ends = sorted((e for e in packs if e["ph"] == "e"), key=lambda e: e["ts"])
        # Its id is its request's in the file (after the first engine's one request).
        assert [e["id"] for e in begins] == [1, 2] and [e["id"] for e in ends] == [1, 2]
        assert [e["args"] for e in begins] == [
            {"request": n, "model": "b", "outcome": "completed"} for n in (0, 1)
        ]
        assert all(e["args"] == {} for e in ends)
        assert [e["ts"] for e in begins] == [round(t * 1e6, 3) for t in (2.001, 3.001)]
        assert [e["ts"] for e in ends] == [round(t * 1e6, 3) for t in (2.002, 3.002)]


class TestFrames:
    def test_a_buffer_decoded_into_again_is_the_newest_and_kept_longest(self) -> None:
        """Frames are numbered one by one; which frame a request reads is found by
        where its pixels lie, and the addresses kept are the newest decoded: a buffer
        decoded into again counts as new, not as the oldest (capacity 1 keeps 4)."""
        buffers = [np.zeros(4, np.uint8) for _ in range(5)]
        address = [data_address(b) for b in buffers]
        clock = Clock(0.0)
        recorder = TraceRecorder("v", capacity=1, clock=clock)
        for index, which in enumerate((0, 1, 2, 3, 0, 4)):
            recorder.frame("cam", index, index / 10, index / 10 + 0.05, address[which])
        assert recorder.framed == 6
        assert [f[0] for f in recorder.frames] == [5]  # a ring of capacity 1: the newest
        request = Request(1.0, (buffers[0],))
        recorder.assigned(request, slot(0, 0), 1.0)
        recorder.ended(request, "completed")
        assert recorder.frame_of == {0: 4}  # frame 4 was decoded into buffer 0 last

    def test_a_recorder_knows_the_last_four_capacities_of_addresses(self) -> None:
        """With capacity 1, four buffers' frames are known, and the oldest of a fifth
        is forgotten: a request reading it is drawn without a frame."""
        buffers = [np.zeros(4, np.uint8) for _ in range(5)]

        def reader_of(count: int, read: int) -> dict[int, int]:
            recorder = TraceRecorder("v", capacity=1, clock=Clock(0.0))
            for index in range(count):
                recorder.frame("cam", index, 0.0, 0.01, data_address(buffers[index]))
            request = Request(1.0, (buffers[read],))
            recorder.assigned(request, slot(0, 0), 1.0)
            recorder.ended(request, "completed")
            return recorder.frame_of

        assert reader_of(4, 0) == {0: 0}
        assert reader_of(5, 0) == {}
        assert reader_of(5, 1) == {0: 1}

    def test_a_frame_read_from_a_requests_sources_is_linked(self) -> None:
        # Device arrays a request reads are its sources, not its arrays.
        buffer = np.zeros(4, np.uint8)
        recorder = TraceRecorder("v", clock=Clock(0.0))
        recorder.frame("cam", 0, 0.0, 0.01, data_address(buffer))
        request = Request(1.0)
        request.sources = (buffer,)
        recorder.assigned(request, slot(0, 0), 1.0)
        recorder.ended(request, "completed")
        assert recorder.frame_of == {0: 0}

    def test_a_request_that_read_no_frame_ends_beside_one_that_did(self) -> None:
        buffer = np.zeros(4, np.uint8)
        recorder = TraceRecorder("v", clock=Clock(0.0))
        recorder.frame("cam", 0, 0.0, 0.01, data_address(buffer))
        reading, other = Request(1.0, (buffer,)), Request(1.0, (np.zeros(4, np.uint8),))
        recorder.assigned(reading, slot(0, 0), 1.0)
        recorder.assigned(other, slot(0, 1), 1.0)
        recorder.ended(other, "completed")  # number 0: read no frame
        recorder.ended(reading, "completed")  # number 1
        assert recorder.frame_of == {1: 0}

    def test_the_links_of_the_last_four_capacities_of_requests_are_kept(self) -> None:
        def links(count: int) -> list[int]:
            buffer = np.zeros(4, np.uint8)
            recorder = TraceRecorder("v", capacity=1, clock=Clock(0.0))
            recorder.frame("cam", 0, 0.0, 0.01, data_address(buffer))
            for _ in range(count):
                request = Request(1.0, (buffer,))
                recorder.assigned(request, slot(0, 0), 1.0)
                recorder.ended(request, "completed")
            return sorted(recorder.frame_of)

        assert links(4) == [0, 1, 2, 3]
        assert links(5) == [1, 2, 3, 4]
        assert links(6) == [2, 3, 4, 5]


class TestAddresses:
    def test_a_device_arrays_address_is_its_cuda_pointer(self) -> None:
        # A frame decoded on the GPU is found by its device pointer.
        assert data_address(FakeCudaArray((2, 2))) == 0x1000
        host = np.zeros(3, np.float32)
        assert data_address(host) == host.__array_interface__["data"][0]
        assert data_address(b"bytes") == -1

    def test_an_engine_not_open_has_no_recorder(self) -> None:
        assert active_recorder(Engine(affine_model())) is None

    def test_an_interface_without_a_pointer_is_no_address(self) -> None:
        for data in (None, (), (None, False), "0x1000"):
            array = FakeCudaArray((2, 2))
            array.__cuda_array_interface__["data"] = data
            assert data_address(array) == -1, data


class TestCoresTraceOfEngines:
    """cores_trace(), what Cores.trace() returns, over engines of this test's own."""

    @pytest.mark.asyncio
    async def test_capacity_and_names_reach_every_recorder(self, tmp_path: Path) -> None:
        model = tmp_path / "detector.bin"
        model.write_bytes(affine_model())
        async with Engine(model) as detector, Engine(affine_model()) as other:
            tracing = cores_trace([detector, other], capacity=2)
            async with tracing as trace:
                for _ in range(5):
                    await detector.infer(ONES)
                    await other.infer(ONES)
        assert [r.name for r in trace.recorders] == ["detector", "engine"]
        assert [(len(r.requests), r.recorded) for r in trace.recorders] == [(2, 5), (2, 5)]

    def test_a_bad_capacity_is_refused_and_one_is_enough(self) -> None:
        for capacity in (0, -1, 1.5, True):
            with pytest.raises(ConfigurationError, match="capacity"):
                cores_trace([], capacity=capacity)  # type: ignore[arg-type]
        assert cores_trace([], capacity=1).trace.recorders == ()

    @pytest.mark.asyncio
    async def test_a_refused_trace_leaves_no_engine_traced(self) -> None:
        async with Engine(affine_model()) as first, Engine(affine_model()) as second:
            async with second.trace():
                with pytest.raises(ConfigurationError, match="one trace at a time"):
                    async with cores_trace([first, second]):
                        pass
            # The first engine's recorder, installed before the refusal, was taken off.
            assert active_recorder(first) is None
            async with first.trace() as recorder:
                await first.infer(ONES)
            assert recorder.recorded == 1

    @pytest.mark.asyncio
    async def test_a_path_that_cannot_be_written_is_named_with_why(self, tmp_path: Path) -> None:
        link = tmp_path / "link.json"
        link.symlink_to(tmp_path / "target.json")
        async with Engine(affine_model()) as engine:
            with pytest.raises(ConfigurationError) as caught:
                async with cores_trace([engine], link):
                    await engine.infer(ONES)
        said = str(caught.value)
        assert said.startswith(f"dla.trace({str(link)!r}) cannot be written: ")
        assert "[Errno" not in said  # the reason alone, not the OSError's whole text
        assert not (tmp_path / "target.json").exists()


class TestEngineTraces:
    @pytest.mark.asyncio
    async def test_an_unnamed_trace_names_its_engine_engine(self) -> None:
        async with Engine(affine_model()) as engine, engine.trace() as recorder:
            await engine.infer(ONES)
        assert recorder.name == "engine"
        assert recorder.trace_events()["otherData"]["engine"] == "engine"

    @pytest.mark.asyncio
    async def test_a_trace_path_that_cannot_be_written_fails_the_open_saying_so(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "no such folder" / "run.json"
        engine = Engine(affine_model(), trace=path)
        with pytest.raises(ConfigurationError) as caught:
            await engine.open()
        assert str(caught.value).startswith(f"trace={str(path)!r} cannot be written: No such")

    def test_times_keep_their_fraction_of_a_microsecond_and_flows_are_named(self) -> None:
        clock = Clock(0.0)
        recorder = TraceRecorder("r", clock=clock)
        run_request(recorder, clock, 1.0000005)
        document = recorder.trace_events()
        queued = [e for e in document["traceEvents"] if e["name"] == "queued"]
        assert queued[0]["ts"] == 1000000.5
        flows = [e for e in document["traceEvents"] if e["ph"] in ("s", "t", "f")]
        assert flows and {(e["name"], e["cat"]) for e in flows} == {("request", "request")}


class TestOpenBound:
    def test_requests_never_ended_are_forgotten_past_four_capacities_and_1024(self) -> None:
        """A request assigned a slot and never ended would be a bug elsewhere; the
        recorder forgets the oldest such past 4 * capacity + 1024, so memory stays
        bounded, and no sooner."""

        def ended_slotted(assigned: int, capacity: int = 1) -> list[bool]:
            recorder = TraceRecorder("r", capacity=capacity, clock=Clock(0.0))
            requests = [Request(0.0) for _ in range(assigned)]
            for request in requests:
                recorder.assigned(request, slot(0, 0), 0.0)
            slotted = []
            for request in requests[:2]:
                recorder.ended(request, "completed")
                slotted.append(len(recorder.requests[-1]) > 4)  # a slot's steps kept
            return slotted

        assert ended_slotted(1028) == [True, True]
        assert ended_slotted(1029) == [False, True]
        assert ended_slotted(1032, capacity=2) == [True, True]
        assert ended_slotted(1033, capacity=2) == [False, True]

    def test_a_recorder_made_without_a_name_is_engine(self) -> None:
        assert TraceRecorder().trace_events()["otherData"]["engine"] == "engine"


class TestSharedHooks:
    """Engines on one Cores share its poller: each traced engine's recorder sees its
    sweeps, while any number of them trace, started and ended in any order."""

    def test_three_recorders_on_one_poller_and_parts_without_a_hook(self) -> None:
        poller = SimpleNamespace(trace=None)

        def flow() -> Any:
            # A device layer in a worker process has no hook: it is skipped.
            return SimpleNamespace(
                trace=None, scheduler=SimpleNamespace(trace=None), device=object(), poller=poller
            )

        flows = [flow() for _ in range(3)]
        recorders = [TraceRecorder(f"r{n}", clock=Clock(0.0)) for n in range(3)]
        for each, recorder in zip(flows, recorders, strict=True):
            install(each, recorder)
            assert each.trace is recorder and each.scheduler.trace is recorder
        with pytest.raises(
            ConfigurationError,
            match=r"^the engine is already being traced \(one trace at a time\)$",
        ):
            install(flows[0], TraceRecorder("again"))

        def sweep() -> list[int]:
            poller.trace.sweep(0.0, [(slot(0, 0), 0)])
            return [r.swept for r in recorders]

        assert sweep() == [1, 1, 1]
        uninstall(flows[1], recorders[1])
        assert flows[1].trace is None and flows[1].scheduler.trace is None
        assert sweep() == [2, 1, 2]
        uninstall(flows[0], recorders[0])
        assert poller.trace is recorders[2]  # the last one holds the hook alone
        assert sweep() == [2, 1, 3]
        uninstall(flows[2], recorders[2])
        assert poller.trace is None


class TestSeenDone:
    """When a request's DLA task was seen done: by the last sweep that found its slot,
    unless that sweep was before the request was submitted (the slot's earlier task)."""

    def run(self, sweep_at: float | None) -> tuple[Any, dict[str, Any]]:
        clock = Clock(0.0)
        recorder = TraceRecorder("r", clock=clock)
        where = slot(0, 0)
        if sweep_at is not None:  # a sweep that found the slot done, at sweep_at
            clock.now = sweep_at
            recorder.sweep(sweep_at, [(where, 0)])
        request = Request(1.0)
        recorder.assigned(request, where, 1.0)
        clock.now = 2.0
        recorder.submitted(request)
        clock.now = 3.0
        recorder.completed(request, where)
        clock.now = 4.0
        recorder.ended(request, "completed")
        document = recorder.trace_events()
        check_trace_format(document)
        (task,) = [e for e in document["traceEvents"] if e["name"] == "DLA task"]
        return recorder.requests[-1], task

    def test_no_sweep_seen_ends_the_task_when_the_loop_took_it(self) -> None:
        record, task = self.run(None)
        assert record[7] is None
        assert task["ts"] + task["dur"] == 3e6

    def test_a_sweep_before_the_submission_was_the_slots_earlier_task(self) -> None:
        record, task = self.run(1.5)
        assert record[7] is None
        assert task["ts"] + task["dur"] == 3e6

    def test_a_sweep_at_the_submission_counts(self) -> None:
        record, task = self.run(2.0)
        assert record[7] == 2.0
        assert task["ts"] + task["dur"] == 2e6


class TestLoopSteps:
    def test_a_request_on_the_loop_draws_pack_submit_unpack_and_returned(self) -> None:
        clock = Clock(0.0)
        recorder = TraceRecorder("r", clock=clock)
        run_request(recorder, clock, 1.0)
        events = recorder.trace_events()["traceEvents"]
        args = {"request": 0, "model": "r", "outcome": "completed"}
        loop = [
            (e["name"], e["ts"], e["dur"], e["args"])
            for e in events
            if e["ph"] == "X" and e["tid"] == 1
        ]
        assert loop == [
            ("pack", 1001000.0, 1000.0, args),
            ("submit", 1002000.0, 1000.0, args),
            ("unpack", 1006000.0, 1000.0, args),
        ]
        queued = [(e["ph"], e["args"]) for e in events if e["name"] == "queued"]
        assert queued == [("b", args), ("e", {})]
        (returned,) = [e for e in events if e["name"] == "returned"]
        assert (returned["cat"], returned["ph"], returned["s"]) == ("aiodla", "i", "t")
        assert returned["ts"] == 1007000.0 and returned["args"] == args

    def test_a_request_that_never_ran_does_not_hide_later_ones(self) -> None:
        clock = Clock(0.0)
        recorder = TraceRecorder("r", clock=clock)
        recorder.ended(Request(0.5), "cancelled")  # number 0: ended while queued
        run_request(recorder, clock, 1.0)  # number 1
        events = recorder.trace_events()["traceEvents"]
        drawn = [(e["name"], e["args"].get("request")) for e in events if e["ph"] == "X"]
        assert ("pack", 1) in drawn and ("unpack", 1) in drawn

    def test_a_frames_flow_ends_at_the_pack_of_the_request_that_read_it(self) -> None:
        buffer = np.zeros(4, np.uint8)
        clock = Clock(0.0)
        recorder = TraceRecorder("r", clock=clock)
        recorder.frame("cam", 0, 0.5, 0.6, data_address(buffer))
        request = Request(1.0, (buffer,))
        recorder.assigned(request, slot(0, 0), 1.0)
        clock.now = 1.5
        recorder.packed(request)
        clock.now = 2.0
        recorder.submitted(request)
        recorder.ended(request, "completed")
        events = recorder.trace_events()["traceEvents"]
        (pack,) = [e for e in events if e["name"] == "pack"]
        ends = [e for e in events if e["name"] == "frame" and e["ph"] == "f"]
        assert [(e["tid"], e["ts"]) for e in ends] == [(1, pack["ts"])]


def one_request(
    recorder: TraceRecorder, clock: Clock, times: dict[str, float], where: Slot
) -> None:
    """A request through the hooks at the times given: assigned, packed, submitted,
    completed (the loop took its completion: its unpack starts) and ended."""
    request = Request(times["assigned"])
    recorder.assigned(request, where, times["assigned"])
    for hook, step in (
        (recorder.packed, "packed"),
        (recorder.submitted, "submitted"),
        (lambda r: recorder.completed(r, where), "completed"),
        (lambda r: recorder.ended(r, "completed"), "ended"),
    ):
        clock.now = times[step]
        hook(request)


class TestUntangle:
    """The loop's slices that overlap an earlier one (a step done in a worker thread
    while the loop went on) are drawn as async slices of their request instead."""

    def loop_and_off_loop(self, overlap_us: float) -> tuple[list[Any], list[Any], Any]:
        clock = Clock(0.0)
        recorder = TraceRecorder("r", clock=clock)
        # Request 0 unpacks from 1.003 s to 1.0101 s (off the loop, in a thread)...
        first = {"assigned": 1.0, "packed": 1.001, "submitted": 1.002, "completed": 1.003,
                 "ended": 1.0101}  # fmt: skip
        one_request(recorder, clock, first, slot(0, 0))
        # ... request 1's pack starts overlap_us before that unpack ends, and ends at a
        # fraction of a microsecond.
        start = 1.0101 - overlap_us * 1e-6
        second = {"assigned": start, "packed": 1.0102004567, "submitted": 1.0103,
                  "completed": 1.0104, "ended": 1.0105}  # fmt: skip
        one_request(recorder, clock, second, slot(0, 1))
        document = recorder.trace_events()
        check_trace_format(document)
        events = document["traceEvents"]
        loop = [
            (e["name"], e["args"]["request"]) for e in events if e["ph"] == "X" and e["tid"] == 1
        ]
        off = [e for e in events if e["tid"] == 4 and e["name"] == "pack"]
        return loop, off, document

    def test_a_slice_overlapping_by_half_a_microsecond_goes_off_the_loop(self) -> None:
        loop, off, document = self.loop_and_off_loop(0.5)
        assert ("pack", 1) not in loop and ("submit", 1) in loop and ("unpack", 0) in loop
        begin, end = off
        assert (begin["ph"], begin["cat"], begin["id"], begin["tid"]) == ("b", "off-loop", 1, 4)
        assert (end["ph"], end["cat"], end["id"], end["args"]) == ("e", "off-loop", 1, {})
        assert begin["args"] == {"request": 1, "model": "r", "outcome": "completed"}
        assert begin["ts"] == round(1.0101 * 1e6 - 0.5, 3)
        assert end["ts"] == 1010200.457  # to the nanosecond, as every time in the file
        names = {e["tid"]: e["args"]["name"] for e in document["traceEvents"]
                 if e["name"] == "thread_name"}  # fmt: skip
        assert names[4] == "off-loop steps"

    def test_an_overlap_of_rounding_alone_stays_on_the_loop(self) -> None:
        # Up to 0.01 us (ten times the file's resolution) is rounding's, not a thread's.
        for overlap in (0.005, 0.01):
            loop, off, document = self.loop_and_off_loop(overlap)
            assert ("pack", 1) in loop and off == []
            names = [e["args"]["name"] for e in document["traceEvents"]
                     if e["name"] == "thread_name"]  # fmt: skip
            assert "off-loop steps" not in names


class TestBusySpans:
    def test_tasks_back_to_back_on_a_core_are_one_busy_span(self) -> None:
        # Request 1 was submitted while request 0 ran: its task starts when request 0's
        # was seen done, so the core was busy without a gap: one span. Request 2 came
        # after a pause: a span of its own.
        clock = Clock(0.0)
        recorder = TraceRecorder("r", clock=clock)
        times = [
            {"assigned": 1.0, "packed": 1.001, "submitted": 1.002, "completed": 1.010, "ended": 1.011},
            {"assigned": 1.003, "packed": 1.004, "submitted": 1.005, "completed": 1.020, "ended": 1.021},
            {"assigned": 1.030, "packed": 1.031, "submitted": 1.032, "completed": 1.040, "ended": 1.041},
        ]  # fmt: skip
        for index, at in enumerate(times):
            one_request(recorder, clock, at, slot(0, index % 2))
        events = recorder.trace_events()["traceEvents"]
        tasks = sorted((e["ts"], e["dur"]) for e in events if e["name"] == "DLA task")
        assert tasks == [(1002000.0, 8000.0), (1010000.0, 10000.0), (1032000.0, 8000.0)]
        busy = sorted((e["ts"], e["dur"]) for e in events if e["name"] == "busy")
        assert busy == [(1002000.0, 18000.0), (1032000.0, 8000.0)]


class TestRequestFlows:
    def test_a_flow_runs_between_the_steps_drawn_on_the_loop(self) -> None:
        """Submit, DLA task, unpack; a request whose submit went off the loop has no
        flow, and one whose unpack did ends at its DLA task; neither hides later ones."""
        clock = Clock(0.0)
        recorder = TraceRecorder("r", clock=clock)
        requests = [
            # 0: on the loop, its unpack long (a worker thread's)
            (1.0, 1.001, 1.002, 1.003, 1.0101),
            # 1: every step inside request 0's unpack: all off the loop
            (1.004, 1.005, 1.006, 1.007, 1.008),
            # 2: on the loop, its unpack long again
            (1.011, 1.012, 1.013, 1.020, 1.030),
            # 3: submitted on the loop, unpacked inside request 2's unpack
            (1.014, 1.0145, 1.015, 1.025, 1.026),
        ]
        steps = ("assigned", "packed", "submitted", "completed", "ended")
        for core, times in enumerate(requests):  # a core each: a task starts when submitted
            one_request(recorder, clock, dict(zip(steps, times, strict=True)), slot(core, 0))
        document = recorder.trace_events()
        check_trace_format(document)
        flows: dict[int, list[tuple[str, int, float]]] = {}
        for e in document["traceEvents"]:
            if e["name"] == "request":
                flows.setdefault(e["id"], []).append((e["ph"], e["tid"], e["ts"]))
        assert flows == {
            0: [("s", 1, 1001000.0), ("t", stream_tid(0, 0), 1002000.0), ("f", 1, 1003000.0)],
            2: [("s", 1, 1012000.0), ("t", stream_tid(2, 0), 1013000.0), ("f", 1, 1020000.0)],
            3: [("s", 1, 1014500.0), ("f", stream_tid(3, 0), 1015000.0)],
        }


class TestARecordingOfRequestsAlone:
    def test_without_video_frames_is_written_without_their_tracks(self) -> None:
        # What a writer reads of a recorder (Recording): no frames, no frame links.
        clock = Clock(0.0)
        full = TraceRecorder("r", clock=clock)
        run_request(full, clock, 1.0)
        bare = SimpleNamespace(
            name="r",
            capacity=full.capacity,
            origin=full.origin,
            recorded=full.recorded,
            swept=full.swept,
            requests=full.requests,
            sweeps=full.sweeps,
        )
        document = CoresTrace([bare]).trace_events()
        check_trace_format(document)
        assert document["traceEvents"] == CoresTrace([full]).trace_events()["traceEvents"]
        assert not any(e["name"] == "frame" for e in document["traceEvents"])


class TestVideoSources:
    def test_a_track_per_source_in_order_of_appearance_and_a_slice_per_frame(self) -> None:
        recorder = TraceRecorder("v", clock=Clock(0.0))
        for source, index, start in (("cam-a", 0, 1.0), ("cam-b", 0, 1.1), ("cam-a", 1, 1.2)):
            recorder.frame(source, index, start, start + 0.05, 0)
        document = recorder.trace_events()
        check_trace_format(document)
        events = document["traceEvents"]
        decodes = [(e["tid"], e["ts"], e["args"]) for e in events if e["name"] == "decode"]
        assert decodes == [
            (500, 1e6, {"source": "cam-a", "frame": 0}),
            (501, 1.1e6, {"source": "cam-b", "frame": 0}),
            (500, 1.2e6, {"source": "cam-a", "frame": 1}),
        ]
        names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert (names[500], names[501]) == ("video: cam-a", "video: cam-b")


class TestFrameFlows:
    """A frame's flow ends at the first step on the loop of the request that read it:
    its pack, else its submit (packed in a worker thread), else its unpack (packed in a
    worker process); none when no step of it is drawn on the loop."""

    def trace(self, steps: list[str], *, before: bool = False) -> tuple[list[Any], list[Any]]:
        """The frame's flow ends and the loop's slices, for a request that read the frame
        and went through ``steps``; ``before``: an earlier request's unpack on the loop
        outlasts them all (so they are drawn off the loop)."""
        buffer = np.zeros(4, np.uint8)
        clock = Clock(0.0)
        recorder = TraceRecorder("r", clock=clock)
        recorder.frame("cam", 0, 0.5, 0.6, data_address(buffer))
        if before:
            times = {"assigned": 0.9, "packed": 0.91, "submitted": 0.92, "completed": 0.93,
                     "ended": 2.0}  # fmt: skip
            one_request(recorder, clock, times, slot(1, 0))
        request = Request(1.0, (buffer,))
        where = slot(0, 0)
        recorder.assigned(request, where, 1.0)
        for at, step in enumerate(steps, start=1):
            clock.now = 1.0 + at / 10
            if step == "packed in a thread":
                thread = threading.Thread(target=recorder.packed, args=(request,))
                thread.start()
                thread.join()
            elif step == "completed":
                recorder.completed(request, where)
            else:
                getattr(recorder, step)(request)
        clock.now = 1.9
        recorder.ended(request, "completed")
        document = recorder.trace_events()
        check_trace_format(document)
        events = document["traceEvents"]
        ends = [(e["tid"], e["ts"]) for e in events if e["name"] == "frame" and e["ph"] == "f"]
        loop = [(e["name"], e["ts"]) for e in events if e["ph"] == "X" and e["tid"] == 1]
        return ends, loop

    def test_packed_in_a_thread_it_ends_at_the_submit(self) -> None:
        ends, loop = self.trace(["packed in a thread", "submitted", "completed"])
        assert ("submit", 1.1e6) in loop and ends == [(1, 1.1e6)]  # (from the pack's end)

    def test_packed_in_a_worker_process_it_ends_at_the_unpack(self) -> None:
        ends, loop = self.trace(["completed"])
        assert loop == [("unpack", 1.1e6)] and ends == [(1, 1.1e6)]

    def test_a_request_without_a_step_on_the_loop_has_none(self) -> None:
        ends, loop = self.trace([])  # ended once assigned: never packed
        assert loop == [] and ends == []
        ends, loop = self.trace(["packed", "submitted", "completed"], before=True)
        assert ("pack", 1.0e6) not in loop and ends == []  # its steps went off the loop

    def test_a_request_whose_record_was_dropped_has_none(self) -> None:
        # Capacity 2 keeps the last two requests, and the links of eight: request 0's
        # link outlives its record; its frame is still drawn, without a flow.
        buffer = np.zeros(4, np.uint8)
        clock = Clock(0.0)
        recorder = TraceRecorder("r", capacity=2, clock=clock)
        recorder.frame("cam", 0, 0.5, 0.6, data_address(buffer))
        request = Request(1.0, (buffer,))
        recorder.assigned(request, slot(0, 0), 1.0)
        clock.now = 1.1
        recorder.packed(request)
        recorder.ended(request, "completed")
        for at in (2.0, 3.0):
            run_request(recorder, clock, at)
        assert recorder.frame_of == {0: 0} and [r[0] for r in recorder.requests] == [1, 2]
        document = recorder.trace_events()
        check_trace_format(document)
        events = document["traceEvents"]
        assert [e["ts"] for e in events if e["name"] == "decode"] == [0.5e6]
        assert not any(e["name"] == "frame" for e in events)


class TestFrameFlowIds:
    def test_unique_in_a_cores_trace_and_none_missing_after_a_request_without_a_step(
        self,
    ) -> None:
        # The first engine's two requests take ids 0 and 1; the second engine's frame
        # flows are numbered after them. Its request 0 read frame 0 but ended before a
        # step on the loop; its request 1 read frame 1 and packed on the loop.
        first = recorded("a", 0.0, [1.0, 2.0])
        buffers = [np.zeros(4, np.uint8) for _ in range(2)]
        clock = Clock(0.0)
        second = TraceRecorder("b", clock=clock)
        for index, buffer in enumerate(buffers):
            second.frame("cam", index, 0.5 + index / 10, 0.55 + index / 10, data_address(buffer))
        never = Request(1.0, (buffers[0],))
        second.assigned(never, slot(0, 0), 1.0)
        second.ended(never, "cancelled")
        reader = Request(2.0, (buffers[1],))
        second.assigned(reader, slot(0, 0), 2.0)
        clock.now = 2.1
        second.packed(reader)
        second.ended(reader, "completed")
        assert second.frame_of == {0: 0, 1: 1}
        document = CoresTrace([first, second]).trace_events()
        check_trace_format(document)
        flows = sorted(
            (e["id"], e["ph"], e["pid"]) for e in document["traceEvents"] if e["name"] == "frame"
        )
        assert flows == [(FRAME_FLOW_BASE + 2 + 1, "f", 2), (FRAME_FLOW_BASE + 2 + 1, "s", 2)]


class TestTimesAndCategories:
    def test_times_are_rounded_to_the_nanosecond_and_slices_are_aiodlas(self) -> None:
        clock = Clock(0.0)
        recorder = TraceRecorder("r", clock=clock)
        # Each step a millisecond and a fraction of a nanosecond off.
        times = {"assigned": 1.0000012344, "packed": 1.0010012346, "submitted": 1.0020012344,
                 "completed": 1.0030012346, "ended": 1.0040012344}  # fmt: skip
        one_request(recorder, clock, times, slot(0, 0))
        recorder.sweep(1.0025, [])
        events = recorder.trace_events()["traceEvents"]
        loop = [(e["name"], e["ts"], e["dur"]) for e in events if e["ph"] == "X" and e["tid"] == 1]
        assert loop == [
            ("pack", 1000001.234, 1000.001),
            ("submit", 1001001.235, 999.999),
            ("unpack", 1003001.235, 999.999),
        ]
        slices = [e for e in events if e["ph"] == "X"]
        assert {e["name"] for e in slices} >= {"pack", "DLA task", "busy", "sweep"}
        assert {e["cat"] for e in slices} == {"aiodla"}
