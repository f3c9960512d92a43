"""CUDA graphs on a GPU: each slot's work around its task, captured with
``cudaStreamBeginCapture`` on the first request of a kind and launched whole after that,
gives the bytes that each call on its own gives, with the same transfers, and the
poller sees the event recorded by the graph's external record node.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import numpy as np
import pytest

from aiodla import Engine, ImagePreprocess, TensorSpec
from aiodla.emulator import make_loadable
from aiodla.runtime._cuda import CudaRuntime

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio]

FRAME = TensorSpec("images", (1, 3, 64, 48), "float16", "chw16")
HEAD = TensorSpec("head", (1, 19, 8, 6), "float16", "chw16")


def detector() -> bytes:
    return make_loadable([FRAME], [HEAD], "mix", 0.0002)


def frames(count: int, dtype: Any = np.float32) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(count)
    return [rng.normal(0, 3, FRAME.shape).astype(dtype) for _ in range(count)]


async def outputs(
    inputs: list[Any],
    *,
    graphs: bool,
    model: bytes | None = None,
    hold_gil: bool = True,
    **options: Any,
) -> tuple[list[Any], dict[str, int], int]:
    """Each input's output (all in flight at once over both cores), the transfers made
    after a first request, and how many graphs were captured."""
    runtime = CudaRuntime(0, hold_gil=hold_gil)
    async with Engine(model or detector(), runtime=runtime, graphs=graphs, **options) as e:
        first = await e.infer(inputs[0])
        before = dataclasses.replace(runtime.counts)
        rest = await asyncio.gather(*(e.infer(x) for x in inputs[1:]))
        after = runtime.counts
        made = {
            f.name: getattr(after, f.name) - getattr(before, f.name)
            for f in dataclasses.fields(after)
        }
        captured = 0 if e._device.graphs is None else e._device.graphs.captured
        if graphs:
            assert e._device.graphs is not None and e._device.graphs.enabled  # no fall-back
        assert all(runtime._held) if hold_gil else not any(runtime._held)
    return [first, *rest], made, captured


@pytest.mark.parametrize(
    "options",
    [
        {"convert": "device"},
        {"convert": "device", "zero_copy": True},
        {"convert": "host"},
    ],
    ids=["device", "device-zero-copy", "host"],
)
async def test_same_bytes_and_transfers_as_each_call(
    real_gpu: None, options: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    inputs = frames(40) + frames(8, np.float16)
    with caplog.at_level(logging.WARNING, logger="aiodla"):
        replayed, made, captured = await outputs(inputs, graphs=True, **options)
        direct, made_directly, none = await outputs(inputs, graphs=False, **options)
    assert none == 0
    # Both cores' slots each captured their work before and after the task, and the
    # float16 inputs a second graph before it where they pack with another kernel.
    assert captured >= 4
    for got, want in zip(replayed, direct, strict=True):
        assert got.tobytes() == want.tobytes()
    assert made == made_directly
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text


async def test_camera_frames_of_two_sizes(real_gpu: None) -> None:
    spec = TensorSpec("image", (1, 3, 32, 32), "float16", "chw16")
    model = make_loadable(
        [spec],
        [TensorSpec("y", spec.shape, "float16", "nchw")],
        "affine",
        0.0002,
        scale=1.0,
        bias=0.0,
    )
    pre = {
        "image": ImagePreprocess(source="bgr", order="rgb", resize="letterbox", max_frame=(64, 64))
    }
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in [(48, 64), (32, 20)] * 6]
    replayed, _, captured = await outputs(
        images, graphs=True, model=model, convert="device", preprocess=pre
    )
    direct, _, _ = await outputs(
        images, graphs=False, model=model, convert="device", preprocess=pre
    )
    assert captured >= 4
    for got, want in zip(replayed, direct, strict=True):
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("convert", ["device", "host"])
async def test_calls_keeping_the_gil_give_the_same_bytes(real_gpu: None, convert: str) -> None:
    """The submit, graph launches and queries made through ctypes keeping the GIL give
    what the bindings give, with the same transfers."""
    inputs = frames(40) + frames(8, np.float16)
    held, made, _ = await outputs(inputs, graphs=True, convert=convert)
    bound, made_bound, _ = await outputs(inputs, graphs=True, convert=convert, hold_gil=False)
    for got, want in zip(held, bound, strict=True):
        assert got.tobytes() == want.tobytes()
    assert made == made_bound
