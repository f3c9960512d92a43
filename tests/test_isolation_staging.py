"""The worker's view of its runtime is a Runtime on every Python: from 3.12,
``isinstance`` against a runtime-checkable protocol looks attributes up statically
(``inspect.getattr_static``), so delegation through ``__getattr__`` alone is refused
there while 3.10 and 3.11 accept it."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from aiodla import ConfigurationError, EmulatedRuntime
from aiodla._isolation._staging import _RUNTIME_MEMBERS, SharedStaging, StagingRuntime
from aiodla.runtime._protocol import (
    ComputeFunctions,
    GraphCapture,
    Kernels,
    Runtime,
    check_capabilities,
    offers,
)


class CoreOnly:
    """A runtime of the core calls alone (no graphs, kernels or host registration)."""

    def __init__(self, runtime: Any) -> None:
        for name in _RUNTIME_MEMBERS:
            setattr(self, name, getattr(runtime, name))
        self.capabilities: frozenset[type] = frozenset()  # declares none


def test_every_member_of_the_protocol_is_found_statically() -> None:
    runtime = EmulatedRuntime()
    staging = SharedStaging(runtime)
    try:
        wrapped = StagingRuntime(runtime, staging)
        missing = [
            name for name in _RUNTIME_MEMBERS if inspect.getattr_static(wrapped, name, None) is None
        ]
        assert missing == []
        assert isinstance(wrapped, Runtime)
        # Host memory is the shared staging's; the rest is the runtime's own.
        buffer = wrapped.host_alloc(64)
        assert buffer.ptr in staging.layout
        wrapped.host_free(buffer)
        assert buffer.ptr not in staging.layout
        assert wrapped.create_stream == runtime.create_stream
    finally:
        staging.close()
        runtime.close()


def test_the_members_include_the_protocols_attributes() -> None:
    assert {"poll_pause", "create_stream", "submit_task", "host_alloc"} <= set(_RUNTIME_MEMBERS)


def test_the_worker_sees_the_capabilities_of_its_runtime_and_no_more() -> None:
    # The device layer asks the wrapped runtime for the capabilities it declares: each
    # must be found statically, whole, and only where the runtime has it.
    runtime = EmulatedRuntime()
    staging = SharedStaging(runtime)
    try:
        wrapped = StagingRuntime(runtime, staging)
        assert wrapped.capabilities == runtime.capabilities
        check_capabilities(wrapped)  # (each declared capability whole)
        assert offers(wrapped, GraphCapture) is wrapped and offers(wrapped, Kernels) is wrapped
        assert offers(wrapped, ComputeFunctions) is wrapped
        # Looked up as Python 3.12 looks:
        for name in ("launch_graph", "pack", "take_compute_failure", "prepare_detect"):
            assert inspect.getattr_static(wrapped, name) == getattr(runtime, name)
        core_only = StagingRuntime(CoreOnly(runtime), staging)  # type: ignore[arg-type]
        assert inspect.getattr_static(core_only, "launch_graph", None) is None
        assert offers(core_only, GraphCapture) is None and offers(core_only, Kernels) is None
    finally:
        staging.close()
        runtime.close()


def test_staging_needs_a_runtime_that_registers_host_memory() -> None:
    with pytest.raises(ConfigurationError, match="host_register"):
        SharedStaging(CoreOnly(EmulatedRuntime()))  # type: ignore[arg-type]
