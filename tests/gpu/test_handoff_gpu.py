"""The submitter thread on a GPU: the driver's ``cuGraphLaunch`` and the stand-in's
``cudlaSubmitTask`` called from C, on the engine's context, give what the loop's own
calls give, and a call that fails there fails its request only.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest

import aiodla._handoff
from aiodla import AiodlaError, Engine, TensorSpec
from aiodla.emulator import make_loadable
from aiodla.runtime._cuda import CudaRuntime

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio]

FRAME = TensorSpec("images", (1, 3, 64, 48), "float16", "chw16")
HEAD = TensorSpec("head", (1, 19, 8, 6), "float16", "chw16")


@pytest.fixture(autouse=True)
def hand_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request goes over, even one alone, one that finds the thread asleep, or
    one whose core is fed ahead."""
    monkeypatch.setattr(aiodla._handoff, "QUIET", 0.0)
    monkeypatch.setattr(aiodla._handoff, "FEED_BELOW", float("inf"))
    monkeypatch.setattr(aiodla._handoff, "WAITING_AT_LEAST", 0)


def frames(count: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(count)
    return [rng.normal(0, 3, FRAME.shape).astype(np.float32) for _ in range(count)]


async def run(inputs: list[Any], submit_thread: bool, **options: Any) -> tuple[Any, ...]:
    """Outputs, the transfers after a first request, and what the thread carried."""
    runtime = CudaRuntime(0)
    model = make_loadable([FRAME], [HEAD], "mix", 0.0002)
    async with Engine(model, runtime=runtime, submit_thread=submit_thread, **options) as e:
        first = await e.infer(inputs[0])
        before = dataclasses.replace(runtime.counts)
        rest = await asyncio.gather(*(e.infer(x) for x in inputs[1:]))
        made = {
            f.name: getattr(runtime.counts, f.name) - getattr(before, f.name)
            for f in dataclasses.fields(before)
        }
        handoff = e._cores.handoff
        native = handoff is not None and handoff.native
        handed = handoff.counts()["handed"] if handoff is not None else 0
    return [first, *rest], made, native, handed


@pytest.mark.parametrize("convert", ["device", "host"])
async def test_same_bytes_and_transfers_as_the_loop_s_calls(real_gpu: None, convert: str) -> None:
    inputs = frames(60)
    threaded, made, native, handed = await run(inputs, True, convert=convert)
    direct, made_directly, _, none = await run(inputs, False, convert=convert)
    assert native  # the driver's entry points, no Python on the thread
    assert handed >= 50 and none == 0
    for a, b in zip(threaded, direct, strict=True):
        np.testing.assert_array_equal(a, b)
    assert made == made_directly


async def test_by_default_the_cuda_runtime_has_the_thread(real_gpu: None) -> None:
    async with Engine(make_loadable([FRAME], [HEAD], "mix", 0.0002), runtime="cuda") as e:
        assert e._cores.handoff is not None and e._cores.handoff.native


async def test_a_failed_submit_on_the_thread_fails_that_request_only(
    real_gpu: None, standin: Any
) -> None:
    model = make_loadable([FRAME], [HEAD], "mix", 0.0002)
    async with Engine(
        model, runtime=CudaRuntime(0), cores=[0], streams_per_core=1, submit_thread=True
    ) as e:
        x, y = frames(2)
        want = await e.infer(x)  # the slot's graphs are captured
        standin.fail_next_call("cudlaSubmitTask", 6)  # cudlaErrorUmd
        with pytest.raises(AiodlaError, match="submitting"):
            await e.infer(y)
        np.testing.assert_array_equal(await e.infer(x), want)
        assert e._cores.handoff.counts()["handed"] == 2
        stats = e.statistics()
        assert (stats.completed, stats.failed, stats.in_flight) == (2, 1, 0)
        assert sum(core.busy_slots for core in stats.cores) == 0
