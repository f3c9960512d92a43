"""Building aiodla's generated CUDA C++ as host code, for the kernel tests that run
without a GPU: the prelude that stands in for CUDA's built-ins (one host thread per
CUDA thread; a real barrier for ``__syncthreads``), one compile of a source and its
runners into a library, a launcher with ``cuLaunchKernel``'s signature that calls that
library, and the NVRTC compile the GPUs aiodla targets must accept."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from aiodla.runtime import _conversion_kernels as ck
from aiodla.runtime._conversion_source import BLOCK

__all__ = ["HOST_PRELUDE", "HostLauncher", "build_host_library", "nvrtc_cubin"]

HOST_PRELUDE = r"""
#include <barrier>
#include <thread>
#include <vector>
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
struct Dim { unsigned x, y, z; };
thread_local Dim threadIdx, blockIdx;
static std::barrier<>* block_barrier;
static void __syncthreads() { block_barrier->arrive_and_wait(); }
"""


def build_host_library(tmp_path: Path, name: str, source: str, runners: str) -> ctypes.CDLL:
    """``source`` (the generated program) and ``runners`` (``extern "C"`` entry points
    calling its kernels) built as one host library; skips without a C++ compiler.
    ``-ffp-contract=off``: each float operation rounds on its own, as on the device."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no host C++ compiler to build the kernels as host code")
    path = tmp_path / f"{name}.cpp"
    path.write_text(HOST_PRELUDE + source + runners)
    library = tmp_path / f"{name}.so"
    flags = ["-std=c++20", "-O1", "-w", "-shared", "-fPIC", "-ffp-contract=off", "-pthread"]
    subprocess.run([compiler, *flags, "-o", str(library), str(path)], check=True)
    return ctypes.CDLL(str(library))


class HostLauncher:
    """cuLaunchKernel's signature, running the host build of the named kernel: its
    ``run_<name>(grid, parameter block)`` runner."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        self.calls: list[str] = []

    def __call__(self, function: str, gx: int, gy: int, gz: int, bx: int, *rest: Any) -> Any:
        by, bz, shared, _stream, params, extra = rest
        assert (gy, gz, bx, by, bz, shared, extra) == (1, 1, BLOCK, 1, 1, 0, 0)
        name = function.removeprefix("fn:")  # FakeToolchain's handle of the kernel
        self.calls.append(name)
        getattr(self.library, f"run_{name}")(ctypes.c_uint(gx), ctypes.c_void_p(params))
        return (0,)


def nvrtc_cubin(source: str, arch: str, name: str) -> bytes:
    """NVRTC's cubin of ``source`` for ``arch`` with aiodla's options (no GPU needed);
    skips where cuda.core or NVRTC is not installed."""
    core = pytest.importorskip("cuda.core")
    if not hasattr(core, "Program"):  # cuda-core before 1.0 kept it in .experimental
        core = pytest.importorskip("cuda.core.experimental")
    try:
        from cuda.bindings import nvrtc

        error, *_ = nvrtc.nvrtcVersion()
    except Exception as exc:
        pytest.skip(f"NVRTC is not installed here: {exc}")
    assert int(error) == 0
    options = core.ProgramOptions(arch=arch, name=name, **ck._OPTIONS)
    program = core.Program(source, "c++", options)
    try:
        cubin = bytes(program.compile("cubin").code)
    finally:
        program.close()
    assert cubin[:4] == b"\x7fELF"
    return cubin
