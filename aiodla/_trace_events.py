"""A recorded timeline as Chrome trace events: what ``_trace``'s recorders kept,
turned into the Trace Event Format JSON that Perfetto UI (ui.perfetto.dev) and
``chrome://tracing`` open, for one engine (:class:`EventWriter`) or for every engine
on one ``Cores`` (:class:`CoresTrace`: a process each, on one clock).

Tracks of the file (one process per engine; tracks are its "threads"):

==================  ===========================================================
``event loop``      ``pack`` and ``submit`` slices, ``unpack`` until the result
                    is handed back, ``returned`` instants
``loop harvests``   sweeps made by the event loop between two batches
``poller``          the poller thread's sweeps (``found``: completions)
``core C``          the core's busy spans (its tasks back to back)
``core C stream S`` each DLA task, with its request, model and outcome
``off-loop steps``  packing or unpacking done in a worker thread
``video: NAME``     each frame a video source opened with ``engine=`` decoded
                    (its reader thread's CPU time for it, ending when decoded),
                    with a flow into the request that read that frame
==================  ===========================================================

A request's queue wait is an async slice (``queued``, one per request) and its steps
are joined by a flow (``s`` at submit, ``t`` at the DLA task, ``f`` at unpack).
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from ._safe_paths import write_regular

__all__ = [
    "TRACE_FORMAT",
    "CoresTrace",
    "EventWriter",
    "RequestRecord",
    "core_tid",
    "stream_tid",
]

TRACE_FORMAT = "aiodla-trace"
PID = 1
TID_LOOP = 1
TID_HARVEST = 2
TID_POLLER = 3
TID_OFF_LOOP = 4
TID_VIDEO = 500  # the first video source's track; one more for each
FRAME_FLOW_BASE = 1 << 40  # frame flows' ids, apart from the requests' own


class Recording(Protocol):
    """What a writer reads of a recorder (``_trace.TraceRecorder``)."""

    name: str
    capacity: int
    origin: float
    recorded: int
    swept: int

    @property
    def requests(self) -> collections.deque[tuple[Any, ...]]: ...

    @property
    def sweeps(self) -> collections.deque[tuple[float, float, int, bool]]: ...


def core_tid(core: int) -> int:
    return 1000 + 100 * core


def stream_tid(core: int, stream: int) -> int:
    return core_tid(core) + 1 + stream


class RequestRecord(NamedTuple):
    """One request as recorded (``time.monotonic`` seconds; None: a step not taken)."""

    number: int
    queued: float
    returned: float
    outcome: str
    assigned: float | None = None
    packed: float | None = None
    submitted: float | None = None
    seen: float | None = None  # by a sweep; None when no sweep was traced (worker process)
    handled: float | None = None  # the loop took its completion
    core: int | None = None
    stream: int | None = None
    packed_off_loop: bool = False


class EventWriter:
    """Turns a recorder's rings into trace events, with well-formed tracks."""

    def __init__(
        self,
        recorder: Recording,
        *,
        pid: int = PID,
        origin: float | None = None,
        first_id: int = 0,
        suffix: str = "",
    ) -> None:
        """``pid``, ``origin``, ``first_id`` and ``suffix`` place one engine's tracks
        in a trace of several (:class:`CoresTrace`): its process, the time zero they
        share, where its async and flow ids start (ids are unique in a file), and what
        its track names end with (``": detector"``)."""
        self.recorder = recorder
        self.pid = pid
        self.origin = recorder.origin if origin is None else origin
        self.first_id = first_id
        self.suffix = suffix
        self.events: list[dict[str, Any]] = []
        self.tracks: dict[int, str] = {}
        # Per request: its loop slices by step, and where its DLA task starts.
        self.steps: dict[int, dict[str, dict[str, Any]]] = collections.defaultdict(dict)
        self.tasks: dict[int, tuple[int, float]] = {}

    def us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 3)

    def slice(self, tid: int, name: str, start: float, end: float, **args: Any) -> dict[str, Any]:
        event = {
            "name": name,
            "cat": "aiodla",
            "ph": "X",
            "pid": self.pid,
            "tid": tid,
            "ts": self.us(start),
            # From the rounded ends, so that back-to-back slices stay back to back.
            "dur": max(0.0, round(self.us(end) - self.us(start), 3)),
            "args": args,
        }
        self.events.append(event)
        return event

    def async_slice(
        self, cat: str, name: str, number: int, start: float, end: float, **args: Any
    ) -> None:
        for phase, at in (("b", start), ("e", end)):
            self.events.append(
                {
                    "name": name,
                    "cat": cat,
                    "ph": phase,
                    "id": self.first_id + number,
                    "pid": self.pid,
                    "tid": TID_OFF_LOOP,
                    "ts": self.us(at),
                    "args": args if phase == "b" else {},
                }
            )

    def flow(self, phase: str, number: int, tid: int, at: float) -> None:
        event = {"name": "request", "cat": "request", "ph": phase,
                 "id": self.first_id + number, "pid": self.pid, "tid": tid, "ts": at}  # fmt: skip
        if phase == "f":
            event["bp"] = "e"  # bind to the slice that encloses it
        self.events.append(event)

    def document(self) -> dict[str, Any]:
        rec = self.recorder
        meta, body = self.parts()
        return {
            "traceEvents": meta + sorted(body, key=lambda e: e["ts"]),
            "displayTimeUnit": "ms",
            "otherData": {
                "format": TRACE_FORMAT,
                "version": 1,
                "engine": rec.name,
                "clock": "time.monotonic, microseconds from the recorder's start",
                **_counts(rec),
            },
        }

    def parts(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(the metadata events that name the process and its tracks, the timed events)."""
        rec = self.recorder
        requests = [RequestRecord(*r) for r in rec.requests]
        self.tracks = {TID_LOOP: "event loop", TID_HARVEST: "loop harvests", TID_POLLER: "poller"}
        self._requests(requests)
        self._tasks(requests)
        for started, ended, found, by_loop in rec.sweeps:
            self.slice(TID_HARVEST if by_loop else TID_POLLER, "sweep", started, ended, found=found)
        self._untangle()
        self._flows()
        self._frames()
        name = {"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0,
                "args": {"name": f"aiodla: {rec.name}"}}  # fmt: skip
        meta = [name]
        for tid, label in sorted(self.tracks.items()):
            for key, value in (
                ("thread_name", {"name": label + self.suffix}),
                ("thread_sort_index", {"sort_index": tid}),
            ):
                meta.append({"name": key, "ph": "M", "pid": self.pid, "tid": tid, "args": value})
        return meta, self.events

    def _requests(self, requests: list[RequestRecord]) -> None:
        model = self.recorder.name
        for r in requests:
            args = {"request": r.number, "model": model, "outcome": r.outcome}
            wait_end = r.assigned if r.assigned is not None else r.returned
            for phase, at in (("b", r.queued), ("e", wait_end)):
                self.events.append(
                    {"name": "queued", "cat": "queue", "ph": phase, "id": self.first_id + r.number,
                     "pid": self.pid, "tid": TID_LOOP, "ts": self.us(at),
                     "args": args if phase == "b" else {}}
                )  # fmt: skip
            if r.assigned is None:  # ended while queued: cancelled or timed out
                continue
            steps = self.steps[r.number]
            if r.packed is not None:
                if r.packed_off_loop:
                    self.async_slice("off-loop", "pack", r.number, r.assigned, r.packed, **args)
                else:
                    steps["pack"] = self.slice(TID_LOOP, "pack", r.assigned, r.packed, **args)
            if r.submitted is not None:
                start = r.packed if r.packed is not None else r.assigned
                steps["submit"] = self.slice(TID_LOOP, "submit", start, r.submitted, **args)
            if r.handled is not None:
                steps["unpack"] = self.slice(TID_LOOP, "unpack", r.handled, r.returned, **args)
            self.events.append(
                {"name": "returned", "cat": "aiodla", "ph": "i", "s": "t", "pid": self.pid,
                 "tid": TID_LOOP, "ts": self.us(r.returned), "args": args}
            )  # fmt: skip

    def _tasks(self, requests: list[RequestRecord]) -> None:
        """DLA tasks on their core's and stream's tracks, and each core's busy spans."""
        # (end, submitted, stream, request, outcome) of each task, by core.
        by_core: dict[int, list[tuple[float, float, int, int, str]]] = collections.defaultdict(list)
        for r in requests:
            if r.submitted is None or r.handled is None or r.core is None or r.stream is None:
                continue
            end = r.seen if r.seen is not None else r.handled
            by_core[r.core].append((end, r.submitted, r.stream, r.number, r.outcome))
        model = self.recorder.name
        for core, tasks in sorted(by_core.items()):
            self.tracks[core_tid(core)] = f"core {core}"
            # A core runs its tasks in order: each starts when it was submitted or when
            # the one before it was seen done, whichever is later.
            tasks.sort()
            previous = float("-inf")
            busy: list[list[float]] = []
            for end, submitted, stream, number, outcome in tasks:
                start = min(max(submitted, previous), end)
                previous = end
                tid = stream_tid(core, stream)
                self.tracks[tid] = f"core {core} stream {stream}"
                task = self.slice(
                    tid, "DLA task", start, end, request=number, model=model, outcome=outcome
                )
                self.tasks[number] = (tid, task["ts"])
                if busy and start <= busy[-1][1]:
                    busy[-1][1] = end
                else:
                    busy.append([start, end])
            for start, end in busy:
                self.slice(core_tid(core), "busy", start, end)

    def _untangle(self) -> None:
        """Turn the loop's slices that overlap an earlier one (a step its coroutine did
        in a worker thread while the loop went on) into async slices, so that the
        loop's track nests properly."""
        slices = sorted(
            (e for e in self.events if e["ph"] == "X" and e["tid"] == TID_LOOP),
            key=lambda e: e["ts"],
        )
        end = float("-inf")
        for event in slices:
            if event["ts"] < end - 0.01:  # (well past rounding's 0.001 us)
                finish = round(event["ts"] + event.pop("dur"), 3)
                event.update(
                    ph="b",
                    cat="off-loop",
                    id=self.first_id + event["args"]["request"],
                    tid=TID_OFF_LOOP,
                )
                self.events.append({**event, "ph": "e", "ts": finish, "args": {}})
            else:
                end = event["ts"] + event["dur"]
        if any(e["tid"] == TID_OFF_LOOP for e in self.events):
            self.tracks[TID_OFF_LOOP] = "off-loop steps"

    def _flows(self) -> None:
        """A flow per request from its submit slice through its DLA task to its unpack
        (or ending at the DLA task when the unpack ran off the loop)."""
        for number, (tid, start) in self.tasks.items():
            steps = self.steps[number]
            submit, unpack = steps.get("submit"), steps.get("unpack")
            if submit is None or submit["ph"] != "X":
                continue
            self.flow("s", number, TID_LOOP, submit["ts"])
            if unpack is not None and unpack["ph"] == "X":
                self.flow("t", number, tid, start)
                self.flow("f", number, TID_LOOP, unpack["ts"])
            else:
                self.flow("f", number, tid, start)

    def _frames(self) -> None:
        """A track per video source, a slice per decoded frame, and a flow from each
        frame into the first step of the request that read it on the loop (its unpack,
        when a worker process packed it)."""
        rec = self.recorder
        tids: dict[str, int] = {}
        frame_slices: dict[int, dict[str, Any]] = {}
        for number, source, index, start, end in getattr(rec, "frames", ()):
            tid = tids.get(source)
            if tid is None:
                tid = tids[source] = TID_VIDEO + len(tids)
                self.tracks[tid] = f"video: {source}"
            frame_slices[number] = self.slice(tid, "decode", start, end, source=source, frame=index)
        for request, frame in getattr(rec, "frame_of", {}).items():
            decoded = frame_slices.get(frame)
            steps = self.steps.get(request, {})
            step = next((steps[k] for k in ("pack", "submit", "unpack") if k in steps), None)
            if decoded is None or step is None or step["ph"] != "X":
                continue
            flow_id = FRAME_FLOW_BASE + self.first_id + frame
            for phase, tid, at in (
                ("s", decoded["tid"], decoded["ts"]),
                ("f", TID_LOOP, step["ts"]),
            ):
                event = {"name": "frame", "cat": "frame", "ph": phase, "id": flow_id,
                         "pid": self.pid, "tid": tid, "ts": at}  # fmt: skip
                if phase == "f":
                    event["bp"] = "e"
                self.events.append(event)


def _counts(rec: Recording) -> dict[str, Any]:
    return {
        "capacity": rec.capacity,
        "requests_recorded": rec.recorded,
        "requests_dropped": rec.recorded - len(rec.requests),
        "sweeps_dropped": rec.swept - len(rec.sweeps),
    }


class CoresTrace:
    """What every engine on one :class:`~aiodla.Cores` did, on one timeline: the value
    of ``async with dla.trace() as trace:``, with :meth:`write` and
    :meth:`trace_events`.

    Each engine is a process of the file, named ``aiodla: <name>``, with the tracks
    an engine's own trace has, their names ending in ``: <name>``; all share one time
    zero, so the two models' DLA tasks on core 0 line up. ``aiodla trace-plot`` draws
    every engine's tasks on the core rows, coloured by model.
    """

    def __init__(self, recorders: Sequence[Recording]) -> None:
        self.recorders = tuple(recorders)

    def trace_events(self) -> dict[str, Any]:
        """The recording as one Trace Event Format document (a JSON-ready dict)."""
        origin = min((r.origin for r in self.recorders), default=0.0)
        meta: list[dict[str, Any]] = []
        body: list[dict[str, Any]] = []
        first_id = 0
        for pid, recorder in enumerate(self.recorders, start=PID):
            writer = EventWriter(
                recorder, pid=pid, origin=origin, first_id=first_id, suffix=f": {recorder.name}"
            )
            named, timed = writer.parts()
            meta += named
            body += timed
            first_id += recorder.recorded  # (request numbers run from 0 to recorded - 1)
        return {
            "traceEvents": meta + sorted(body, key=lambda e: e["ts"]),
            "displayTimeUnit": "ms",
            "otherData": {
                "format": TRACE_FORMAT,
                "version": 1,
                "engine": " + ".join(r.name for r in self.recorders),
                "engines": [{"name": r.name, **_counts(r)} for r in self.recorders],
                "clock": "time.monotonic, microseconds from the first recorder's start",
            },
        }

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the trace to ``path`` (JSON), as ``TraceRecorder.write`` does."""
        document = json.dumps(self.trace_events(), separators=(",", ":"))
        return write_regular(path, document.encode("utf-8"))
