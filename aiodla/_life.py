"""The engine's life: its states, the one record of them, and the health they give.

:class:`~aiodla.Engine` alone writes a :class:`Life`; the flow reads it to know whether
work may start and why it may not.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from ._errors import AiodlaError, EngineClosedError, EngineDeadError
from ._statistics import EngineHealth

if TYPE_CHECKING:
    from ._device import DeviceLayer

__all__ = ["EngineState", "Life"]


class EngineState(enum.Enum):
    NEW = "new"
    OPENING = "opening"
    OPEN = "open"
    DEAD = "dead"  # the device broke it while open; closing it is still up to you
    CLOSING = "closing"
    CLOSED = "closed"


class Life:
    """``state``: work is started only while it is OPEN; after CLOSED a late
    completion is ignored. ``dead_cause``: what broke the engine, recorded once."""

    __slots__ = ("dead_cause", "state")

    def __init__(self) -> None:
        self.state = EngineState.NEW
        self.dead_cause: BaseException | None = None

    def not_serving_error(self) -> AiodlaError:
        """What a request that cannot be served now fails with."""
        if self.dead_cause is not None:
            error: AiodlaError = EngineDeadError(f"the engine is dead: {self.dead_cause}")
            error.__cause__ = self.dead_cause
            return error
        return EngineClosedError("the engine was closed")

    def health(self, device: DeviceLayer) -> EngineHealth:
        """The engine's health (``Engine.health``) from its life and its device layer."""
        if self.dead_cause is not None:
            return EngineHealth("dead", f"the device broke the engine: {self.dead_cause}")
        if self.state is not EngineState.OPEN:
            return EngineHealth("closed", f"the engine is {self.state.value}")
        restarting = device.health()
        if restarting is not None:
            return restarting
        cores = device.lanes
        out = tuple(core.core for core in cores if not core.in_rotation)
        if out:
            serving = [core.core for core in cores if core.in_rotation]
            return EngineHealth(
                "degraded",
                f"core(s) {list(out)} out of rotation after repeated task faults; "
                f"core(s) {serving} serve every request",
                out,
            )
        return EngineHealth("ok", f"serving on core(s) {[core.core for core in cores]}")
