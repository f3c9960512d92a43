"""Where the ``nvdec`` decoder's thread spends its CPU per 1080p frame, and whether
PyNvVideoCodec lets other threads run while it decodes.

1. **Phases**, one thread, no engine: PyNvVideoCodec's demuxing (``next(demuxer)``),
   its ``Decode`` (NVDEC's parse, decode and map), and what aiodla's ``nvdec`` decoder
   adds to each picture (``_copied``, as the decoder calls it: reading the planes'
   views, the two device-to-device copies into a buffer of the source's pool, and the
   synchronize before the picture leaves). Thread CPU (``time.thread_time``) per frame, ``--repeats``
   passes over the clip, median and min..max.
2. **The GIL**: 0, 1, 4 and 16 threads demux and decode the clip flat out while the
   main thread sleeps 1 ms at a time: how late it wakes (p50, p99, max) says how long
   a decoding thread keeps the interpreter from the others (an event loop beside
   sixteen cameras is such a thread); with each, ``Decode``'s wall time and CPU a frame.

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

import numpy as np
import PyNvVideoCodec as nvc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_video import make_clip

from aiodla._video_nvdec import _copied, _DevicePool

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
    pool: _DevicePool | None = None
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
                pool = _DevicePool(width * height * 3 // 2)
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


def gil(clip: str, threads: int, seconds: float) -> dict[str, float]:
    """The main thread's 1 ms sleeps, how late they end, beside ``threads`` decoders."""
    stop = threading.Event()
    totals: list[tuple[int, float, float]] = []
    workers = [
        threading.Thread(target=decode_flat_out, args=(clip, stop, totals)) for _ in range(threads)
    ]
    for worker in workers:
        worker.start()
    time.sleep(1.0)  # every decoder opened and decoding
    late: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        due = time.perf_counter() + TICK
        time.sleep(TICK)
        late.append((time.perf_counter() - due) * 1e3)
    stop.set()
    for worker in workers:
        worker.join()
    row = {
        "late_p50_ms": float(np.percentile(late, 50)),
        "late_p99_ms": float(np.percentile(late, 99)),
        "late_max_ms": max(late),
    }
    frames = sum(t[0] for t in totals)
    if frames:
        row["decode_wall_us"] = sum(t[1] for t in totals) / frames * 1e6
        row["decode_cpu_us"] = sum(t[2] for t in totals) / frames * 1e6
        row["frames_per_s"] = frames / (seconds + 1.0)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--frames", type=int, default=300, help="the clip's length")
    parser.add_argument("--seconds", type=float, default=3.0, help="each GIL case")
    parser.add_argument("--json", help="write the figures here")
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
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
