"""A timeline of what an engine did, written as Chrome trace events.

``engine.trace()`` installs a :class:`TraceRecorder` on the engine's flow and poller
for the length of an ``async with`` block, ``Engine(..., trace=path)`` (a
:class:`TraceFile`) for the engine's whole life; :meth:`TraceRecorder.write` turns what
it kept into the Trace Event Format JSON that Perfetto UI (ui.perfetto.dev) and
``chrome://tracing`` open.

What is recorded, per request: when it was queued (``infer``), given a slot, packed
(host conversion or the device conversion's enqueue), submitted, seen done (by the
poller's sweep, or the loop's own harvest), and returned to its caller; per poller
sweep: when it ran, on which thread, and how many completions it found. Nothing about
the device is queried for the trace: a DLA task is drawn from the host's view, from its
submission (or the end of its core's previous task, if later) to the sweep that saw it
done, which is an upper bound of the task's own time by the poller's lateness.

Cost: while no trace is installed, each hook is one ``is None`` test in the engine;
while one is, a request costs a few clock reads and one tuple in a ring. Memory is
bounded: the last ``capacity`` requests and the last ``capacity`` sweeps are kept, older
ones are dropped (and counted in the file's ``otherData``).

The file's tracks: see ``_trace_events``.

Threads: the hooks run on the event loop's thread, except :meth:`sweep`, which the
poller thread calls too; a ``deque.append`` and a dict store are atomic under the GIL,
and the loop reads a sweep's record only after the poller posted that batch to it.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from ._errors import ConfigurationError, EngineClosedError
from ._options import DEFAULT_TRACE_CAPACITY as DEFAULT_CAPACITY
from ._safe_paths import write_regular
from ._trace_events import TRACE_FORMAT, CoresTrace, EventWriter
from ._trace_events import RequestRecord as RequestRecord
from ._trace_events import core_tid as core_tid
from ._trace_events import stream_tid as stream_tid

__all__ = [
    "TRACE_FORMAT",
    "CoresTrace",
    "CoresTracing",
    "TraceFile",
    "TraceRecorder",
    "Tracing",
    "active_recorder",
    "cores_trace",
    "data_address",
    "engine_trace",
]


class TraceRecorder:
    """What one engine did, kept in bounded rings; made by ``engine.trace()``::

        async with engine.trace("run.json", name="detector", capacity=100_000):
            ...  # every request that ends in the block is recorded

    On leaving the block the trace is written to the path as Chrome trace-event JSON,
    which Perfetto UI (ui.perfetto.dev) and ``chrome://tracing`` open, and which
    ``aiodla trace-plot run.json out.png`` draws. Without a path nothing is written:
    the block's value is this recorder, with :meth:`write` and :meth:`trace_events`.

    ``name`` labels the engine (its model) in the file; ``capacity`` bounds memory: the
    last ``capacity`` requests and the last ``capacity`` poller sweeps are kept, older
    ones dropped (counted in the file's ``otherData``). One trace at a time per engine;
    ``engine.trace()`` on an engine that is not open raises ``EngineClosedError``, a
    second one while the first records ``ConfigurationError``.

    The methods ``assigned`` to ``sweep`` are the engine's hooks, not for applications.
    """

    def __init__(
        self,
        name: str = "engine",
        *,
        capacity: int = DEFAULT_CAPACITY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ConfigurationError(f"trace {capacity=} must be an int >= 1")
        self.name = name
        self.capacity = capacity
        self._clock = clock
        self.origin = clock()
        # One plain tuple a request that ended, as RequestRecord's fields (a tuple is
        # cheaper to make on the loop; the writer names its fields).
        self.requests: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=capacity)
        # One tuple a sweep: (started, ended, found, by the loop).
        self.sweeps: collections.deque[tuple[float, float, int, bool]] = collections.deque(
            maxlen=capacity
        )
        self.recorded = 0  # requests recorded in all; past capacity the oldest are gone
        self.swept = 0
        # Per request started on a slot and not ended yet: (core, stream, assigned,
        # packed, submitted, seen, handled, packed off the loop). Every started request
        # ends through ``ended``; the limit only keeps a bug from growing it unbounded.
        self._open: dict[Any, list[Any]] = {}
        self._open_limit = 4 * capacity + 1024
        self._seen: dict[Any, float] = {}  # per slot: when a sweep last found it done
        self._loop_thread = threading.get_ident()
        # Video frames: (frame number, source, index, start, end), and which request read
        # which frame, found by where the frame's pixels lie (the last frame decoded at
        # an address is the one a request on that address reads).
        self.frames: collections.deque[tuple[int, str, int, float, float]] = collections.deque(
            maxlen=capacity
        )
        self.framed = 0
        self._frame_at: dict[int, int] = {}
        self.frame_of: dict[int, int] = {}  # request number -> frame number
        self._reading: dict[Any, int] = {}  # request on a slot -> the frame it reads
        self._frame_end: dict[str, float] = {}  # per source: its last frame's end

    # -- hooks: the engine's flow (loop thread) -----------------------------------------

    def assigned(self, request: Any, slot: Any, at: float) -> None:
        """``request`` got ``slot`` at ``at`` (the time its queue wait ended)."""
        opened = self._open
        opened[request] = [slot.core.core, slot.index, at, None, None, None, None, False]
        if self._frame_at:  # which frame it reads: its arrays are gone once it ends
            self._note_frame(request)
        if len(opened) > self._open_limit:  # a request that never ended (a bug): forget it
            del opened[next(iter(opened))]

    def packed(self, request: Any) -> None:
        """The request's input is packed (on the loop, or in a worker thread)."""
        entry = self._open.get(request)
        if entry is not None:
            entry[3] = self._clock()
            entry[7] = threading.get_ident() != self._loop_thread

    def submitted(self, request: Any) -> None:
        """The request's work is enqueued on its slot's stream."""
        entry = self._open.get(request)
        if entry is not None:
            entry[4] = self._clock()

    def completed(self, request: Any, slot: Any) -> None:
        """The loop takes the slot's completion (before unpacking it)."""
        entry = self._open.get(request)
        if entry is not None:
            entry[5] = self._seen.get(slot)
            entry[6] = self._clock()

    def ended(self, request: Any, outcome: str) -> None:
        """The request's outcome was decided and handed to its caller (or, cancelled,
        dropped)."""
        returned = self._clock()
        number = self.recorded
        self.recorded += 1
        entry = self._open.pop(request, None)
        if entry is None:  # never started on a slot: cancelled or timed out in line
            self.requests.append((number, request.started, returned, outcome))
            return
        if self._reading:
            self._link(number, request)
        core, stream, assigned, packed, submitted, seen, handled, off_loop = entry
        if seen is not None and (submitted is None or seen < submitted):  # an earlier task's
            seen = None
        self.requests.append(
            (number, request.started, returned, outcome, assigned, packed, submitted, seen,
             handled, core, stream, off_loop)
        )  # fmt: skip

    # -- hooks: video sources (loop thread) ------------------------------------------------

    def frame(self, source: str, index: int, start: float, end: float, address: int) -> None:
        """Video source ``source`` decoded its frame ``index`` from ``start`` to ``end``
        (``time.monotonic``); its pixels lie at ``address``."""
        number = self.framed
        self.framed += 1
        # A track's slices must not overlap: the start is estimated (end less the
        # thread's CPU time), so it yields to the source's previous frame.
        start = min(max(start, self._frame_end.get(source, start)), end)
        self._frame_end[source] = end
        self.frames.append((number, source, index, start, end))
        at = self._frame_at
        at.pop(address, None)  # re-inserted last: the dict stays in decoding order
        at[address] = number
        if len(at) > 4 * self.capacity:
            del at[next(iter(at))]

    def _note_frame(self, request: Any) -> None:
        for value in (*getattr(request, "arrays", ()), *getattr(request, "sources", ())):
            frame = self._frame_at.get(data_address(value))
            if frame is not None:
                self._reading[request] = frame
                return

    def _link(self, number: int, request: Any) -> None:
        frame = self._reading.pop(request, None)
        if frame is not None:
            self.frame_of[number] = frame
            if len(self.frame_of) > 4 * self.capacity:
                del self.frame_of[next(iter(self.frame_of))]

    # -- hook: the poller (its thread, or the loop's harvest) ----------------------------

    def sweep(self, started: float, done: Iterable[tuple[Any, int]]) -> None:
        """A sweep that began at ``started`` found the slots in ``done`` finished."""
        ended = self._clock()
        found = 0
        seen = self._seen
        for slot, _status in done:
            seen[slot] = ended
            found += 1
        self.swept += 1
        self.sweeps.append((started, ended, found, threading.get_ident() == self._loop_thread))

    # -- output ---------------------------------------------------------------------------

    def trace_events(self) -> dict[str, Any]:
        """The recording as a Trace Event Format document (a JSON-ready dict)."""
        return EventWriter(self).document()

    def write(self, path: str | Path) -> Path:
        """Write the trace to ``path`` (JSON); returns the path.

        ``path`` is a regular file, created or replaced; a final symbolic link is not
        followed, and a FIFO, a device or a directory is refused (an ``OSError`` that
        says which) before anything is written.
        """
        document = json.dumps(self.trace_events(), separators=(",", ":"))
        return write_regular(path, document.encode("utf-8"))


def _parts(flow: Any) -> tuple[Any, ...]:
    # The flow, the scheduler, the device layer and the poller each record their part
    # (a device layer in a worker process, and its poller, have no hook).
    return (flow, flow.scheduler, flow.device, flow.poller)


class SweepHooks:
    """Several recorders on one poller: the engines of a ``Cores`` share its poller
    thread, and each traced engine's recorder sees every sweep (a sweep's ``found``
    counts the completions of all of them; each recorder looks up its own slots)."""

    def __init__(self, recorders: list[TraceRecorder]) -> None:
        self.recorders = recorders

    def sweep(self, started: float, done: Iterable[tuple[Any, int]]) -> None:
        done = list(done)
        for recorder in list(self.recorders):  # (a copy: the loop may uninstall one)
            recorder.sweep(started, done)


def install(flow: Any, recorder: TraceRecorder) -> None:
    """Put ``recorder`` on every hook of the engine's ``flow``; one trace at a time per
    engine. A hook another engine's recorder already holds (a shared poller) takes
    both."""
    if flow.trace is not None:
        raise ConfigurationError("the engine is already being traced (one trace at a time)")
    for part in _parts(flow):
        if not hasattr(part, "trace"):
            continue
        held = part.trace
        if held is None:
            part.trace = recorder
        elif isinstance(held, SweepHooks):
            held.recorders.append(recorder)
        else:
            part.trace = SweepHooks([held, recorder])


def uninstall(flow: Any, recorder: TraceRecorder) -> None:
    for part in _parts(flow):
        held = getattr(part, "trace", None)
        if held is recorder:
            part.trace = None
        elif isinstance(held, SweepHooks) and recorder in held.recorders:
            held.recorders.remove(recorder)
            if len(held.recorders) == 1:
                part.trace = held.recorders[0]


class Tracing:
    """``async with engine.trace(path) as recorder:``: record while in the block."""

    def __init__(self, engine: Any, path: str | Path | None, recorder: TraceRecorder) -> None:
        self._engine = engine
        self._path = path
        self.recorder = recorder

    async def __aenter__(self) -> TraceRecorder:
        install(self._engine._flow, self.recorder)
        return self.recorder

    async def __aexit__(self, *exc_info: object) -> None:
        uninstall(self._engine._flow, self.recorder)
        if self._path is not None:
            _write(self.recorder, self._path, f"engine.trace({str(self._path)!r})")


class TraceFile:
    """``Engine(..., trace=path)``: one recorder for the engine's whole life, written to
    ``path`` when the engine closes.

    Made when the engine opens, before any device: the path is written then (an empty,
    valid trace), so a path that cannot be written (no such folder, a folder, no
    permission) fails the open with a :class:`ConfigurationError` naming it, rather
    than losing the run's trace at close.
    """

    def __init__(self, path: str | os.PathLike[str], name: str, capacity: int) -> None:
        self.path = Path(path)
        self.recorder = TraceRecorder(name, capacity=capacity)
        _write(self.recorder, self.path, f"trace={str(path)!r}")

    @classmethod
    def of(cls, options: Any, model: object) -> TraceFile | None:
        """The trace ``Engine(model, trace=..., trace_capacity=...)`` asks for, or None."""
        if options.trace is None:
            return None
        return cls(options.trace, trace_name(model), options.trace_capacity)

    def start(self, flow: Any) -> TraceFile:
        install(flow, self.recorder)
        return self

    async def finish(self, flow: Any) -> None:
        """Stop recording and write the file (in a worker thread: a full ring of the
        default capacity is about a hundred megabytes of JSON)."""
        uninstall(flow, self.recorder)
        await anyio.to_thread.run_sync(
            _write, self.recorder, self.path, f"trace={str(self.path)!r}", " at close"
        )


def _write(recorder: TraceRecorder, path: str | Path, what: str, when: str = "") -> None:
    """Write the trace, or raise a ConfigurationError that names the path and why (a
    folder removed, a link, a FIFO, no permission) instead of a bare OSError."""
    try:
        recorder.write(path)
    except OSError as exc:
        raise ConfigurationError(f"{what} cannot be written{when}: {exc.strerror or exc}") from exc


class CoresTracing:
    """``async with dla.trace(path) as trace:``: record every engine open on the
    cores while in the block (see :func:`cores_trace`)."""

    def __init__(
        self,
        engines: Sequence[Any],
        path: str | os.PathLike[str] | None,
        names: Sequence[str],
        capacity: int,
    ) -> None:
        self._path = path
        self._engines = tuple(engines)
        clock = time.monotonic
        self._recorders = [TraceRecorder(name, capacity=capacity, clock=clock) for name in names]
        self.trace = CoresTrace(self._recorders)

    async def __aenter__(self) -> CoresTrace:
        installed: list[tuple[Any, TraceRecorder]] = []
        try:
            for engine, recorder in zip(self._engines, self._recorders, strict=True):
                install(engine._flow, recorder)
                installed.append((engine, recorder))
        except BaseException:
            for engine, recorder in installed:
                uninstall(engine._flow, recorder)
            raise
        return self.trace

    async def __aexit__(self, *exc_info: object) -> None:
        for engine, recorder in zip(self._engines, self._recorders, strict=True):
            uninstall(engine._flow, recorder)
        if self._path is not None:
            try:
                self.trace.write(self._path)
            except OSError as exc:
                raise ConfigurationError(
                    f"dla.trace({str(self._path)!r}) cannot be written: {exc.strerror or exc}"
                ) from exc


def cores_trace(
    engines: Sequence[Any],
    path: str | os.PathLike[str] | None = None,
    *,
    names: Mapping[Any, str] | None = None,
    capacity: int = DEFAULT_CAPACITY,
) -> CoresTracing:
    """What ``Cores.trace()`` returns: a trace of ``engines`` (those open on the cores),
    each named by ``names[engine]``, else by its model's file stem; names that repeat
    are numbered (``engine``, ``engine 2``)."""
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ConfigurationError(f"trace {capacity=} must be an int >= 1")
    names = dict(names or {})
    unknown = [name for engine, name in names.items() if engine not in engines]
    if unknown:
        raise ConfigurationError(f"names={unknown!r}: not engines open on these cores")
    chosen: list[str] = []
    for engine in engines:
        name = names.get(engine) or trace_name(engine._model)
        if name in chosen:
            name = next(f"{name} {n}" for n in itertools.count(2) if f"{name} {n}" not in chosen)
        chosen.append(name)
    return CoresTracing(engines, path, chosen, capacity)


def trace_name(model: object) -> str:
    """How a trace names an engine's model: its file's stem, or ``engine`` for bytes."""
    if isinstance(model, (str, os.PathLike)):
        return Path(model).stem or "engine"
    return "engine"


def engine_trace(
    self: Any,
    path: str | Path | None = None,
    *,
    name: str | None = None,
    capacity: int = DEFAULT_CAPACITY,
) -> Tracing:
    """Record a timeline of this engine while in an ``async with`` block.

    ``async with engine.trace("run.json"):`` records every request that ends in the
    block (queued, given a slot, packed, submitted, its DLA task on its core and
    stream, seen done, unpacked, returned) and the poller's sweeps, and writes them on
    leaving the block as Chrome trace-event JSON, which Perfetto UI and
    ``chrome://tracing`` open; ``aiodla trace-plot run.json out.png`` draws it. Without
    ``path`` nothing is written: the block's value, a :class:`TraceRecorder`, has
    ``write(path)`` and ``trace_events()``. ``capacity`` bounds memory: the last
    ``capacity`` requests and sweeps are kept. ``name`` labels the engine (default:
    ``"engine"``). The engine must be open; one trace at a time. For the engine's
    whole life, from open to close: ``Engine(model, trace="run.json")``.
    """
    if self.state.value != "open":
        raise EngineClosedError(f"trace() needs an open engine; it is {self.state.value}")
    return Tracing(self, path, TraceRecorder(name or "engine", capacity=capacity))


def active_recorder(engine: Any) -> TraceRecorder | None:
    """The recorder tracing ``engine`` now, or None."""
    flow = getattr(engine, "_flow", None)
    return None if flow is None else flow.trace


def data_address(value: Any) -> int:
    """Where an array's first byte lies (host or device), or -1 for anything else."""
    for name in ("__array_interface__", "__cuda_array_interface__"):
        interface = getattr(value, name, None)
        if isinstance(interface, dict):
            data = interface.get("data")
            if isinstance(data, tuple) and data and isinstance(data[0], int):
                return data[0]
    return -1
