"""Models and helpers the tests share (imported as ``support``)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import anyio
import numpy as np

from aiodla import TensorSpec
from aiodla.emulator import make_loadable
from aiodla.runtime import EmulatedRuntime

X = TensorSpec("x", (1, 3, 8, 8), "float16", "chw16")
Y = TensorSpec("y", (1, 3, 8, 8), "float32", "nchw")


def affine_model(latency: float = 0.001, *, scale: float = 2.0, bias: float = 0.5) -> bytes:
    """One float16 CHW16 input, one float32 output: y = scale * x + bias."""
    return make_loadable([X], [Y], "affine", latency, scale=scale, bias=bias)


def two_pair_model(latency: float = 0.001) -> bytes:
    """Two inputs and two outputs, mean over H and W."""
    inputs = [
        TensorSpec("a", (1, 4, 6, 6), "float16", "chw16"),
        TensorSpec("b", (2, 3, 5, 7), "float32", "nhwc"),
    ]
    outputs = [
        TensorSpec("mean_a", (1, 4, 1, 1), "float32", "nchw"),
        TensorSpec("mean_b", (2, 3, 1, 1), "float16", "nchw"),
    ]
    return make_loadable(inputs, outputs, "mean_hw", latency, scale=3.0, bias=-1.0)


def expected_affine(
    x: np.ndarray[Any, Any], scale: float = 2.0, bias: float = 0.5
) -> np.ndarray[Any, Any]:
    """What the affine model returns for ``x``, computed independently of aiodla."""
    stored = x.astype(np.float16).astype(np.float64)
    return (stored * scale + bias).astype(np.float32)


def the_one_failure(inputs: Any, outcomes: Any) -> BaseException:
    """The single exception among ``outcomes`` (``gather(..., return_exceptions=True)``
    over the affine model); every other outcome must be its input's right result."""
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(failed) == 1, failed
    for x, y in zip(inputs, outcomes, strict=True):
        if not isinstance(y, BaseException):
            np.testing.assert_array_equal(y, expected_affine(x))
    return failed[0]


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Yield to the loop until ``predicate()`` holds; fail the test after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


async def take_core_out(engine: Any, arm: Callable[[], Any], core: int) -> None:
    """Fail ``core``'s next task (``arm`` sets the fault up; it may return an awaitable)
    and send requests of ones until it ran: with ``max_consecutive_faults=1`` the core
    is then out of rotation."""
    armed = arm()
    if armed is not None:
        await armed
    ones = np.ones(X.shape, np.float32)
    for _ in range(4):
        try:
            await engine.infer(ones)
        except Exception:
            break
    assert not engine.statistics().cores[core].in_rotation


def busy_slots(engine: Any) -> int:
    """Slots the DLA still holds (an ended request's task may still be running)."""
    return sum(core.busy_slots for core in engine.statistics().cores)


def all_idle(engine: Any) -> bool:
    """No request queued or in flight, and every slot back in the pool."""
    stats = engine.statistics()
    return stats.queued == 0 and stats.in_flight == 0 and busy_slots(engine) == 0


# How long a finished task's completion may take to reach the loop (a sweep of the
# poller, a wake-up of the loop) before a slot still busy counts as not given back.
COMPLETION_SETTLE = 2.0


async def slots_not_back(
    engine: Any, runtime: EmulatedRuntime, settle: float = COMPLETION_SETTLE
) -> str | None:
    """Why ``engine`` (open, on the emulated ``runtime``) holds a slot that nothing
    holds, or None: a busy slot belongs to a request in flight or to a task the DLA has
    not finished (a cancelled request's, a held gate's, a hung core's). Anything beyond
    that, once completions had ``settle`` seconds to arrive, leaked."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settle
    while True:
        stats = engine.statistics()
        busy = sum(core.busy_slots for core in stats.cores)
        on_the_dla = sum(runtime.tasks_in_flight(core.core) for core in stats.cores)
        if busy <= stats.in_flight + on_the_dla:
            return None
        if loop.time() > deadline:
            return (
                f"{engine!r} holds {busy} busy slot(s) with {stats.in_flight} request(s) "
                f"in flight and {on_the_dla} task(s) on the emulated DLA: a slot was not "
                "given back"
            )
        await asyncio.sleep(0.001)


def counts_add_up(stats: Any) -> bool:
    """Every request counted once: submitted == ended + queued + in flight, none negative."""
    parts = (
        stats.completed,
        stats.failed,
        stats.cancelled,
        stats.timed_out,
        stats.queued,
        stats.in_flight,
    )
    return min(parts) >= 0 and sum(parts) == stats.submitted and stats.rejected >= 0


def doubled(inputs: Any) -> dict[str, Any]:
    """A compute function for single-pair models of tensors ``x`` -> ``y``, importable
    as the compute reference ``support:doubled``."""
    return {"y": inputs["x"].astype(np.float32) * 2}


# -- Engine(isolation="process") ----------------------------------------------------------


def worker_pid(engine: Any) -> int:
    worker = engine.statistics().worker
    assert worker is not None and worker.pid is not None
    return int(worker.pid)


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, reaped or not, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


class FakeCudaArray:
    """A device array as an array library exports it (refused unread: no GPU behind it)."""

    def __init__(self, shape: tuple[int, ...], typestr: str = "<f4") -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (0x1000, False),
            "version": 3,
            "strides": None,
        }


class Misstated(EmulatedRuntime):
    """An emulated runtime that states ``factor`` times the loadable's service time
    (each task still takes the loadable's own), and counts its event queries
    (tests/test_estimates.py, benchmarks/bench_estimates.py). ``clock``: the emulated
    device's time, real unless a test moves it."""

    def __init__(
        self, factor: float, cores: int = 2, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(cores, clock=clock)
        self.factor = factor
        self.queries = 0

    def stated_service_time(self, loadable: bytes) -> float | None:
        stated = super().stated_service_time(loadable)
        return None if stated is None else stated * self.factor

    def query_event(self, event: int) -> bool:
        self.queries += 1
        return super().query_event(event)


class FakeToolchain:
    """Stands in for NVRTC and the driver's module loading (the ``fake_toolchain``
    fixture of tests/runtime): compiles to the source's bytes, loads only what it
    compiled, and counts both."""

    def __init__(self) -> None:
        self.compiled = 0
        self.loaded: list[bytes] = []

    def target(self) -> tuple[str, str]:
        return "sm_90", "13.0"

    def compile(self, source: str, arch: str) -> bytes:
        self.compiled += 1
        return b"CUBIN" + source.encode()

    def load(self, cubin: bytes, names: Any) -> dict[str, Any]:
        if not cubin.startswith(b"CUBIN"):
            raise RuntimeError("not a cubin")
        self.loaded.append(cubin)
        return {name: f"fn:{name}" for name in names}


class NoThreads:
    """Every token of the loop's default thread limiter, held until released."""

    def __init__(self) -> None:
        self.limiter = anyio.to_thread.current_default_thread_limiter()
        self.borrowers = [object() for _ in range(int(self.limiter.total_tokens))]

    async def __aenter__(self) -> NoThreads:
        for borrower in self.borrowers:
            await self.limiter.acquire_on_behalf_of(borrower)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for borrower in self.borrowers:
            self.limiter.release_on_behalf_of(borrower)

    def waiting(self) -> int:
        return int(self.limiter.statistics().tasks_waiting)


class StepThreads:
    """Records, per call of an engine's device layer method ``name`` that did its step,
    whether it ran on the calling (loop) thread; a staging call that returns False
    weighed the request and left it for a worker thread, and counts as ``declined``."""

    def __init__(self, engine: Any, name: str) -> None:
        self.on_loop: list[bool] = []
        self.declined = 0
        layer = engine._device
        real = getattr(layer, name)
        loop_thread = threading.current_thread()

        def spy(*args: Any) -> Any:
            result = real(*args)
            if result is False:
                self.declined += 1
            else:
                self.on_loop.append(threading.current_thread() is loop_thread)
            return result

        setattr(layer, name, spy)


class HeldRequest(NamedTuple):
    """The ``held_offloaded_request`` fixture: its engine, the gate that holds its
    request on the DLA, and the request's task."""

    engine: Any
    gate: Any
    task: asyncio.Future[Any]
