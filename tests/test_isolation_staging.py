"""The worker's view of its runtime is a Runtime on every Python: from 3.12,
``isinstance`` against a runtime-checkable protocol looks attributes up statically
(``inspect.getattr_static``), so delegation through ``__getattr__`` alone is refused
there while 3.10 and 3.11 accept it."""

from __future__ import annotations

import inspect

from aiodla import EmulatedRuntime
from aiodla._isolation._staging import _RUNTIME_MEMBERS, SharedStaging, StagingRuntime
from aiodla.runtime._protocol import Runtime


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
