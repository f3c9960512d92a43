"""Where the ``nvdec`` decoder's thread spends its CPU per 1080p frame, and whether
PyNvVideoCodec lets other threads run while it decodes.

1. **Phases**, one thread, no engine: PyNvVideoCodec's demuxing (``next(demuxer)``),
   its ``Decode`` (NVDEC's parse, decode and map), and what aiodla's ``nvdec`` decoder
   adds to each picture (``_copied``, as the decoder calls it: reading the planes'
   views, the two device-to-device copies into a buffer of the source's pool, and the
   synchronize before the picture leaves). Thread CPU (``time.thread_time``) per frame, ``--repeats``
   passes over the clip, median and min..max.
2. **The GIL**: 0, 1, 4 and 16 threads demux and decode the clip flat out while a
   thread of the benchmark's sleeps 1 ms at a time: how late it wakes (p50, p99, max) says
   how long a decoding thread keeps the interpreter from the others (an event loop beside
   sixteen cameras is such a thread); with each, ``Decode``'s wall time and CPU a frame.
3. **PyNvVideoCodec's ThreadedDecoder** (``--threaded``), the same GIL test with each
   thread taking pictures from a ``ThreadedDecoder`` (which demuxes and decodes on a
   thread of its own, in C++) and copying them as aiodla does: the sleeper's lateness,
   the Python threads' CPU a frame and the whole process's, how often a fetch found
   nothing ready; and what it says when given an ``rtsp://`` address nobody serves
   (does it open network streams at all, or only files?).

The clip is ``bench_video``'s (1920x1080 H.264 at 30 frames/s, made with PyAV). Needs a
GPU with NVDEC and PyNvVideoCodec::

    python benchmarks/bench_nvdec_phases.py [--repeats 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import PyNvVideoCodec as nvc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stalls import LockProbe, tail
from bench_video import make_clip

from aiodla._video_device_buffers import DevicePool
from aiodla._video_nvdec import _copied

PHASES = ("demux", "decode", "aiodla")
THREADS = (0, 1, 4, 16)
TICK = 1e-3


def opened(clip: str) -> tuple[Any, Any]:
    demuxer = nvc.CreateDemuxer(clip)
    decoder = nvc.CreateDecoder(
        gpuid=0, codec=demuxer.GetNvCodecId(), cudacontext=0, cudastream=0, usedevicememory=True
    )
    return demuxer, decoder


def phases(clip: str) -> dict[str, float]:
    """One pass: each phase's thread CPU per frame, in microseconds."""
    spent = dict.fromkeys(PHASES, 0.0)
    demuxer, decoder = opened(clip)
    pool: DevicePool | None = None
    frames = 0
    packets = iter(demuxer)
    while True:
        began = time.thread_time()
        packet = next(packets, None)
        if packet is None:
            break
        demuxed = time.thread_time()
        pictures = decoder.Decode(packet)
        decoded = time.thread_time()
        spent["demux"] += demuxed - began
        spent["decode"] += decoded - demuxed
        for picture in pictures:
            began = time.thread_time()
            width, height = decoder.GetWidth(), decoder.GetHeight()
            if pool is None:
                pool = DevicePool(width * height * 3 // 2)
            _copied(picture, pool, width, height)  # (dropped at once: back to the pool)
            spent["aiodla"] += time.thread_time() - began
            frames += 1
    if pool is not None:
        pool.close()
    return {name: value / max(frames, 1) * 1e6 for name, value in spent.items()} | {
        "frames": frames
    }


def decode_flat_out(
    clip: str, stop: threading.Event, totals: list[tuple[int, float, float]]
) -> None:
    frames, wall, cpu = 0, 0.0, 0.0
    while not stop.is_set():
        demuxer, decoder = opened(clip)
        for packet in demuxer:
            if stop.is_set():
                break
            began_wall, began_cpu = time.perf_counter(), time.thread_time()
            frames += len(decoder.Decode(packet))
            wall += time.perf_counter() - began_wall
            cpu += time.thread_time() - began_cpu
    totals.append((frames, wall, cpu))


def take_threaded(
    clip: str,
    frames_in_clip: int,
    stop: threading.Event,
    totals: list[tuple[int, float, float]],
    empties: list[int],
) -> None:
    """Pictures from a ThreadedDecoder, each copied into a pool buffer as the ``nvdec``
    decoder copies them; a new ThreadedDecoder when the clip's pictures are all taken
    (what it returns at the end is not what this measures). An empty batch (nothing
    ready yet) is counted in ``empties`` and retried after 0.5 ms."""
    frames, wall, cpu, empty = 0, 0.0, 0.0, 0
    pool: DevicePool | None = None
    width = height = 0
    while not stop.is_set():
        decoder = nvc.ThreadedDecoder(clip, buffer_size=4, use_device_memory=True)
        taken = 0
        while taken < frames_in_clip and not stop.is_set():
            began_wall, began_cpu = time.perf_counter(), time.thread_time()
            batch = decoder.get_batch_frames(1)
            for picture in batch:
                if pool is None:  # the clip's size, once (6accc63 read it every picture)
                    meta = decoder.get_stream_metadata()
                    width, height = int(meta.width), int(meta.height)
                    pool = DevicePool(width * height * 3 // 2)
                _copied(picture, pool, width, height)
            wall += time.perf_counter() - began_wall
            cpu += time.thread_time() - began_cpu
            if not batch:
                empty += 1
                time.sleep(5e-4)
            taken += len(batch)
            frames += len(batch)
        decoder.end()
    if pool is not None:
        pool.close()
    totals.append((frames, wall, cpu))
    empties.append(empty)


def rtsp_answer() -> dict[str, Any]:
    """What ThreadedDecoder does with an rtsp:// address where nothing listens."""
    began = time.perf_counter()
    answer = ["no answer within 15 s"]

    def ask() -> None:
        try:
            decoder = nvc.ThreadedDecoder("rtsp://127.0.0.1:9/none", buffer_size=4)
            batch = decoder.get_batch_frames(1)
            answer[0] = f"opened; first batch {len(batch)} pictures"
        except Exception as exc:
            answer[0] = f"{type(exc).__name__}: {exc}"

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(15.0)
    return {"answer": answer[0][:400], "seconds": time.perf_counter() - began}


def gil(clip: str, threads: int, seconds: float, threaded: int = 0) -> dict[str, float]:
    """A thread's 1 ms sleeps (``_stalls.LockProbe``), how late they end, beside
    ``threads`` decoders (ThreadedDecoders when ``threaded`` is the clip's length)."""
    stop = threading.Event()
    totals: list[tuple[int, float, float]] = []
    empties: list[int] = []
    target, args = (
        (take_threaded, (clip, threaded, stop, totals, empties))
        if threaded
        else (decode_flat_out, (clip, stop, totals))
    )
    # Daemons, joined for a while only: a fetch that never returns must not hang the run.
    workers = [threading.Thread(target=target, args=args, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    with LockProbe(TICK) as probe:
        time.sleep(1.0)  # every decoder opened and decoding
        process_began = time.process_time()
        probe.begin = time.perf_counter()
        time.sleep(seconds)
        process_cpu = time.process_time() - process_began
    stop.set()
    for worker in workers:
        worker.join(10.0)
    late = tail(probe.late, 1.0)
    row = {
        "late_p50_ms": late["p50_ms"],
        "late_p99_ms": late["p99_ms"],
        "late_max_ms": late["max_ms"],
    }
    frames = sum(t[0] for t in totals)
    if frames:
        row["decode_wall_us"] = sum(t[1] for t in totals) / frames * 1e6
        row["decode_cpu_us"] = sum(t[2] for t in totals) / frames * 1e6
        row["frames_per_s"] = frames / (seconds + 1.0)
        # The window's CPU of every thread (the decoders' own C++ threads included)
        # over the window's share of the frames.
        row["process_cpu_us"] = process_cpu / (frames * seconds / (seconds + 1.0)) * 1e6
    if threaded:
        row["empty_batches"] = sum(empties)
        row["stuck_threads"] = sum(worker.is_alive() for worker in workers)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frames", type=int, default=300, help="the clip's length")
    parser.add_argument("--seconds", type=float, default=3.0, help="each GIL case")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument(
        "--threaded", action="store_true", help="also the GIL test with ThreadedDecoder"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        clip = str(make_clip(Path(folder) / "clip.mp4", args.frames))
        passes = [phases(clip) for _ in range(args.repeats)]
        report: dict[str, Any] = {"frames": args.frames, "phases_us": {}}
        for name in PHASES:
            values = [p[name] for p in passes]
            report["phases_us"][name] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
            print(f"{name:12} {statistics.median(values):8.1f} us a frame "
                  f"({min(values):.1f}..{max(values):.1f})")  # fmt: skip
        report["gil"] = {}
        for threads in THREADS:
            row = gil(clip, threads, args.seconds)
            report["gil"][str(threads)] = row
            print(
                f"{threads:2} decoding threads: "
                + ", ".join(f"{k} {v:.2f}" for k, v in row.items())
            )
        if args.threaded:
            report["threaded_gil"] = {}
            for threads in THREADS[1:]:
                try:
                    row = gil(clip, threads, args.seconds, threaded=args.frames)
                except Exception as exc:  # an API this version lacks: say so, go on
                    row = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                report["threaded_gil"][str(threads)] = row
                print(f"{threads:2} ThreadedDecoders: {row}", flush=True)
            report["threaded_rtsp"] = rtsp_answer()
            print("ThreadedDecoder given rtsp://:", report["threaded_rtsp"], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
