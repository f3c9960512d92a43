"""Instructions per request of the host's threads, counted by callgrind: the figure a
shared machine does not blur (its CPU times vary by tens of percent with the load).

Runs ``host_cost_once.py`` (``--workload engine``, the default: bench_engine's host-cost
workload, the emulated runtime, two zero-latency cores, 64 requests in flight; ``boxes``:
bench_data_path's camera to boxes, a 1080p frame buffer letterboxed on the device into
the YOLOv5s-shaped model and ``Detect``, 16 in flight; ``small``: the same engine set-up
with the small model, the reference a boxes figure is divided by to tell a change to the
camera path from one to every request's) under callgrind, in segments of ``--size``
requests after a warm-up; callgrind dumps its counters at each segment's end, so every
segment is a measurement and start-up cancels out. Each tree is run ``--runs`` times,
the trees interleaved (A B, B A, ...), and the figures are the medians over all
segments of all runs, with their spread.

Thread 1 is the event loop's: its figure is the one to compare between trees. The
others together are mostly the poller; callgrind writes them only at exit, so theirs is
per request over a whole run (warm-up, segments and close).

What kept repeats of one tree apart (by up to 20 % in the earlier N / N + DELTA method)
and what holds them together now:

- start-up: its cost, a few times a segment's, varies with the run and came into the
  difference of two processes; segments of one process leave it out;
- the hash seed: ``PYTHONHASHSEED=0`` (``--hash-seed``), so set and dict layouts of
  strings are the same in every run;
- the collector: a collection is triggered by allocations of every thread, and
  scanned the warm-up's heap; ``--gc frozen`` (the default) freezes the warm-up's
  objects, ``--gc off`` runs none during the segments;
- the emulated device's work: the emulator makes a task's copies and op when some
  thread looks at its event, the poller or (between batches) the loop, whichever
  comes first; it moved tens of thousands of instructions per request between the
  threads. ``--device excluded`` (the default) leaves it out of the counts, as
  ``bench_engine``'s host cost leaves out its CPU time: on a Jetson the DLA and the
  copy engines do that work (on the boxes path the device's letterbox and ``Detect``
  too). ``--device skipped`` does not run it at all, for boxes runs a few times
  shorter; its figures compare between trees only (see
  ``host_cost_once.skip_device_work``);
- callgrind's thread scheduling: ``--fair-sched=yes`` hands the CPU in turn to the
  runnable threads, so the poller and the loop interleave alike from run to run.

Usage::

    python benchmarks/count_instructions.py [--rev REV ...] [--tree PATH ...] [--runs 3]
        [--workload engine|boxes|small] [--size 500]
        [--segments 5] [--warmup 300] [--gc frozen] [--json PATH] [--keep DIR]

For example, the restructure against the commit before it::

    nice -n 10 python benchmarks/count_instructions.py --rev 2d2fa9a --rev main

and camera to boxes against the same base, with the small model beside it (a boxes
request costs a few times a small one under callgrind: shorter segments)::

    nice -n 10 python benchmarks/count_instructions.py --rev 8afbbf9 --rev main \\
        --workload boxes --device skipped --warmup 100 --size 200 --segments 3
    nice -n 10 python benchmarks/count_instructions.py --rev 8afbbf9 --rev main \\
        --workload small --warmup 100 --size 200 --segments 3

``--rev``: a git revision whose ``aiodla`` is measured (exported with ``git archive``);
``--tree``: a checkout's. Give two or more to compare (default: this checkout). ``--keep``: leave callgrind's files there (for
``callgrind_annotate``, per function).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _reports import report_path

HERE = Path(__file__).resolve().parent
_SUMMARY = re.compile(r"^summary:\s+(\d+)", re.MULTILINE)
_PART = re.compile(r"\.(\d+)-(\d+)$")


def callgrind(prefix: Path) -> list[str]:
    """valgrind's command line for a run counted in segments: a dump at each
    ``os.getppid()``, threads apart, and the emulated device's work (run inside
    ``sys.call_tracing`` by ``host_cost_once.set_apart``) left out."""
    return [
        "valgrind",
        "--tool=callgrind",
        "--separate-threads=yes",
        "--fair-sched=yes",
        "--dump-before=getppid",
        "--toggle-collect=sys_call_tracing",
        "--collect-atstart=yes",  # (after --toggle-collect, which sets it to no)
        f"--callgrind-out-file={prefix}",
    ]


def loop_parts(scratch: Path) -> dict[int, int]:
    """The event loop thread's instructions in each dump of a run written under
    ``scratch`` (part 1: start-up and warm-up; then one part per segment)."""
    parts: dict[int, int] = {}
    for path in scratch.glob("cg.*-01"):  # thread 01: the event loop's
        name = _PART.search(path.name)
        found = _SUMMARY.search(path.read_text(errors="replace"))
        if name and found:
            parts[int(name[1])] = int(found[1])
    return parts


def count(tree: Path, scratch: Path, args: argparse.Namespace) -> tuple[list[int], int]:
    """Instructions executed by the loop's thread in each segment of one run, and by
    the other threads in the whole run (warm-up and close included)."""
    prefix = scratch / "cg"
    command = [
        *callgrind(prefix),
        sys.executable,  # the venv's own: its site-packages come with it
        str(HERE / "host_cost_once.py"),
        f"--workload={args.workload}",
        f"--warmup={args.warmup}",
        f"--size={args.size}",
        f"--segments={args.segments}",
        f"--gc={args.gc}",
        f"--device={args.device}",
    ]
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": str(args.hash_seed)}
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"callgrind run of {tree} failed:\n{done.stderr[-3000:]}")
    parts = loop_parts(scratch)
    # The other threads' counts come at exit: a dump before a function writes only
    # the thread that called it.
    others = 0
    for path in scratch.glob("cg-*"):
        found = _SUMMARY.search(path.read_text(errors="replace"))
        if found and not path.name.endswith("-01"):
            others += int(found[1])
    # Part 1 is start-up and warm-up; then one part per segment.
    return [parts[part] for part in sorted(parts) if part > 1], others


def describe(revision: str) -> str:
    """``revision`` and the commit it names, e.g. ``main (e2d79f1)``."""
    commit = subprocess.run(
        ["git", "-C", str(HERE.parent), "rev-parse", "--short", revision],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return revision if commit.startswith(revision) else f"{revision} ({commit})"


def export(revision: str, into: Path) -> Path:
    """The package as it was at ``revision``, unpacked in a folder of ``into``."""
    tree = into / revision.replace("/", "_")
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(HERE.parent), "archive", revision, "aiodla"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def summarize(values: list[float]) -> dict[str, Any]:
    median = statistics.median(values)
    return {
        "median": median,
        "min": min(values),
        "max": max(values),
        "spread_percent": 100 * (max(values) - min(values)) / median,
        "values": values,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", action="append", default=[], help="(repeatable)")
    parser.add_argument("--tree", type=Path, action="append", default=[], help="(repeatable)")
    parser.add_argument("--runs", type=int, default=3, help="processes per tree")
    parser.add_argument(
        "--workload",
        choices=("engine", "boxes", "small"),
        default="engine",
        help="what each request does (see host_cost_once.py)",
    )
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--size", type=int, default=500, help="requests per segment")
    parser.add_argument("--segments", type=int, default=5, help="segments per run")
    parser.add_argument("--gc", choices=("on", "frozen", "off"), default="frozen")
    parser.add_argument("--hash-seed", type=int, default=0)
    parser.add_argument(
        "--device",
        choices=("excluded", "counted", "skipped"),
        default="excluded",
        help="the emulated device's work in the counts or not (see host_cost_once.py)",
    )
    parser.add_argument("--json", help="report path (default: a temporary file)")
    parser.add_argument("--keep", type=Path, help="keep callgrind's files in this folder")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("count_instructions.py needs valgrind (apt-get install valgrind)")
    exports = tempfile.TemporaryDirectory()
    trees = [export(rev, Path(exports.name)) for rev in args.rev]
    trees += [tree.resolve() for tree in args.tree]
    labels = [describe(rev) for rev in args.rev] + [str(tree) for tree in args.tree]
    if not trees:
        trees, labels = [HERE.parent], [str(HERE.parent)]
    segments: dict[int, list[int]] = {index: [] for index in range(len(trees))}
    others: dict[int, list[float]] = {index: [] for index in range(len(trees))}
    requests = args.warmup + args.segments * args.size
    for run in range(args.runs):
        order = range(len(trees)) if run % 2 == 0 else reversed(range(len(trees)))
        for index in order:
            with tempfile.TemporaryDirectory() as scratch:
                found, rest = count(trees[index], Path(scratch), args)
                if args.keep:
                    kept = args.keep / f"tree{index}-run{run}"
                    shutil.copytree(scratch, kept, dirs_exist_ok=True)
            segments[index].extend(found)
            others[index].append(rest / requests)
            loop = [part / args.size for part in found]
            print(f"tree {index} run {run}: loop " + " ".join(f"{v:,.0f}" for v in loop))
    results = []
    for index, tree in enumerate(trees):
        loop = [part / args.size for part in segments[index]]
        results.append(
            {
                "tree": str(tree),
                "revision": labels[index],
                "loop_instructions_per_request": summarize(loop),
                "other_threads_instructions_per_request": summarize(others[index]),
                "loop_instructions_by_segment": segments[index],
            }
        )
    for index, result in enumerate(results):
        loop, others = (
            result["loop_instructions_per_request"],
            result["other_threads_instructions_per_request"],
        )
        print(
            f"tree {index} {result['revision']}\n"
            f"  event loop:    {loop['median']:10,.0f} instructions per request "
            f"({loop['min']:,.0f}..{loop['max']:,.0f}, spread {loop['spread_percent']:.1f} %)\n"
            f"  other threads: {others['median']:10,.0f} instructions per request "
            f"({others['min']:,.0f}..{others['max']:,.0f}; poller, whole runs)"
        )
    for index in range(1, len(results)):
        ratio = (
            results[index]["loop_instructions_per_request"]["median"]
            / results[0]["loop_instructions_per_request"]["median"]
        )
        print(f"event loop, tree {index} / tree 0: {ratio:.3f}")
    report = {
        "parameters": {
            key: value for key, value in vars(args).items() if key not in ("tree", "keep", "json")
        },
        "method": (
            "callgrind --fair-sched=yes --dump-before=getppid (one segment a dump) "
            "--toggle-collect=sys_call_tracing (the emulated device's work, with "
            "--device excluded), PYTHONHASHSEED fixed"
        ),
        "trees": results,
    }
    path = report_path(args.json, "instructions.json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
