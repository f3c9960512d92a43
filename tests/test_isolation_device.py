"""Device conversion with ``isolation="process"``: the application stages the caller's
bytes (or camera frames) in shared memory; the worker's conversion kernels pack and
unpack them on the slot's stream, as in-process ``convert="device"`` does."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import numpy as np
import pytest

from aiodla import (
    ConfigurationError,
    Engine,
    ImagePreprocess,
    InputTypeError,
    TensorSpec,
    WorkerLostError,
)
from aiodla._data_path import DevicePath, HostPath
from aiodla._isolation import inject_fault
from aiodla.emulator import make_loadable

from support import (
    FakeCudaArray,
    X,
    affine_model,
    counts_add_up,
    expected_affine,
    wait_until,
    worker_pid,
)

pytestmark = pytest.mark.asyncio

ENGINE_TIMEOUT = 0x40000006
IMAGES = TensorSpec("images", (1, 3, 48, 64), "float16", "chw16")
OUT = TensorSpec("out", (1, 3, 48, 64), "float32", "nchw")
LETTERBOX = ImagePreprocess(source="bgr", order="rgb", resize="letterbox", std=0.25)


def process_engine(model: bytes, **options: Any) -> Engine:
    return Engine(model, runtime="emulated", isolation="process", convert="device", **options)


def camera_model() -> bytes:
    return make_loadable([IMAGES], [OUT], "affine", 0.0005, scale=1.0, bias=0.0)


def frame(height: int, width: int, seed: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3)).astype(np.uint8)


@pytest.mark.parametrize("zero_copy", [False, True])
async def test_the_worker_converts_what_the_application_staged(zero_copy: bool) -> None:
    rng = np.random.default_rng(0)
    # Several source types: the worker must pack each as the type the application read.
    xs = [rng.standard_normal(X.shape).astype(t) for t in (np.float32, np.float16, np.float64)]
    xs.append(rng.integers(-3, 4, X.shape).astype(np.int16))
    xs.append(np.asfortranarray(xs[0]))  # strided: staged dense
    async with process_engine(affine_model(), zero_copy=zero_copy) as engine:
        assert isinstance(engine._device.path, DevicePath)  # type: ignore[attr-defined]
        results = await asyncio.gather(*(engine.infer(x) for x in xs))
        stats = engine.statistics()
    for x, y in zip(xs, results, strict=True):
        np.testing.assert_array_equal(y, expected_affine(x.astype(np.float32)))
    assert stats.completed == len(xs) and counts_add_up(stats)


async def test_camera_frames_pre_processed_in_the_worker() -> None:
    frames = [frame(108, 192, 1), frame(200, 100, 2), frame(31, 57, 3)]
    options: dict[str, Any] = {"preprocess": {"images": LETTERBOX}}
    async with Engine(camera_model(), runtime="emulated", convert="device", **options) as threaded:
        expected = [await threaded.infer(f) for f in frames]
    async with process_engine(camera_model(), **options) as engine:
        assert engine._device.path.fused  # type: ignore[attr-defined]  # one kernel, in the worker
        got = await asyncio.gather(*(engine.infer(f) for f in frames))
    for want, result in zip(expected, got, strict=True):
        np.testing.assert_array_equal(result, want)


async def test_auto_follows_the_worker_runtime() -> None:
    # The emulated runtime has no GPU memory: "auto" converts on the host, as in-process.
    async with Engine(affine_model(), runtime="emulated", isolation="process") as engine:
        assert isinstance(engine._device.path, HostPath)  # type: ignore[attr-defined]
        np.testing.assert_array_equal(
            await engine.infer(np.ones(X.shape)), expected_affine(np.ones(X.shape))
        )


async def test_a_fault_costs_only_in_flight_requests() -> None:
    async with process_engine(affine_model()) as engine:
        first = worker_pid(engine)
        ones = np.ones(X.shape, np.float32)
        tasks = [asyncio.ensure_future(engine.infer(ones * (i % 9))) for i in range(120)]
        await wait_until(lambda: engine.statistics().in_flight > 0)
        await inject_fault(engine, "fail_next_task", 0, ENGINE_TIMEOUT, on_stream=True)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        lost = [r for r in results if not isinstance(r, np.ndarray)]
        assert lost and all(isinstance(r, WorkerLostError) for r in lost), lost
        for i, y in enumerate(results):
            if isinstance(y, np.ndarray):  # the queue went to the new worker, correctly
                np.testing.assert_array_equal(y, expected_affine(ones * (i % 9)))
        assert worker_pid(engine) != first and counts_add_up(engine.statistics())
        os.kill(worker_pid(engine), signal.SIGKILL)  # and the next replacement serves too
        await wait_until(lambda: engine.statistics().worker.restarts == 2)  # type: ignore[union-attr]
        np.testing.assert_array_equal(await engine.infer(ones), expected_affine(ones))


async def test_device_outputs_and_arrays_are_refused_saying_why() -> None:
    async with process_engine(affine_model()) as engine:
        with pytest.raises(InputTypeError, match="CUDA IPC is unavailable on Tegra"):
            await engine.infer(FakeCudaArray(X.shape))
        with pytest.raises(ConfigurationError, match="runtime lives in the worker process"):
            await engine.infer(np.ones(X.shape), output="device")
        np.testing.assert_array_equal(
            await engine.infer(np.ones(X.shape)), expected_affine(np.ones(X.shape))
        )
        stats = engine.statistics()
        assert stats.completed == 1 and counts_add_up(stats)
