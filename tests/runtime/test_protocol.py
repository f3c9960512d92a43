"""Every Runtime implementation has every member the protocol declares, and answers
the two questions the engine asks of any runtime: how long to pause between polls,
and what service time a loadable states."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from aiodla.emulator._format import stated_latency
from aiodla.runtime import EmulatedRuntime, Runtime
from aiodla.runtime._cuda import CudaRuntime
from aiodla.testing import DLAControls

from support import affine_model

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
