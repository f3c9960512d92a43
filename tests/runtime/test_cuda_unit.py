"""CudaRuntime without a GPU: the unwrapper, the error mapping, probe's answer, and the
cuDLA half driven through the real ``cuda.bindings.cudla`` into the host-fake stand-in.

The GPU half lives in tests/gpu.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from cuda.bindings import cudla
from cuda.bindings import runtime as rt

import aiodla.runtime._cuda as cuda_module
from aiodla.emulator import _standin
from aiodla.runtime._cuda import (
    NO_LIBCUDLA,
    CudaRuntime,
    InvalidCudlaArgumentError,
    UnknownCudlaStatusError,
    check_cuda,
    cuda_error,
    probe,
)
from aiodla.runtime._protocol import CudaCallError

NVCC = os.environ.get("NVCC", "nvcc")
TESTS = Path(__file__).resolve().parents[1]


def _has_gpu() -> bool:
    error, count = rt.cudaGetDeviceCount()
    return int(error) == 0 and count > 0


class TestUnwrapper:
    def test_success_shapes(self) -> None:
        ok = rt.cudaError_t.cudaSuccess
        assert check_cuda("c", (ok,)) is None
        assert check_cuda("c", (ok, 42)) == 42
        assert check_cuda("c", (ok, 1, 2)) == (1, 2)

    def test_failure_names_call_and_error(self) -> None:
        with pytest.raises(CudaCallError) as caught:
            check_cuda("cudaMalloc", (rt.cudaError_t.cudaErrorMemoryAllocation, None))
        error = caught.value
        assert (error.call, error.code, error.name) == (
            "cudaMalloc",
            2,
            "cudaErrorMemoryAllocation",
        )
        assert str(error) == "cudaMalloc failed: cudaErrorMemoryAllocation (2)"
        assert not error.sticky

    def test_sticky_errors(self) -> None:
        assert cuda_error("x", rt.cudaError_t.cudaErrorIllegalAddress).sticky
        assert cuda_error("x", 911).sticky
        assert not cuda_error("x", 600).sticky

    def test_names_for_plain_ints(self) -> None:
        assert cuda_error("x", 999).name == "cudaErrorUnknown"
        assert cuda_error("x", 424242).name == "cudaError 424242"
        # the bindings' own enum knows every name, also those aiodla does not list
        assert cuda_error("x", rt.cudaError_t(101)).name == "cudaErrorInvalidDevice"


class TestCudlaErrors:
    def test_status_outside_the_enum(self) -> None:
        def returns_garbage() -> None:
            cudla.check_status(987654)  # what every binding does with a status

        with pytest.raises(UnknownCudlaStatusError) as caught:
            cuda_module._cudla_call("cudlaCreateDevice", returns_garbage)
        error = caught.value
        assert isinstance(error, cudla.CudlaError)
        assert error.status == 987654
        assert error.call == "cudlaCreateDevice"
        assert "987654" in str(error)
        assert pickle.loads(pickle.dumps(error)).status == 987654

    def test_known_status_passes_through(self) -> None:
        def invalid() -> None:
            cudla.check_status(4)

        with pytest.raises(cudla.CudlaError) as caught:
            cuda_module._cudla_call("cudlaMemRegister", invalid)
        assert type(caught.value) is cudla.CudlaError
        assert caught.value.status == 4

    def test_other_value_errors_pass_through(self) -> None:
        def broken() -> None:
            raise ValueError("buf must be either a Python int")

        with pytest.raises(ValueError, match="buf must be"):
            cuda_module._cudla_call("cudlaModuleLoadFromMemory", broken)

    def test_invalid_argument(self) -> None:
        error = InvalidCudlaArgumentError("cudlaSetTaskTimeoutInMs", "too long")
        assert isinstance(error, cudla.CudlaError)
        assert error.status == 1
        assert str(error).endswith("cudlaSetTaskTimeoutInMs: too long")
        assert pickle.loads(pickle.dumps(error)).detail == "too long"

    def test_timeout_checked_before_any_call(self) -> None:
        with pytest.raises(InvalidCudlaArgumentError):
            CudaRuntime().set_task_timeout(1, 1 << 33)

    def test_make_task_refuses_numpy_ints(self) -> None:
        import numpy as np

        with pytest.raises(TypeError, match="Python ints"):
            CudaRuntime().make_task(1, [np.uint64(64)], [128])

    def test_make_task_builds_a_cudla_task(self) -> None:
        task = CudaRuntime().make_task(0x10, [0x1000, 0x2000], [0x3000])
        assert isinstance(task, cudla.Task)
        assert task.module_handle == 0x10
        assert list(task.input_tensor) == [0x1000, 0x2000]
        assert list(task.output_tensor) == [0x3000]
        assert task.wait_events == 0
        assert task.signal_events == 0


class TestProbe:
    def test_answers_without_libcudla(self) -> None:
        if _standin.standin_loaded() or _standin._already_loaded_cudla() is not None:
            pytest.skip("a libcudla.so.1 is loaded in this process")
        usable, reason = probe()
        if usable:
            pytest.skip(f"this machine has a usable cuDLA: {reason}")
        assert reason == NO_LIBCUDLA or "CUDA device" in reason

    def test_never_raises(self, monkeypatch: pytest.MonkeyPatch) -> None:
        class Exploding:
            def __getattr__(self, name: str) -> Any:
                raise RuntimeError("bindings exploded")

        monkeypatch.setattr(
            cuda_module,
            "cudla",
            types.SimpleNamespace(CudlaError=cudla.CudlaError, device_get_count=lambda: 2),
        )
        monkeypatch.setattr(cuda_module, "_rt", Exploding())
        usable, reason = probe()
        assert not usable
        assert "bindings exploded" in reason


class TestWithoutADriver:
    """What the CUDA calls say on a machine with no GPU or driver (CI)."""

    @pytest.fixture(autouse=True)
    def _no_gpu(self) -> None:
        if _has_gpu():
            pytest.skip("this machine has a GPU; tests/gpu covers the CUDA calls")

    def test_calls_fail_with_named_errors(self) -> None:
        runtime = CudaRuntime()
        for call, args in (
            (runtime.make_current, ()),
            (runtime.create_stream, ()),
            (runtime.create_event, ()),
            (runtime.malloc, (64,)),
            (runtime.host_alloc, (64,)),
        ):
            with pytest.raises(CudaCallError) as caught:
                call(*args)
            assert caught.value.name.startswith("cudaError"), caught.value
        runtime.close()


_BINDINGS_SCRIPT = r"""
import ctypes, json, sys
sys.path.insert(0, sys.argv[2])
import numpy as np
from aiodla.emulator._standin import load_standin
from aiodla.runtime._cuda import CudaRuntime, UnknownCudlaStatusError, probe
from aiodla.emulator._ops import run_model
from cuda.bindings import cudla
from vectors import vectors

controls = load_standin(sys.argv[1])
runtime = CudaRuntime()
runtime.make_current = lambda: None  # no CUDA here: the fake runs tasks on the host
facts = {"cores": runtime.device_count(), "version": runtime.version()}
mismatches = 0


def release(device, module, registered, memory):
    for r in registered:
        runtime.mem_unregister(device, r)
    for p in memory:
        controls.fake_free(p)
    runtime.unload_module(module)
    runtime.destroy_device(device)


for vector in vectors(requests=2):
    device = runtime.create_device(1)
    runtime.set_task_timeout(device, 1000)
    module = runtime.load_module(device, vector.loadable)
    inputs, outputs = runtime.module_tensors(module)
    assert [d.name for d in inputs] == [s.name for s in vector.model.inputs]
    assert [d.size for d in outputs] == [s.size for s in vector.model.outputs]
    memory = [controls.fake_alloc(d.size) for d in (*inputs, *outputs)]
    tensors = (*inputs, *outputs)
    registered = [runtime.mem_register(device, p, d.size) for p, d in zip(memory, tensors)]
    task = runtime.make_task(module, registered[: len(inputs)], registered[len(inputs):])
    for buffers in vector.buffers:
        for pointer, data in zip(memory, buffers):  # the inputs' memory comes first
            ctypes.memmove(pointer, data, len(data))
        runtime.submit_task(device, task, 0)
        assert runtime.get_last_error(device) == 0
        expected = [np.zeros(s.size, np.uint8) for s in vector.model.outputs]
        with np.errstate(over="ignore", invalid="ignore"):
            run_model(vector.model, [np.frombuffer(b, np.uint8) for b in buffers], expected)
        for pointer, want in zip(memory[len(inputs):], expected, strict=True):
            got = ctypes.string_at(pointer, want.size)
            mismatches += got != want.tobytes()
    controls.fail_next_task(1, 0x40000006)
    runtime.submit_task(device, task, 0)
    first, second = runtime.get_last_error(device), runtime.get_last_error(device)
    facts.setdefault("failed", []).append([first, second])
    release(device, module, registered, memory)
# The submissions above went through the stand-in's cudlaSubmitTask keeping the GIL;
# its failures read as the bindings' do.
facts["held"] = runtime._held.submit_task is not None and runtime._held.last_error is not None
device = runtime.create_device(0)
module = runtime.load_module(device, vector.loadable)
inputs, outputs = runtime.module_tensors(module)
memory = [controls.fake_alloc(d.size) for d in (*inputs, *outputs)]
registered = [runtime.mem_register(device, p, d.size) for p, d in zip(memory, (*inputs, *outputs))]
task = runtime.make_task(module, registered[: len(inputs)], registered[len(inputs):])
for status in (4, 4243):
    controls.fail_next_call("cudlaSubmitTask", status)
    try:
        runtime.submit_task(device, task, 0)
    except cudla.CudlaError as exc:
        facts.setdefault("submit_failed", []).append([type(exc).__name__, int(exc.status)])
release(device, module, registered, memory)
unheld = CudaRuntime(hold_gil=False)
unheld.make_current = lambda: None
unheld.destroy_device(unheld.create_device(0))
facts["unheld"] = not any(unheld._held)
controls.fail_next_call("cudlaCreateDevice", 4242)
try:
    runtime.create_device(0)
except UnknownCudlaStatusError as exc:
    facts["unknown"] = exc.status
try:
    runtime.create_device(7)
except cudla.CudlaError as exc:
    facts["no_core"] = int(exc.status)
facts["mismatches"] = mismatches
facts["live"] = controls.live_handles()
facts["probe"] = probe()
print(json.dumps(facts))
"""


def test_cudla_half_through_the_bindings(tmp_path: Path) -> None:
    """CudaRuntime's cuDLA calls, through cuda.bindings.cudla into the host-fake stand-in.

    In a subprocess: once cuda.bindings.cudla has bound to a libcudla it keeps it.
    """
    if shutil.which(NVCC) is None:
        pytest.skip(f"{NVCC!r} is not installed")
    library = _standin.build_standin(tmp_path, nvcc=NVCC, host_fake=True)
    result = subprocess.run(
        [sys.executable, "-c", _BINDINGS_SCRIPT, str(library), str(TESTS)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert facts["cores"] == 2
    assert facts["version"] == 1_002_001
    assert facts["mismatches"] == 0
    assert all(pair == [0x40000006, 0] for pair in facts["failed"])
    assert facts["unknown"] == 4242
    assert facts["held"] and facts["unheld"]
    assert facts["submit_failed"] == [["CudlaError", 4], ["UnknownCudlaStatusError", 4243]]
    assert facts["no_core"] == 1
    assert facts["live"] == {"devices": 0, "modules": 0, "registrations": 0}
    usable, reason = facts["probe"]
    assert not usable
    assert "CUDA device" in reason


class _CaptureBindings:
    """The graph calls of cuda.bindings.runtime, answering as told (no GPU needed)."""

    cudaStreamCaptureMode = rt.cudaStreamCaptureMode
    cudaEventRecordExternal = rt.cudaEventRecordExternal

    def __init__(self) -> None:
        self.end_error = rt.cudaError_t.cudaSuccess
        self.launch_error = rt.cudaError_t.cudaSuccess
        self.calls: list[str] = []

    def cudaStreamBeginCapture(self, stream: int, mode: Any) -> tuple[Any]:
        self.calls.append("begin")
        return (rt.cudaError_t.cudaSuccess,)

    def cudaStreamEndCapture(self, stream: int) -> tuple[Any, Any]:
        self.calls.append("end")
        return (self.end_error, "graph")

    def cudaGraphInstantiate(self, graph: Any, flags: int) -> tuple[Any, Any]:
        return (rt.cudaError_t.cudaSuccess, "executable")

    def cudaGraphDestroy(self, graph: Any) -> tuple[Any]:
        self.calls.append("destroy graph")
        return (rt.cudaError_t.cudaSuccess,)

    def cudaGraphLaunch(self, executable: Any, stream: int) -> tuple[Any]:
        self.calls.append("launch")
        return (self.launch_error,)

    def cudaEventRecordWithFlags(self, event: int, stream: int, flags: Any) -> tuple[Any]:
        self.calls.append(f"record {int(flags)}")
        return (rt.cudaError_t.cudaSuccess,)


class TestGraphs:
    """CudaRuntime's capture: the transfer counts a capture made are taken back and
    added at each launch; failures name their call (tests/gpu runs real graphs)."""

    @pytest.fixture
    def bindings(self, monkeypatch: pytest.MonkeyPatch) -> _CaptureBindings:
        fake = _CaptureBindings()
        monkeypatch.setattr(cuda_module, "_rt", fake)
        return fake

    def test_counts_follow_launches_not_captures(self, bindings: _CaptureBindings) -> None:
        runtime = CudaRuntime()
        runtime.begin_capture(7)
        runtime.counts.copies_to_device += 1  # as a copy recorded in the capture counts it
        runtime.counts.bytes_to_device += 64
        runtime.record_event(3, 7)  # recorded in a capture: an external record node
        graph = runtime.end_capture(7)
        assert (runtime.counts.copies_to_device, runtime.counts.bytes_to_device) == (0, 0)
        for _ in range(2):
            runtime.launch_graph(graph, 7)
        assert (runtime.counts.copies_to_device, runtime.counts.bytes_to_device) == (2, 128)
        assert bindings.calls == ["begin", "record 1", "end", "destroy graph", "launch", "launch"]

    def test_a_capture_that_fails_to_end_counts_nothing(self, bindings: _CaptureBindings) -> None:
        runtime = CudaRuntime()
        runtime.begin_capture(7)
        runtime.counts.conversions += 2
        bindings.end_error = rt.cudaError_t.cudaErrorStreamCaptureInvalidated
        with pytest.raises(CudaCallError, match="cudaStreamEndCapture") as caught:
            runtime.end_capture(7)
        assert caught.value.code == 901
        assert runtime.counts.conversions == 0
        assert not runtime._capturing  # a later record_event is an ordinary one

    def test_a_failed_launch_names_its_call(self, bindings: _CaptureBindings) -> None:
        runtime = CudaRuntime()
        runtime.begin_capture(7)
        graph = runtime.end_capture(7)
        bindings.launch_error = rt.cudaError_t.cudaErrorLaunchFailure
        with pytest.raises(CudaCallError, match="cudaGraphLaunch") as caught:
            runtime.launch_graph(graph, 7)
        assert caught.value.sticky
