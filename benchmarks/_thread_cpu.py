"""CPU time by thread, for the benchmarks that report CPU per request by thread.

Every thread of the process is read, not only Python's: the CUDA driver's own threads
and the stand-in's have no ``threading.Thread``. A thread's CPU clock is read by its
kernel id (Linux's per-thread clock id, what glibc's ``pthread_getcpuclockid`` makes),
named after its Python thread where there is one, else after ``/proc``'s ``comm``.

Groups: ``loop`` (the event loop's thread), ``poller`` (aiodla's poller thread), and
``other`` = the whole process less those two, so a thread that ended during the window
still counts there. ``by_name`` splits ``other`` among the threads alive at the end (threads named alike
but for their numbers, a pool's workers, together).
"""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from dataclasses import dataclass, field

POLLER_NAME = "aiodla-poller"


def _clock_id(native_id: int) -> int:
    # Linux: MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED) | CPUCLOCK_PERTHREAD_MASK.
    return ((~native_id) << 3) | 6


def thread_cpu(native_id: int) -> float | None:
    """CPU seconds of one thread of this process, or None once it has ended."""
    try:
        return time.clock_gettime(_clock_id(native_id))
    except (OSError, ProcessLookupError):
        return None


def _thread_names() -> dict[int, str]:
    """Kernel id -> name: the Python thread's name, else the OS name (``comm``)."""
    python = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    names = {}
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: Python's threads only
        return python
    for tid in tids:
        if tid in python:
            names[tid] = python[tid]
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as file:
                names[tid] = f"[{file.read().strip()}]"
        except OSError:
            continue
    return names


@dataclass
class Snapshot:
    """CPU seconds so far: of the process, and of each thread alive now."""

    process: float
    threads: dict[int, tuple[str, float]] = field(default_factory=dict)


def snapshot() -> Snapshot:
    threads = {}
    for tid, name in _thread_names().items():
        cpu = thread_cpu(tid)
        if cpu is not None:
            threads[tid] = (name, cpu)
    return Snapshot(time.process_time(), threads)


def per_request(
    before: Snapshot, after: Snapshot, requests: int, loop_id: int
) -> tuple[dict[str, float], dict[str, float]]:
    """(group -> CPU us per request, other thread's name -> CPU us per request)."""
    scale = 1e6 / max(requests, 1)
    groups = {"loop": 0.0, "poller": 0.0}
    by_name: dict[str, float] = {}
    for tid, (name, cpu) in after.threads.items():
        spent = (cpu - before.threads.get(tid, (name, 0.0))[1]) * scale
        if tid == loop_id:
            groups["loop"] += spent
        elif name.startswith(POLLER_NAME):
            groups["poller"] += spent
        elif spent > 0:
            # Numbered alike (a pool's workers): one entry for all of them.
            key = re.sub(r"\d+", "#", name)
            by_name[key] = by_name.get(key, 0.0) + spent
    process = (after.process - before.process) * scale
    groups["other"] = process - groups["loop"] - groups["poller"]
    groups["process"] = process
    return groups, by_name


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
