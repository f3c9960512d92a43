"""CudaRuntime, method by method, against the stand-in on a real GPU.

Together these reach every line of aiodla/runtime/_cuda.py: the success path of each
call, every error mapping (cuDLA statuses in and outside ``cudla.Status``, CUDA errors
with their names, "not ready" as a state) and ``probe``'s answers.
"""

from __future__ import annotations

import pickle
import sys
import threading
import types
from typing import Any

import numpy as np
import pytest
from cuda.bindings import cudla

import aiodla.runtime._cuda as cuda_module
from aiodla._errors import ConfigurationError
from aiodla._tensors import TensorSpec
from aiodla.emulator._format import make_loadable
from aiodla.runtime._cuda import (
    CudaRuntime,
    InvalidCudlaArgumentError,
    UnknownCudlaStatusError,
    check_cuda,
    cuda_error,
    probe,
)
from aiodla.runtime._protocol import CudaCallError, HostBuffer, Runtime

pytestmark = pytest.mark.gpu

INVALID_PARAM = 1
INVALID_ADDRESS = 4
INVALID_DEVICE = 8
INVALID_MODULE = 12


def status_of(exc: BaseException) -> int:
    return int(exc.status)  # type: ignore[attr-defined]


def tiny_loadable(latency: float = 0.0) -> bytes:
    x = TensorSpec("x", (1, 16, 2, 3), "float16", "chw16")
    y = TensorSpec("y", (1, 16, 2, 3), "float16", "nchw")
    return make_loadable([x], [y], "affine", latency, scale=2.0, bias=1.0)


class TestDiscovery:
    def test_is_a_runtime(self, runtime: CudaRuntime) -> None:
        assert isinstance(runtime, Runtime)
        assert runtime.name == "cuda"
        assert repr(runtime) == "<CudaRuntime device=0>"

    def test_version_and_cores(self, runtime: CudaRuntime, standin: Any) -> None:
        assert runtime.version() == 1_002_001
        assert runtime.device_count() == standin.cores >= 1

    def test_probe_finds_the_standin(self) -> None:
        usable, reason = probe()
        assert usable, reason
        assert "DLA core" in reason

    def test_bad_device_index(self) -> None:
        with pytest.raises(ConfigurationError, match="device"):
            CudaRuntime(-1)
        with pytest.raises(ConfigurationError):
            CudaRuntime(True)  # a bool is not a device index

    def test_make_current_on_a_missing_device(self, real_gpu: None) -> None:
        with pytest.raises(CudaCallError) as caught:
            CudaRuntime(4096).make_current()
        assert caught.value.call == "cudaSetDevice"
        assert caught.value.name == "cudaErrorInvalidDevice"
        assert not caught.value.sticky

    def test_make_current_from_another_thread(self, runtime: CudaRuntime) -> None:
        failures: list[BaseException] = []

        def work() -> None:
            try:
                runtime.make_current()
                stream = runtime.create_stream()
                runtime.destroy_stream(stream)
            except BaseException as exc:
                failures.append(exc)

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        assert not failures


class TestCudlaCalls:
    def test_full_cycle(self, runtime: CudaRuntime, standin: Any) -> None:
        device = runtime.create_device(0)
        try:
            assert isinstance(device, int)
            runtime.set_task_timeout(device, 5000)
            module = runtime.load_module(device, bytearray(tiny_loadable()))
            inputs, outputs = runtime.module_tensors(module)
            assert [d.name for d in inputs] == ["x"]
            assert [d.name for d in outputs] == ["y"]
            spec_in = TensorSpec.from_descriptor(inputs[0])
            spec_out = TensorSpec.from_descriptor(outputs[0])
            assert spec_in.format == "chw16"
            assert spec_out.format == "nchw"
            memory = [runtime.malloc(spec_in.size), runtime.malloc(spec_out.size)]
            registered = [
                runtime.mem_register(device, p, s.size)
                for p, s in zip(memory, (spec_in, spec_out), strict=True)
            ]
            assert all(isinstance(r, int) for r in registered)
            assert registered[0] != memory[0]  # tasks must be given registered pointers
            task = runtime.make_task(module, [registered[0]], [registered[1]])
            stream = runtime.create_stream()
            event = runtime.create_event()
            host_in, host_out = runtime.host_alloc(spec_in.size), runtime.host_alloc(spec_out.size)
            x = np.arange(96, dtype=np.float16).reshape(1, 16, 2, 3)
            spec_in.pack(x, out=host_in.array)
            runtime.copy_to_device(memory[0], host_in, spec_in.size, stream)
            runtime.submit_task(device, task, stream)
            runtime.copy_to_host(host_out, memory[1], spec_out.size, stream)
            runtime.record_event(event, stream)
            runtime.synchronize_stream(stream)
            assert runtime.query_event(event)
            assert runtime.get_last_error(device) == 0
            np.testing.assert_array_equal(spec_out.unpack(host_out.array), x * 2 + 1)
            runtime.destroy_event(event)
            runtime.destroy_stream(stream)
            runtime.host_free(host_in)
            runtime.host_free(host_out)
            for r in registered:
                runtime.mem_unregister(device, r)
            for p in memory:
                runtime.free(p)
            runtime.unload_module(module)
        finally:
            runtime.destroy_device(device)
        assert standin.live_handles() == {"devices": 0, "modules": 0, "registrations": 0}

    def test_cudla_errors_carry_the_status(self, runtime: CudaRuntime, standin: Any) -> None:
        with pytest.raises(cudla.CudlaError) as caught:
            runtime.create_device(standin.cores)  # no such core
        assert status_of(caught.value) == INVALID_PARAM
        with pytest.raises(cudla.CudlaError) as caught:
            runtime.destroy_device(0xBAD0)
        assert status_of(caught.value) == INVALID_DEVICE
        device = runtime.create_device(0)
        try:
            with pytest.raises(cudla.CudlaError) as caught:
                runtime.load_module(device, b"not an emulator loadable")
            assert status_of(caught.value) == INVALID_MODULE
            with pytest.raises(cudla.CudlaError) as caught:
                runtime.unload_module(0xBAD0)
            assert status_of(caught.value) == INVALID_MODULE
            with pytest.raises(cudla.CudlaError) as caught:
                runtime.module_tensors(0xBAD0)
            assert status_of(caught.value) == INVALID_MODULE
            with pytest.raises(cudla.CudlaError) as caught:
                runtime.mem_unregister(device, 0x1234)
            assert status_of(caught.value) == INVALID_ADDRESS
            with pytest.raises(cudla.CudlaError) as caught:
                runtime.set_task_timeout(device, 0)
            assert status_of(caught.value) == INVALID_PARAM
        finally:
            runtime.destroy_device(device)

    def test_status_outside_the_enum(self, runtime: CudaRuntime, standin: Any) -> None:
        standin.fail_next_call("cudlaGetVersion", 12345)
        with pytest.raises(UnknownCudlaStatusError) as caught:
            runtime.version()
        error = caught.value
        assert isinstance(error, cudla.CudlaError)
        assert error.status == 12345
        assert error.call == "cudlaGetVersion"
        assert "12345" in str(error)
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is UnknownCudlaStatusError
        assert copy.status == 12345

    def test_injected_known_status(self, runtime: CudaRuntime, standin: Any) -> None:
        standin.fail_next_call("cudlaDeviceGetCount", 6)
        with pytest.raises(cudla.CudlaError) as caught:
            runtime.device_count()
        assert status_of(caught.value) == 6
        assert runtime.device_count() == standin.cores  # one call only

    def test_timeout_beyond_uint32(self, runtime: CudaRuntime) -> None:
        device = runtime.create_device(0)
        try:
            with pytest.raises(InvalidCudlaArgumentError) as caught:
                runtime.set_task_timeout(device, 1 << 40)
            error = caught.value
            assert isinstance(error, cudla.CudlaError)
            assert status_of(error) == INVALID_PARAM
            assert "32 bits" in str(error)
            assert "cudlaSetTaskTimeoutInMs" in str(error)
            copy = pickle.loads(pickle.dumps(error))
            assert copy.detail == error.detail
            with pytest.raises(InvalidCudlaArgumentError):
                runtime.set_task_timeout(device, -1)
        finally:
            runtime.destroy_device(device)

    def test_make_task_wants_python_ints(self, runtime: CudaRuntime) -> None:
        with pytest.raises(TypeError, match="Python ints"):
            runtime.make_task(1, [np.int64(5)], [6])

    def test_unrelated_value_error_passes_through(self) -> None:
        def broken() -> None:
            raise ValueError("something else entirely")

        with pytest.raises(ValueError, match="something else"):
            cuda_module._cudla_call("cudlaGetVersion", broken)

    def test_get_last_error_of_a_bad_handle(self, runtime: CudaRuntime) -> None:
        assert runtime.get_last_error(0xBAD0) == INVALID_DEVICE


class TestCudaCalls:
    def test_timing_events_measure_a_task(self, runtime: CudaRuntime, gpu_session: Any) -> None:
        from _setup import ModelSetup

        latency = 0.005
        setup = ModelSetup(runtime, 0, tiny_loadable(latency=latency))
        try:
            start, end = runtime.create_event(timing=True), runtime.create_event(timing=True)
            plain = runtime.create_event()
            runtime.record_event(start, setup.stream)
            runtime.submit_task(setup.device, setup.task, setup.stream)
            runtime.record_event(end, setup.stream)
            runtime.record_event(plain, setup.stream)
            runtime.synchronize_stream(setup.stream)
            seconds = runtime.elapsed_time(start, end)
            if gpu_session.host_fake:
                assert seconds == 0.0
            else:
                assert latency * 0.98 <= seconds < latency + 0.01
            with pytest.raises(CudaCallError, match="cudaEventElapsedTime"):
                runtime.elapsed_time(start, plain)  # created without timing
            for event in (start, end, plain):
                runtime.destroy_event(event)
        finally:
            setup.close()

    def test_streams_events_memory(self, runtime: CudaRuntime) -> None:
        stream = runtime.create_stream()
        event = runtime.create_event()
        device = runtime.malloc(4096)
        host = runtime.host_alloc(4096)
        assert isinstance(host, HostBuffer)
        assert host.nbytes == 4096
        assert host.array.dtype == np.uint8
        assert host.array.flags.writeable
        host.array[:] = np.arange(4096) % 251
        back = runtime.host_alloc(4096)
        runtime.copy_to_device(device, host, 4096, stream)
        runtime.copy_to_host(back, device, 4096, stream)
        runtime.record_event(event, stream)
        runtime.synchronize_stream(stream)
        assert runtime.query_event(event)
        np.testing.assert_array_equal(back.array, host.array)
        for buffer in (host, back):
            runtime.host_free(buffer)
        runtime.free(device)
        runtime.destroy_event(event)
        runtime.destroy_stream(stream)

    def test_invalid_sizes(self, runtime: CudaRuntime) -> None:
        with pytest.raises(CudaCallError, match="cudaMalloc"):
            runtime.malloc(0)
        with pytest.raises(CudaCallError, match="cudaHostAlloc"):
            runtime.host_alloc(0)
        host = runtime.host_alloc(64)
        try:
            with pytest.raises(CudaCallError) as caught:
                runtime.copy_to_device(0, host, 65, 0)
            assert caught.value.name == "cudaErrorInvalidValue"
            with pytest.raises(CudaCallError):
                runtime.copy_to_host(host, 0, 0, 0)
        finally:
            runtime.host_free(host)

    def test_host_free_twice_is_refused(self, runtime: CudaRuntime) -> None:
        host = runtime.host_alloc(64)
        runtime.host_free(host)
        with pytest.raises(CudaCallError, match="cudaFreeHost"):
            runtime.host_free(host)
        stranger = HostBuffer(host.ptr, np.zeros(64, dtype=np.uint8))
        with pytest.raises(CudaCallError):
            runtime.host_free(stranger)

    def test_out_of_memory_is_named(self, runtime: CudaRuntime) -> None:
        with pytest.raises(CudaCallError) as caught:
            runtime.malloc(1 << 60)
        assert caught.value.call == "cudaMalloc"
        assert caught.value.name == "cudaErrorMemoryAllocation"
        assert not caught.value.sticky

    def test_query_not_ready_is_a_state(
        self, runtime: CudaRuntime, standin: Any, real_gpu: None
    ) -> None:
        from _setup import ModelSetup

        with ModelSetup(runtime, 0, tiny_loadable()) as setup:
            gate = standin.hold(0)
            try:
                setup.enqueue([bytes(setup.inputs[0].size)])
                assert gate.wait_for_held(1, timeout=10.0)
                assert runtime.query_event(setup.event) is False
            finally:
                gate.release()
            runtime.synchronize_stream(setup.stream)
            assert runtime.query_event(setup.event) is True

    def test_query_error_raises(
        self, runtime: CudaRuntime, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        failing = _Patched(cuda_module._rt, cudaEventQuery=lambda event: (_error(400),))
        monkeypatch.setattr(cuda_module, "_rt", failing)
        with pytest.raises(CudaCallError) as caught:
            runtime.query_event(1)
        assert caught.value.call == "cudaEventQuery"
        assert caught.value.name == "cudaErrorInvalidResourceHandle"

    def test_sticky_errors_are_marked(
        self, runtime: CudaRuntime, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        failing = _Patched(cuda_module._rt, cudaStreamSynchronize=lambda stream: (_error(911),))
        monkeypatch.setattr(cuda_module, "_rt", failing)
        with pytest.raises(CudaCallError) as caught:
            runtime.synchronize_stream(0)
        assert caught.value.sticky
        assert caught.value.name == "cudaErrorExternalDevice"

    def test_close_is_idempotent(self) -> None:
        runtime = CudaRuntime(0)
        runtime.close()
        runtime.close()


class TestUnwrapper:
    def test_shapes(self) -> None:
        ok = _error(0)
        assert check_cuda("x", (ok,)) is None
        assert check_cuda("x", (ok, 7)) == 7
        assert check_cuda("x", (ok, 7, 8)) == (7, 8)

    def test_failure_names_the_call_and_error(self) -> None:
        with pytest.raises(CudaCallError) as caught:
            check_cuda("cudaMalloc", (_error(2), None))
        assert caught.value.call == "cudaMalloc"
        assert caught.value.code == 2
        assert "cudaErrorMemoryAllocation" in str(caught.value)

    def test_error_name_from_plain_ints(self) -> None:
        assert cuda_error("c", 700).name == "cudaErrorIllegalAddress"
        assert cuda_error("c", 123456).name == "cudaError 123456"


class TestProbe:
    def test_not_found(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from cuda.pathfinder import DynamicLibNotFoundError

        def missing() -> int:
            raise DynamicLibNotFoundError("Failure finding libcudla.so.1")

        monkeypatch.setattr(cuda_module, "cudla", _fake_cudla(missing))
        assert probe() == (False, cuda_module.NO_LIBCUDLA)

    def test_not_found_with_an_old_pathfinder(self, monkeypatch: pytest.MonkeyPatch) -> None:
        class DynamicLibNotFoundError(Exception):
            pass

        def missing() -> int:
            raise DynamicLibNotFoundError("gone")

        monkeypatch.setattr(cuda_module, "cudla", _fake_cudla(missing))
        monkeypatch.setitem(sys.modules, "cuda.pathfinder", None)
        assert probe() == (False, cuda_module.NO_LIBCUDLA)

    def test_broken_library(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def broken() -> int:
            raise OSError("bad ELF")

        monkeypatch.setattr(cuda_module, "cudla", _fake_cudla(broken))
        usable, reason = probe()
        assert not usable
        assert "could not be used" in reason
        assert "bad ELF" in reason

    def test_no_cores(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(cuda_module, "cudla", _fake_cudla(lambda: 0))
        assert probe() == (False, "libcudla.so.1 reports no DLA cores")

    def test_one_core_is_singular(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(cuda_module, "cudla", _fake_cudla(lambda: 1))
        assert probe() == (True, "libcudla.so.1 reports 1 DLA core")

    def test_cuda_device_errors(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(cuda_module, "cudla", _fake_cudla(lambda: 2))
        patched = _Patched(cuda_module._rt, cudaGetDeviceCount=lambda: (_error(100), 0))
        monkeypatch.setattr(cuda_module, "_rt", patched)
        usable, reason = probe()
        assert not usable
        assert "cudaErrorNoDevice" in reason
        patched = _Patched(cuda_module._rt, cudaGetDeviceCount=lambda: (_error(0), 0))
        monkeypatch.setattr(cuda_module, "_rt", patched)
        assert probe() == (False, "cuDLA hybrid mode needs a CUDA device, and none was found")

    def test_never_raises(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(cuda_module, "cudla", _fake_cudla(lambda: 2))

        def explode() -> Any:
            raise RuntimeError("driver exploded")

        monkeypatch.setattr(
            cuda_module, "_rt", _Patched(cuda_module._rt, cudaGetDeviceCount=explode)
        )
        usable, reason = probe()
        assert not usable
        assert "driver exploded" in reason


# -- helpers -------------------------------------------------------------------------------


def _error(code: int) -> Any:
    from cuda.bindings import runtime as rt

    return rt.cudaError_t(code)


class _Patched:
    """A view of a runtime module with some functions replaced."""

    def __init__(self, base: Any, **replacements: Any) -> None:
        self._base = base
        self.__dict__.update(replacements)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def _fake_cudla(device_get_count: Any) -> Any:
    return types.SimpleNamespace(CudlaError=cudla.CudlaError, device_get_count=device_get_count)
