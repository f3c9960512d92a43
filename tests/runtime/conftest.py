"""Fixtures of the runtime's tests."""

from __future__ import annotations

import pytest

from aiodla.runtime import _conversion_kernels as ck

from support import FakeToolchain


@pytest.fixture
def fake_toolchain(monkeypatch: pytest.MonkeyPatch) -> FakeToolchain:
    """The conversion kernels build with a :class:`FakeToolchain` instead of NVRTC."""
    toolchain = FakeToolchain()
    monkeypatch.setattr(ck, "_toolchain", lambda device: toolchain)
    return toolchain
