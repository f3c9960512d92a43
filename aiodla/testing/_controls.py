"""Test controls over an emulated DLA, and the engines a test opens on it.

:class:`DLAControls` wraps the emulated runtime's fault injection in a small API
for users' tests: fail the next task, start it late, hold tasks in flight until the
test lets them go, break the device. It sees every task as it is submitted (through
:class:`_ControlledRuntime`), which lets a coroutine wait for "n tasks are in flight"
without sleeping and lets a fault land on whichever core the scheduler picks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import pickle
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._engine import Engine
from .._tensors import TensorSpec
from ..emulator._compute import ComputeFunction
from ..runtime._emulated import EmulatedRuntime
from ..runtime._faults import TaskGate
from ._model import ModelDescription, emulated_model
from ._remote import RemoteGate, Workers

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._isolation._supervisor import Supervisor
    from .._options import EngineKeywords

__all__ = ["DLA_TASK_FAILURE", "DLAControls", "EngineFactory", "Gate", "HandleLeakError"]

# cudlaErrorDlaErrInvalidInput: what a DLA task reports when it faults on its input.
DLA_TASK_FAILURE = 0x40000001
# How often Gate.reached asks a worker process how many tasks its gate holds.
_POLL_INTERVAL = 0.001


class HandleLeakError(AssertionError):
    """A test left emulated DLA handles alive: an engine it opened was never closed."""


class _ControlledRuntime(EmulatedRuntime):
    """The emulated runtime, telling its :class:`DLAControls` about every task.

    An engine opened on it with ``isolation="process"`` runs an emulated runtime of its
    own in its worker: while one is open, the fault controls and gates act in the
    workers instead (:class:`Workers`), and the counters add the workers' up.
    """

    def __init__(self, controls: DLAControls, cores: int) -> None:
        super().__init__(cores)
        self._controls = controls
        # Device handles are never reused, so this map needs no pruning.
        self._device_cores: dict[int, int] = {}
        self.workers = Workers(cores)
        # Call failures armed while no worker was attached, for the next worker to open
        # (as in-process, they belong to the next engine to open); the compute functions
        # bound to loadables.
        self._armed: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
        self._computes: dict[bytes, ComputeFunction | str] = {}

    def bind_compute(self, loadable: bytes, compute: ComputeFunction | str | None) -> None:
        super().bind_compute(loadable, compute)
        if compute is None:
            self._computes.pop(bytes(loadable), None)
        else:
            self._computes[bytes(loadable)] = compute

    def worker_setup(self, loadable: bytes) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
        """What a process-mode engine's worker applies before it opens ``loadable``: the
        call failures armed here and not used yet (they move there), the compute bound."""
        setup: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        for failure, args, kwargs in self._armed:
            if failure in self._call_failures.pending:
                self._call_failures.remove(failure)
                setup.append(("fail_call", args, kwargs))
        self._armed.clear()
        compute = self._computes.get(bytes(loadable))
        if compute is not None:
            try:
                pickle.loads(pickle.dumps(compute))
            except Exception as exc:
                raise TypeError(
                    f"compute={compute!r} cannot reach the worker process of "
                    "isolation='process': pass a function defined at a module's top level, "
                    f"or a 'module:function' reference ({exc})"
                ) from None
            setup.append(("bind_compute", (bytes(loadable), compute), {}))
        return setup

    def attach_worker(self, supervisor: Supervisor, loadable: bytes) -> Callable[[], None]:
        """A process-mode engine opened on this runtime (its device layer calls this)."""
        return self.workers.attach(supervisor, self._controls._submitting_remote)

    def fail_next_task(
        self, core: int, status: int = 0x40000001, *, on_stream: bool = False
    ) -> None:
        if self.workers:
            self.workers.act("fail_next_task", core, status, on_stream=on_stream)
        else:
            super().fail_next_task(core, status, on_stream=on_stream)

    def hang_core(self, core: int, hung: bool = True) -> None:
        if self.workers:
            self.workers.act("hang_core", core, hung)
        else:
            super().hang_core(core, hung)

    def hold(self, core: int) -> Any:
        return self.workers.hold(core) if self.workers else super().hold(core)

    def poison(self, code: int = 911) -> None:
        if self.workers:
            self.workers.act("poison", code)
        else:
            super().poison(code)

    def fail_call(
        self, call: str, error: BaseException | int, *, after: int = 0, core: int | None = None
    ) -> None:
        if self.workers:
            self.workers.act("fail_call", call, error, after=after, core=core)
        else:
            super().fail_call(call, error, after=after, core=core)
            armed = self._call_failures.pending[-1]
            self._armed.append((armed, (call, error), {"after": after, "core": core}))

    def core_tasks(self, core: int) -> int:
        live = int(sum(self.workers.count("core_tasks", core)))
        return super().core_tasks(core) + self.workers.closed_tasks[core] + live

    def core_busy_time(self, core: int) -> float:
        busy = float(sum(self.workers.count("core_busy_time", core)))
        return super().core_busy_time(core) + self.workers.closed_busy_time[core] + busy

    def live_handles(self) -> dict[str, int]:
        live = super().live_handles()
        for worker in self.workers.count("live_handles"):
            for kind, count in worker.items():
                live[kind] = live.get(kind, 0) + count
        return live

    def create_device(self, core: int) -> int:
        handle = super().create_device(core)
        self._device_cores[handle] = core
        return handle

    def submit_task(self, device: int, task: Any, stream: int) -> None:
        core = self._device_cores.get(device)
        if core is None:  # not a device of this runtime: let the runtime say so
            super().submit_task(device, task, stream)
            return
        delay = self._controls._submitting(core)
        try:
            super().submit_task(device, task, stream)
        except BaseException:
            if delay is not None:
                delay[0].release()  # the task never reached the gate: nothing to delay
            raise
        self._controls._submitted(delay)


@dataclasses.dataclass
class _Fault:
    core: int | None  # None: whichever core the next task goes to
    value: Any  # a cudlaStatus for failures; (seconds, loop) for delays


class Gate:
    """Tasks held on one or more DLA cores before they start, until released.

    Made by :meth:`DLAControls.hold`. While it stands, every task submitted to its
    cores waits in flight: the requests are submitted, their slots busy, and nothing
    completes. Use it as a context manager (``with controls.hold(0) as gate:``) to
    release on exit, or call :meth:`release`.
    """

    def __init__(self, controls: DLAControls, gates: dict[int, TaskGate | RemoteGate]) -> None:
        self._controls = controls
        self._gates = gates

    @property
    def cores(self) -> tuple[int, ...]:
        """The cores this gate holds."""
        return tuple(self._gates)

    @property
    def count(self) -> int:
        """Tasks that reached the gate since it was put up (released ones included)."""
        return sum(gate.held for gate in self._gates.values())

    @property
    def released(self) -> bool:
        return all(gate.released for gate in self._gates.values())

    async def reached(self, count: int = 1, *, timeout: float = 5.0) -> None:
        """Wait until ``count`` tasks have reached the gate, without blocking the loop.

        Raises ``TimeoutError`` naming how many arrived if that takes over ``timeout``
        seconds (a test that submitted fewer requests than it waits for, say).

        Cancellation: cancelling the wait changes nothing about the gate or its tasks.
        """
        if self.count >= count:
            return
        if self._controls._runtime.workers:
            await self._poll(count, timeout)
            return
        waiter = _Waiter(self, count, asyncio.get_running_loop().create_future())
        self._controls._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter.future, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"{self.count} of the {count} task(s) waited for reached the gate on "
                f"core(s) {list(self.cores)} within {timeout:g} s"
            ) from None
        finally:
            self._controls._waiters.remove(waiter)

    async def _poll(self, count: int, timeout: float) -> None:
        """:meth:`reached` for gates in worker processes: their tasks arrive there, so
        ask (a round trip each) until enough have, yielding to the loop in between."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.count < count:
            if loop.time() > deadline:
                raise TimeoutError(
                    f"{self.count} of the {count} task(s) waited for reached the gate on "
                    f"core(s) {list(self.cores)} within {timeout:g} s"
                )
            await asyncio.sleep(_POLL_INTERVAL)

    def release(self) -> None:
        """Let the held tasks start now, in the order they came; idempotent."""
        for gate in self._gates.values():
            gate.release()

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "holding"
        return f"<Gate cores {list(self.cores)} {state}, {self.count} task(s) reached>"


@dataclasses.dataclass(eq=False)
class _Waiter:
    gate: Gate
    count: int
    future: asyncio.Future[None]

    def check(self) -> None:
        if not self.future.done() and self.gate.count >= self.count:
            self.future.set_result(None)


class DLAControls:
    """Controls over the emulated DLA behind a test's engines.

    ``runtime`` is the emulated runtime itself: open engines of your own on it with
    ``Engine(model, runtime=controls.runtime)`` (and close them: the fixture fails the
    test if any handle is still alive at teardown). A *task* is one request's run on
    a DLA core; each request runs exactly one.
    """

    def __init__(self, cores: int = 2) -> None:
        self._runtime = _ControlledRuntime(self, cores)
        self.runtime: EmulatedRuntime = self._runtime
        self._core_count = cores
        self._failures: collections.deque[_Fault] = collections.deque()
        self._delays: collections.deque[_Fault] = collections.deque()
        # Cores held, by a Gate of the test's or by a delay; at most one gate each.
        self._held: dict[int, TaskGate | RemoteGate] = {}
        self._timers: list[asyncio.TimerHandle] = []
        self._waiters: list[_Waiter] = []

    @property
    def cores(self) -> int:
        """How many DLA cores the emulated device has."""
        return self._core_count

    def fail_next(
        self, core: int | None = None, *, status: int = DLA_TASK_FAILURE, count: int = 1
    ) -> None:
        """Make the next ``count`` tasks fail with the DLA ``status`` (a cudlaStatus).

        ``core=None`` fails the next tasks wherever the engine sends them; a core
        number, only tasks on that core. The requests raise :class:`aiodla.TaskError`
        with ``.status`` and ``.core``.
        """
        self._check_core(core)
        if count < 1:
            raise ValueError(f"{count=} must be >= 1")
        self._failures.extend(_Fault(core, int(status)) for _ in range(count))

    def delay_next(self, seconds: float, *, core: int | None = None) -> None:
        """Start the next task ``seconds`` late, as if the DLA took that much longer.

        ``core=None``: the next task wherever it goes; a core number: the next task on
        that core. Tasks sent to that core meanwhile wait behind it, as they would
        behind a slow task on a real core. A held core's tasks are not delayed: the
        delay goes to the next task on a core that is not held. Call from a coroutine
        (the delay is timed on its event loop).
        """
        self._check_core(core)
        if not seconds >= 0:
            raise ValueError(f"{seconds=} must be >= 0")
        self._delays.append(_Fault(core, (float(seconds), asyncio.get_running_loop())))

    def hold(self, *cores: int) -> Gate:
        """Hold every task submitted to ``cores`` (all cores when none are given)
        before it starts, until the returned :class:`Gate` is released."""
        chosen = cores or tuple(range(self._core_count))
        for core in chosen:
            self._check_core(core)
            if self._is_held(core):
                raise RuntimeError(
                    f"core {core} is held already (by a gate, or for a delayed task); "
                    "release that gate first"
                )
        gates: dict[int, TaskGate | RemoteGate] = {core: self.runtime.hold(core) for core in chosen}
        self._held.update(gates)
        return Gate(self, gates)

    def poison(self) -> None:
        """Break the device as a sticky CUDA error does: engines on it die, every
        waiting and in-flight request fails with :class:`aiodla.EngineDeadError`.
        An ``isolation="process"`` engine loses its worker instead: the requests in
        flight fail with :class:`aiodla.WorkerLostError`, a new worker serves the rest."""
        self.runtime.poison()

    def release_all(self) -> None:
        """Release every gate and pending delay, drop unused faults (teardown does it)."""
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        self._failures.clear()
        self._delays.clear()
        for gate in list(self._held.values()):
            gate.release()
        self._held.clear()

    def close(self) -> None:
        """Release every gate, then the emulated runtime itself (teardown does it)."""
        self.release_all()
        self.runtime.close()

    def leak_report(self) -> str | None:
        """What the runtime did not get back: live handles (an engine opened on it was
        never closed), releases of handles that were not alive; None when all is well."""
        live = {kind: n for kind, n in self.runtime.live_handles().items() if n}
        problems = []
        if live:
            problems.append(
                "emulated DLA handles are still alive at teardown ("
                + ", ".join(f"{kind} {n}" for kind, n in live.items())
                + "): an engine opened on this runtime was not closed; use "
                "'async with Engine(...)' or 'await engine.aclose()'"
            )
        if self._runtime.workers.leaked:
            problems.append(
                f"{self._runtime.workers.leaked} worker process(es) of isolation='process' "
                "engines exited with emulated DLA handles still alive"
            )
        if self.runtime.invalid_releases:
            problems.append(
                f"{self.runtime.invalid_releases} release(s) of handles that were not alive"
            )
        return "; ".join(problems) or None

    def check_released(self) -> None:
        """Raise :class:`HandleLeakError` with the :meth:`leak_report`, if any."""
        report = self.leak_report()
        if report is not None:
            raise HandleLeakError(report)

    # -- seen from the runtime, as each task is submitted ------------------------------------

    def _check_core(self, core: int | None) -> None:
        if core is not None and (
            not isinstance(core, int) or isinstance(core, bool) or not 0 <= core < self._core_count
        ):
            raise ValueError(f"{core=} is not one of the {self._core_count} emulated DLA cores")

    def _is_held(self, core: int) -> bool:
        gate = self._held.get(core)
        if gate is not None and gate.released:
            del self._held[core]
            return False
        return gate is not None

    @staticmethod
    def _take(faults: collections.deque[_Fault], core: int) -> _Fault | None:
        for fault in faults:
            if fault.core is None or fault.core == core:
                faults.remove(fault)
                return fault
        return None

    def _submitting(
        self, core: int, worker: Supervisor | None = None
    ) -> tuple[TaskGate | RemoteGate, float, asyncio.AbstractEventLoop] | None:
        """Arm the faults meant for this task; a delay puts up a gate it will pass.
        ``worker``: the task is being sent to that worker process, so they are armed
        there (sent ahead of the task on its channel), not in this process."""
        runtime = self._runtime
        failure = self._take(self._failures, core)
        if failure is not None:
            if worker is None:
                EmulatedRuntime.fail_next_task(runtime, core, failure.value)
            else:
                worker.control(None, "fail_next_task", (core, failure.value), wait=False)
        if self._is_held(core):
            return None
        delay = self._take(self._delays, core)
        if delay is None:
            return None
        gate: TaskGate | RemoteGate
        if worker is None:
            gate = EmulatedRuntime.hold(runtime, core)
        else:
            gate = runtime.workers.hold(core, only=worker)
        self._held[core] = gate
        seconds, loop = delay.value
        return gate, seconds, loop

    def _submitting_remote(self, worker: Supervisor, core: int) -> None:
        """A process-mode engine is sending a task to ``core`` of its worker."""
        self._submitted(self._submitting(core, worker))

    def _submitted(
        self, delay: tuple[TaskGate | RemoteGate, float, asyncio.AbstractEventLoop] | None
    ) -> None:
        if delay is not None:
            gate, seconds, loop = delay
            self._on_loop(loop, self._start_delay, gate, seconds)
        for waiter in list(self._waiters):
            self._on_loop(waiter.future.get_loop(), waiter.check)

    def _start_delay(self, gate: TaskGate | RemoteGate, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        self._timers.append(loop.call_later(seconds, gate.release))

    @staticmethod
    def _on_loop(loop: asyncio.AbstractEventLoop, callback: Any, *args: Any) -> None:
        """Run ``callback`` on ``loop``: now when this is its thread, else soon."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            callback(*args)
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to wake
            loop.call_soon_threadsafe(callback, *args)


class EngineFactory:
    """Opens emulated engines for one test (the ``aiodla_engine`` fixture).

    ``await factory(spec, ...)`` returns an open :class:`aiodla.Engine` on the
    emulated DLA of :attr:`controls`; every engine it opened is closed at teardown.
    """

    def __init__(self, controls: DLAControls) -> None:
        self.controls = controls
        self._engines: list[Engine] = []

    # The model keywords are emulated_model's, repeated on purpose: the factory's
    # signature documents what it accepts, and forwards each unchanged.
    async def __call__(
        self,
        spec: ModelDescription | None = None,
        *,
        inputs: Sequence[TensorSpec] | None = None,
        outputs: Sequence[TensorSpec] | None = None,
        latency: float | None = None,
        op: str | None = None,
        scale: float | None = None,
        bias: float | None = None,
        compute: ComputeFunction | str | None = None,
        **engine_options: Unpack[EngineKeywords],
    ) -> Engine:
        """An open engine for the described model (see :func:`emulated_model`);
        ``engine_options`` are :class:`aiodla.Engine`'s keywords (``cores``,
        ``max_queue``, ``stage_times``, ...), all but ``runtime``.

        ``compute`` (a callable, or ``"module:function"``) computes the outputs in
        place of the emulator's op: it takes the input arrays by name, as the DLA
        would read them, and returns the outputs by name (``onnx_compute``,
        ``replay``, or your own function; see ``aiodla.emulator``)."""
        if "runtime" in engine_options:
            raise TypeError(
                "aiodla_engine runs its engines on the emulated DLA of aiodla_controls; "
                "it takes no runtime="
            )
        model = emulated_model(
            spec, inputs=inputs, outputs=outputs, latency=latency, op=op, scale=scale, bias=bias
        )
        runtime = self.controls.runtime
        # Bound for this open only: the modules it loads keep it, a later engine of
        # the same model in the test gets its own compute (or none).
        runtime.bind_compute(model, compute)
        try:
            engine = Engine(model, runtime=runtime, **engine_options)
            await engine.open()
        finally:
            runtime.bind_compute(model, None)
        self._engines.append(engine)
        return engine

    async def aclose(self) -> None:
        """Release the controls' gates (so no task is left waiting), then close every
        engine this factory opened, newest first."""
        self.controls.release_all()
        engines, self._engines = self._engines[::-1], []
        for engine in engines:
            await engine.aclose()
