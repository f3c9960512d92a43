"""Fault injection for the emulated runtime, working on its timeline.

Tests reach failure states through it without hardware: a task that fails with a
status, a core that hangs, tasks held at a gate, a poisoned CUDA context, a call that
fails. :class:`EmulatedRuntime` holds a :class:`FaultInjection` and passes its test
controls to it (the controls of ``aiodla.testing`` build on those); also the cuDLA
errors the emulator raises.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

from cuda.bindings import cudla

from ._protocol import CudaCallError

if TYPE_CHECKING:
    from ..emulator._compute import ComputeTask
    from ..emulator._format import EmulatorModel
    from ..emulator._ops import ModelRunner
    from ._timeline import Timeline, _Device

__all__ = ["CallFailures", "EmulatedCudlaError", "FaultInjection", "TaskGate"]

_EXTERNAL_DEVICE = 911  # cudaErrorExternalDevice


def _status(name: str) -> Any:
    # Look members up by value: cuda-bindings 13.3 and 13.5 spell the names differently.
    return cudla.Status(_STATUS_VALUES[name])


_STATUS_VALUES = {
    "invalid_param": 1,
    "out_of_resources": 2,
    "invalid_address": 4,
    "invalid_device": 8,
    "invalid_attribute": 9,
    "memory_registered": 11,
    "invalid_module": 12,
    "unsupported_operation": 13,
    "engine_timeout": 0x40000006,
}


class EmulatedCudlaError(cudla.CudlaError):  # type: ignore[misc]
    """``cudla.CudlaError`` with a sentence saying what the emulator caught."""

    def __init__(self, status: Any, detail: str) -> None:
        super().__init__(int(status))
        self.detail = detail

    def __str__(self) -> str:
        return f"{super().__str__()}: {self.detail}"


def _reject(name: str, detail: str) -> EmulatedCudlaError:
    return EmulatedCudlaError(_status(name), detail)


class TaskGate:
    """Holds a core's tasks before they start, until the test releases them.

    ``held`` counts the tasks submitted to the core while the gate stood. Tests use it
    to reach "a task is in flight on the DLA" without sleeping.
    """

    def __init__(self, faults: FaultInjection, core: int) -> None:
        self._faults = faults
        self.core = core
        self._released = False
        self._condition = threading.Condition()
        self._held = 0

    @property
    def held(self) -> int:
        """Tasks waiting at the gate."""
        return self._held

    @property
    def released(self) -> bool:
        return self._released

    def wait_for_held(self, count: int = 1, timeout: float = 10.0) -> bool:
        """Block until ``count`` tasks wait at the gate; False on timeout."""
        with self._condition:
            return self._condition.wait_for(lambda: self._held >= count, timeout)

    def release(self) -> None:
        """Let the held tasks (and later ones) start now; the gate is then gone."""
        if not self._released:
            self._released = True
            self._faults.release_gate(self)

    def _arrived(self) -> None:
        with self._condition:
            self._held += 1
            self._condition.notify_all()

    def __enter__(self) -> TaskGate:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


@dataclasses.dataclass(eq=False)
class _CallFailure:
    call: str
    after: int
    error: BaseException
    core: int | None


class CallFailures:
    """Runtime calls armed to fail (:meth:`FaultInjection.fail_call`), and the check
    each call makes; ``armed`` spares the calls the check while none is."""

    def __init__(self) -> None:
        self.pending: list[_CallFailure] = []
        self.armed = False
        self._lock = threading.Lock()

    def arm(self, failure: _CallFailure) -> None:
        with self._lock:
            self.pending.append(failure)
            self.armed = True

    def remove(self, failure: _CallFailure) -> None:
        with self._lock:
            self.pending.remove(failure)
            self.armed = bool(self.pending)

    def check(self, call: str, core: int | None = None) -> None:
        """Raise the failure armed for ``call`` (about ``core``) once its turn came."""
        if not self.armed:
            return
        with self._lock:
            for failure in self.pending:
                if failure.call != call or (failure.core is not None and failure.core != core):
                    continue
                if failure.after > 0:
                    failure.after -= 1
                    return
                self.pending.remove(failure)
                self.armed = bool(self.pending)
                raise failure.error


class FaultInjection:
    """The emulated runtime's test controls: inject task failures, hangs, gates,
    poison and failing calls, into the state its ``timeline`` holds."""

    def __init__(self, timeline: Timeline, failures: CallFailures) -> None:
        self._timeline = timeline
        self.failures = failures

    def fail_next_task(self, core: int, status: int, *, on_stream: bool) -> None:
        """See :meth:`EmulatedRuntime.fail_next_task`."""
        self._timeline.core(core).failures.append((int(cudla.Status(int(status))), on_stream))

    def hang_core(self, core: int, hung: bool) -> None:
        """See :meth:`EmulatedRuntime.hang_core`."""
        self._timeline.core(core).hung = hung

    def hold(self, core: int) -> TaskGate:
        """See :meth:`EmulatedRuntime.hold`."""
        timeline = self._timeline
        target = timeline.core(core)
        with timeline.lock:
            gate = target.gate
            if not isinstance(gate, TaskGate):  # (none yet: the timeline knows only Gate)
                gate = target.gate = TaskGate(self, core)
            return gate

    def release_gate(self, gate: TaskGate) -> None:
        timeline = self._timeline
        with timeline.lock:
            core = timeline.cores[gate.core]
            if core.gate is gate:
                core.gate = None
            now = timeline.clock()
            while core.blocked:
                timeline.place(core.blocked.popleft(), now)
            timeline.placed.notify_all()

    def poison(self, code: int) -> None:
        """See :meth:`EmulatedRuntime.poison`."""
        timeline = self._timeline
        with timeline.lock:
            timeline.poisoned = CudaCallError("(context)", code)
            for stream in (*timeline.streams.values(), *timeline.retired):
                stream.operations.clear()
                stream.unplaced.clear()
            for device in timeline.devices.values():
                device.tasks_in_flight = 0
            for core in timeline.cores:
                core.blocked.clear()
            timeline.placed.notify_all()

    def fail_call(
        self, call: str, error: BaseException | int, *, after: int, core: int | None
    ) -> None:
        """See :meth:`EmulatedRuntime.fail_call` (which checks ``call`` names one of
        its methods)."""
        if isinstance(error, int):
            error = (
                EmulatedCudlaError(cudla.Status(error), f"injected failure of {call}")
                if call in _CUDLA_CALLS
                else CudaCallError(call, error)
            )
        self.failures.arm(_CallFailure(call, after, error, core))

    def task_effect(
        self, device: _Device, model: EmulatorModel, runner: ModelRunner
    ) -> _TaskEffect:
        """A task's effect, armed with the faults its core holds as it is submitted
        (they belong to the task then, whenever it starts)."""
        effect = _TaskEffect(self._timeline, device, model, runner)
        core = device.core
        if core.hung:
            effect.hung, effect.status = True, _STATUS_VALUES["engine_timeout"]
        elif core.failures:
            effect.status, effect.on_stream = core.failures.popleft()
        return effect


class _TaskEffect:
    """A task's effect: compute its outputs (unless it failed), latch its status.

    With a compute function (``compute``), the outputs were written on the compute
    thread before the stream reached this effect; a failure of that function is kept
    for the stream's slot (``stream``), where the engine takes it with the completion.
    """

    __slots__ = (
        "compute",
        "device",
        "duration",
        "failure",
        "hung",
        "on_stream",
        "runner",
        "status",
        "stream",
        "timeline",
    )

    def __init__(
        self, timeline: Timeline, device: _Device, model: EmulatorModel, runner: ModelRunner
    ) -> None:
        self.timeline = timeline
        self.device = device
        self.runner = runner
        self.duration = model.latency
        self.status = 0
        self.hung = False
        self.on_stream = False
        self.compute: ComputeTask | None = None
        self.failure: BaseException | None = None
        self.stream = 0

    def __call__(self) -> None:
        device = self.device
        timeline = self.timeline
        if not self.status and timeline.poisoned is None:
            if self.compute is None:
                self.runner()
            elif self.failure is not None:
                timeline.compute_failures[self.stream] = self.failure
        if self.status:
            device.last_error = self.status
            if self.on_stream and timeline.poisoned is None:
                # The stream's later work never completes: every CUDA call from now on,
                # the poller's event query first, raises the sticky error. (The stream
                # being advanced is left as it is; poison() would clear it under us.)
                timeline.poisoned = CudaCallError("(context)", _EXTERNAL_DEVICE)
        device.tasks_in_flight -= 1
        device.core.tasks_completed += 1


_CUDLA_CALLS = frozenset(
    {
        "create_device",
        "destroy_device",
        "load_module",
        "unload_module",
        "module_tensors",
        "mem_register",
        "mem_unregister",
        "submit_task",
        "get_last_error",
        "set_task_timeout",
    }
)
