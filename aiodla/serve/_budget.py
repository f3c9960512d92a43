"""The byte budget that HTTP request bodies share while the server holds them.

Each body opens an :class:`Account` for the size it declares (``Content-Length``, or
the request limit for a chunked body) and takes bytes from the budget as they arrive,
so a socket that declares a large body and then goes idle holds only what it sent:
it holds up no one. A grant that would leave the bodies being received unable to all
finish (each one's remaining bytes cannot be covered, in some order, by what is free
plus what the bodies before it will give back) waits instead: the banker's rule for
one resource. So bodies arriving interleaved never fill the budget with halves that
wait for each other; waits are granted first come first served (see ``_grant``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

__all__ = ["Account", "ByteBudget"]


class Account:
    """One body's share: ``need`` bytes still to come, ``held`` bytes taken."""

    def __init__(self, budget: ByteBudget, size: int) -> None:
        self._budget = budget
        self.need = size
        self.held = 0

    async def take(self, size: int) -> None:
        """Take ``size`` more bytes of the body, waiting until that is safe.

        Cancellation: a cancelled wait takes nothing and holds up no one.
        """
        await self._budget._take(self, size)


class ByteBudget:
    """At most ``capacity`` bytes held at once by the open accounts."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self._accounts: set[Account] = set()
        self._need = 0  # the accounts' needs, summed
        self._waiting: collections.deque[tuple[Account, int, asyncio.Future[None]]] = (
            collections.deque()
        )

    @contextlib.asynccontextmanager
    async def account(self, size: int) -> AsyncIterator[Account]:
        """An account for a body of at most ``size`` bytes (at most the capacity),
        closed, with what it holds given back, at the end of the block."""
        account = Account(self, min(size, self.capacity))
        self._accounts.add(account)
        self._need += account.need
        try:
            yield account
        finally:
            self._accounts.discard(account)
            self._need -= account.need
            self.held -= account.held
            account.need = account.held = 0
            self._grant()

    async def _take(self, account: Account, size: int) -> None:
        size = min(size, account.need)  # a body is cut at its declared size before this
        if not self._waiting and self._safe(account, size):
            self._move(account, size)
            return
        future = asyncio.get_running_loop().create_future()
        entry = (account, size, future)
        self._waiting.append(entry)
        self._grant()  # safe now, although waits before it are not
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._give_back(account, size)  # granted as the wait was cancelled
            else:
                self._waiting.remove(entry)
                self._grant()
            raise

    def _move(self, account: Account, size: int) -> None:
        account.need -= size
        account.held += size
        self._need -= size
        self.held += size

    def _give_back(self, account: Account, size: int) -> None:
        account.need += size
        account.held -= size
        self._need += size
        self.held -= size
        self._grant()

    def _safe(self, account: Account, size: int) -> bool:
        """Whether, with ``size`` more bytes granted to ``account``, every open account
        can still finish in some order."""
        free = self.capacity - self.held - size
        if free < 0:
            return False
        if free >= self._need - size:
            return True  # everything still to come fits at once: the common case
        # Smallest need first: each finished body gives back what it held.
        for other in sorted(self._accounts, key=lambda a: a.need - (size if a is account else 0)):
            need, held = other.need, other.held
            if other is account:
                need, held = need - size, held + size
            if need > free:
                return False
            free += held
        return True

    def _grant(self) -> None:
        # First come first served, except that a body already arriving may pass a wait
        # that is not safe yet: some arriving body can always finish (the state is
        # safe), and it may be one that waits behind. A body yet to take its first
        # bytes never passes another, so none starves.
        blocked = False
        for entry in list(self._waiting):
            account, size, future = entry
            if future.done() or (blocked and not account.held):
                continue  # a cancelled wait (its task takes it out), or not its turn
            if self._safe(account, size):
                self._waiting.remove(entry)
                self._move(account, size)
                future.set_result(None)
            else:
                blocked = True
