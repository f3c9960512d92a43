"""aiodla's cache directory on disk, and entries in it that only this user can have put.

Every cache the library writes lives under one directory: ``$AIODLA_CACHE_DIR``, else
``$XDG_CACHE_HOME/aiodla``, else ``~/.cache/aiodla``, each cache in a folder of its
own. What is read back from it is loaded into the process (compiled GPU code), so
another user who could write there could run code as this one. Hence:

- the directories aiodla creates are ``0700``, its entries ``0600``;
- a directory or entry that is a symbolic link, owned by another user, or writable by
  the group or the world is refused with a warning naming it: the caller then keeps
  what it built in memory and writes nothing there;
- each entry carries a SHA-256 of its content, so a truncated or damaged one is a miss,
  rebuilt and rewritten, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "CacheWarning",
    "EntryRefused",
    "cache_dir",
    "cache_folder",
    "read_entry",
    "unsafe",
    "write_entry",
]

_MAGIC = b"AIODLAK1"
_DIGEST = 32  # SHA-256


class CacheWarning(UserWarning):
    """A cache directory or entry was refused (it says which and why)."""


class EntryRefused(Exception):
    """The entry may not be trusted (a :class:`CacheWarning` said why): build again,
    and write nothing over it."""


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The root of aiodla's caches: ``$AIODLA_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/aiodla``, else ``~/.cache/aiodla``."""
    env = os.environ if environ is None else environ
    explicit = env.get("AIODLA_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    # The XDG spec says a relative path is invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "aiodla"
    return Path.home() / ".cache" / "aiodla"


def unsafe(info: os.stat_result, kind: str) -> str | None:
    """Why a directory or entry with this ``lstat`` may not be trusted, or None."""
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    wanted = stat.S_ISDIR if kind == "directory" else stat.S_ISREG
    if not wanted(info.st_mode):
        return f"it is not a {kind}"
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        return f"it is owned by another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def cache_folder(folder: Path) -> Path | None:
    """``folder``, created ``0700`` where missing (its parents too), if it is safe to
    use; else None, with a :class:`CacheWarning` saying why (an unusable one, such as
    a read-only home, is None without a warning: it only costs a rebuild)."""
    try:
        _make_private(folder)
        info = os.lstat(folder)
    except OSError:
        return None
    reason = unsafe(info, "directory")
    if reason is not None:
        _refuse(folder, reason, "directory")
        return None
    return folder


def read_entry(path: Path) -> bytes | None:
    """The content of the entry at ``path``: None when it is missing or damaged (a
    rebuild rewrites it); :class:`EntryRefused` when it may not be trusted."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError:
        # O_NOFOLLOW on a link fails with ELOOP: say so rather than treat it as a miss.
        if os.path.islink(path):
            _refuse(path, "it is a symbolic link", "entry")
        return None
    with os.fdopen(descriptor, "rb") as file:
        reason = unsafe(os.fstat(file.fileno()), "file")
        if reason is not None:
            _refuse(path, reason, "entry")
        try:
            data = file.read()
        except OSError:
            return None
    header = len(_MAGIC) + _DIGEST
    if len(data) <= header or not data.startswith(_MAGIC):
        return None
    digest, content = data[len(_MAGIC) : header], data[header:]
    return content if hashlib.sha256(content).digest() == digest else None


def write_entry(path: Path, content: bytes) -> None:
    """Write the entry atomically (a ``0600`` temporary file, then a rename): a
    concurrent reader sees all or nothing. A folder that cannot be written only costs a
    rebuild next time."""
    try:
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(_MAGIC + hashlib.sha256(content).digest() + content)
        os.replace(temp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp)


def _make_private(folder: Path) -> None:
    """Create ``folder`` and any missing parent ``0700`` (whatever the umask)."""
    missing = []
    for candidate in (folder, *folder.parents):
        if os.path.lexists(candidate):
            break
        missing.append(candidate)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it first
            os.mkdir(directory, 0o700)
            os.chmod(directory, 0o700)


def _refuse(path: Path, reason: str, kind: str) -> None:
    """Warn that ``path`` is refused; an entry's refusal also raises EntryRefused."""
    warnings.warn(
        f"aiodla: not using the cache {kind} {path}: {reason}; what it would hold is "
        "built again and kept in memory",
        CacheWarning,
        stacklevel=3,
    )
    if kind == "entry":
        raise EntryRefused(f"{path}: {reason}")
