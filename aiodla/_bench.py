"""``aiodla bench``'s machinery: drive an engine with concurrent requests, then sum up.

The command itself (arguments, output, exit status) is in ``_cli``; this module runs
the requests, draws the progress bar and turns the run into a report and its lines.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ._engine import Engine
from ._errors import AiodlaError, EngineClosedError, EngineDeadError
from ._tensors import TensorSpec

__all__ = [
    "BENCH_FORMAT",
    "BENCH_VERSION",
    "failure_message",
    "limited_by",
    "progress_bar",
    "run_bench",
    "summary_lines",
]

BENCH_FORMAT = "aiodla-bench"
BENCH_VERSION = 1
# The progress bar is redrawn this often; per-request updates would cost the benchmark.
PROGRESS_PERIOD = 0.1
# Cores busy this much of the run were the bound: the rest is ramp-up and wind-down.
CORES_SATURATED = 0.9


def failure_message(result: dict[str, Any]) -> str:
    """The line ``aiodla bench`` ends with when requests failed."""
    errors = ", ".join(f"{name} x{count}" for name, count in sorted(result["errors"].items()))
    cause = f"; {result['fatal']}" if result["fatal"] else ""
    return (
        f"aiodla: error: {result['failed']} of {result['requests']} "
        f"requests failed ({errors}){cause}"
    )


def _tracing(engine: Engine, path: str | None, model: str) -> Any:
    """The run's trace, written when the engine's block ends; or no trace."""
    if path is None:
        return contextlib.nullcontext()
    return engine.trace(path, name=Path(model).stem)


def _random_inputs(specs: Sequence[TensorSpec]) -> Any:
    rng = np.random.default_rng(0)
    arrays = {}
    for spec in specs:
        if spec.is_integer and spec.scale is None:
            info = np.iinfo(spec.numpy_dtype)
            low, high = max(info.min, -100), min(info.max, 100)
            arrays[spec.name] = rng.integers(low, high, spec.shape, endpoint=True).astype(
                spec.numpy_dtype
            )
        else:
            arrays[spec.name] = rng.standard_normal(spec.shape).astype(np.float32)
    return next(iter(arrays.values())) if len(arrays) == 1 else arrays


class _BenchRun:
    """What the workers share: how many requests were issued, how they ended."""

    def __init__(self, requests: int | None, deadline: float | None) -> None:
        self.requests = requests
        self.deadline = deadline
        self.issued = 0
        self.latencies: list[float] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.fatal: str | None = None
        self.interrupted = False  # by Ctrl-C: the results are partial

    def claim(self) -> bool:
        """Take the next request to send, if the run is not over."""
        if self.fatal is not None:
            return False
        if self.requests is not None:
            if self.issued >= self.requests:
                return False
        elif time.perf_counter() >= self.deadline:  # type: ignore[operator]
            return False
        self.issued += 1
        return True

    @property
    def failed(self) -> int:
        return sum(self.errors.values())


async def run_bench(
    open_engine: Callable[[], Engine],
    model: str,
    data: bytes,
    *,
    cores: tuple[int, ...],
    streams: int,
    concurrency: int,
    requests: int | None,
    duration: float | None,
    runtime: str,
    progress: Any,
    trace: str | None = None,
) -> dict[str, Any]:
    """Send the requests (``concurrency`` at a time) through the engine ``open_engine``
    makes; the report ``aiodla bench --json`` prints. ``trace``: write the run's
    timeline there (``engine.trace``)."""
    import anyio

    async with open_engine() as engine, _tracing(engine, trace, model):
        inputs = _random_inputs(engine.inputs)
        started = time.perf_counter()
        run = _BenchRun(requests, None if duration is None else started + duration)

        async def worker() -> None:
            while run.claim():
                sent = time.perf_counter()
                try:
                    await engine.infer(inputs)
                except (EngineClosedError, EngineDeadError) as exc:
                    run.errors[type(exc).__name__] += 1
                    run.fatal = run.fatal or str(exc)
                except AiodlaError as exc:
                    run.errors[type(exc).__name__] += 1
                else:
                    run.latencies.append(time.perf_counter() - sent)

        def show() -> None:
            if progress is None:
                return
            elapsed = time.perf_counter() - started
            done = len(run.latencies) + run.failed
            progress.update(
                progress.task_ids[0],
                completed=done if requests is not None else min(elapsed, duration or 0.0),
                done=done,
                rate=done / elapsed if elapsed > 0 else 0.0,
            )
            progress.refresh()

        async def refresh() -> None:
            while True:
                show()
                await anyio.sleep(PROGRESS_PERIOD)

        interrupt = _cancel_on_ctrl_c()
        try:
            async with anyio.create_task_group() as display:
                display.start_soon(refresh)
                async with anyio.create_task_group() as workers:
                    for _ in range(concurrency):
                        workers.start_soon(worker)
                display.cancel_scope.cancel()
        except asyncio.CancelledError:
            # Ctrl-C cancels this task (see _cancel_on_ctrl_c): keep what was measured
            # and report it. Uncancelling lets the engine close normally.
            uncancel = getattr(asyncio.current_task(), "uncancel", None)  # Python >= 3.11
            if uncancel is not None:
                uncancel()
            run.interrupted = True
        finally:
            interrupt()
        show()
        elapsed = time.perf_counter() - started
        stats = engine.statistics()
        runtime_name = engine.runtime.name
        stated = engine.stated_service_time
    latencies = np.asarray(run.latencies)
    completed = len(run.latencies)
    report = {
        "format": BENCH_FORMAT,
        "version": BENCH_VERSION,
        "model": model,
        "runtime": runtime_name,
        "cores": list(cores),
        "streams_per_core": streams,
        "concurrency": concurrency,
        "requests": run.issued,
        "completed": completed,
        "failed": run.failed,
        "errors": dict(run.errors),
        "fatal": run.fatal,
        "elapsed_s": elapsed,
        "throughput_rps": completed / elapsed if elapsed > 0 else 0.0,
        "slots": len(cores) * streams,
        "interrupted": run.interrupted,
        # More requests in flight than cores cannot go faster than the cores; fewer
        # cannot keep every core busy.
        "ideal_rps": min(len(cores), concurrency) / stated if stated else None,
        "latency_s": None
        if not completed
        else {
            "p50": float(np.percentile(latencies, 50)),
            "p90": float(np.percentile(latencies, 90)),
            "p99": float(np.percentile(latencies, 99)),
            "max": float(np.max(latencies)),
            "mean": float(np.mean(latencies)),
        },
        "per_core": [
            {
                "core": core.core,
                "completed": core.completed,
                "failed": core.failed,
                "utilization": min(1.0, core.busy_time / elapsed) if elapsed > 0 else 0.0,
            }
            for core in stats.cores
        ],
    }
    report["limited_by"] = limited_by(report)
    return report


def limited_by(report: dict[str, Any]) -> str:
    """What held the throughput back: the DLA cores when they never waited, else the
    requests offered when fewer than the slots, else the host feeding them."""
    utilization = [core["utilization"] for core in report["per_core"]]
    low, high = min(utilization, default=0.0), max(utilization, default=0.0)
    busy = f"{low:.0%}" if f"{low:.0%}" == f"{high:.0%}" else f"{low:.0%}-{high:.0%}"
    count = len(utilization)
    which = f"core {report['cores'][0]}" if count == 1 else "both" if count == 2 else f"all {count}"
    if low >= CORES_SATURATED:
        return f"the DLA cores ({which} busy {busy})"
    if report["concurrency"] < report["slots"]:
        return f"concurrency {report['concurrency']} < {report['slots']} slots"
    return f"the host (the DLA cores only {busy} busy with every slot offered work)"


@contextmanager
def progress_bar(console: Any, total: float, enabled: bool) -> Iterator[Any]:
    """A live bar on a terminal; None (no output at all) anywhere else."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("bench"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.fields[done]} requests, {task.fields[rate]:.0f} req/s"),
        TimeElapsedColumn(),
        console=console,
        auto_refresh=False,
        transient=False,
    )
    progress.add_task("bench", total=total, done=0, rate=0.0)
    with progress:
        yield progress


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def summary_lines(result: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(label, text) lines of the report, for people."""
    if result["interrupted"]:
        yield "interrupted", f"by Ctrl-C after {result['elapsed_s']:.2f} s: partial results"
    cores = ",".join(map(str, result["cores"]))
    yield (
        "model",
        (
            f"{result['model']} on the {result['runtime']} runtime, cores {cores} x "
            f"{result['streams_per_core']} streams, concurrency {result['concurrency']}"
        ),
    )
    yield (
        "requests",
        (
            f"{result['completed']} completed, {result['failed']} failed in "
            f"{result['elapsed_s']:.2f} s"
        ),
    )
    throughput = f"{result['throughput_rps']:.0f} req/s"
    if result["ideal_rps"]:
        throughput += (
            f" ({result['throughput_rps'] / result['ideal_rps']:.0%} of the ideal "
            f"{result['ideal_rps']:.0f} req/s: min(cores, concurrency) / task "
            "latency)"
        )
    yield "throughput", throughput
    yield "limited by", result["limited_by"]
    latency = result["latency_s"]
    yield (
        "latency",
        "n/a"
        if latency is None
        else (
            f"p50 {_ms(latency['p50'])}  p90 {_ms(latency['p90'])}  p99 {_ms(latency['p99'])}  "
            f"max {_ms(latency['max'])}"
        ),
    )
    for core in result["per_core"]:
        yield (
            f"core {core['core']}",
            (f"{core['completed']} tasks, {core['failed']} failed, {core['utilization']:.1%} busy"),
        )
    errors = ", ".join(f"{name} x{count}" for name, count in sorted(result["errors"].items()))
    yield "errors", errors or "none"


def _cancel_on_ctrl_c() -> Callable[[], None]:
    """Make Ctrl-C cancel the running task, as ``asyncio.run`` does from Python 3.11 on
    (on 3.10 it raises KeyboardInterrupt out of the loop, losing the partial results);
    returns what undoes it. Only the main thread of a Unix process can take signals."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    if task is None:
        return lambda: None
    try:
        loop.add_signal_handler(signal.SIGINT, task.cancel)
    except (NotImplementedError, RuntimeError, ValueError):
        return lambda: None

    def restore() -> None:
        loop.remove_signal_handler(signal.SIGINT)

    return restore
