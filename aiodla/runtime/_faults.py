"""Fault injection for the emulated runtime, a layer over its timeline.

Tests reach failure states through it without hardware: a task that fails with a
status, a core that hangs, tasks held at a gate, a poisoned CUDA context, a call that
fails. :class:`FaultInjection` is what :class:`EmulatedRuntime` and the controls of
``aiodla.testing`` build on; also the cuDLA errors the emulator raises.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

from cuda.bindings import cudla

from .._errors import ConfigurationError
from ._protocol import CudaCallError
from ._timeline import Timeline

if TYPE_CHECKING:
    from ..emulator._compute import ComputeTask
    from ..emulator._format import EmulatorModel
    from ..emulator._ops import ModelRunner
    from ._timeline import _Device

__all__ = ["EmulatedCudlaError", "FaultInjection", "TaskGate"]

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

    def __init__(self, runtime: FaultInjection, core: int) -> None:
        self._runtime = runtime
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
            self._runtime._release_gate(self)

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


class FaultInjection(Timeline):
    """The emulated runtime's test controls: inject task failures, hangs, gates,
    poison and failing calls. ``_call_failures`` is created by the runtime."""

    _call_failures: list[_CallFailure]
    _devices: dict[int, _Device]

    def fail_next_task(
        self, core: int, status: int = 0x40000001, *, on_stream: bool = False
    ) -> None:
        """The next task submitted to ``core`` fails with ``status`` (a cudlaStatus);
        its outputs are not written.

        By default the failure shows only through ``get_last_error``. ``on_stream=True``
        makes it surface as a DLA hardware fault does in hybrid mode (NVIDIA's
        cuDLAErrorReporting sample): a sticky ``cudaErrorExternalDevice`` on the task's
        stream, which poisons the context, while ``get_last_error`` still reports the
        status.
        """
        self._core(core).failures.append((int(cudla.Status(int(status))), on_stream))

    def hang_core(self, core: int, hung: bool = True) -> None:
        """Tasks submitted to ``core`` from now hang until the device's task timeout,
        then fail with ``ERROR_DLA_ERR_ENGINE_TIMEOUT``; ``hung=False`` ends that."""
        self._core(core).hung = hung

    def hold(self, core: int) -> TaskGate:
        """Hold every task submitted to ``core`` before it starts, until released."""
        target = self._core(core)
        with self._lock:
            gate = target.gate
            if not isinstance(gate, TaskGate):  # (none yet: the timeline knows only Gate)
                gate = target.gate = TaskGate(self, core)
            return gate

    def _release_gate(self, gate: TaskGate) -> None:
        with self._lock:
            core = self._cores[gate.core]
            if core.gate is gate:
                core.gate = None
            now = self._clock()
            while core.blocked:
                self._place(core.blocked.popleft(), now)
            self._placed.notify_all()

    def poison(self, code: int = _EXTERNAL_DEVICE) -> None:
        """Poison the CUDA context: from now every CUDA call raises a sticky error, and
        the work queued on the device is lost. Releasing a CUDA handle then raises too,
        but the handle counts as released (the process's end reclaims it)."""
        with self._lock:
            self._poisoned = CudaCallError("(context)", code)
            for stream in (*self._streams.values(), *self._retired):
                stream.operations.clear()
                stream.unplaced.clear()
            for device in self._devices.values():
                device.tasks_in_flight = 0
            for core in self._cores:
                core.blocked.clear()
            self._placed.notify_all()

    def fail_call(
        self,
        call: str,
        error: BaseException | int,
        *,
        after: int = 0,
        core: int | None = None,
    ) -> None:
        """Make the runtime method ``call`` fail once, after ``after`` successful calls.

        ``error`` is an exception, or a number: a cudlaStatus for cuDLA calls, a
        cudaError_t for CUDA calls. ``core`` limits it to calls about that DLA core.
        """
        if not callable(getattr(self, call, None)) or call.startswith("_"):
            raise ConfigurationError(f"{call=} is not a runtime method")
        if isinstance(error, int):
            error = (
                EmulatedCudlaError(cudla.Status(error), f"injected failure of {call}")
                if call in _CUDLA_CALLS
                else CudaCallError(call, error)
            )
        self._call_failures.append(_CallFailure(call, after, error, core))

    def _check_injected(self, call: str, core: int | None = None) -> None:
        if not self._call_failures:
            return
        with self._lock:
            for failure in self._call_failures:
                if failure.call != call or (failure.core is not None and failure.core != core):
                    continue
                if failure.after > 0:
                    failure.after -= 1
                    return
                self._call_failures.remove(failure)
                raise failure.error

    def _task_effect(
        self, device: _Device, model: EmulatorModel, runner: ModelRunner
    ) -> _TaskEffect:
        """A task's effect, armed with the faults its core holds as it is submitted
        (they belong to the task then, whenever it starts)."""
        effect = _TaskEffect(self, device, model, runner)
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
        "runtime",
        "status",
        "stream",
    )

    def __init__(
        self, runtime: Timeline, device: _Device, model: EmulatorModel, runner: ModelRunner
    ) -> None:
        self.runtime = runtime
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
        if not self.status and self.runtime._poisoned is None:
            if self.compute is None:
                self.runner()
            elif self.failure is not None:
                self.runtime._compute_failures[self.stream] = self.failure
        if self.status:
            device.last_error = self.status
            if self.on_stream and self.runtime._poisoned is None:
                # The stream's later work never completes: every CUDA call from now on,
                # the poller's event query first, raises the sticky error. (The stream
                # being advanced is left as it is; poison() would clear it under us.)
                self.runtime._poisoned = CudaCallError("(context)", _EXTERNAL_DEVICE)
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
