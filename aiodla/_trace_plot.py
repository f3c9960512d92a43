"""A static picture of a trace (``aiodla trace-plot``), for where no browser is at hand.

It reads the Chrome trace-event JSON that ``engine.trace()`` writes and draws, with
matplotlib, one row per DLA core over time, and above them the event loop's and the
poller's work:

* ``color="model"``: each DLA task coloured by its engine's model; a core's row is as
  busy as the core was;
* ``color="state"``: each core's row split into one lane per stream, and on it each
  request in its states: queued (drawn thin), packed and submitted, waiting for the
  core, on the DLA, waiting for the loop to take the completion, unpacked until
  returned.

``start``/``end`` (milliseconds from the trace's start) draw a window of a long trace.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path
from typing import Any

from ._errors import ConfigurationError
from ._safe_paths import UnsafePathError, read_limited

__all__ = ["COLORINGS", "STATE_COLORS", "plot_trace", "read_trace"]

COLORINGS = ("model", "state")
STATE_COLORS = {
    "queued": "#d9d9d9",
    "packed and submitted": "#9ecae1",
    "waiting for the core": "#fdd0a2",
    "DLA task": "#31a354",
    "waiting for the loop": "#fc9272",
    "unpack": "#756bb1",
}
LOOP_COLORS = {"pack": "#6baed6", "submit": "#3182bd", "unpack": "#756bb1"}


class _Trace:
    """A trace document's slices, by the rows the picture has."""

    def __init__(self, document: dict[str, Any]) -> None:
        events = document["traceEvents"]
        # By (process, track): a trace of several engines (Cores.trace) has a process
        # for each, with the same track names in each.
        self.names = {
            (e.get("pid"), e.get("tid")): e["args"]["name"]
            for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"
        }
        self.tasks: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)  # by core
        self.loop: list[dict[str, Any]] = []
        self.sweeps: list[dict[str, Any]] = []
        # Per request (process, number): its steps.
        self.steps: dict[Any, dict[str, tuple[float, float]]] = collections.defaultdict(dict)
        begun: dict[tuple[Any, ...], float] = {}
        for e in events:
            phase = e.get("ph")
            track = self.names.get((e.get("pid"), e.get("tid")), "")
            args = e.get("args", {})
            name = e.get("name", "")
            if phase == "X" and name == "DLA task":
                core, stream = _core_and_stream(track)
                self.tasks[core].append({**e, "stream": stream})
            elif phase == "X" and _is(track, "event loop"):
                self.loop.append(e)
                request = args.get("request")
                if isinstance(request, (int, str)):
                    self.steps[(e.get("pid"), request)][name] = (e["ts"], e["ts"] + e["dur"])
            elif phase == "X" and (_is(track, "poller") or _is(track, "loop harvests")):
                self.sweeps.append(e)
            elif phase == "b" and e.get("cat") in ("queue", "off-loop"):
                begun[(e.get("pid"), e["id"], name)] = e["ts"]
            elif phase == "e" and (e.get("pid"), e.get("id"), name) in begun:
                # A queue wait, or a step done in a worker thread.
                at = begun.pop((e.get("pid"), e["id"], name))
                self.steps[(e.get("pid"), e["id"])][name] = (at, e["ts"])
        if not self.tasks and not self.loop:
            raise ConfigurationError("the trace holds no DLA task and no step of a request")

    def span(self) -> tuple[float, float]:
        times = [e["ts"] for rows in self.tasks.values() for e in rows] + [
            e["ts"] for e in self.loop
        ]
        ends = [e["ts"] + e["dur"] for rows in self.tasks.values() for e in rows] + [
            e["ts"] + e["dur"] for e in self.loop
        ]
        return min(times), max(ends)


def _is(track: str, kind: str) -> bool:
    # "event loop", or "event loop: detector" in a trace of several engines.
    return track == kind or track.startswith(f"{kind}: ")


_STREAM_TRACK = re.compile(r"core (\d+) stream (\d+)(?::|$)")


def _core_and_stream(track: str) -> tuple[int, int]:
    # "core C stream S" (": engine" after it in a trace of several), as aiodla._trace
    # names the tracks.
    found = _STREAM_TRACK.match(track)
    if found is None:
        raise ConfigurationError(f"a DLA task on a track named {track!r}")
    return int(found[1]), int(found[2])


#: A trace of the default capacity is about a hundred megabytes of JSON.
TRACE_FILE_LIMIT = 2 << 30


def read_trace(path: str | Path) -> dict[str, Any]:
    """The trace document at ``path``, with a clear error if it is not one: a regular
    file (not a FIFO or a device, which are never waited on) of at most 2 GiB, holding
    a JSON object whose ``traceEvents`` are objects with the fields the picture reads."""
    try:
        data = read_limited(path, TRACE_FILE_LIMIT)
    except UnsafePathError as exc:
        raise ConfigurationError(f"{str(path)!r} is {exc.strerror}") from None
    try:
        document = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigurationError(f"{str(path)!r} is not UTF-8 text: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"{str(path)!r} is not JSON: {exc}") from None
    except RecursionError:
        raise ConfigurationError(f"{str(path)!r} nests its JSON too deeply to be a trace") from None
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise ConfigurationError(f"{str(path)!r} is not a trace: no 'traceEvents' list")
    for index, event in enumerate(document["traceEvents"]):
        problem = _malformed(event)
        if problem is not None:
            raise ConfigurationError(
                f"{str(path)!r}: traceEvents[{index}] {problem}: {_shown(event)}"
            )
    return document


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _malformed(event: Any) -> str | None:
    """What is wrong with one event for the picture, or None. Only the fields the
    picture reads are held to the Trace Event Format; others pass as they are."""
    if not isinstance(event, dict):
        return "is not an object"
    phase = event.get("ph")
    if not isinstance(phase, str):
        return "has no phase ('ph') string"
    if not isinstance(event.get("name", ""), str) or (phase != "M" and "name" not in event):
        return "has no 'name' string"
    if "args" in event and not isinstance(event["args"], dict):
        return "has 'args' that are not an object"
    for key in ("pid", "tid"):
        if key in event and not isinstance(event[key], (int, str)):
            return f"has a {key!r} that is neither a number nor a string"
    if phase == "M":
        if event.get("name") == "thread_name" and not (
            isinstance(event.get("args", {}).get("name"), str) and "tid" in event
        ):
            return "names a track with no 'tid' or no 'args.name' string"
        return None
    if phase in ("X", "b", "e", "i", "B", "E") and not _number(event.get("ts")):
        return "has no numeric 'ts'"
    if phase == "X" and not _number(event.get("dur")):
        return "is a complete event ('X') with no numeric 'dur'"
    if phase in ("b", "e") and not isinstance(event.get("id"), (int, str)):
        return "is an async event with no 'id'"
    return None


def _shown(event: Any) -> str:
    text = json.dumps(event)
    return text if len(text) <= 120 else text[:117] + "..."


def plot_trace(
    document: dict[str, Any],
    out: str | Path,
    *,
    color: str = "model",
    start: float | None = None,
    end: float | None = None,
    width: float = 12.0,
    title: str | None = None,
) -> Path:
    """Draw ``document`` (a trace's JSON) into ``out`` (PNG, SVG, PDF: by its suffix)."""
    if color not in COLORINGS:
        raise ConfigurationError(f"{color=} must be one of {', '.join(COLORINGS)}")
    trace = _Trace(document)
    first, last = trace.span()
    low = first if start is None else start * 1e3
    high = last if end is None else end * 1e3
    if not low < high:
        raise ConfigurationError(f"the window {start}..{end} ms holds nothing of the trace")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    cores = sorted(trace.tasks)
    rows = ["event loop", "sweeps"] + [f"core {core}" for core in cores]
    # An SVG keeps its words as text (searchable, and smaller than their outlines).
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig, ax = plt.subplots(figsize=(width, 1.0 + 0.55 * len(rows)), dpi=120)
    try:
        ms = 1e-3  # trace microseconds to the axis's milliseconds
        y = {name: len(rows) - 1 - i for i, name in enumerate(rows)}
        for e in trace.loop:
            ax.broken_barh(
                [(e["ts"] * ms, max(e["dur"] * ms, 1e-4))],
                (y["event loop"] - 0.35, 0.7),
                color=LOOP_COLORS.get(e["name"], "#999999"),
            )
        for e in trace.sweeps:
            ax.vlines(e["ts"] * ms, y["sweeps"] - 0.3, y["sweeps"] + 0.3, color="#636363", lw=0.5)
        legend = [Patch(color=c, label=f"loop: {n}") for n, c in LOOP_COLORS.items()]
        if color == "model":
            legend += _by_model(ax, trace, cores, y, ms)
        else:
            legend += _by_state(ax, trace, cores, y, ms)
        ax.set_yticks(list(y.values()), list(y))
        ax.set_xlim(low * ms, high * ms)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.set_xlabel("time (ms from the start of the trace)")
        ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        ax.set_title(title or "aiodla trace", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        out = Path(out)
        with matplotlib.rc_context({"svg.fonttype": "none"}):
            fig.savefig(out, metadata={"Software": None} if out.suffix == ".png" else None)
    finally:
        plt.close(fig)
    return out


def _by_model(ax: Any, trace: _Trace, cores: list[int], y: dict[str, int], ms: float) -> list[Any]:
    from matplotlib import colormaps
    from matplotlib.patches import Patch

    models = sorted(
        {str(e.get("args", {}).get("model", "?")) for core in cores for e in trace.tasks[core]}
    )
    palette = colormaps["Dark2"]  # apart from the loop's blues
    colors = {model: palette(i % 8) for i, model in enumerate(models)}
    for core in cores:
        for model in models:
            bars = [
                (e["ts"] * ms, e["dur"] * ms)
                for e in trace.tasks[core]
                if str(e.get("args", {}).get("model", "?")) == model
            ]
            ax.broken_barh(bars, (y[f"core {core}"] - 0.4, 0.8), color=colors[model])
    return [Patch(color=colors[m], label=f"DLA: {m}") for m in models]


def _by_state(ax: Any, trace: _Trace, cores: list[int], y: dict[str, int], ms: float) -> list[Any]:
    from matplotlib.patches import Patch

    for core in cores:
        tasks = trace.tasks[core]
        lanes = sorted({e["stream"] for e in tasks})
        height = 0.8 / max(len(lanes), 1)
        for e in tasks:
            lane = lanes.index(e["stream"])
            bottom = y[f"core {core}"] - 0.4 + lane * height
            steps = trace.steps.get((e.get("pid"), e.get("args", {}).get("request")), {})
            start, stop = e["ts"], e["ts"] + e["dur"]
            spans = []
            if "queued" in steps:
                spans.append(("queued", *steps["queued"]))
            if "submit" in steps:
                began = steps.get("pack", steps["submit"])[0]
                spans.append(("packed and submitted", began, steps["submit"][1]))
                spans.append(("waiting for the core", steps["submit"][1], start))
            spans.append(("DLA task", start, stop))
            if "unpack" in steps:
                spans.append(("waiting for the loop", stop, steps["unpack"][0]))
                spans.append(("unpack", *steps["unpack"]))
            for state, a, b in spans:
                if b > a:
                    # Queued time is drawn thin: the next request waits while this
                    # stream's previous one still runs.
                    h = height * (0.35 if state == "queued" else 0.9)
                    ax.broken_barh([(a * ms, (b - a) * ms)], (bottom, h), color=STATE_COLORS[state])
    return [Patch(color=c, label=s) for s, c in STATE_COLORS.items()]
