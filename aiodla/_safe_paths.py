"""Files at paths a user names (``doctor --root``, ``trace=``, ``trace-plot``), read and
written without trusting what is there.

A path may name a FIFO (an open for reading or writing waits for the other end,
forever), a device (``/dev/zero`` never ends), a huge file, or a symbolic link that an
attacker placed where a file will be written. So: opens never block (``O_NONBLOCK``:
a FIFO with no writer opens at once, one with no reader fails at once), only regular
files are read or written (checked on the open descriptor, so the check and the use
see the same file), reads stop at a limit, and a write never follows a final symbolic
link (``O_NOFOLLOW``) and never truncates what it then refuses. Each refusal is an
:class:`UnsafePathError`, an ``OSError`` whose ``strerror`` says what was found.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["UnsafePathError", "read_limited", "write_regular"]

_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOCTTY = getattr(os, "O_NOCTTY", 0)
_BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation


class UnsafePathError(OSError):
    """A path names something that is not a regular file, or one too large to read."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: str | os.PathLike[str], message: str, code: int = errno.EINVAL) -> None:
    raise UnsafePathError(code, message, os.fspath(path))


def read_limited(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file at ``path``, which must hold at most ``limit``.

    Follows symbolic links (a device tree is reached through one); refuses what they
    lead to unless it is a regular file. Raises ``OSError`` (``FileNotFoundError``,
    ``PermissionError``, ...) as ``open`` does, or :class:`UnsafePathError`.
    """
    fd = os.open(path, os.O_RDONLY | _NONBLOCK | _NOCTTY | _CLOEXEC | _BINARY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            _refuse(path, f"{_kind(mode)}, not a regular file: not read")
        chunks = []
        left = limit + 1  # one byte past the limit tells a file that is too large
        while left > 0:
            # (procfs and sysfs files report a size of 0 or 4096: read, do not trust it)
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            _refuse(path, f"larger than {_size(limit)}: not read", errno.EFBIG)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_regular(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path``, created or replaced: a regular file, never through a
    final symbolic link, never a FIFO or device (refused before anything is truncated)."""
    flags = os.O_WRONLY | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _NOCTTY | _CLOEXEC | _BINARY
    try:
        fd = os.open(path, flags, 0o666)
    except OSError:
        _explain(path)
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            _refuse(path, f"{_kind(mode)}, not a regular file: not written")
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return Path(path)


def _explain(path: str | os.PathLike[str]) -> None:
    """Say what ``path`` is when the open for writing failed because of it: O_NOFOLLOW's
    ELOOP (or EMLINK on FreeBSD), a FIFO with no reader's ENXIO, a directory's EISDIR."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if stat.S_ISLNK(mode):
        _refuse(path, "a symbolic link: not followed for writing (name the file itself)")
    if not stat.S_ISREG(mode):
        _refuse(path, f"{_kind(mode)}, not a regular file: not written")


def _size(limit: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if limit >= size and limit % size == 0:
            return f"{limit // size} {unit}"
    return f"{limit} bytes"
