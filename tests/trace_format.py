"""The Trace Event Format's rules that Perfetto UI and chrome://tracing rely on, checked
on a document (the ``perfetto`` package's trace processor would download a binary at
run time, which CI cannot).

From the format's specification: every event has ``name``, ``ph``, ``pid`` and ``tid``,
and every timed one a numeric ``ts`` in microseconds; complete events (``X``) a ``dur``
>= 0; on one track (pid, tid) slices nest, begin/end pairs balance and timestamps never
go back; async begin/end (``b``/``e``) pair by (cat, id, name); a flow (``s``, ``t``...,
``f``) has one start and one finish per id, in time order, each inside a slice of its
track (where the viewer binds it).
"""

from __future__ import annotations

import collections
from typing import Any

KNOWN_PHASES = set("XBEbeistfM")
# Timestamps carry 0.001 us of rounding; a slice may touch the next within that.
SLACK = 0.01


def check_trace_format(document: dict[str, Any]) -> None:
    """Assert every rule above; the message names the offending event."""
    events = document["traceEvents"]
    assert isinstance(events, list) and events
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for event in events:
        for key in ("name", "ph", "pid", "tid"):
            assert key in event, f"{key!r} missing: {event}"
        assert event["ph"] in KNOWN_PHASES, event
        if event["ph"] == "M":
            continue
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0, event
        if event["ph"] == "X":
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0, event
        tracks[(event["pid"], event["tid"])].append(event)
    slices: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for track, track_events in tracks.items():
        times = [e["ts"] for e in track_events]
        assert times == sorted(times), f"timestamps go back on track {track}"
        slices[track] = _check_nesting(track, track_events)
    _check_async_pairs(events)
    _check_flows(events, slices)


def _check_nesting(
    track: tuple[int, int], events: list[dict[str, Any]]
) -> list[tuple[float, float]]:
    """Slices of a track nest (each inside the enclosing one, or after it); B/E balance."""
    open_ends: list[float] = []
    begun: list[dict[str, Any]] = []
    spans = []
    for event in events:
        if event["ph"] == "X":
            start, end = event["ts"], event["ts"] + event["dur"]
            while open_ends and open_ends[-1] <= start + SLACK:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + SLACK, f"overlap on {track}: {event}"
            open_ends.append(end)
            spans.append((start, end))
        elif event["ph"] == "B":
            begun.append(event)
        elif event["ph"] == "E":
            assert begun, f"E without B on {track}: {event}"
            spans.append((begun.pop()["ts"], event["ts"]))
    assert not begun, f"B without E on {track}: {begun}"
    return spans


def _check_async_pairs(events: list[dict[str, Any]]) -> None:
    begun: dict[tuple[Any, ...], float] = {}
    for event in events:
        key = (event.get("cat"), event.get("id"), event["name"])
        if event["ph"] == "b":
            assert "id" in event and key not in begun, event
            begun[key] = event["ts"]
        elif event["ph"] == "e":
            assert key in begun, f"async end without begin: {event}"
            assert begun.pop(key) <= event["ts"], event
    assert not begun, f"async begins without end: {list(begun)[:5]}"


def _check_flows(
    events: list[dict[str, Any]], slices: dict[tuple[int, int], list[tuple[float, float]]]
) -> None:
    flows: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
    for event in events:
        if event["ph"] in "stf":
            flows[event["id"]].append(event)
            spans = slices.get((event["pid"], event["tid"]), [])
            at = event["ts"]
            assert any(s - SLACK <= at <= e + SLACK for s, e in spans), (
                f"flow step not in a slice: {event}"
            )
    for flow_id, steps in flows.items():
        phases = [e["ph"] for e in steps]
        assert phases.count("s") == 1 and phases.count("f") == 1, f"flow {flow_id}: {phases}"
        ordered = sorted(steps, key=lambda e: "stf".index(e["ph"]))
        times = [e["ts"] for e in ordered]
        assert times == sorted(times), f"flow {flow_id} goes back in time: {ordered}"
        finish = next(e for e in steps if e["ph"] == "f")
        assert finish.get("bp") == "e", finish
