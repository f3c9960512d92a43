"""The engine's life: its states, and the one record of them.

:class:`~aiodla.Engine` alone writes a :class:`Life`; the flow reads it to know whether
work may start and why it may not.
"""

from __future__ import annotations

import enum

from ._errors import AiodlaError, EngineClosedError, EngineDeadError

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
