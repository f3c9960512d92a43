"""Engine(isolation="process") on the GPU: the CUDA runtime and the stand-in in a worker.

The same faults as tests/test_isolation.py, with the real ``cuda.bindings`` code in the
worker process: a DLA fault surfacing on the stream (the stand-in's trap, which loses
the worker's CUDA context), a SIGKILL of the worker and a hung worker (SIGSTOP). Each
costs only the requests the worker held; every queued request completes, correctly, on
the worker that replaces it; and nothing is left behind: the worker's handle
accounting (the stand-in's handles and CUDA resources, the worker's exit status), and
in this process the shared-memory segments and file descriptors.

The application's process (pytest's) has the stand-in loaded only so that the engine
can hand its path to the worker; the staging buffers the worker pins here are a memfd
it maps, so ``CudaRuntime.host_register`` runs on every request's bytes. ``convert``
defaults to "auto": on the GPU the worker converts on the device.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from typing import Any

import numpy as np
import pytest

from aiodla import (
    AiodlaError,
    Engine,
    ImagePreprocess,
    ProcessIsolation,
    TensorSpec,
    WorkerLostError,
)
from aiodla._isolation import inject_fault
from aiodla._isolation._worker import CONTEXT_LOST_EXIT
from aiodla.emulator._format import make_loadable, parse_loadable
from aiodla.emulator._ops import compute_logical, to_storage

from support import alive, counts_add_up, open_fds, shm_entries, wait_until, worker_pid

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio]

ENGINE_TIMEOUT = 0x40000006
X = TensorSpec("x", (1, 16, 4, 4), "float16", "chw16")
Y = TensorSpec("y", (1, 16, 4, 4), "float16", "nchw")
SLOTS = 4  # two cores, two streams each
LOADABLE = make_loadable([X], [Y], "affine", 0.002, scale=0.5, bias=1.0)


def request(i: int) -> np.ndarray[Any, Any]:
    return np.full(X.shape, (i % 64) * 0.25 - 8, np.float16)


def expected(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return to_storage(compute_logical(parse_loadable(LOADABLE), 0, x), Y.numpy_dtype)


def process_engine(**options: Any) -> Engine:
    return Engine(
        LOADABLE,
        runtime="cuda",
        isolation=ProcessIsolation(**options.pop("isolation", {})),
        cores=(0, 1),
        streams_per_core=2,
        **options,
    )


async def outcome(engine: Engine, i: int) -> Any:
    try:
        y = await engine.infer(request(i))
    except AiodlaError as error:
        return error
    np.testing.assert_array_equal(y, expected(request(i)))
    return "ok"


async def under_load(engine: Engine, fault: Any, count: int = 300) -> list[WorkerLostError]:
    """``count`` requests at once, ``fault`` while the first run: returns the losses,
    having checked that they are only what the worker held and the rest completed."""
    tasks = [asyncio.ensure_future(outcome(engine, i)) for i in range(count)]
    await wait_until(lambda: engine.statistics().in_flight > 0, timeout=30)
    await fault()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    lost = [r for r in results if r != "ok"]
    assert all(isinstance(r, WorkerLostError) for r in lost), lost
    assert 1 <= len(lost) <= SLOTS, lost  # the queue survived onto the new worker
    stats = engine.statistics()
    assert stats.completed == count - len(lost) and stats.failed == len(lost)
    assert counts_add_up(stats) and stats.worker is not None and stats.worker.restarts == 1
    return lost  # type: ignore[return-value]


@pytest.fixture
def accounted(real_gpu: None) -> Any:
    """This process's segments and descriptors are the same after the test."""
    gc.collect()
    before = (shm_entries(), open_fds())
    yield
    gc.collect()
    assert (shm_entries(), open_fds()) == before


async def closed_cleanly(engine: Engine) -> None:
    supervisor = engine._device.supervisor  # type: ignore[attr-defined]
    pid = worker_pid(engine)
    await engine.aclose()
    assert not alive(pid)
    # 0: the worker released every stand-in handle and CUDA resource it counted.
    assert supervisor.exit_status == 0


@pytest.mark.parametrize(
    ("convert", "zero_copy"),
    # Device conversion in the worker, its kernels reading a device copy of the shared
    # staging or (cudaHostRegisterMapped, as on a Jetson) the staging in place.
    [("host", None), ("device", False), ("device", True)],
)
async def test_results_on_both_cores(accounted: None, convert: str, zero_copy: bool | None) -> None:
    engine = process_engine(convert=convert, zero_copy=zero_copy)
    await engine.open()
    results = await asyncio.gather(*(outcome(engine, i) for i in range(200)))
    assert results == ["ok"] * 200
    stats = engine.statistics()
    assert all(core.completed > 0 for core in stats.cores) and counts_add_up(stats)
    await closed_cleanly(engine)


async def test_poisoned_context_costs_only_in_flight_requests(accounted: None) -> None:
    engine = process_engine()
    await engine.open()
    first = worker_pid(engine)

    async def fault() -> None:
        await inject_fault(engine, "fail_next_task", 0, ENGINE_TIMEOUT, on_stream=True)

    lost = await under_load(engine, fault)
    assert "CUDA context was lost" in lost[0].cause, lost[0].cause
    assert lost[0].exit_status == CONTEXT_LOST_EXIT
    assert not alive(first) and engine.health().status == "ok"
    await closed_cleanly(engine)


async def test_sigkill_costs_only_in_flight_requests(accounted: None) -> None:
    engine = process_engine()
    await engine.open()
    first = worker_pid(engine)

    async def fault() -> None:
        os.kill(first, signal.SIGKILL)

    lost = await under_load(engine, fault)
    assert lost[0].exit_status == -signal.SIGKILL
    await closed_cleanly(engine)


async def test_a_hung_worker_costs_only_in_flight_requests(accounted: None) -> None:
    engine = process_engine(isolation={"heartbeat_timeout": 0.5})
    await engine.open()
    first = worker_pid(engine)

    async def fault() -> None:
        os.kill(first, signal.SIGSTOP)

    lost = await under_load(engine, fault)
    assert "stopped answering" in lost[0].cause and not alive(first)
    await closed_cleanly(engine)


CAMERA = make_loadable(
    [TensorSpec("images", (1, 3, 48, 64), "float16", "chw16")],
    [TensorSpec("out", (1, 3, 48, 64), "float16", "nchw")],
    "affine",
    0.002,
    scale=1.0,
    bias=0.0,
)
LETTERBOX = ImagePreprocess(source="bgr", order="rgb", resize="letterbox", std=0.25)


@pytest.mark.parametrize("zero_copy", [False, True])
async def test_frame_buffers_are_read_where_they_lie(accounted: None, zero_copy: bool) -> None:
    """The application's frame buffers, page-locked by the worker (cudaHostRegister of a
    memfd mapping; mapped with zero_copy, the kernel reading them in place): a request
    on one never writes the slot's staging, and equals a copy of the frame, before and
    after the worker is replaced."""
    engine = Engine(
        CAMERA,
        runtime="cuda",
        isolation="process",
        convert="device",
        zero_copy=zero_copy,
        preprocess={"images": LETTERBOX},
    )
    await engine.open()
    cores = engine._device  # type: ignore[attr-defined]
    assert cores.path.fused, "the worker compiled no pre-processing kernels"
    buffers = engine.frame_buffers(2, (120, 160, 3))
    rng = np.random.default_rng(7)
    for buffer in buffers:
        buffer[:] = rng.integers(0, 256, buffer.shape, np.uint8)
    for replaced in (False, True):
        if replaced:
            os.kill(worker_pid(engine), signal.SIGKILL)
            await wait_until(lambda: engine.statistics().worker.restarts == 1, timeout=60)  # type: ignore[union-attr]
        staging = [slot.inputs[0].host.array for slot in cores.slots]  # the worker's
        for view in (*buffers, buffers[1][10:100, 20:150]):
            for part in staging:
                part[:] = 0xA5
            got = await engine.infer(view)
            assert all(bool((part == 0xA5).all()) for part in staging)  # not staged
            np.testing.assert_array_equal(got, await engine.infer(np.ascontiguousarray(view)))
    await closed_cleanly(engine)
