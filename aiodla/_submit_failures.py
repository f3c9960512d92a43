"""What a failed submission does to its request and its slot (mixed into the flow).

A runtime call of a submission raised: the request fails with a
:class:`~aiodla.DeviceError` naming the call, a sticky CUDA error kills the engine
instead, a probe is tried again later, and the slot returns to the pool only once what
reached its stream ran: after the end mark that ``retire`` recorded. A slot whose end
could not be marked is lost to the pool: it may never be safe to reuse.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._cores import Cores, Slot, device_error, is_sticky
from ._errors import AiodlaError

if TYPE_CHECKING:
    from ._cores import CoreState
    from ._flow import CompletionSource
    from ._scheduler import Request

__all__ = ["SubmitFailures"]

logger = logging.getLogger("aiodla")


class SubmitFailures:
    """Mixed into :class:`~aiodla._flow.Flow`."""

    cores: Cores
    poller: CompletionSource | None
    _die_callback: Callable[[BaseException], None]

    if TYPE_CHECKING:

        def release(self, slot: Slot) -> None: ...
        def _finish(self, request: Request, *, error: BaseException | None = None) -> Any: ...
        def _schedule_probe(self, core: CoreState) -> None: ...

    def _submit_failed(self, slot: Slot, request: Request | None, exc: Exception) -> None:
        if not self._fail_submission(slot, request, exc):
            return
        # Some copies may be queued on the stream already: the slot is reusable only
        # after they ran, so mark the stream's end and let the poller return the slot.
        if self.cores.retire(slot, time.monotonic()):
            self.poller.watch(slot)  # type: ignore[union-attr]

    def _fail_submission(self, slot: Slot, request: Request | None, exc: Exception) -> bool:
        """The request's and the slot's share of a failed submit; False when the error
        killed the engine."""
        if is_sticky(exc):
            self._die_callback(exc)
            return False
        doing = f"core {slot.core.core}: submitting the request"
        error = device_error(doing, exc) or AiodlaError(f"{doing} failed: {exc!r}")
        error.__cause__ = exc
        if slot.request is not None:
            slot.request.slot = None
            slot.request = None
        if request is not None:
            self._finish(request, error=error)
        else:
            logger.warning("aiodla: %s", error)
        if slot.probing:  # the probe never ran: try again later
            slot.probing = False
            self._schedule_probe(slot.core)
        return True
