"""Two per-request pieces of camera to boxes on the event loop, at two revisions: finding
a 1080p frame in the engine frame buffer that holds it (``FrameBuffers.find``) and
reading a request's detections out of the detector's output buffer (``read_output``).

Each round times both, best of ``--tries`` batches of ``--calls`` calls, once with the
base revision's ``aiodla`` and once with the new one's, each in a fresh process, which
goes first alternating; medians of the rounds (min..max) and new / base. The frame is a
whole buffer (contiguous) and a crop of it (strided), on the emulated runtime's pinned
memory; the output holds 40 detections of 300.

Usage::

    python benchmarks/bench_loop_pieces.py --base 800794c [--new HEAD] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench_data_path import summarize
from compare_revisions import export, run_in

# Run in the child: ``aiodla`` comes from the PYTHONPATH it was given.
CHILD = """
import json, timeit
import numpy as np
from aiodla.runtime import EmulatedRuntime
from aiodla._frame_buffers import FrameBuffers
from aiodla.runtime._detect_output import output_layout, read_output
calls, tries = {calls!r}, {tries!r}
frames = FrameBuffers(EmulatedRuntime(), mapped=False)
(frame,) = frames.create(1, (1080, 1920, 3), np.uint8)
crop = frame[40:1040, 100:1800]
layout = output_layout(300)
raw = np.zeros(layout.size, np.uint8)
raw[:4].view(np.int32)[0] = 40
def best(call):
    return min(timeit.repeat(call, number=calls, repeat=tries)) / calls * 1e6
import aiodla
print(json.dumps({{
    "aiodla": aiodla.__file__,
    "find a whole frame": best(lambda: frames.find(frame)),
    "find a crop": best(lambda: frames.find(crop)),
    "read 40 detections": best(lambda: read_output(raw, layout)),
}}))
"""


def measure(path: Path, calls: int, tries: int) -> dict[str, float]:
    return run_in(path, CHILD.format(calls=calls, tries=tries))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--new", default="HEAD")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {"base": [], "new": []}
    with tempfile.TemporaryDirectory() as base_dir, tempfile.TemporaryDirectory() as new_dir:
        trees = {"base": export(args.base, Path(base_dir)), "new": export(args.new, Path(new_dir))}
        for round_ in range(args.rounds):
            order = ("base", "new") if round_ % 2 == 0 else ("new", "base")
            for which in order:
                runs[which].append(measure(trees[which], args.calls, args.tries))
    report: dict[str, object] = {"base": args.base, "new": args.new, "rounds": args.rounds}
    print(f"{'piece':22s} {'base us':>22s} {'new us':>22s} {'new / base':>10s}")
    for piece in runs["new"][0]:
        base = summarize([r[piece] for r in runs["base"]])
        new = summarize([r[piece] for r in runs["new"]])
        report[piece] = {"base_us": base, "new_us": new, "ratio": new["median"] / base["median"]}
        print(
            f"{piece:22s} {base['median']:6.2f} ({base['min']:.2f}..{base['max']:.2f})"
            f" {new['median']:8.2f} ({new['min']:.2f}..{new['max']:.2f})"
            f" {new['median'] / base['median']:10.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
