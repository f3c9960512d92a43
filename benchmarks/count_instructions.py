"""Instructions per request of the host's threads, counted by callgrind: the figure a
shared machine does not blur (its CPU times vary by tens of percent with the load).

Runs ``host_cost_once.py`` (bench_engine's host-cost measurement: the emulated runtime,
two zero-latency cores, 64 requests in flight) under callgrind with N and N + DELTA
requests, and divides each thread's difference by DELTA, so start-up and the first N
requests cancel out. Thread 1 is the event loop's; the others together are mostly the
poller, which in the emulated runtime also does the device's work (copies and the op)
and polls as often as callgrind's slowed clock lets it: the loop's figure is the one to
compare between trees.

Usage::

    python benchmarks/count_instructions.py [--requests 100] [--delta 1000]
        [--tree PATH] [--json PATH]

``--tree``: the checkout whose ``aiodla`` is measured (default: this one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _reports import report_path

HERE = Path(__file__).resolve().parent
_SUMMARY = re.compile(r"^summary:\s+(\d+)", re.MULTILINE)


def count(requests: int, tree: Path, scratch: Path) -> dict[int, int]:
    """Instructions executed by each thread (callgrind's numbering) in one run."""
    prefix = scratch / f"cg.{requests}"
    done = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--separate-threads=yes",
            f"--callgrind-out-file={prefix}",
            sys.executable,  # the venv's own: its site-packages come with it
            str(HERE / "host_cost_once.py"),
            str(requests),
        ],
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd=tree,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(f"callgrind run of {requests} requests failed:\n{done.stderr[-3000:]}")
    counts = {}
    for path in scratch.glob(f"cg.{requests}-*"):
        found = _SUMMARY.search(path.read_text(errors="replace"))
        if found:
            counts[int(path.name.rsplit("-", 1)[1])] = int(found[1])
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--delta", type=int, default=1000)
    parser.add_argument("--tree", type=Path, default=HERE.parent)
    parser.add_argument("--json", help="report path (default: a temporary file)")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("count_instructions.py needs valgrind (apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as scratch:
        low = count(args.requests, args.tree, Path(scratch))
        high = count(args.requests + args.delta, args.tree, Path(scratch))
    loop = (high[1] - low[1]) / args.delta
    others = (sum(high.values()) - high[1] - sum(low.values()) + low[1]) / args.delta
    report = {
        "tree": str(args.tree.resolve()),
        "parameters": {"requests": args.requests, "delta": args.delta},
        "loop_instructions_per_request": loop,
        "other_threads_instructions_per_request": others,
        "by_thread": {"low": low, "high": high},
    }
    print(f"event loop:    {loop:12,.0f} instructions per request")
    print(f"other threads: {others:12,.0f} instructions per request (poller and device)")
    path = report_path(args.json, "instructions.json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
