"""The server's log, rate-limited: a client can make the server log (a malformed
request, a failed TLS handshake, a connection over the cap), so each kind of line is
written at most :data:`BURST` times in :data:`PERIOD` seconds; the next one written
after a pause says how many like it were left out, and so does the last server's end.

A kind of line is its logger, level and message template (``"HTTP %d to %s: %s"``,
whatever the values). The filter sits on the loggers the server's fronts write to
(:data:`LOGGERS`) while a server runs; a logger's filter sees only that logger's own
records, so other parts of an application are untouched.
"""

from __future__ import annotations

import collections
import logging
import time

__all__ = ["BURST", "LOGGERS", "PERIOD", "RateLimit", "rate_limited"]

#: Lines of one kind written per period, at most.
BURST = 10
#: Seconds of one period.
PERIOD = 60.0
#: The loggers a server's fronts write to: aiodla's, aiohttp's, asyncio's (a failed
#: accept, an SSL error in a transport).
LOGGERS = ("aiodla.serve", "aiohttp.server", "aiohttp.web", "aiohttp.access", "asyncio")
#: Kinds of lines remembered, at most (the oldest are forgotten first).
MAX_KINDS = 1024


class RateLimit(logging.Filter):
    """At most ``burst`` records of one kind per ``period`` seconds."""

    def __init__(self, burst: int = BURST, period: float = PERIOD) -> None:
        super().__init__()
        self.burst = burst
        self.period = period
        # kind -> [start of its period, records let through in it, records left out]
        self._kinds: collections.OrderedDict[tuple[str, int, str], list[float]] = (
            collections.OrderedDict()
        )

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        state = self._kinds.get(kind)
        if state is None:
            state = self._kinds[kind] = [now, 0.0, 0.0]
            if len(self._kinds) > MAX_KINDS:
                self._kinds.popitem(last=False)
        else:
            self._kinds.move_to_end(kind)
        if now - state[0] >= self.period:
            state[0], state[1] = now, 0.0
        if state[1] >= self.burst:
            state[2] += 1
            return False
        state[1] += 1
        if state[2]:
            left_out, state[2] = int(state[2]), 0.0
            record.msg = f"{record.getMessage()} ({left_out} more like it left out)"
            record.args = None
        return True

    def left_out(self) -> list[tuple[str, int, str, int]]:
        """The kinds with lines left out since their last line: (logger, level,
        template, count), each count then reset."""
        found: list[tuple[str, int, str, int]] = []
        for (name, level, template), state in self._kinds.items():
            if state[2]:
                found.append((name, level, template, int(state[2])))
                state[2] = 0.0
        return found


class _Installed:
    """One filter on :data:`LOGGERS` while at least one server runs."""

    def __init__(self) -> None:
        self.filter = RateLimit()
        self.users = 0

    def add(self) -> None:
        if not self.users:
            for name in LOGGERS:
                logging.getLogger(name).addFilter(self.filter)
        self.users += 1

    def remove(self) -> None:
        self.users -= 1
        if not self.users:
            for name in LOGGERS:
                logging.getLogger(name).removeFilter(self.filter)
            # What was left out since its kind's last line, said once at the end.
            for name, level, template, count in self.filter.left_out():
                logging.getLogger(name).log(
                    level, "%d more lines like %r were left out", count, template
                )


rate_limited = _Installed()
