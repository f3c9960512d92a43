"""Where each thread's CPU goes, from ``py-spy record --threads --format raw`` output.

py-spy samples every thread's stack; its raw output has one line per distinct stack,
``thread (0x...);outer (file:line);...;inner (file:line) COUNT``. This prints, for the
threads holding the most samples, the functions with the most samples on top of the
stack (self) and anywhere in it (inclusive), native frames included when py-spy ran
with ``--native``. A thread is named by the first marker function its stacks hold
(the event loop's ``_run_once``, the poller's ``_sweep``), else by its id::

    python tools/spy_threads.py spy-boxes.txt [--top 25] [--requests N]
        [--under Engine.infer] [--idle epoll_wait] [--thread MainThread]

``--under NAME`` keeps the stacks holding function NAME (``on_completions`` also names
``Flow.on_completions``; give the functions of the load, since a set-up that runs as a
coroutine is under the loop's ``_run_once`` too); ``--idle NAME`` drops the stacks
whose innermost frame is NAME (a thread waiting in a call that py-spy counts as
running); ``--thread TEXT`` keeps the threads whose py-spy name holds TEXT.

``--requests N`` adds each function's share per request, in samples, for comparing
two runs of different lengths.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

MARKERS = {"_run_once": "event loop", "_sweep": "poller", "_worker": "worker"}
LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")


def frame_name(frame: str) -> str:
    """``function (file:line)`` without the line: one entry per function."""
    return re.sub(r":\d+\)$", ")", frame.strip())


def named(frame: str, names: list[str]) -> bool:
    """Whether the frame's function is one of ``names`` (``_run_once`` names
    ``BaseEventLoop._run_once`` too)."""
    function = frame.split(" (", 1)[0]
    return any(function == name or function.endswith("." + name) for name in names)


def read(path: str) -> dict[str, list[tuple[list[str], int]]]:
    threads: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    with open(path) as lines:
        for line in lines:
            match = LINE.match(line.rstrip("\n"))
            if match is None:
                continue
            frames = match["stack"].split(";")
            threads[frames[0]].append(([frame_name(f) for f in frames[1:]], int(match["count"])))
    return threads


def label(thread: str, stacks: list[tuple[list[str], int]]) -> str:
    for stack, _ in stacks:
        for frame in stack:
            for marker, name in MARKERS.items():
                if named(frame, [marker]):
                    return f"{name} {thread}"
    return thread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--threads", type=int, default=3)
    parser.add_argument("--requests", type=int, default=0)
    parser.add_argument("--under", action="append", default=[])
    parser.add_argument("--idle", action="append", default=[])
    parser.add_argument("--thread", default="", help="only threads whose name holds this")
    args = parser.parse_args(argv)
    threads: dict[str, list[tuple[list[str], int]]] = {}
    for thread, stacks in read(args.raw).items():
        if args.thread not in thread:
            continue
        kept = [
            (stack, count)
            for stack, count in stacks
            if (not args.under or any(named(f, args.under) for f in stack))
            and not (stack and named(stack[-1], args.idle))
        ]
        if kept:  # (a thread with no stack left is not shown)
            threads[thread] = kept
    total = max(1, sum(c for stacks in threads.values() for _, c in stacks))
    ranked = sorted(threads.items(), key=lambda item: -sum(c for _, c in item[1]))
    for thread, stacks in ranked[: args.threads]:
        samples = sum(c for _, c in stacks)
        print(f"\n== {label(thread, stacks)}: {samples} samples ({100 * samples / total:.1f} %)")
        own: collections.Counter[str] = collections.Counter()
        anywhere: collections.Counter[str] = collections.Counter()
        for stack, count in stacks:
            if stack:
                own[stack[-1]] += count
            for frame in set(stack):
                anywhere[frame] += count
        for title, counter in (("self", own), ("inclusive", anywhere)):
            print(f"-- {title}")
            for frame, count in counter.most_common(args.top):
                per = f" {count / args.requests:8.3f}/req" if args.requests else ""
                print(f"{count:7d} {100 * count / samples:5.1f} %{per}  {frame[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
