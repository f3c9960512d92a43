"""Would a Python submitter thread take the runtime's calls off the event loop's time?

Issue 18 asks whether moving a request's enqueue calls (two graph launches and
``cudlaSubmitTask``, about 36 us a request on the H200 stand-in) to a submitter thread
pays. This is a model of that question with no GPU: the loop's own Python per request
is a busy wait of ``--python-us``; each of the three calls is a copy of as many bytes
as takes ``--call-us``, made either keeping the GIL (a memoryview copy, as CudaRuntime's
held calls do) or releasing it (``np.copyto`` of that size, as ``cuda.bindings`` does).

- ``inline``: the loop makes the three calls itself, keeping the GIL (today's engine);
- ``thread``: the loop hands each request to a submitter thread through a queue and
  goes on (at most ``--depth`` outstanding); the submitter makes the calls releasing
  the GIL, so that in principle they overlap the loop's Python;
- ``thread, switch interval`` : the same with ``sys.setswitchinterval`` at
  ``--switch-us`` (a process-wide setting a library cannot make for its users; shown
  to separate the GIL's scheduling from the hand-off itself).

Prints wall and process CPU microseconds per request, medians over ``--repeats``
interleaved repeats (min..max), and each mode's wall time over inline's. The ideal for
``thread`` is max(python, 3 x call) per request.

    python benchmarks/bench_submitter_thread.py [--python-us 22] [--call-us 12]
        [--requests 20000] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

CALLS = 3  # two graph launches and cudlaSubmitTask


def busy(microseconds: float) -> None:
    """Python work on the loop's thread for about ``microseconds``."""
    end = time.perf_counter() + microseconds * 1e-6
    while time.perf_counter() < end:
        pass


class Calls:
    """A call of about ``call_us`` made keeping or releasing the GIL."""

    def __init__(self, call_us: float) -> None:
        # Doubled until a held copy takes call_us, then down to the size that does
        # (linear in the bytes near there; the caches make it less so far from it).
        nbytes = 1 << 16
        while self._sized(nbytes) * 1e6 < call_us and nbytes <= 1 << 28:
            nbytes *= 2
        self._sized(max(4096, int(nbytes * call_us * 1e-6 / self.time(self.held))))

    def _sized(self, nbytes: int) -> float:
        """Copy ``nbytes`` from now on; the held copy's seconds."""
        self.source, self.into = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        self._held_into, self._held_from = self.into.data, self.source.data
        return self.time(self.held)

    def held(self) -> None:
        self._held_into[:] = self._held_from

    def released(self) -> None:
        np.copyto(self.into, self.source)  # numpy releases the GIL for this size

    @staticmethod
    def time(call: Callable[[], None], n: int = 200) -> float:
        call()
        began = time.perf_counter()
        for _ in range(n):
            call()
        return (time.perf_counter() - began) / n


def inline(requests: int, python_us: float, calls: Calls, depth: int) -> None:
    """The calls on the loop itself (``depth`` unused: nothing is outstanding)."""
    for _ in range(requests):
        busy(python_us)
        for _ in range(CALLS):
            calls.held()


def threaded(requests: int, python_us: float, calls: Calls, depth: int) -> None:
    handed: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    room = threading.Semaphore(depth)

    def submitter() -> None:
        while handed.get() is not None:
            for _ in range(CALLS):
                calls.released()
            room.release()

    thread = threading.Thread(target=submitter)
    thread.start()
    for index in range(requests):
        busy(python_us)
        room.acquire()
        handed.put(index)
    handed.put(None)
    thread.join()


def measure(
    mode: Callable[..., None], args: argparse.Namespace, calls: Calls
) -> tuple[float, float]:
    """Wall and process CPU microseconds per request."""
    wall, cpu = time.perf_counter(), time.process_time()
    mode(args.requests, args.python_us, calls, args.depth)
    n = args.requests
    return (time.perf_counter() - wall) / n * 1e6, (time.process_time() - cpu) / n * 1e6


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-us", type=float, default=22.0)
    parser.add_argument("--call-us", type=float, default=12.0)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--switch-us", type=float, default=50.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    calls = Calls(args.call_us)
    held_us, released_us = Calls.time(calls.held) * 1e6, Calls.time(calls.released) * 1e6
    default_switch = sys.getswitchinterval()

    def switched() -> tuple[float, float]:
        sys.setswitchinterval(args.switch_us * 1e-6)
        try:
            return measure(threaded, args, calls)
        finally:
            sys.setswitchinterval(default_switch)

    modes: dict[str, Callable[[], tuple[float, float]]] = {
        "inline": lambda: measure(inline, args, calls),
        "thread": lambda: measure(threaded, args, calls),
        "thread, switch interval": switched,
    }

    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
    for repeat in range(args.repeats):
        order = list(modes) if repeat % 2 == 0 else list(reversed(modes))
        for name in order:
            runs[name].append(modes[name]())
    results = {
        name: {
            "wall_us": spread([w for w, _ in values]),
            "cpu_us": spread([c for _, c in values]),
            "wall_over_inline": spread(
                [w / i for (w, _), (i, _) in zip(values, runs["inline"], strict=True)]
            ),
        }
        for name, values in runs.items()
    }
    print(
        f"per request: python {args.python_us:.0f} us + {CALLS} calls "
        f"(held {held_us:.1f} us, released {released_us:.1f} us each, {calls.into.nbytes} bytes); "
        f"depth {args.depth}; medians of {args.repeats} interleaved repeats (min..max)"
    )
    ideal = max(args.python_us, CALLS * held_us)
    print(f"  ideal for a submitter thread: {ideal:.1f} us wall a request")
    for name, figures in results.items():
        wall, cpu, ratio = figures["wall_us"], figures["cpu_us"], figures["wall_over_inline"]
        print(
            f"  {name:<26} wall {wall['median']:7.1f} us ({wall['min']:.1f}..{wall['max']:.1f})"
            f"  cpu {cpu['median']:7.1f} us  wall / inline {ratio['median']:.2f}"
            f" ({ratio['min']:.2f}..{ratio['max']:.2f})"
        )
    if args.json:
        report = {"parameters": vars(args), "call_us": {"held": held_us, "released": released_us}}
        report |= {"ideal_thread_us": ideal, "results": results}
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
