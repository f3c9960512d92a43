"""The controls of ``aiodla.testing`` reaching the worker of a process-mode engine.

An engine opened with ``isolation="process"`` on :attr:`DLAControls.runtime` runs an
emulated runtime of its own in its worker process. :class:`Workers` keeps the workers
of such engines (each attached by the engine as it opens, detached as it closes) and
forwards the controls to them over the engine's control channel, as a blocking round
trip: a control has acted before the test's next line, as in-process. A held core is a
:class:`RemoteGate`, the worker's gates seen from here.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._errors import WorkerLostError
from .._isolation._worker import LEAKED_EXIT

if TYPE_CHECKING:
    from .._isolation._supervisor import Supervisor

__all__ = ["RemoteGate", "Workers"]


class RemoteGate:
    """Tasks held on one core of one or more workers, as :class:`TaskGate` holds them
    in-process: ``held`` counts the tasks that reached it, ``release()`` lets them go."""

    def __init__(self, core: int, gates: list[tuple[Supervisor, int]]) -> None:
        self.core = core
        self._gates = gates
        self._released = False

    @property
    def held(self) -> int:
        """Tasks that reached the gate (a round trip to each worker)."""
        return sum(_ask(supervisor, number, "held", 0) for supervisor, number in self._gates)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Let the held tasks start now; idempotent. A lost worker's gate went with it."""
        if self._released:
            return
        self._released = True
        for supervisor, number in self._gates:
            _ask(supervisor, number, "release", None)

    def __enter__(self) -> RemoteGate:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "holding"
        return f"<RemoteGate core {self.core} {state}, {len(self._gates)} worker(s)>"


def _ask(supervisor: Supervisor, gate: int, name: str, default: Any) -> Any:
    """A gate's answer; ``default`` when its worker is gone (its gates went with it)."""
    try:
        return supervisor.control(gate, name)
    except WorkerLostError:
        return default


class Workers:
    """The worker processes of the process-mode engines open on one controlled runtime."""

    def __init__(self, cores: int) -> None:
        self._core_count = cores
        # Weakly: the controls must not keep an engine dropped unclosed alive (its
        # collection warns, and kills its worker).
        self._attached: weakref.WeakSet[Supervisor] = weakref.WeakSet()
        self._numbers = itertools.count()  # gate numbers, unique across workers
        self.leaked = 0  # workers that exited with handles still alive
        # The task counters of closed workers, by core, read as each closed: the
        # runtime's counters outlive its engines, as in-process.
        self.closed_tasks = [0] * cores
        self.closed_busy_time = [0.0] * cores

    def __bool__(self) -> bool:
        return bool(self._attached)

    def attach(
        self, supervisor: Supervisor, on_submit: Callable[[Supervisor, int], None]
    ) -> Callable[[], None]:
        """Forward the controls to this engine's worker until the returned function
        is called (the engine's close); ``on_submit`` hears of each submission."""
        self._attached.add(supervisor)
        supervisor.submit_hook = lambda core: on_submit(supervisor, core)
        supervisor.close_hook = lambda: self._keep_counters(supervisor)

        def detach() -> None:
            supervisor.submit_hook = supervisor.close_hook = None
            self._attached.discard(supervisor)
            if supervisor.exit_status == LEAKED_EXIT:
                self.leaked += 1

        return detach

    def _keep_counters(self, supervisor: Supervisor) -> None:
        """The worker is about to close: keep what its cores did."""
        for core in range(self._core_count):
            with contextlib.suppress(WorkerLostError, TimeoutError):
                tasks = supervisor.control(None, "core_tasks", (core,))
                busy = supervisor.control(None, "core_busy_time", (core,))
                self.closed_tasks[core] += tasks
                self.closed_busy_time[core] += busy

    def act(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Apply the runtime control ``name`` in every worker; raises its error (and
        :class:`aiodla.WorkerLostError` while a worker is being replaced)."""
        for supervisor in list(self._attached):
            supervisor.control(None, name, args, kwargs)

    def count(self, name: str, *args: Any) -> list[Any]:
        """The counter ``name`` of every worker that serves now."""
        answers = []
        for supervisor in list(self._attached):
            try:
                answers.append(supervisor.control(None, name, args))
            except WorkerLostError:
                continue  # a worker being replaced: its counts went with it
        return answers

    def hold(self, core: int, only: Supervisor | None = None) -> RemoteGate:
        """Hold ``core`` in every worker (or in ``only``'s, without waiting: it is
        sent ahead of the submission being made)."""
        gates = []
        for supervisor in [only] if only is not None else list(self._attached):
            number = next(self._numbers)
            supervisor.control(None, "hold", (core, number), wait=only is None)
            gates.append((supervisor, number))
        return RemoteGate(core, gates)
