"""A submission that fails in the worker is what it is in-process: the request fails,
no task is counted, and a probe that was never submitted does not bring its core back.
And a worker that hangs while opening the model is a clear error, not a bare timeout."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import numpy as np
import pytest

from aiodla import DeviceError, EmulatedRuntime, Engine, WorkerLostError
from aiodla._isolation import _supervisor, inject_fault

from support import X, affine_model, take_core_out

ONES = np.ones(X.shape, np.float32)
ENGINE_TIMEOUT = 0x40000006
MODES = ["thread", "process"]


def engine_in(mode: str, **options: Any) -> tuple[Engine, EmulatedRuntime | None]:
    if mode == "process":
        return Engine(affine_model(), runtime="emulated", isolation="process", **options), None
    runtime = EmulatedRuntime()
    return Engine(affine_model(), runtime=runtime, **options), runtime


async def arm(engine: Engine, runtime: EmulatedRuntime | None, name: str, *args: Any) -> None:
    if runtime is None:
        await inject_fault(engine, name, *args)
    else:
        getattr(runtime, name)(*args)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_a_failed_submission_counts_no_task(mode: str) -> None:
    engine, runtime = engine_in(mode, cores=[0])
    async with engine:
        await arm(engine, runtime, "fail_call", "submit_task", 1)
        with pytest.raises(DeviceError, match="submitting the request"):
            await engine.infer(ONES)
        await engine.infer(ONES)
        stats = engine.statistics()
        assert stats.cores[0].completed == 1 and stats.cores[0].failed == 0
        assert stats.failed == 1 and stats.completed == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", MODES)
async def test_a_probe_that_was_never_submitted_keeps_its_core_out(mode: str) -> None:
    engine, runtime = engine_in(mode, cores=[0, 1], max_consecutive_faults=1, probe_interval=0.3)
    async with engine:
        await take_core_out(
            engine, lambda: arm(engine, runtime, "fail_next_task", 0, ENGINE_TIMEOUT), 0
        )
        await arm(engine, runtime, "fail_call", "submit_task", 1)  # the probe's submission
        await asyncio.sleep(0.45)  # the first probe (~0.3 s) ran, the next (~0.6 s) not yet
        assert not engine.statistics().cores[0].in_rotation


@pytest.mark.asyncio
async def test_a_worker_that_hangs_while_opening_is_a_worker_lost_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_supervisor, "OPEN_TIMEOUT", 0.5)
    spawn = _supervisor._spawn

    def hanging_spawn() -> Any:
        process, sock = spawn()
        os.kill(process.pid, signal.SIGSTOP)  # hung before it could open anything
        return process, sock

    monkeypatch.setattr(_supervisor, "_spawn", hanging_spawn)
    engine = Engine(affine_model(), runtime="emulated", isolation="process")
    with pytest.raises(WorkerLostError, match=r"did not open the model within 0.5 s") as caught:
        await engine.open()
    assert caught.value.exit_status == -signal.SIGKILL  # killed and reaped, not left
