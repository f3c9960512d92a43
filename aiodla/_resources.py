"""Release device resources in reverse order of creation, exactly once, even after errors."""

from __future__ import annotations

import logging
from collections.abc import Callable, Container
from typing import Any

__all__ = ["ResourceStack"]

logger = logging.getLogger("aiodla")


class ResourceStack:
    """Remembers how to release each resource as it is created.

    ``release_all`` calls the releases newest first; a release that raises is logged
    and collected, and the rest still run. Each release runs at most once. Every entry
    names an ``owner`` (a DLA core): the owners in ``keep`` are left alone, for a core
    whose hung task still uses its memory.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[str, object, Callable[..., Any], tuple[Any, ...]]] = []

    def push(self, what: str, owner: object, release: Callable[..., Any], *args: Any) -> None:
        self._entries.append((what, owner, release, args))

    def __len__(self) -> int:
        return len(self._entries)

    def release_all(self, keep: Container[object] = ()) -> list[tuple[str, BaseException]]:
        """Release every entry whose owner is not in ``keep``; returns the failures."""
        failures: list[tuple[str, BaseException]] = []
        kept = []
        while self._entries:
            entry = self._entries.pop()
            what, owner, release, args = entry
            if owner in keep:
                kept.append(entry)
                continue
            try:
                release(*args)
            except Exception as exc:
                logger.warning("aiodla: releasing %s failed: %s", what, exc)
                failures.append((what, exc))
        kept.reverse()
        self._entries = kept
        return failures
