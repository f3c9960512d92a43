"""What the event loop's thread and the poller's thread spend their time on.

Used by ``benchmarks/bench_threads.py --profile``: one measurement with both threads
profiled, the top functions of each by own time (``tottime``) printed, and a pstats
file saved per thread (``python -m pstats FILE``, snakeviz, ... read them).

The poller is profiled by wrapping ``aiodla._poller.Poller._run`` (patched here, before
the engine starts its thread; the thread's target is bound when the poller is made), so
its profile covers the poller's whole life: warm-up and close as well as the window.
Two profilers, the same output:

- ``cprofile`` (up to Python 3.11, the default there): a ``cProfile.Profile`` per
  thread; the loop's is on for the measurement window only. From 3.12 cProfile runs on
  ``sys.monitoring``: one profiler a process, fed by every thread's events, so two
  threads cannot each have their own (CPython issue 124656).
- ``process`` (the default from 3.12): one ``cProfile.Profile`` over the window, fed
  by every thread (what ``sys.monitoring`` allows); the loop's and the poller's
  functions are told apart by name (``aiodla/_poller.py`` and the runtime's event query
  are the poller's), and the CPU of each thread is still measured separately.
- ``profile`` (any version): the pure-Python ``profile.Profile``
  per thread, through ``sys.setprofile``, which stays per thread. It cannot start in the
  middle of a stack, so the loop's profile covers the whole ``asyncio.run`` of the
  measurement (engine open, warm-up, window, close); the benchmark warms caches with an
  unprofiled run first. Several times slower than cProfile: read shares, not speeds.

Both time by the wall clock by default: waits show as the calls that wait
(``select.epoll.poll`` in the loop, ``lock.acquire`` or ``time.sleep`` in the poller).
``clock="cpu"`` times by each thread's CPU clock instead (``process``: the process's,
see ``_window_clock``), which hides waits but costs a system call per event (on this
workplace's machines it slowed the loop fourfold).
"""

from __future__ import annotations

import cProfile
import io
import marshal
import profile
import pstats
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import _thread_cpu

from aiodla import _poller

THREADS = ("loop", "poller")
T = TypeVar("T")


def default_backend() -> str:
    return "cprofile" if sys.version_info < (3, 12) else "process"


class ThreadProfiler:
    """Profiles the loop's thread and the poller's over one measurement.

    ``install()`` before the engine opens (it patches the poller); ``run(call)`` runs the
    measurement on this (the loop's) thread; the measurement calls ``start()`` and
    ``stop()`` around its window; ``uninstall()`` after; then ``report()``.
    """

    def __init__(self, backend: str, clock: str = "wall") -> None:
        if backend == "cprofile" and sys.version_info >= (3, 12):
            raise SystemExit(
                "cProfile cannot profile two threads at once from Python 3.12 "
                "(one sys.monitoring profiler a process): use --profiler process"
            )
        self.backend = backend
        self.clock = clock
        self.stats: dict[str, dict[Any, Any]] = {}
        self.cpu: dict[str, float] = {}
        self._original_run: Callable[..., None] | None = None
        self._profiles: dict[str, list[Any]] = {name: [] for name in (*THREADS, "process")}
        self._window: cProfile.Profile | None = None

    def _new(self) -> Any:
        timer = time.thread_time if self.clock == "cpu" else time.perf_counter
        if self.backend == "cprofile":
            return cProfile.Profile(timer)
        return profile.Profile(timer)

    def _window_clock(self) -> Callable[[], float]:
        """The window profiler's timer. ``process`` feeds one profiler from every thread:
        a per-thread CPU clock would time a call by two threads' clocks (nonsense,
        negative times), so its CPU clock is the process's (a call's time then includes
        what the other thread ran meanwhile)."""
        if self.clock != "cpu":
            return time.perf_counter
        return time.process_time if self.backend == "process" else time.thread_time

    # -- lifecycle ---------------------------------------------------------------------

    def install(self) -> None:
        if self.backend == "process":
            return  # one profiler sees every thread: nothing to wrap
        original = _poller.Poller._run
        self._original_run = original
        profiles, new = self._profiles["poller"], self._new

        def profiled_run(poller: _poller.Poller) -> None:
            profiler = new()
            profiles.append(profiler)
            profiler.runcall(original, poller)

        _poller.Poller._run = profiled_run  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self._original_run is not None:
            _poller.Poller._run = self._original_run  # type: ignore[method-assign]
            self._original_run = None

    def run(self, call: Callable[[], T]) -> T:
        """Run the measurement on this thread (under the profiler, for ``profile``)."""
        if self.backend in ("cprofile", "process"):
            return call()
        profiler = self._new()
        self._profiles["loop"].append(profiler)
        result: T = profiler.runcall(call)
        return result

    def start(self) -> None:
        """On the loop thread, the engine open and warm: the window begins."""
        poller = next(
            (t for t in threading.enumerate() if t.name.startswith(_thread_cpu.POLLER_NAME)),
            None,
        )
        if poller is None:
            raise RuntimeError("no poller thread: is the engine open?")
        self._threads = {"loop": threading.current_thread(), "poller": poller}
        self._cpu_before = {name: _cpu(t) for name, t in self._threads.items()}
        self._process_before = time.process_time()
        if self.backend in ("cprofile", "process"):
            self._window = cProfile.Profile(self._window_clock())
            self._profiles["process" if self.backend == "process" else "loop"].append(self._window)
            self._window.enable()

    def stop(self) -> None:
        if self._window is not None:
            self._window.disable()
        self.cpu = {
            name: _cpu(thread) - self._cpu_before[name] for name, thread in self._threads.items()
        }
        self.cpu["process"] = time.process_time() - self._process_before

    def collect(self) -> None:
        """After the engine closed (the poller's profile is complete then)."""
        for name, profilers in self._profiles.items():
            if not profilers:
                continue
            merged: dict[Any, Any] = {}
            for profiler in profilers:
                profiler.create_stats()
                merged.update(profiler.stats)
            self.stats[name] = merged

    # -- output ------------------------------------------------------------------------

    def report(self, prefix: str, requests: int, top: int = 25) -> list[Path]:
        """Print the top functions per thread; save ``PREFIX-loop.pstats`` and
        ``PREFIX-poller.pstats``; return their paths."""
        paths = []
        for name in self.stats:
            path = Path(f"{prefix}-{name}.pstats")
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as file:
                marshal.dump(self.stats[name], file)
            paths.append(path)
            cpu = self.cpu.get(name, 0.0)
            whole = name == "poller" or self.backend == "profile"
            print(
                f"\n=== {name} thread: {cpu * 1e3:.1f} ms CPU in the window, "
                f"{cpu * 1e6 / max(requests, 1):.1f} us per request; profile: {self.backend}, "
                f"{self.clock} clock, {'its whole life' if whole else 'the window'} "
                f"(saved {path})"
            )
            if not self.stats[name]:
                print("    (nothing recorded)")
                continue
            out = io.StringIO()
            stats = pstats.Stats(str(path), stream=out)
            stats.sort_stats("tottime").print_stats(top)
            # Drop pstats' first line (date, file name): keep the totals and the table.
            print(out.getvalue().split("\n", 1)[1].strip("\n"))
        return paths


def _cpu(thread: threading.Thread) -> float:
    assert thread.native_id is not None
    return _thread_cpu.thread_cpu(thread.native_id) or 0.0
