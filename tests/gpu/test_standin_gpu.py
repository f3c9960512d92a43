"""The GPU stand-in libcudla.so.1: cuDLA's validation rules, fault injection, accounting,
and the hybrid-mode behaviour aiodla relies on (tasks on the caller's stream, one task at
a time per core, the service time spent on the GPU)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from cuda.bindings import cudla

from aiodla._tensors import TensorSpec
from aiodla.emulator._format import make_loadable, parse_loadable
from aiodla.emulator._ops import run_model
from aiodla.runtime._cuda import CudaRuntime

from _setup import ModelSetup

pytestmark = pytest.mark.gpu

INVALID_PARAM = 1
OUT_OF_RESOURCES = 2
INVALID_ADDRESS = 4
INVALID_DEVICE = 8
INVALID_ATTRIBUTE = 9
MEMORY_REGISTERED = 11
INVALID_MODULE = 12
UNSUPPORTED = 13
DLA_INVALID_INPUT = 0x40000001
ENGINE_TIMEOUT = 0x40000006
NO_HANDLES = {"devices": 0, "modules": 0, "registrations": 0}
NOTHING_LIVE = {"allocations": 0, "bytes": 0, "events": 0, "streams": 0}


def model(
    latency: float = 0.0, *, op: str = "affine", scale: float = 2.0, bias: float = 1.0
) -> bytes:
    x = TensorSpec("x", (1, 16, 2, 3), "float16", "chw16")
    shape = (1, 16, 2, 3) if op == "affine" else (1, 16, 1, 1)
    y = TensorSpec("y", shape, "float16", "nchw")
    return make_loadable([x], [y], op, latency, scale=scale, bias=bias)


def request(setup: ModelSetup, seed: int) -> tuple[list[bytes], list[bytes]]:
    """Input buffers and the expected output bytes (by the emulated runtime's ops)."""
    spec = setup.inputs[0]
    x = (np.arange(96, dtype=np.float64).reshape(spec.shape) * 0.25 + seed).astype(np.float16)
    data = [spec.pack(x).tobytes()]
    expected = [np.zeros(s.size, dtype=np.uint8) for s in setup.outputs]
    run_model(parse_loadable(setup.loadable), [np.frombuffer(data[0], dtype=np.uint8)], expected)
    return data, [e.tobytes() for e in expected]


class _Setup(ModelSetup):
    def __init__(self, runtime: Any, core: int, loadable: bytes, **kwargs: Any) -> None:
        self.loadable = loadable
        super().__init__(runtime, core, loadable, **kwargs)


def status_of(call: Any, *args: Any) -> int:
    with pytest.raises(cudla.CudlaError) as caught:
        call(*args)
    return int(caught.value.status)


@pytest.fixture
def setup(runtime: CudaRuntime, standin: Any) -> Any:
    with _Setup(runtime, 0, model()) as made:
        yield made
    assert standin.live_handles() == NO_HANDLES
    assert standin.live_resources() == NOTHING_LIVE


class TestBasics:
    def test_result_and_handles(self, setup: _Setup, standin: Any) -> None:
        assert standin.live_handles() == {"devices": 1, "modules": 1, "registrations": 2}
        data, expected = request(setup, 3)
        outputs, status = setup.run(data)
        assert status == 0
        assert outputs == expected

    def test_mean_hw(self, runtime: CudaRuntime) -> None:
        with _Setup(runtime, 1, model(op="mean_hw", scale=0.5, bias=-2.0)) as made:
            data, expected = request(made, 7)
            assert made.run(data) == (expected, 0)

    def test_every_output_byte_is_written(self, setup: _Setup) -> None:
        for seed, pattern in ((1, 0xCD), (2, 0xFF), (3, 0x00)):
            setup.fill_outputs(pattern)
            data, expected = request(setup, seed)
            assert setup.run(data) == (expected, 0)

    def test_attributes_through_the_bindings(self, setup: _Setup) -> None:
        kinds = cudla.ModuleAttributeType
        assert cudla.module_get_attributes(setup.module, int(kinds.NUM_INPUT_TENSORS)) == 1
        assert cudla.module_get_attributes(setup.module, int(kinds.NUM_OUTPUT_TENSORS)) == 1
        records = cudla.module_get_attributes(setup.module, int(kinds.OUTPUT_TENSOR_DESCRIPTORS))
        assert len(records) == 1
        assert int(records[0].size_) == setup.outputs[0].size
        unified = cudla.device_get_attribute(
            setup.device, int(cudla.DevAttributeType.UNIFIED_ADDRESSING)
        )
        assert int(unified.unified_addressing_supported) == 1
        with pytest.raises(cudla.CudlaError) as caught:
            cudla.device_get_attribute(setup.device, 77)
        assert int(caught.value.status) == INVALID_ATTRIBUTE


class TestValidation:
    def test_raw_pointer_in_a_task(self, setup: _Setup, runtime: CudaRuntime) -> None:
        task = runtime.make_task(setup.module, [setup.device_in[0]], [setup.registered_out[0]])
        assert status_of(runtime.submit_task, setup.device, task, setup.stream) == INVALID_ADDRESS

    def test_registration_rules(self, setup: _Setup, runtime: CudaRuntime) -> None:
        size = setup.inputs[0].size
        pointer = runtime.malloc(4096)
        try:
            assert (
                status_of(runtime.mem_register, setup.device, pointer + 16, 64) == INVALID_ADDRESS
            )
            assert status_of(runtime.mem_register, setup.device, pointer, 0) == INVALID_ADDRESS
            assert (
                status_of(runtime.mem_register, setup.device, pointer, 2 * 4096) == INVALID_ADDRESS
            )
            host = runtime.host_alloc(4096)
            try:
                assert (
                    status_of(runtime.mem_register, setup.device, host.ptr, 64) == INVALID_ADDRESS
                )
            finally:
                runtime.host_free(host)
            # already registered (by the setup) on this device handle
            assert (
                status_of(runtime.mem_register, setup.device, setup.device_in[0], size)
                == MEMORY_REGISTERED
            )
            inner = runtime.mem_register(setup.device, pointer + 32, 64)  # inside: fine
            runtime.mem_unregister(setup.device, inner)
        finally:
            runtime.free(pointer)

    def test_registration_smaller_than_the_tensor(
        self, setup: _Setup, runtime: CudaRuntime
    ) -> None:
        pointer = runtime.malloc(4096)
        small = runtime.mem_register(setup.device, pointer, 32)
        try:
            task = runtime.make_task(setup.module, [small], [setup.registered_out[0]])
            assert status_of(runtime.submit_task, setup.device, task, setup.stream) == INVALID_PARAM
        finally:
            runtime.mem_unregister(setup.device, small)
            runtime.free(pointer)

    def test_module_of_another_handle(self, setup: _Setup, runtime: CudaRuntime) -> None:
        other = runtime.create_device(0)
        try:
            assert status_of(runtime.submit_task, other, setup.task, setup.stream) == INVALID_MODULE
        finally:
            runtime.destroy_device(other)

    def test_wrong_tensor_counts(self, setup: _Setup, runtime: CudaRuntime) -> None:
        task = runtime.make_task(setup.module, setup.registered_in * 2, setup.registered_out)
        assert status_of(runtime.submit_task, setup.device, task, setup.stream) == INVALID_PARAM

    def test_sixteen_handles_per_core(self, runtime: CudaRuntime, standin: Any) -> None:
        handles = []
        try:
            for _ in range(16):
                handles.append(runtime.create_device(1))
            assert status_of(runtime.create_device, 1) == OUT_OF_RESOURCES
            other = runtime.create_device(0)  # another core is unaffected
            runtime.destroy_device(other)
        finally:
            for handle in handles:
                runtime.destroy_device(handle)
        assert standin.live_handles() == NO_HANDLES

    def test_hybrid_mode_needs_null_events(self, setup: _Setup) -> None:
        for field in ("wait_events", "signal_events"):
            task = cudla.Task()
            task.module_handle = setup.module
            task.input_tensor = setup.registered_in
            task.output_tensor = setup.registered_out
            setattr(task, field, 0x40)  # any non-NULL pointer: never dereferenced
            status = status_of(cudla.submit_task, setup.device, task.ptr, 1, setup.stream, 0)
            assert status == UNSUPPORTED

    def test_null_tensor_arrays(self, setup: _Setup) -> None:
        task = cudla.Task()
        task.module_handle = setup.module
        task.output_tensor = setup.registered_out
        assert (
            status_of(cudla.submit_task, setup.device, task.ptr, 1, setup.stream, 0) == UNSUPPORTED
        )

    def test_submit_arguments(self, setup: _Setup) -> None:
        pointer = setup.task.ptr
        assert (
            status_of(cudla.submit_task, setup.device, pointer, 0, setup.stream, 0) == INVALID_PARAM
        )
        assert status_of(cudla.submit_task, setup.device, 0, 1, setup.stream, 0) == INVALID_PARAM
        noop = 1  # CUDLA_SUBMIT_NOOP (13.3 and 13.5 spell the member differently)
        assert (
            status_of(cudla.submit_task, setup.device, pointer, 1, setup.stream, noop)
            == UNSUPPORTED
        )
        assert (
            status_of(cudla.submit_task, setup.device, pointer, 1, setup.stream, 1 << 8)
            == INVALID_PARAM
        )

    def test_one_module_per_handle(self, setup: _Setup, runtime: CudaRuntime) -> None:
        assert status_of(runtime.load_module, setup.device, model()) == UNSUPPORTED

    def test_not_an_emulator_loadable(self, runtime: CudaRuntime) -> None:
        device = runtime.create_device(0)
        try:
            blob = model()
            for bad in (b"", b"\x00" * 64, blob[:-1], blob + b"\x00", b"XIODLAEM" + blob[8:]):
                assert status_of(runtime.load_module, device, bad) == INVALID_MODULE
        finally:
            runtime.destroy_device(device)

    def test_create_flags(self) -> None:
        assert status_of(cudla.create_device, 0, 2) == INVALID_PARAM

    def test_task_timeout_range(self, setup: _Setup, runtime: CudaRuntime) -> None:
        assert status_of(runtime.set_task_timeout, setup.device, 0) == INVALID_PARAM
        assert status_of(runtime.set_task_timeout, setup.device, 1_000_001) == INVALID_PARAM
        runtime.set_task_timeout(setup.device, 1_000_000)
        runtime.set_task_timeout(setup.device, 1)

    def test_destroy_ends_what_the_handle_owns(self, runtime: CudaRuntime, standin: Any) -> None:
        # cudla.h gives cudlaDestroyDevice no status for a module or memory still
        # attached (only success, invalid device, CUDA and UMD errors): destroy releases
        # them, and the module's handle then answers "not loaded into a valid device".
        live, released = standin.live_resources(), standin.released_by_destroy()
        device = runtime.create_device(0)
        with_device = standin.live_resources()
        module = runtime.load_module(device, model())
        pointer = runtime.malloc(4096)
        try:
            registered = runtime.mem_register(device, pointer, 4096)
            assert standin.live_resources()["allocations"] == with_device["allocations"] + 1
            runtime.destroy_device(device)
            assert standin.live_handles() == NO_HANDLES
            assert standin.live_resources() == live
            assert standin.released_by_destroy() == {
                "modules": released["modules"] + 1,
                "registrations": released["registrations"] + 1,
            }
            for _ in range(2):  # every later use, not only the first
                assert status_of(runtime.unload_module, module) == INVALID_DEVICE
                assert status_of(runtime.module_tensors, module) == INVALID_DEVICE
            assert status_of(runtime.mem_unregister, device, registered) == INVALID_DEVICE
            assert status_of(runtime.destroy_device, device) == INVALID_DEVICE
        finally:
            runtime.free(pointer)

    def test_unload_twice(self, runtime: CudaRuntime, standin: Any) -> None:
        live = standin.live_resources()
        device = runtime.create_device(1)
        try:
            with_device = standin.live_resources()
            module = runtime.load_module(device, model())
            runtime.unload_module(module)
            assert standin.live_resources() == with_device
            assert status_of(runtime.unload_module, module) == INVALID_MODULE
            assert status_of(runtime.module_tensors, module) == INVALID_MODULE
            # The handle can load again once its module is gone, and release again.
            again = runtime.load_module(device, model())
            runtime.unload_module(again)
        finally:
            runtime.destroy_device(device)
        assert standin.live_resources() == live

    def test_stale_handles(self, runtime: CudaRuntime) -> None:
        device = runtime.create_device(0)
        runtime.destroy_device(device)
        assert status_of(runtime.destroy_device, device) == INVALID_DEVICE
        assert status_of(runtime.set_task_timeout, device, 100) == INVALID_DEVICE
        assert status_of(runtime.load_module, device, model()) == INVALID_DEVICE
        assert status_of(runtime.mem_register, device, 0, 64) == INVALID_DEVICE
        assert runtime.get_last_error(device) == INVALID_DEVICE

    def test_work_in_flight_blocks_release(
        self, setup: _Setup, runtime: CudaRuntime, standin: Any, real_gpu: None
    ) -> None:
        data, expected = request(setup, 5)
        gate = standin.hold(0)
        try:
            setup.enqueue(data)
            assert gate.wait_for_held(1, timeout=10.0)
            assert (
                status_of(runtime.mem_unregister, setup.device, setup.registered_in[0])
                == INVALID_PARAM
            )
            assert status_of(runtime.unload_module, setup.module) == INVALID_PARAM
            assert status_of(runtime.destroy_device, setup.device) == INVALID_PARAM
        finally:
            gate.release()
        runtime.synchronize_stream(setup.stream)
        assert setup.results() == expected
        assert runtime.get_last_error(setup.device) == 0


class TestFaults:
    def test_failed_task_writes_nothing_and_latches(self, setup: _Setup, standin: Any) -> None:
        setup.fill_outputs(0xAB)
        data, expected = request(setup, 1)
        standin.fail_next_task(0, DLA_INVALID_INPUT)
        outputs, status = setup.run(data)
        assert status == DLA_INVALID_INPUT
        assert outputs == [b"\xab" * setup.outputs[0].size]
        assert setup.runtime.get_last_error(setup.device) == 0  # read once, then cleared
        assert setup.run(data) == (expected, 0)

    def test_latest_failure_is_reported(self, setup: _Setup, standin: Any) -> None:
        data, _ = request(setup, 1)
        standin.fail_next_task(0, DLA_INVALID_INPUT)
        standin.fail_next_task(0, 0x40000003)
        setup.enqueue(data)
        setup.enqueue(data)
        setup.runtime.synchronize_stream(setup.stream)
        assert setup.runtime.get_last_error(setup.device) == 0x40000003
        assert setup.runtime.get_last_error(setup.device) == 0

    def test_failure_goes_to_the_core(self, runtime: CudaRuntime, standin: Any) -> None:
        with _Setup(runtime, 0, model()) as zero, _Setup(runtime, 1, model()) as one:
            data, expected = request(zero, 2)
            standin.fail_next_task(1, DLA_INVALID_INPUT)
            assert zero.run(data) == (expected, 0)
            assert one.run(data)[1] == DLA_INVALID_INPUT

    def test_next_task_started_takes_the_failure(
        self, runtime: CudaRuntime, standin: Any, real_gpu: None
    ) -> None:
        with _Setup(runtime, 0, model()) as first, _Setup(runtime, 0, model()) as second:
            data, expected = request(first, 4)
            gate = standin.hold(0)
            try:
                first.enqueue(data)
                assert gate.wait_for_held(1, timeout=10.0)
                second.enqueue(data)  # queued behind the held task on the GPU
                standin.fail_next_task(0, DLA_INVALID_INPUT)  # after both were submitted
            finally:
                gate.release()
            runtime.synchronize_stream(first.stream)
            runtime.synchronize_stream(second.stream)
            assert runtime.get_last_error(first.device) == DLA_INVALID_INPUT
            assert runtime.get_last_error(second.device) == 0
            assert second.results() == expected

    def test_hung_core_times_out(self, runtime: CudaRuntime, standin: Any) -> None:
        with _Setup(runtime, 1, model(), timeout_ms=200) as made:
            data, expected = request(made, 6)
            standin.hang_core(1)
            began = time.monotonic()
            _, status = made.run(data)
            elapsed = time.monotonic() - began
            assert status == ENGINE_TIMEOUT
            assert elapsed >= 0.19
            standin.hang_core(1, False)
            assert made.run(data) == (expected, 0)

    def test_held_task_ends_at_the_timeout(
        self, runtime: CudaRuntime, standin: Any, real_gpu: None
    ) -> None:
        with _Setup(runtime, 0, model(), timeout_ms=150) as made:
            data, _ = request(made, 6)
            gate = standin.hold(0)
            try:
                began = time.monotonic()
                assert made.run(data)[1] == ENGINE_TIMEOUT
                assert time.monotonic() - began >= 0.14
            finally:
                gate.release()

    def test_hold_and_release(self, setup: _Setup, standin: Any, real_gpu: None) -> None:
        data, expected = request(setup, 8)
        with standin.hold(0) as gate:
            setup.enqueue(data)
            assert gate.wait_for_held(1, timeout=10.0)
            assert gate.held == 1
            time.sleep(0.02)
            assert not setup.runtime.query_event(setup.event)
        setup.runtime.synchronize_stream(setup.stream)
        assert gate.held == 0
        assert setup.results() == expected

    def test_fail_next_call(self, setup: _Setup, standin: Any, runtime: CudaRuntime) -> None:
        standin.fail_next_call("cudlaSubmitTask", 6)
        assert status_of(runtime.submit_task, setup.device, setup.task, setup.stream) == 6
        data, expected = request(setup, 9)
        assert setup.run(data) == (expected, 0)

    def test_core_accounting(self, setup: _Setup, standin: Any) -> None:
        before = standin.core_tasks(0)
        data, _ = request(setup, 0)
        for _ in range(3):
            setup.run(data)
        assert standin.core_tasks(0) == before + 3


class TestScheduling:
    def test_service_time_is_spent_on_the_gpu(self, runtime: CudaRuntime, real_gpu: None) -> None:
        with _Setup(runtime, 0, model(latency=0.05)) as made:
            data, expected = request(made, 1)
            began = time.monotonic()
            made.enqueue(data)
            enqueued = time.monotonic() - began
            runtime.synchronize_stream(made.stream)
            total = time.monotonic() - began
            assert enqueued < 0.02, "submit must not wait for the task"
            assert total >= 0.049
            assert made.results() == expected

    def test_one_core_runs_one_task_at_a_time(
        self, runtime: CudaRuntime, standin: Any, real_gpu: None
    ) -> None:
        latency, rounds = 0.02, 5
        with _Setup(runtime, 0, model(latency)) as a, _Setup(runtime, 0, model(latency)) as b:
            data, _ = request(a, 1)
            busy_before = standin.core_busy_time(0)
            began = time.monotonic()
            for _ in range(rounds):
                a.enqueue(data)
                b.enqueue(data)
            runtime.synchronize_stream(a.stream)
            runtime.synchronize_stream(b.stream)
            elapsed = time.monotonic() - began
        assert elapsed >= 2 * rounds * latency * 0.98
        assert standin.core_busy_time(0) - busy_before == pytest.approx(
            2 * rounds * latency, rel=1e-6
        )

    def test_a_core_runs_the_tasks_of_every_handle_one_at_a_time(
        self, runtime: CudaRuntime, real_gpu: None
    ) -> None:
        # A core is one piece of hardware: two device handles (each with its own
        # module) submitting to one core at once take two tasks' time, as on a DLA,
        # while the same two tasks on two cores overlap. The gate cannot show this: a
        # second handle's task would also wait at a held core's gate. (The host-fake
        # build runs a task in the submitting thread: see
        # test_every_handle_of_a_core_counts_on_it.)
        latency = 0.05
        loadable = model(latency=latency)
        with (
            _Setup(runtime, 0, loadable) as a,
            _Setup(runtime, 0, loadable) as b,
            _Setup(runtime, 1, loadable) as other,
        ):
            data, expected = request(a, 5)

            def both(first: _Setup, second: _Setup) -> float:
                start = time.monotonic()
                first.enqueue(data)
                second.enqueue(data)
                for made in (first, second):
                    runtime.synchronize_stream(made.stream)
                elapsed = time.monotonic() - start
                assert first.results() == expected
                assert second.results() == expected
                return elapsed

            one_core = min(both(a, b) for _ in range(3))
            two_cores = min(both(a, other) for _ in range(3))
        assert one_core >= 1.8 * latency, (one_core, two_cores)
        assert two_cores < 1.5 * latency, (one_core, two_cores)

    def test_every_handle_of_a_core_counts_on_it(self, runtime: CudaRuntime, standin: Any) -> None:
        # Two device handles, each with its own module, on one core from two threads:
        # every task is the core's (its count and busy time), each handle gets its own
        # results, and the other core ran nothing.
        latency, rounds = 0.0005, 10
        with _Setup(runtime, 0, model(latency)) as a, _Setup(runtime, 0, model(latency)) as b:
            data, expected = request(a, 7)
            tasks, busy = standin.core_tasks(0), standin.core_busy_time(0)
            other = standin.core_tasks(1)
            failures: list[BaseException] = []

            def work(made: _Setup) -> None:
                try:
                    runtime.make_current()
                    for _ in range(rounds):
                        assert made.run(data) == (expected, 0)
                except BaseException as exc:
                    failures.append(exc)

            threads = [threading.Thread(target=work, args=(made,)) for made in (a, b)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not failures, failures[0]
        assert standin.core_tasks(0) == tasks + 2 * rounds
        assert standin.core_busy_time(0) - busy == pytest.approx(2 * rounds * latency, rel=1e-6)
        assert standin.core_tasks(1) == other

    def test_two_cores_run_in_parallel(self, runtime: CudaRuntime, real_gpu: None) -> None:
        latency, rounds = 0.02, 5
        with _Setup(runtime, 0, model(latency)) as a, _Setup(runtime, 1, model(latency)) as b:
            data, expected = request(a, 1)
            began = time.monotonic()
            for _ in range(rounds):
                a.enqueue(data)
                b.enqueue(data)
            runtime.synchronize_stream(a.stream)
            runtime.synchronize_stream(b.stream)
            elapsed = time.monotonic() - began
            assert a.results() == expected
            assert b.results() == expected
        assert rounds * latency * 0.98 <= elapsed < 1.6 * rounds * latency

    def test_many_threads_on_one_core(self, runtime: CudaRuntime, standin: Any) -> None:
        failures: list[BaseException] = []

        def worker(seed: int) -> None:
            try:
                runtime.make_current()
                with _Setup(runtime, 0, model(latency=0.0005)) as made:
                    for round_ in range(20):
                        data, expected = request(made, seed * 100 + round_)
                        outputs, status = made.run(data)
                        assert status == 0
                        assert outputs == expected
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures, failures[0]
        assert standin.live_handles() == NO_HANDLES

    def test_task_runs_on_the_given_stream(self, setup: _Setup, runtime: CudaRuntime) -> None:
        other = runtime.create_stream()
        try:
            data, expected = request(setup, 11)
            setup.enqueue(data, stream=other)  # copies, task and copy-out on `other`
            runtime.synchronize_stream(other)
            assert setup.results() == expected
        finally:
            runtime.destroy_stream(other)
