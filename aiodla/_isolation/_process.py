"""The worker process itself: started fresh, killed, reaped.

A fresh interpreter, never a fork (a process with CUDA state must not fork); the set of
workers not reaped yet keeps their ``Popen`` objects alive until they are.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys

_WORKER_MAIN = "from aiodla._isolation._worker import main; main()"


def _spawn() -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A fresh interpreter running the worker, with one end of a socketpair.

    Started from the loop's thread: the kernel's parent-death signal follows the
    thread that started the process, and the loop's thread lives as long as the engine.
    """
    mine, theirs = socket.socketpair()
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    # The worker imports this very aiodla, wherever it was imported from.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (package_root, env.get("PYTHONPATH"))))
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_MAIN, str(theirs.fileno()), str(os.getpid())],
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
