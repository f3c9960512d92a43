"""tests/gpu: the real CUDA path, on an NVIDIA GPU with aiodla's cuDLA stand-in.

Every test here is skipped, cleanly and with the reason, when the machine has no NVIDIA
GPU or driver (``cudaGetDeviceCount`` fails or finds none) or no ``nvcc``. Otherwise,
once per session: build the stand-in ``libcudla.so.1`` into a temporary directory (or
take a prebuilt one from ``AIODLA_STANDIN_LIB``) and load it before anything calls
``cuda.bindings.cudla``.

``AIODLA_GPU_TESTS=host-fake`` is a dry run for machines without a GPU: the host-fake
build of the stand-in runs each task on the submitting thread, and
``aiodla.runtime._cuda`` talks to :mod:`_host_fake` instead of the CUDA runtime. It
checks the tests' and the runtime's logic; tests that need real concurrency or timing
(fixture ``real_gpu``) skip there.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE.parent):  # _host_fake, _setup and the shared vectors
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from aiodla.emulator._standin import StandinControls, build_standin, load_standin  # noqa: E402

HOST_FAKE = os.environ.get("AIODLA_GPU_TESTS", "") == "host-fake"
NVCC = os.environ.get("NVCC", "nvcc")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.gpu)


@dataclasses.dataclass
class GpuSession:
    """What the session set up: the stand-in's controls and the CUDA module in use."""

    controls: StandinControls
    library: Path
    host_fake: bool
    cuda: Any  # cuda.bindings.runtime, or the host fake of it


def _no_gpu_reason() -> str | None:
    try:
        from cuda.bindings import runtime as rt
    except Exception as exc:  # no usable cuda-bindings at all
        return f"cuda.bindings.runtime cannot be imported: {exc}"
    error, count = rt.cudaGetDeviceCount()
    if int(error) != 0:
        name = getattr(error, "name", str(error))
        return f"no NVIDIA GPU or driver here (cudaGetDeviceCount: {name})"
    if count < 1:
        return "no NVIDIA GPU here (cudaGetDeviceCount found none)"
    return None


@pytest.fixture(scope="session")
def gpu_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuSession]:
    if HOST_FAKE:
        if shutil.which(NVCC) is None:
            pytest.skip(f"the host-fake dry run needs {NVCC!r} to build the stand-in")
        import aiodla.runtime._cuda as cuda_module

        from _host_fake import HostFakeRuntime

        path = build_standin(tmp_path_factory.mktemp("standin"), nvcc=NVCC, host_fake=True)
        controls = load_standin(path)
        fake = HostFakeRuntime(controls)
        real = cuda_module._rt
        cuda_module._rt = fake
        try:
            yield GpuSession(controls, path, True, fake)
        finally:
            cuda_module._rt = real
        return
    reason = _no_gpu_reason()
    if reason is not None:
        pytest.skip(reason)
    prebuilt = os.environ.get("AIODLA_STANDIN_LIB")
    if prebuilt:
        path = Path(prebuilt)
    else:
        if shutil.which(NVCC) is None:
            pytest.skip(f"{NVCC!r} was not found: the stand-in cannot be built")
        path = build_standin(tmp_path_factory.mktemp("standin"), nvcc=NVCC)
    controls = load_standin(path)
    from cuda.bindings import runtime as rt

    yield GpuSession(controls, path, False, rt)


@pytest.fixture(autouse=True)
def _needs_gpu(gpu_session: GpuSession) -> None:
    """Every test in tests/gpu runs only with the session above (skips otherwise)."""


@pytest.fixture
def standin(gpu_session: GpuSession) -> Iterator[StandinControls]:
    """The stand-in's controls; faults and holds are cleared after each test."""
    controls = gpu_session.controls
    yield controls
    for core in range(controls.cores):
        controls.release(core)
        controls.hang_core(core, False)


@pytest.fixture
def real_gpu(gpu_session: GpuSession) -> None:
    """Skip in the host-fake dry run: this test needs concurrency or timing of a GPU."""
    if gpu_session.host_fake:
        pytest.skip("needs a real GPU (concurrency or timing); host-fake dry run")


@pytest.fixture
def cuda_rt(gpu_session: GpuSession) -> Any:
    """cuda.bindings.runtime (or its host fake in a dry run)."""
    return gpu_session.cuda


@pytest.fixture
def runtime(gpu_session: GpuSession) -> Iterator[Any]:
    from aiodla.runtime._cuda import CudaRuntime

    cuda_runtime = CudaRuntime(0)
    cuda_runtime.make_current()
    yield cuda_runtime
    cuda_runtime.close()
