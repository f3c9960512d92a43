"""Camera to boxes with the decode included: host CPU per 1080p frame.

A 1920x1080 H.264 clip (30 frames/s, made here with PyAV: gradients and moving discs,
easier to decode than a real street scene) goes to boxes through YOLOv5s-shaped heads
(``aiodla emulate --preset yolov5s``'s I/O; ``Detect(head="yolov5")`` on the stream),
both cores. Cases, interleaved and repeated (median and min..max of each):

- **all-in, per decoder present** (``ffmpeg``; ``gstreamer`` where PyGObject and its
  plugins are; ``nvdec`` where PyNvVideoCodec and a GPU are, with ``--gpu``): ``aiodla.VideoSource(clip, decoder=..., engine=engine)`` (where it is not
  installed, PyAV directly: the frame's I420 planes copied into an engine frame buffer)
  -> ``engine.infer(frame)`` -> Detections;
- **(i) engine alone**: I420 frames already in the engine's frame buffers -> Detections;
- **(ii) today**: ``cv2.VideoCapture(clip).read()`` (FFmpeg decode and its BGR
  conversion, in a worker thread) -> ``ImagePreprocess(source="bgr")`` -> Detections;
- **decode alone**: PyAV decoding the clip on one thread (as the ``ffmpeg`` decoder
  does), nothing else.

``host us/frame`` is the process's CPU (every thread: the loop, the poller, the
decoder's threads) per frame, less the emulated device's work (the emulated runtime's
stream operations and compute threads: a Jetson's DLA and GPU do that, not its CPU);
on the CUDA runtime nothing is subtracted. The loop, poller and by-thread columns say
where it went; on the emulated runtime they include the emulated device's work
wherever it ran (the poller applies stream work there), which ``host us`` leaves out. Printed ratios, each against the issue's
target: ffmpeg all-in / (decode alone + engine alone) <= 1.1; (ii) / ffmpeg all-in
>= 1.5; nvdec all-in / engine alone <= 1.5.

``--streams N``: N streams of the clip, each taken at 30 frames/s (a frame's capture
time is its slot on a 30 Hz clock; decoding runs ahead of it, so the decoder's CPU and
throughput count, its own latency does not), newest frame wins, into ``Detect`` on both
cores; per-stream delivered frame rate and p99 capture-to-boxes. Every stream's clock
starts together (the worst case: sixteen frames arrive at once each interval), and a
stream keeps up to ``_paced.PIPELINE`` (3) frames in flight, as a camera app that awaits each
result in its own task does: the target allows three frame intervals from capture to
boxes, so a frame still in flight when the next is captured is no reason to drop that
one. A frame captured while three are in flight is dropped (newest wins). The stand-in's task
time is ``--task-ms`` (3.8 ms, YOLOv5s on an Orin DLA core): two cores carry
2 / 3.8 ms = 526 frames/s, above 16 x 30 = 480; the report also gives what the runtime
itself sustains for that task on both cores with no engine (``device_floor_per_s``,
``measured_task_ms``), since the stand-in may take longer than the time stated.

Usage::

    python benchmarks/bench_video.py [OUTPUT.json] [--gpu] [--repeats 5] [--frames 120]
    python benchmarks/bench_video.py --gpu --streams 16 [--seconds 10] [--decoder ffmpeg]
        [--streams-per-core 2] [--max-frames 2] [--isolation process] [--stagger]
        [--gc-freeze] [--switch-interval-ms MS]

``--streams`` also reports what delays the streams (``benchmarks/_stalls.py``);
``--stagger`` gives each camera's clock its own phase (independent cameras) instead of
every stream's frame arriving at once, and ``--gc-freeze`` / ``--switch-interval-ms``
try the collector's and the interpreter lock's levers an application holds.

``--isolation process`` decodes each source in a process of its own
(``VideoSource(isolation="process")``); ``host us`` then adds the decoding processes'
CPU (each reaped as its source closes, inside the window).

``--gpu`` runs on the CUDA runtime with the GPU stand-in (built with nvcc, or
``--standin`` / ``AIODLA_STANDIN_LIB``); without it, the emulated runtime, which checks
the harness and measures the host's side (decode, the engine's Python) but nothing of
GPU speed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import queue
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
from _paced import FPS, cores_busy, paced
from _reports import report_path
from _stalls import CollectorPauses, LockProbe, SlowCallbacks, tail
from _standin_lib import load_standin
from _thread_cpu import per_request, snapshot
from bench_data_path import device_floor, summarize, ticker

import aiodla
from aiodla import Detect, Engine, ImagePreprocess, VideoFrame
from aiodla.emulator import make_loadable
from aiodla.emulator._detector import PRESETS

SIZE = (1080, 1920)
CORES = 2
COMPUTE_THREADS = "aiodla-emulated-compute"


def make_clip(path: Path, frames: int) -> Path:
    """``frames`` frames of 1080p30 H.264 (yuv420p), written with PyAV."""
    import av

    height, width = SIZE
    rows, columns = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "veryfast"}
        for k in range(frames):
            image = np.empty((height, width, 3), np.uint8)
            image[..., 0] = (columns + 4 * k) % 256
            image[..., 1] = rows * 255 // height
            image[..., 2] = (columns // 8 + rows // 8 + 2 * k) % 256
            for x in range(200, width, 400):  # discs that move: motion to encode
                disc = (rows - 540) ** 2 + (columns - x - 6 * k) ** 2 < 120**2
                image[disc] = (30, 200, 250)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="bgr24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def detector(task_s: float) -> bytes:
    inputs, outputs, _ = PRESETS["yolov5s"]
    return make_loadable(inputs, outputs, "detect", task_s)


def engine(args: argparse.Namespace, source: str) -> Engine:
    pre = ImagePreprocess(source=source, order="rgb", resize="letterbox")  # type: ignore[arg-type]
    return Engine(
        detector(args.task_ms / 1e3), runtime=args.runtime, convert="device",
        cores=range(CORES), preprocess={"images": pre}, postprocess=Detect(head="yolov5"),
        streams_per_core=args.streams_per_core,
    )  # fmt: skip


def copy_i420(frame: Any, into: np.ndarray[Any, Any]) -> None:
    """An AVFrame's I420 planes into one (H*3/2) x W array, once (its rows may be
    pitched: each plane's line size is at least its width)."""
    height, width = frame.height, frame.width
    flat = into.reshape(-1)
    at = 0
    for plane, (rows, columns) in zip(
        frame.planes, ((height, width), (height // 2, width // 2), (height // 2, width // 2)),
        strict=True,
    ):  # fmt: skip
        lines = np.frombuffer(plane, np.uint8).reshape(rows, plane.line_size)
        flat[at : at + rows * columns].reshape(rows, columns)[...] = lines[:, :columns]
        at += rows * columns


class PyAVFrames:
    """All-in without ``aiodla.VideoSource``: PyAV decodes on a thread of its own, each
    frame's planes copied into a free engine frame buffer and handed to the loop; a
    buffer is free again once its request ended (``release``)."""

    def __init__(self, clip: Path, buffers: list[np.ndarray[Any, Any]], count: int) -> None:
        self.free: queue.SimpleQueue[np.ndarray[Any, Any] | None] = queue.SimpleQueue()
        for buffer in buffers:
            self.free.put(buffer)
        self.ready: asyncio.Queue[VideoFrame | None] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.thread = threading.Thread(
            target=self.decode, args=(clip, count), name="bench-pyav", daemon=True
        )
        self.thread.start()

    def decode(self, clip: Path, count: int) -> None:
        import av

        index = 0
        while index < count:
            with av.open(str(clip)) as container:
                for frame in container.decode(video=0):
                    buffer = self.free.get()
                    if buffer is None:  # closed
                        return
                    copy_i420(frame, buffer)
                    made = VideoFrame(
                        array=buffer, format="i420", width=frame.width, height=frame.height,
                        source=clip.name, index=index, pts=frame.time,
                        captured_at=time.time(), on_device=False,
                    )  # fmt: skip
                    self.loop.call_soon_threadsafe(self.ready.put_nowait, made)
                    index += 1
                    if index == count:
                        break
        self.loop.call_soon_threadsafe(self.ready.put_nowait, None)

    def release(self, frame: VideoFrame) -> None:
        self.free.put(frame.array)

    def close(self) -> None:
        """Stop decoding (the thread ends at its next frame)."""
        self.free.put(None)

    async def __aiter__(self) -> AsyncIterator[VideoFrame]:
        while (frame := await self.ready.get()) is not None:
            yield frame


async def drive(
    infer: Callable[[Any], Any], frames: AsyncIterator[Any], inflight: int,
    done: Callable[[Any], None] | None = None,
) -> int:  # fmt: skip
    """Every frame of ``frames`` to boxes, ``inflight`` requests at most at once."""
    slots = asyncio.Semaphore(inflight)
    tasks: set[asyncio.Task[Any]] = set()
    count = 0

    async def one(frame: Any) -> None:
        try:
            boxes = await infer(frame)
            assert boxes is not None
        finally:
            if done is not None:
                done(frame)
            slots.release()

    async for frame in frames:
        await slots.acquire()
        task = asyncio.create_task(one(frame))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        count += 1
    await asyncio.gather(*tasks)
    return count


def children_cpu() -> float:
    """CPU seconds of this process's children that have ended and been reaped."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Window:
    """Host CPU over a window: the process's, less the emulated device's, per frame,
    and where it went (the loop's thread, aiodla's poller, each other thread by name);
    plus the CPU of child processes that ended within it (decoding processes, with
    ``--isolation process``: each is reaped as its source closes)."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.loop_id = threading.get_native_id()
        self.started = time.perf_counter()
        self.device = float(getattr(runtime, "device_time", 0.0))
        self.before = snapshot()
        self.children = children_cpu()

    def per_frame(self, frames: int) -> dict[str, Any]:
        after = snapshot()
        elapsed = time.perf_counter() - self.started
        device = float(getattr(self.runtime, "device_time", 0.0)) - self.device
        groups, by_name = per_request(self.before, after, frames, self.loop_id)
        emulated = sum(us for name, us in by_name.items() if name.startswith(COMPUTE_THREADS))
        threads = {name: us for name, us in by_name.items() if not name.startswith(COMPUTE_THREADS)}
        children = 1e6 * (children_cpu() - self.children) / frames
        return {
            "host_us": groups["process"] - emulated - 1e6 * device / frames + children,
            "children_us": children,
            "loop_us": groups["loop"],
            "poller_us": groups["poller"],
            "frames": frames,
            "fps": frames / elapsed,
            "threads_us": threads,  # the rest, by thread (emulated device threads apart)
        }


def isolation(args: argparse.Namespace) -> dict[str, str]:
    """VideoSource's isolation argument, left out where it is the default (so that a
    revision from before the argument runs too)."""
    return {} if args.isolation == "thread" else {"isolation": args.isolation}


async def taken(frames: AsyncIterator[Any], count: int) -> AsyncIterator[Any]:
    """The next ``count`` frames of ``frames`` (which stays open for more)."""
    for _ in range(count):
        yield await anext(frames)


async def all_in(args: argparse.Namespace, clip: Path, decoder: str) -> dict[str, float]:
    """The source opened and warmed up first: the window holds frames only."""
    source_format = await probe_format(clip, decoder)
    warm = args.inflight * 2
    async with engine(args, source_format) as opened:
        video_source = getattr(aiodla, "VideoSource", None)
        release: Callable[[Any], None] | None = None
        if video_source is not None:
            camera = video_source(
                str(clip), decoder=decoder, engine=opened, repeat=True, max_frames=4,
                name=f"{decoder} clip", **isolation(args),
            )  # fmt: skip
            await camera.__aenter__()
            frames: AsyncIterator[Any] = aiter(camera)
        else:  # PyAV directly (ffmpeg only)
            buffers = opened.frame_buffers(args.inflight + 4, (SIZE[0] * 3 // 2, SIZE[1]))
            reader = PyAVFrames(clip, buffers, warm + args.frames)
            frames, release = aiter(reader), reader.release
        try:
            await drive(opened.infer, taken(frames, warm), args.inflight, release)
            window = Window(opened.runtime)
            count = await drive(opened.infer, taken(frames, args.frames), args.inflight, release)
            result = window.per_frame(count)
            if video_source is not None:
                # Frames that went into plain arrays, each staged by a copy of the
                # engine's: none is expected (the source's buffers cover every slot).
                result["unpooled"] = camera.statistics().unpooled
        finally:
            if video_source is not None:
                await camera.__aexit__(None, None, None)
    return result


async def engine_alone(args: argparse.Namespace, clip: Path) -> dict[str, float]:
    import av

    async with engine(args, "i420") as opened:
        # a ring of decoded frames in the engine's frame buffers, read again and again
        ring = opened.frame_buffers(16, (SIZE[0] * 3 // 2, SIZE[1]))
        with av.open(str(clip)) as container:
            for frame, buffer in zip(container.decode(video=0), ring, strict=False):
                copy_i420(frame, buffer)
        made = [
            VideoFrame(array=b, format="i420", width=SIZE[1], height=SIZE[0], source="ring",
                       index=k, pts=None, captured_at=0.0, on_device=False)
            for k, b in enumerate(ring)
        ]  # fmt: skip

        async def frames(count: int) -> AsyncIterator[VideoFrame]:
            for k in range(count):
                yield made[k % len(made)]

        await drive(opened.infer, frames(args.inflight * 2), args.inflight)
        window = Window(opened.runtime)
        count = await drive(opened.infer, frames(args.frames), args.inflight)
        result = window.per_frame(count)
    return result


async def today(args: argparse.Namespace, clip: Path) -> dict[str, float]:
    """What users write today: OpenCV's VideoCapture (FFmpeg, BGR) off the loop."""
    import cv2

    async with engine(args, "bgr") as opened:

        async def frames(count: int) -> AsyncIterator[Any]:
            capture = cv2.VideoCapture(str(clip))
            taken = 0
            while taken < count:
                ok, image = await asyncio.to_thread(capture.read)
                if not ok:  # the clip's end: from its start again
                    capture.release()
                    capture = cv2.VideoCapture(str(clip))
                    continue
                yield image
                taken += 1
            capture.release()

        await drive(opened.infer, frames(args.inflight * 2), args.inflight)
        window = Window(opened.runtime)
        count = await drive(opened.infer, frames(args.frames), args.inflight)
        result = window.per_frame(count)
    return result


def decode_alone(args: argparse.Namespace, clip: Path) -> dict[str, float]:
    """PyAV decoding the clip on this thread, opened and warmed up before the window
    (as the all-in source is); at the clip's end it opens it again. One decoding
    thread, as the ffmpeg decoder sets it (``thread_count = 1``): PyAV's default adds
    FFmpeg's slice threads, whose CPU varied from 0.2 to 2.7 ms a frame between runs
    here, which would move the baseline, not aiodla's share of the all-in cost."""
    import av

    def pictures() -> Any:
        while True:
            with av.open(str(clip)) as container:
                stream = container.streams.video[0]
                stream.codec_context.thread_count = 1
                yield from container.decode(stream)

    decoded = pictures()
    for _ in range(args.inflight * 2):
        next(decoded)
    window = Window(None)
    for _ in range(args.frames):
        next(decoded)
    result = window.per_frame(args.frames)
    decoded.close()
    return result


def decoders_present(args: argparse.Namespace) -> list[str]:
    """The decoders that can run here: ``aiodla.VideoSource``'s (nvdec only with the
    CUDA runtime, which its device frames need); ffmpeg by PyAV alone without it."""
    try:
        from aiodla._video_decoders import available_decoders
    except ImportError:
        return ["ffmpeg"]
    present = []
    for name, why_not in available_decoders().items():
        if why_not is not None:
            print(f"no {name} case: {why_not}", flush=True)
        elif name == "nvdec" and args.runtime != "cuda":
            print("no nvdec case: its device frames need the CUDA runtime (--gpu)", flush=True)
        else:
            present.append(name)
    return present


async def probe_format(clip: Path, decoder: str) -> str:
    """The planar format ``decoder`` gives for the clip (its first frame's)."""
    video_source = getattr(aiodla, "VideoSource", None)
    if video_source is None:
        return "i420"  # PyAV: FFmpeg's H.264 decoder gives I420
    async with video_source(str(clip), decoder=decoder) as camera:
        async for frame in camera:
            return str(frame.format)
    raise RuntimeError(f"the {decoder} decoder gave no frame of {clip}")


def case_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median and spread over the repeats; threads by their medians."""
    entry: dict[str, Any] = {
        key: summarize([r[key] for r in results]) for key in results[0] if key != "threads_us"
    }
    names = sorted({name for r in results for name in r["threads_us"]})
    entry["threads_us"] = {
        name: statistics.median(r["threads_us"].get(name, 0.0) for r in results) for name in names
    }
    return entry


def ratio(
    raw: dict[str, list[dict[str, float]]], top: list[str], bottom: list[str], target: str
) -> dict[str, Any] | None:
    """sum(top) / sum(bottom) host us, repeat by repeat (each repeat's own cases)."""
    if not all(name in raw for name in (*top, *bottom)):
        return None
    values = [
        sum(raw[n][k]["host_us"] for n in top) / sum(raw[n][k]["host_us"] for n in bottom)
        for k in range(len(raw[top[0]]))
    ]
    return {**summarize(values), "target": target}


def run(args: argparse.Namespace, clip: Path) -> dict[str, Any]:
    cases: dict[str, Callable[[], dict[str, float]]] = {
        "decode alone (PyAV)": lambda: decode_alone(args, clip),
        "engine alone (i)": lambda: asyncio.run(engine_alone(args, clip)),
    }
    for decoder in decoders_present(args):
        cases[f"all-in {decoder}"] = lambda d=decoder: asyncio.run(all_in(args, clip, d))
    try:
        import cv2  # noqa: F401
    except ImportError:
        print("OpenCV is not installed: no cv2.VideoCapture baseline", flush=True)
    else:
        cases["today: cv2 BGR (ii)"] = lambda: asyncio.run(today(args, clip))
    raw: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for repeat in range(args.repeats):
        for name, case in cases.items():  # interleaved
            result = case()
            raw[name].append(result)
            print(f"[{repeat + 1}/{args.repeats}] {name}: {result}", flush=True)
    report: dict[str, Any] = {
        "runtime": args.runtime,
        "task_ms": args.task_ms,
        "frames": args.frames,
        "inflight": args.inflight,
        "video_source": getattr(aiodla, "VideoSource", None) is not None,
        "cases": {n: case_summary(rs) for n, rs in raw.items()},
        "ratios": {},
    }
    targets = {
        "ffmpeg all-in / (decode alone + engine alone)": (
            ["all-in ffmpeg"], ["decode alone (PyAV)", "engine alone (i)"], "<= 1.1"),
        "today (ii) / ffmpeg all-in": (["today: cv2 BGR (ii)"], ["all-in ffmpeg"], ">= 1.5"),
        "nvdec all-in / engine alone": (["all-in nvdec"], ["engine alone (i)"], "<= 1.5"),
    }  # fmt: skip
    for label, (top, bottom, target) in targets.items():
        found = ratio(raw, top, bottom, target)
        if found is not None:
            report["ratios"][label] = found
    return report


def table(report: dict[str, Any]) -> str:
    lines = [
        f"runtime {report['runtime']}, {report['task_ms']} ms a task, {CORES} cores, "
        f"{report['frames']} 1080p frames a case, {report['inflight']} in flight; "
        f"VideoSource {'used' if report['video_source'] else 'absent (PyAV directly)'}",
        f"{'case':<26}{'host us/frame':>14}{'(min..max)':>16}{'loop':>7}{'poller':>7}"
        f"{'frames/s':>9}  other threads (us/frame)",
    ]
    for name, entry in report["cases"].items():
        host = entry["host_us"]
        spread = f"{host['min']:.0f}..{host['max']:.0f}"
        threads = ", ".join(
            f"{thread} {us:.0f}" for thread, us in entry["threads_us"].items() if us >= 20
        )
        if entry.get("unpooled", {}).get("max", 0):
            threads += f"; frames unpooled (staged by a copy) up to {entry['unpooled']['max']:.0f}"
        lines.append(
            f"{name:<26}{host['median']:>14.0f}{spread:>16}{entry['loop_us']['median']:>7.0f}"
            f"{entry['poller_us']['median']:>7.0f}{entry['fps']['median']:>9.1f}  {threads}"
        )
    for label, found in report["ratios"].items():
        lines.append(
            f"{label} = {found['median']:.3f} ({found['min']:.3f}..{found['max']:.3f}), "
            f"target {found['target']}"
        )
    return "\n".join(lines)


# -- --streams N --------------------------------------------------------------------------


async def streams(args: argparse.Namespace, clip: Path) -> dict[str, Any]:
    """N streams at 30 frames/s into one engine: each stream's delivered rate and its
    capture-to-boxes latencies (capture: the frame's slot on its 30 Hz clock)."""
    decoder = args.decoder
    if decoder == "auto":
        decoder = "nvdec" if "nvdec" in decoders_present(args) else "ffmpeg"
    source_format = await probe_format(clip, decoder)
    video_source = getattr(aiodla, "VideoSource", None)
    async with engine(args, source_format) as opened:
        results: list[dict[str, Any]] = []
        # Every stream's clock starts together, once every source is open (a decoding
        # process takes a second or so to start: its opening is no stream's lateness).
        all_open = asyncio.Event()
        clock: dict[str, float] = {}
        opening = [args.streams]

        def opened_one() -> None:
            opening[0] -= 1
            if opening[0] == 0:
                if args.gc_freeze:  # what an application may do once it has started
                    gc.freeze()
                clock["begin"] = time.perf_counter() + 0.5
                clock["end"] = clock["begin"] + args.seconds
                probe.begin = collector.begin = slow.begin = clock["begin"]
                all_open.set()

        async def one(number: int) -> None:
            if video_source is not None:
                camera = video_source(
                    str(clip), decoder=decoder, engine=opened, repeat=True,
                    max_frames=args.max_frames, name=f"stream {number}", **isolation(args),
                )  # fmt: skip
                await camera.__aenter__()
                source: Any = aiter(camera)
                reader = None
            else:
                buffers = opened.frame_buffers(8, (SIZE[0] * 3 // 2, SIZE[1]))
                reader = PyAVFrames(clip, buffers, 10**9)
                source = aiter(reader)

            async def boxes(frame: Any) -> None:
                try:
                    await opened.infer(frame)
                finally:
                    if reader is not None:
                        reader.release(frame)

            try:
                opened_one()
                await all_open.wait()
                # --stagger: each camera's clock at its own phase, as independent
                # cameras run, instead of all sixteen frames arriving at once
                phase = number / args.streams / FPS if args.stagger else 0.0
                stream = await paced(
                    lambda: anext(source), boxes, clock["begin"] + phase, clock["end"] + phase
                )
            finally:
                if reader is None:
                    await camera.__aexit__(None, None, None)
                else:
                    reader.close()
            results.append({**stream, "fps": len(stream["latencies"]) / args.seconds})

        # Which side runs short: the cores (busy all the time), the event loop (late
        # to wake), or neither (the decoders, or the way frames reach the loop).
        lags: list[float] = []
        stop = asyncio.Event()
        tick = asyncio.ensure_future(ticker(lags, stop))

        window = Window(opened.runtime)

        async def busy() -> list[float]:
            await all_open.wait()
            return await cores_busy(opened, clock["begin"], clock["end"])

        with LockProbe() as probe, CollectorPauses() as collector, SlowCallbacks() as slow:
            busy_fraction, *_ = await asyncio.gather(busy(), *(one(k) for k in range(args.streams)))
        stop.set()
        await tick
        delivered = sum(len(r["latencies"]) for r in results)
        cpu = window.per_frame(max(delivered, 1))
    rates = [r["fps"] for r in results]
    p99 = [1e3 * float(np.percentile(r["latencies"], 99)) for r in results if r["latencies"]]
    return {
        "decoder": decoder,
        "isolation": args.isolation,
        "streams": args.streams,
        "task_ms": args.task_ms,
        "capacity_per_s": CORES / (args.task_ms / 1e3),
        "fps": {"median": statistics.median(rates), "min": min(rates), "max": max(rates)},
        "p99_ms": summarize(p99) if p99 else None,
        "frame_interval_ms": 1e3 / FPS,
        "dropped": sum(r["late"] + r["full"] for r in results),
        # frames dropped because the stream's loop woke a whole interval late, and
        # because PIPELINE frames of the stream were still in flight
        "dropped_late": sum(r["late"] for r in results),
        "dropped_pipeline_full": sum(r["full"] for r in results),
        # each core's busy time from the first slot to the last / that window's length
        "core_busy_fraction": busy_fraction,
        "streams_per_core": args.streams_per_core,
        "max_frames": args.max_frames,
        "loop_lag_p99_ms": 1e3 * float(np.percentile(lags, 99)) if lags else None,
        # how long a stream's take() waited for its source's next frame, p99 per stream
        # (median and max over the streams): a source behind makes its stream late
        "take_wait_p99_ms": summarize(
            [1e3 * float(np.percentile(r["waits"], 99)) for r in results if r["waits"]]
        ),
        # the whole run's host CPU (sources opening included) per frame delivered
        "host_us_per_frame": cpu["host_us"],
        # over the whole run: the sources' opening, the streams, their closing (host CPU
        # a frame times frames a second of that run)
        "host_cores": cpu["host_us"] * cpu["fps"] / 1e6,
        # Where long stalls come from (see _stalls): how late the streams woke for each
        # slot, how late a thread of the bench's own woke from 1 ms sleeps (a stall it
        # shares is the whole process's), the garbage collector's pauses and the loop's
        # callbacks of 10 ms or more.
        "stagger": args.stagger,
        "gc_freeze": args.gc_freeze,
        "switch_interval_ms": 1e3 * sys.getswitchinterval(),
        "streams_woke": tail([w for r in results for w in r["woke"]], 1 / FPS),
        "lock_probe_late": tail(probe.late, 1 / FPS),
        "collector": collector.report(1 / FPS),
        "slow_callbacks": slow.report(),
        "targets": "each stream >= 29.5 frames/s; p99 <= 3 frame intervals (100 ms)",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", nargs="?", help="JSON path")
    parser.add_argument("--gpu", action="store_true", help="the CUDA runtime and the stand-in")
    parser.add_argument("--standin", default=os.environ.get("AIODLA_STANDIN_LIB"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--frames", type=int, default=120, help="1080p frames a case")
    parser.add_argument("--inflight", type=int, default=4, help="requests in flight at most")
    parser.add_argument("--task-ms", type=float, default=3.8, help="the detector's task time")
    parser.add_argument("--streams", type=int, default=0, help="N 1080p30 streams instead")
    parser.add_argument("--seconds", type=float, default=10.0, help="--streams: how long")
    parser.add_argument(
        "--streams-per-core", type=int, default=2, help="the engine's slots on each core"
    )
    parser.add_argument(
        "--max-frames", type=int, default=2, help="--streams: decoded frames a source keeps"
    )
    parser.add_argument(
        "--decoder",
        default="auto",
        choices=("auto", "nvdec", "ffmpeg", "gstreamer"),
        help="--streams: the streams' decoder (auto: nvdec where present, else ffmpeg)",
    )
    parser.add_argument(
        "--isolation",
        default="thread",
        choices=("thread", "process"),
        help="where each source decodes: its reader thread, or a process of its own",
    )
    parser.add_argument(
        "--stagger", action="store_true", help="--streams: each camera's clock at its own phase"
    )
    parser.add_argument(
        "--gc-freeze", action="store_true", help="--streams: gc.freeze() once sources are open"
    )
    parser.add_argument(
        "--switch-interval-ms", type=float, help="--streams: sys.setswitchinterval, ms"
    )
    args = parser.parse_args(argv)
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    args.runtime = "cuda" if args.gpu else "emulated"
    if args.gpu:
        load_standin(args.standin)
    with tempfile.TemporaryDirectory(prefix="aiodla-bench-video-") as folder:
        clip = make_clip(Path(folder) / "clip.mp4", 4 * FPS)
        if args.streams:
            # What the runtime takes for the detector's task, back to back on both cores
            # with no engine: the stand-in may take longer than the task time stated.
            floor = device_floor(
                detector(args.task_ms / 1e3), args.runtime, 2.0, args.task_ms / 1e3
            )
            report = asyncio.run(streams(args, clip))
            report["device_floor_per_s"] = floor
            report["measured_task_ms"] = 1e3 * CORES / floor
            report["needed_per_s"] = args.streams * FPS
            output = report_path(args.output, "video-streams.json")
            output.write_text(json.dumps(report, indent=2) + "\n")
            print(json.dumps(report, indent=2))
            return 0
        report = run(args, clip)
    output = report_path(args.output, f"video-{'gpu' if args.gpu else 'emulated'}.json")
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
