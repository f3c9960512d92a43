"""An engine refused at its open on shared cores, word for word (issue 44's mutation run
of ``_shared_cores``: the refusals were matched by a part): cores not open yet, a
``trust_compute`` of the engine's own, process isolation on a runtime instance, a
runtime of the engine's own, another event loop's engine, an engine opening while the
cores close."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aiodla
from aiodla import ConfigurationError, Cores, EmulatedRuntime, Engine, EngineClosedError
from aiodla._shared_cores import CoresState
from aiodla.testing import DLAControls

from support import X, affine_model


@pytest.mark.asyncio
async def test_cores_not_open_yet(runtime: EmulatedRuntime) -> None:
    dla = Cores([0, 1], runtime=runtime)
    engine = Engine(affine_model(), cores=dla)
    with pytest.raises(EngineClosedError) as refused:
        await engine.open()
    assert str(refused.value) == (
        "the shared cores are new: open them first ('async with aiodla.Cores(...) as dla')"
    )
    assert engine.state is aiodla.EngineState.CLOSED


@pytest.mark.asyncio
async def test_trust_compute_of_the_engines_own(runtime: EmulatedRuntime) -> None:
    async with Cores([0, 1], runtime=runtime) as dla:
        engine = Engine(affine_model(), cores=dla, trust_compute=True)
        with pytest.raises(ConfigurationError) as refused:
            await engine.open()
        assert str(refused.value) == (
            "trust_compute applies to the runtime of the shared cores: "
            "aiodla.Cores(..., trust_compute=True)"
        )
        assert dla.engines == 0


@pytest.mark.asyncio
async def test_process_isolation_on_a_runtime_instance(runtime: EmulatedRuntime) -> None:
    async with Cores([0, 1], runtime=runtime) as dla:
        engine = Engine(affine_model(), cores=dla, isolation="process")
        with pytest.raises(ConfigurationError) as refused:
            await engine.open()
        assert str(refused.value) == (
            "isolation='process' on shared cores needs the runtime by name "
            "(aiodla.Cores(runtime='auto' | 'cuda' | 'emulated'))"
        )
        assert dla.engines == 0


@pytest.mark.asyncio
async def test_cores_and_a_subset_read_as_their_numbers_and_say_what_they_hold(
    runtime: EmulatedRuntime,
) -> None:
    dla = Cores([0, 1], runtime=runtime)
    assert list(dla) == [0, 1] and list(dla.subset([1])) == [1]
    async with dla, Engine(affine_model(), cores=dla.subset([1])):
        assert repr(dla) == "<aiodla.Cores open [0: 0 held, 1: 0 held] engines=1>"
        assert repr(dla.subset([1])) == f"<aiodla.CoreSet [1] of {dla!r}>"


@pytest.mark.asyncio
async def test_cores_opened_twice_or_given_a_trust_compute_not_bool(
    runtime: EmulatedRuntime,
) -> None:
    with pytest.raises(ConfigurationError) as refused:
        Cores([0, 1], runtime=runtime, trust_compute="yes")  # type: ignore[arg-type]
    assert str(refused.value) == "trust_compute='yes' must be a bool"
    async with Cores([0, 1], runtime=runtime) as dla:
        with pytest.raises(aiodla.AiodlaError) as again:
            await dla.open()
        assert str(again.value) == "the cores are open; open them once"


@pytest.mark.asyncio
async def test_cores_choose_their_runtime_by_default() -> None:
    # runtime="auto": the emulated runtime where no DLA answers, as an engine's own.
    async with Cores([0, 1]) as dla, Engine(affine_model(), cores=dla) as engine:
        await engine.infer(np.ones(X.shape, np.float32))
        assert engine.statistics().completed == 1


def test_a_runtime_of_the_engines_own(runtime: EmulatedRuntime) -> None:
    dla = Cores([0, 1], runtime=runtime)
    with pytest.raises(ConfigurationError) as refused:
        Engine(affine_model(), cores=dla, runtime="emulated")
    assert str(refused.value) == (
        "runtime='emulated': an engine on shared cores uses theirs; "
        "pass it to aiodla.Cores(..., runtime=...)"
    )


def test_an_engine_opening_from_another_event_loop(runtime: EmulatedRuntime) -> None:
    dla = Cores([0, 1], runtime=runtime)
    asyncio.run(dla.open())

    async def elsewhere() -> None:
        engine = Engine(affine_model(), cores=dla)
        with pytest.raises(aiodla.AiodlaError) as refused:
            await engine.open()
        assert str(refused.value) == (
            "an engine opens on shared cores from the cores' own event loop"
        )
        assert engine.state is aiodla.EngineState.CLOSED and dla.engines == 0
        await dla.aclose()

    asyncio.run(elsewhere())
    assert dla.state is CoresState.CLOSED


@pytest.mark.asyncio
async def test_an_engine_opening_while_the_cores_close(
    runtime: EmulatedRuntime, aiodla_controls: DLAControls
) -> None:
    dla = Cores([0, 1], runtime=runtime)
    await dla.open()
    engine = Engine(affine_model(), cores=dla)
    await engine.open()
    ones = np.ones(X.shape, np.float32)
    with aiodla_controls.hold() as gate:
        running = asyncio.ensure_future(engine.infer(ones))
        await gate.reached(1)
        closing = asyncio.ensure_future(dla.aclose())
        await asyncio.sleep(0)  # (its engine's close waits for the request held)
        assert dla.state is CoresState.CLOSING
        with pytest.raises(EngineClosedError) as refused:
            Engine(affine_model(), cores=dla)
        assert str(refused.value) == (
            "the shared cores are closing: open them first ('async with aiodla.Cores(...) as dla')"
        )
    await closing
    assert dla.state is CoresState.CLOSED and engine.state is aiodla.EngineState.CLOSED
    assert (await running).shape == ones.shape
