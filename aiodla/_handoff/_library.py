"""The submitter thread's C library: compiled once per source and compiler, then cached.

aiodla ships ``submitter.c`` as package data and builds it with the host's C compiler the
first time an engine asks for it (``$AIODLA_CC``, else ``$CC``, else ``cc``), into
``$AIODLA_CACHE_DIR`` (else ``$XDG_CACHE_HOME/aiodla``, else ``~/.cache/aiodla``). The
file name carries a hash of the source and the compiler, so an edited source or another
compiler builds anew, and processes that build at once each write their own temporary
file and rename it into place. The library is plain C (no Python headers): one build
serves every Python version.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["ABI", "HandoffUnavailableError", "cache_dir", "compiler", "load"]

ABI = 2  # AIODLA_HANDOFF_ABI in submitter.c; 2: the bind status apart from errno
_SOURCE = "submitter.c"
_FLAGS = ("-O2", "-std=c11", "-shared", "-fPIC", "-pthread")
_lock = threading.Lock()
_loaded: dict[tuple[str, ...], Library] = {}


class HandoffUnavailableError(RuntimeError):
    """The submitter thread's library could not be built or loaded (says why)."""


class Library:
    """The library's entry points with their prototypes.

    The loop's and the poller's per-request calls keep the GIL (they take a mutex or
    read an atomic: releasing the GIL would cost more); ``start`` and ``destroy`` wait
    for the thread, which may need the GIL for a Python runtime's calls, so they
    release it.
    """

    def __init__(self, path: Path) -> None:
        released = ctypes.CDLL(str(path))
        held = ctypes.PyDLL(str(path))
        u32, u64, pointer = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
        self.path = path
        self.abi = _function(released, "aiodla_handoff_abi", ctypes.c_int)
        self.create = _function(
            released, "aiodla_handoff_create", pointer, u32, *(pointer,) * 4, u64, u64, u64
        )
        status = ctypes.POINTER(ctypes.c_int)
        self.start = _function(released, "aiodla_handoff_start", ctypes.c_int, pointer, status)
        self.destroy = _function(released, "aiodla_handoff_destroy", None, pointer)
        self.push = _function(held, "aiodla_handoff_push", ctypes.c_int, pointer, u32, *(u64,) * 6)
        self.state = _function(held, "aiodla_handoff_state", ctypes.c_int, pointer, u32)
        code = ctypes.POINTER(ctypes.c_int32)
        code = ctypes.POINTER(ctypes.c_int32)
        self.failure = _function(held, "aiodla_handoff_failure", ctypes.c_int, pointer, u32, code)
        self.counts = _function(
            released, "aiodla_handoff_counts", None, pointer, ctypes.POINTER(u64)
        )


def _function(library: ctypes.CDLL, name: str, result: Any, *arguments: Any) -> Any:
    function = getattr(library, name)
    function.restype = result
    function.argtypes = arguments
    return function


def compiler() -> list[str]:
    """The C compiler command: ``$AIODLA_CC``, else ``$CC``, else ``cc``."""
    return shlex.split(os.environ.get("AIODLA_CC") or os.environ.get("CC") or "cc")


def cache_dir() -> Path:
    """Where built libraries are kept."""
    chosen = os.environ.get("AIODLA_CACHE_DIR")
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aiodla"


def load() -> Library:
    """The library, built first if this source and compiler have no build cached yet.
    Raises :class:`HandoffUnavailableError` saying why when it cannot be."""
    command = compiler()
    key = tuple(command)
    with _lock:
        library = _loaded.get(key)
        if library is None:
            library = Library(_build(command))
            if library.abi() != ABI:
                raise HandoffUnavailableError(f"{library.path} is not ABI {ABI}")
            _loaded[key] = library
        return library


def _build(command: list[str]) -> Path:
    source = resources.files(__package__).joinpath(_SOURCE).read_bytes()
    if not command or shutil.which(command[0]) is None:
        raise HandoffUnavailableError(
            f"no C compiler {command[0] if command else ''!r} on PATH (set AIODLA_CC)"
        )
    digest = hashlib.sha256(source + "\0".join([*command, *_FLAGS]).encode()).hexdigest()[:16]
    directory = cache_dir()
    target = directory / f"libaiodla-handoff-{digest}.so"
    if target.exists():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            source_path = Path(scratch) / _SOURCE
            source_path.write_bytes(source)
            built = Path(scratch) / target.name
            result = subprocess.run(
                [*command, *_FLAGS, "-o", str(built), str(source_path)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if result.returncode != 0:
                detail = (result.stderr or result.stdout).strip()[-2000:]
                raise HandoffUnavailableError(
                    f"building the submitter thread's library with {shlex.join(command)} "
                    f"failed (exit {result.returncode}): {detail}"
                )
            os.replace(built, target)
    except OSError as exc:
        raise HandoffUnavailableError(
            f"building the submitter thread's library in {directory} failed: {exc}"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise HandoffUnavailableError(f"{shlex.join(command)} ran over 120 s") from exc
    return target
