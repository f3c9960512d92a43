"""Every Runtime implementation has every member the protocol declares, and answers
the two questions the engine asks of any runtime: how long to pause between polls,
and what service time a loadable states."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from aiodla import Engine, RuntimeUnavailableError
from aiodla.emulator._format import stated_latency
from aiodla.runtime import (
    ComputeFunctions,
    EmulatedRuntime,
    FaultControls,
    GraphCapture,
    HostRegistration,
    Kernels,
    Runtime,
)
from aiodla.runtime._cuda import CudaRuntime
from aiodla.testing import DLAControls

from support import X, affine_model, expected_affine

# Bytes that are not an emulator loadable: to aiodla, a DLA loadable only cuDLA reads.
DLA_LOADABLE = b"NVDA" + bytes(60)

IMPLEMENTATIONS = [
    pytest.param(lambda: EmulatedRuntime(cores=2), id="emulated"),
    # Construction calls no CUDA; selection tells it how emulator loadables state a time.
    pytest.param(lambda: CudaRuntime(states=stated_latency), id="cuda"),
    pytest.param(lambda: DLAControls().runtime, id="testing-controls"),
]


def protocol_members() -> set[str]:
    declared = set(Runtime.__annotations__) | {
        name for name, value in vars(Runtime).items() if callable(value)
    }
    return {name for name in declared if not name.startswith("_")}


@pytest.mark.parametrize("make", IMPLEMENTATIONS)
class TestEveryImplementation:
    def test_has_every_member_of_the_protocol(self, make: Callable[[], Runtime]) -> None:
        runtime = make()
        missing = sorted(name for name in protocol_members() if not hasattr(runtime, name))
        assert missing == []
        assert isinstance(runtime, Runtime)

    def test_an_emulator_loadable_states_its_service_time(
        self, make: Callable[[], Runtime]
    ) -> None:
        assert make().stated_service_time(affine_model(latency=0.0025)) == 0.0025

    def test_a_dla_loadable_states_none(self, make: Callable[[], Runtime]) -> None:
        assert make().stated_service_time(DLA_LOADABLE) is None

    def test_poll_pause_is_a_non_negative_number(self, make: Callable[[], Runtime]) -> None:
        pause = make().poll_pause
        assert isinstance(pause, float)
        assert pause >= 0


def test_the_protocol_declares_what_the_engine_reads() -> None:
    assert {"poll_pause", "stated_service_time"} <= protocol_members()


def test_poll_pauses() -> None:
    # The emulator's sweeps take the GIL from the loop; CUDA event queries release it.
    assert EmulatedRuntime().poll_pause == 100e-6
    assert CudaRuntime().poll_pause == 0.0


class CoreOnly:
    """The emulated runtime's core calls and nothing else: a runtime of no capability."""

    def __init__(self, runtime: EmulatedRuntime) -> None:
        self.inner = runtime
        for name in protocol_members():
            setattr(self, name, getattr(runtime, name))
        # The protocol's declaration of capabilities, copied above, is the inner runtime's;
        # this one has none of their methods, so it declares none.
        self.capabilities: frozenset[type] = frozenset()


CAPABILITIES = (GraphCapture, Kernels, HostRegistration, ComputeFunctions, FaultControls)


class TestCapabilities:
    @pytest.mark.parametrize("make", IMPLEMENTATIONS)
    def test_what_each_implementation_can_do(self, make: Callable[[], Runtime]) -> None:
        runtime = make()
        found = {c.__name__ for c in CAPABILITIES if isinstance(runtime, c)}
        # Test controls are the emulated runtime's alone; the rest every one has.
        emulated = isinstance(runtime, EmulatedRuntime)
        assert found == {c.__name__ for c in CAPABILITIES} - (
            set() if emulated else {"FaultControls"}
        )

    def test_a_runtime_of_the_core_calls_alone_has_no_capability(self) -> None:
        runtime = CoreOnly(EmulatedRuntime())
        assert isinstance(runtime, Runtime)
        assert [c for c in CAPABILITIES if isinstance(runtime, c)] == []

    @pytest.mark.asyncio
    async def test_an_engine_opens_on_the_core_calls_alone(self) -> None:
        # No kernels: it converts on the host; no graphs: it enqueues each call.
        runtime = CoreOnly(EmulatedRuntime())
        async with Engine(affine_model(), runtime=runtime, convert="auto") as engine:
            x = np.full(X.shape, 0.5, np.float16)
            np.testing.assert_array_equal(await engine.infer(x), expected_affine(x))
        assert runtime.inner.counts.conversions == 0
        assert runtime.inner.live_handles()["graphs"] == 0
        assert set(runtime.inner.live_handles().values()) == {0}

    @pytest.mark.asyncio
    async def test_device_conversion_without_kernels_is_refused_by_name(self) -> None:
        runtime = CoreOnly(EmulatedRuntime())
        runtime.has_device_memory = True  # a GPU, but no kernels
        engine = Engine(affine_model(), runtime=runtime, convert="device")
        with pytest.raises(RuntimeUnavailableError, match="needs a runtime with GPU kernels"):
            await engine.open()
        assert set(runtime.inner.live_handles().values()) == {0}
