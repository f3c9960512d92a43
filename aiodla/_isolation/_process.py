"""A child process itself (the engine's worker, a video source's decoding process):
started fresh, tied to its parent's life, killed, reaped.

A fresh interpreter, never a fork (a process with CUDA state must not fork); the set of
children not reaped yet keeps their ``Popen`` objects alive until they are.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys

_WORKER_MAIN = "from aiodla._isolation._worker import main; main()"


_PR_SET_PDEATHSIG = 1


def _spawn(main: str = _WORKER_MAIN) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A fresh interpreter running ``main`` (Python source; by default the engine's
    worker), with one end of a socketpair: ``main`` finds that end's descriptor and
    the parent's pid in ``sys.argv[1:3]``.

    Start it from a thread that lives as long as the child is wanted: the kernel's
    parent-death signal follows the thread that started the process (the engine's
    worker starts from the loop's thread, which lives as long as the engine; a
    decoding process from its source's reader thread).
    """
    mine, theirs = socket.socketpair()
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    # The worker imports this very aiodla, wherever it was imported from.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (package_root, env.get("PYTHONPATH"))))
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", main, str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    _LIVE_WORKERS.add(process)
    return process, mine


# Workers not reaped yet. Held here so that a worker's Popen is never collected with
# an engine dropped unclosed (it would warn that its process still runs before the
# engine's own finalizer could kill it).
_LIVE_WORKERS: set[subprocess.Popen[bytes]] = set()


def _wait(process: subprocess.Popen[bytes], timeout: float | None = None) -> int:
    status = process.wait(timeout)
    _LIVE_WORKERS.discard(process)
    return status


def _kill(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)


def die_with(parent: int) -> None:
    """In a child: have the kernel kill this process when its parent dies (Linux); if
    the parent is gone already, go now. The channel's end-of-file is the portable
    second check."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)
