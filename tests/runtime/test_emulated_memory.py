"""The emulated runtime out of host memory: the CUDA error a real allocation gives.

numpy's MemoryError becomes ``cudaErrorMemoryAllocation`` (2) naming the bytes asked
for, so an engine that cannot allocate a tensor's buffers says which tensor.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from typing import Any

import pytest

import aiodla.runtime._emulated_memory as emulated
from aiodla import DeviceError, EmulatedRuntime, Engine
from aiodla.runtime import CudaCallError

from support import affine_model

MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation


@pytest.fixture
def no_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    def exhausted(nbytes: int) -> Any:
        raise MemoryError

    monkeypatch.setattr(emulated, "_zeros", exhausted)


@pytest.mark.usefixtures("no_memory")
class TestOutOfMemory:
    @pytest.mark.parametrize("call", ["malloc", "host_alloc"])
    def test_an_allocation_fails_as_cuda_would(self, call: str) -> None:
        runtime = EmulatedRuntime()
        with pytest.raises(CudaCallError) as caught:
            getattr(runtime, call)(4 << 30)
        error = caught.value
        assert (error.call, error.code, error.name) == (
            call,
            MEMORY_ALLOCATION,
            "cudaErrorMemoryAllocation",
        )
        assert f"{4 << 30} bytes" in str(error)
        assert not error.sticky  # the context survives: other allocations may succeed
        assert runtime.live_handles()["device_memory"] == 0
        assert runtime.live_handles()["host_memory"] == 0

    def test_an_engine_that_cannot_allocate_names_the_tensor(self) -> None:
        async def open_engine() -> None:
            async with Engine(affine_model(), runtime="emulated"):
                pass

        with pytest.raises(DeviceError) as caught:
            asyncio.run(open_engine())
        assert caught.value.cuda_error == MEMORY_ALLOCATION
        assert "core 0 slot 0 tensor 'x'" in str(caught.value)
        assert "bytes asked for" in str(caught.value)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, RLIMIT_AS")
def test_under_an_address_space_limit() -> None:
    # A real MemoryError: the child limits its address space to what it maps now plus
    # 256 MiB, then asks for 4 GiB (the (16384, 1, 256, 256) float32 tensor's bytes).
    child = textwrap.dedent("""
        import resource
        from aiodla import EmulatedRuntime
        from aiodla.runtime import CudaCallError

        runtime = EmulatedRuntime()
        with open("/proc/self/statm") as statm:
            mapped = int(statm.read().split()[0]) * resource.getpagesize()
        limit = mapped + (256 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        try:
            runtime.malloc(16384 * 256 * 256 * 4)
        except CudaCallError as exc:
            print(exc.code, exc)
    """)
    result = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        "2 malloc failed: cudaErrorMemoryAllocation (2): 4294967296 bytes asked for"
    ), result.stdout
