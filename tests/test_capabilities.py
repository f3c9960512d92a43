"""Capabilities a runtime declares: each one whole, or the engine refuses to open and
names the method it lacks; one it does not declare is not used."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiodla import ConfigurationError, EmulatedRuntime, Engine
from aiodla._isolation._staging import _RUNTIME_MEMBERS
from aiodla.runtime._protocol import (
    CAPABILITIES,
    GraphCapture,
    Kernels,
    capability_methods,
    check_capabilities,
    offers,
)

from support import X, affine_model, expected_affine

ONES = np.ones(X.shape, np.float32)


class Declaring:
    """An emulated runtime's calls, declaring ``capabilities`` and lacking ``without``."""

    def __init__(
        self, runtime: EmulatedRuntime, capabilities: frozenset[type], without: str = ""
    ) -> None:
        names = set(_RUNTIME_MEMBERS)
        for capability in capabilities:
            names |= capability_methods(capability)
        for name in sorted(names - {"capabilities", without}):
            setattr(self, name, getattr(runtime, name))
        self.capabilities = capabilities


class TestDeclared:
    @pytest.mark.asyncio
    async def test_a_declared_capability_missing_a_method_fails_at_open_naming_it(
        self, runtime: EmulatedRuntime
    ) -> None:
        partial = Declaring(runtime, frozenset({GraphCapture, Kernels}), without="pack")
        engine = Engine(affine_model(), runtime=partial)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="declares Kernels but has no pack"):
            await engine.open()
        assert all(n == 0 for n in runtime.live_handles().values())

    @pytest.mark.asyncio
    async def test_a_capability_not_declared_is_not_used(self, runtime: EmulatedRuntime) -> None:
        # Every method of graph capture is there, undeclared: the engine enqueues each
        # call instead of capturing graphs, and serves.
        plain = Declaring(runtime, frozenset())
        for name in capability_methods(GraphCapture):
            setattr(plain, name, getattr(runtime, name))
        assert offers(plain, GraphCapture) is None  # type: ignore[arg-type]
        async with Engine(affine_model(), runtime=plain) as engine:  # type: ignore[arg-type]
            np.testing.assert_array_equal(await engine.infer(ONES), expected_affine(ONES))
            assert engine._device.graphs is None  # type: ignore[attr-defined]

    def test_declaring_what_is_no_capability_is_refused(self, runtime: EmulatedRuntime) -> None:
        odd = Declaring(runtime, frozenset())
        odd.capabilities = frozenset({int})
        with pytest.raises(ConfigurationError, match="declares <class 'int'>, which is not"):
            check_capabilities(odd)  # type: ignore[arg-type]

    @pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: c.__name__)
    def test_the_emulated_runtime_declares_each_capability_whole(
        self, runtime: EmulatedRuntime, capability: Any
    ) -> None:
        assert capability in runtime.capabilities
        assert capability_methods(capability) <= set(dir(runtime))
        check_capabilities(runtime)

    def test_detection_on_the_stream_is_a_capability_of_the_runtime_seam(self) -> None:
        from aiodla.runtime import _protocol

        assert "DetectsOnStream" in _protocol.__all__
        assert {"prepare_detect", "detect"} == capability_methods(_protocol.DetectsOnStream)
