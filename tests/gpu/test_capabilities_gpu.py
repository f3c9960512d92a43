"""The CUDA runtime declares every capability the engine uses, each one whole (an
engine would refuse to open on it otherwise, naming the method it lacks)."""

from __future__ import annotations

from typing import Any

import pytest

from aiodla.runtime._protocol import (
    CAPABILITIES,
    capability_methods,
    check_capabilities,
    offers,
)


@pytest.mark.parametrize("capability", CAPABILITIES, ids=lambda c: c.__name__)
def test_the_cuda_runtime_declares_each_capability_whole(runtime: Any, capability: Any) -> None:
    assert capability in runtime.capabilities
    assert capability_methods(capability) <= set(dir(runtime))
    assert offers(runtime, capability) is runtime
    check_capabilities(runtime)
