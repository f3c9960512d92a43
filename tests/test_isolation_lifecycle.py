"""An engine in process mode dropped unclosed while its loop runs is collected as an
in-process one is: it warns, and its worker is killed and reaped (no zombie)."""

from __future__ import annotations

import asyncio
import gc
import os
import warnings
import weakref

import pytest

from aiodla import Engine

from support import affine_model


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore::ResourceWarning")
async def test_a_dropped_engine_is_collected_and_its_worker_reaped() -> None:
    engine = Engine(affine_model(), runtime="emulated", isolation="process", cores=[0])
    await engine.__aenter__()
    pid = engine.statistics().worker.pid  # type: ignore[union-attr]
    collected = weakref.ref(engine)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del engine
        gc.collect()
        await asyncio.sleep(0.1)
    assert collected() is None
    assert any("unclosed engine" in str(w.message) for w in caught)
    assert reaped(pid)


def reaped(pid: int) -> bool:
    """Gone, and waited for already: not even a zombie is left."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return not os.path.exists(f"/proc/{pid}")
    return False
