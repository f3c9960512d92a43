"""The emulated runtime: strict as cuDLA, an exact timeline, faults on request."""

from __future__ import annotations

import time

import numpy as np
import pytest
from cuda.bindings import cudla

from aiodla import ConfigurationError, EmulatedRuntime, TensorSpec
from aiodla.emulator import make_loadable
from aiodla.runtime import CudaCallError

IN = TensorSpec("x", (1, 2, 4, 4), "float32", "nchw")
OUT = TensorSpec("y", (1, 2, 4, 4), "float32", "nchw")


def model(latency: float = 0.0) -> bytes:
    return make_loadable([IN], [OUT], "affine", latency, scale=3.0, bias=1.0)


def status_of(info: pytest.ExceptionInfo[BaseException]) -> int:
    return int(info.value.status)  # type: ignore[attr-defined]


class Rig:
    """One device, module, stream, event and registered buffers, as the engine makes them."""

    def __init__(self, rt: EmulatedRuntime, core: int = 0, latency: float = 0.0) -> None:
        self.rt = rt
        self.device = rt.create_device(core)
        self.module = rt.load_module(self.device, model(latency))
        self.stream = rt.create_stream()
        self.event = rt.create_event()
        self.ptr_in, self.ptr_out = rt.malloc(IN.size), rt.malloc(OUT.size)
        self.reg_in = rt.mem_register(self.device, self.ptr_in, IN.size)
        self.reg_out = rt.mem_register(self.device, self.ptr_out, OUT.size)
        self.host_in, self.host_out = rt.host_alloc(IN.size), rt.host_alloc(OUT.size)
        self.task = rt.make_task(self.module, [self.reg_in], [self.reg_out])

    def run(self, x: np.ndarray) -> None:  # type: ignore[type-arg]
        rt = self.rt
        IN.pack(x, out=self.host_in.array)
        rt.copy_to_device(self.ptr_in, self.host_in, IN.size, self.stream)
        rt.submit_task(self.device, self.task, self.stream)
        rt.copy_to_host(self.host_out, self.ptr_out, OUT.size, self.stream)
        rt.record_event(self.event, self.stream)

    def result(self) -> np.ndarray:  # type: ignore[type-arg]
        return OUT.unpack(self.host_out.array)

    def close(self) -> None:
        rt = self.rt
        rt.synchronize_stream(self.stream)
        rt.mem_unregister(self.device, self.reg_in)
        rt.mem_unregister(self.device, self.reg_out)
        rt.free(self.ptr_in)
        rt.free(self.ptr_out)
        rt.host_free(self.host_in)
        rt.host_free(self.host_out)
        rt.destroy_event(self.event)
        rt.destroy_stream(self.stream)
        rt.unload_module(self.module)
        rt.destroy_device(self.device)


class ManualClock:
    """The emulated runtime's time source, moved by the test alone."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def done_at(rt: EmulatedRuntime, event: int, clock: ManualClock, step: float = 0.001) -> float:
    """The time on ``clock`` at which ``event`` completes, stepping the clock forward
    (from where it is) by ``step`` until it does."""
    for _ in range(100_000):
        if rt.query_event(event):
            return clock.now
        clock.now = round(clock.now + step, 9)
    raise AssertionError("the event never completed")


@pytest.fixture
def rt() -> EmulatedRuntime:
    return EmulatedRuntime(cores=2)


class TestHappyPath:
    def test_runs_the_model_and_releases_everything(self, rt: EmulatedRuntime) -> None:
        rig = Rig(rt)
        x = np.arange(32, dtype=np.float32).reshape(IN.shape)
        rig.run(x)
        rt.synchronize_stream(rig.stream)
        assert rt.query_event(rig.event)
        np.testing.assert_array_equal(rig.result(), x * 3 + 1)
        assert rt.get_last_error(rig.device) == 0
        rig.close()
        assert all(v == 0 for v in rt.live_handles().values())

    def test_event_not_done_before_its_time(self, rt: EmulatedRuntime) -> None:
        rig = Rig(rt, latency=0.05)
        rig.run(np.zeros(IN.shape, np.float32))
        assert not rt.query_event(rig.event)
        time.sleep(0.06)
        assert rt.query_event(rig.event)
        rig.close()

    def test_timeline_is_exact_per_core(self) -> None:
        """Two streams on one core: tasks run back to back, 20 ms each, never overlapping
        (on a clock the test moves, so a loaded machine changes nothing)."""
        clock = ManualClock()
        rt = EmulatedRuntime(cores=2, clock=clock)
        rig = Rig(rt, latency=0.02)
        other_stream, other_event = rt.create_stream(), rt.create_event()
        rig.run(np.zeros(IN.shape, np.float32))
        rt.submit_task(rig.device, rig.task, other_stream)
        rt.record_event(other_event, other_stream)
        assert [done_at(rt, event, clock) for event in (rig.event, other_event)] == [
            pytest.approx(0.02),
            pytest.approx(0.04),
        ]
        assert rt.core_busy_time(0) == pytest.approx(0.04)
        rt.destroy_event(other_event)
        rt.destroy_stream(other_stream)
        rig.close()

    def test_a_core_runs_every_handles_tasks_one_at_a_time(self) -> None:
        """Two device handles, each with its own module (20 ms and 30 ms tasks), on one
        core: the core is one piece of hardware, so the second task starts when the
        first ends, whichever handle submitted it."""
        clock = ManualClock()
        rt = EmulatedRuntime(cores=2, clock=clock)
        first, second = Rig(rt, core=0, latency=0.02), Rig(rt, core=0, latency=0.03)
        for rig in (first, second):
            rig.run(np.ones(IN.shape, np.float32))
        assert [done_at(rt, rig.event, clock) for rig in (first, second)] == [
            pytest.approx(0.02),
            pytest.approx(0.05),
        ]
        assert rt.core_busy_time(0) == pytest.approx(0.05) and rt.core_busy_time(1) == 0
        for rig in (first, second):
            np.testing.assert_array_equal(rig.result(), np.ones(IN.shape) * 3 + 1)
            rig.close()

    def test_two_cores_run_in_parallel(self) -> None:
        clock = ManualClock()
        rt = EmulatedRuntime(cores=2, clock=clock)
        rigs = [Rig(rt, core=0, latency=0.03), Rig(rt, core=1, latency=0.03)]
        for rig in rigs:
            rig.run(np.ones(IN.shape, np.float32))
        assert [done_at(rt, rig.event, clock) for rig in rigs] == [pytest.approx(0.03)] * 2
        for rig in rigs:
            rig.close()

    def test_copy_bandwidth(self) -> None:
        rt = EmulatedRuntime(copy_bandwidth=IN.size / 0.02)  # 20 ms per copy
        rig = Rig(rt)
        began = time.monotonic()
        rig.run(np.zeros(IN.shape, np.float32))
        rt.synchronize_stream(rig.stream)
        assert time.monotonic() - began >= 0.04
        rig.close()


class TestStrictness:
    def test_unregistered_pointer(self, rt: EmulatedRuntime) -> None:
        rig = Rig(rt)
        task = rt.make_task(rig.module, [rig.ptr_in], [rig.reg_out])  # raw, not registered
        with pytest.raises(cudla.CudlaError) as info:
            rt.submit_task(rig.device, task, rig.stream)
        assert status_of(info) == 4  # cudlaErrorInvalidAddress
        rig.close()

    def test_misaligned_registration(self, rt: EmulatedRuntime) -> None:
        device = rt.create_device(0)
        ptr = rt.malloc(256)
        with pytest.raises(cudla.CudlaError) as info:
            rt.mem_register(device, ptr + 8, 64)
        assert status_of(info) == 4
        with pytest.raises(cudla.CudlaError) as info:
            rt.mem_register(device, ptr, 512)  # beyond the allocation
        assert status_of(info) == 4
        reg = rt.mem_register(device, ptr, 256)
        with pytest.raises(cudla.CudlaError) as info:
            rt.mem_register(device, ptr, 256)
        assert status_of(info) == 11  # cudlaErrorMemoryRegistered
        rt.mem_unregister(device, reg)
        with pytest.raises(cudla.CudlaError) as info:
            rt.mem_unregister(device, reg)
        assert status_of(info) == 4
        rt.free(ptr)
        rt.destroy_device(device)

    def test_size_mismatch(self, rt: EmulatedRuntime) -> None:
        device = rt.create_device(0)
        module = rt.load_module(device, model())
        small = rt.malloc(IN.size)
        reg_small = rt.mem_register(device, small, IN.size // 2)
        out = rt.malloc(OUT.size)
        reg_out = rt.mem_register(device, out, OUT.size)
        stream = rt.create_stream()
        with pytest.raises(cudla.CudlaError) as info:
            rt.submit_task(device, rt.make_task(module, [reg_small], [reg_out]), stream)
        assert status_of(info) == 1  # cudlaErrorInvalidParam
        with pytest.raises(cudla.CudlaError) as info:
            rt.submit_task(device, rt.make_task(module, [], [reg_out]), stream)
        assert status_of(info) == 1

    def test_module_from_another_device(self, rt: EmulatedRuntime) -> None:
        rig0, rig1 = Rig(rt, core=0), Rig(rt, core=1)
        with pytest.raises(cudla.CudlaError) as info:
            rt.submit_task(rig1.device, rig0.task, rig1.stream)
        assert status_of(info) == 12  # cudlaErrorInvalidModule
        rig0.close()
        rig1.close()

    def test_sixteen_handles_per_core(self, rt: EmulatedRuntime) -> None:
        handles = [rt.create_device(0) for _ in range(16)]
        with pytest.raises(cudla.CudlaError) as info:
            rt.create_device(0)
        assert status_of(info) == 2  # cudlaErrorOutOfResources
        rt.destroy_device(rt.create_device(1))
        for handle in handles:
            rt.destroy_device(handle)

    def test_one_module_per_device_and_bad_loadable(self, rt: EmulatedRuntime) -> None:
        device = rt.create_device(0)
        with pytest.raises(cudla.CudlaError) as info:
            rt.load_module(device, b"garbage")
        assert status_of(info) == 12
        module = rt.load_module(device, model())
        with pytest.raises(cudla.CudlaError) as info:
            rt.load_module(device, model())
        assert status_of(info) == 13  # cudlaErrorUnsupportedOperation
        rt.unload_module(module)
        rt.destroy_device(device)

    def test_destroy_with_work_in_flight(self, rt: EmulatedRuntime) -> None:
        rig = Rig(rt, latency=10.0)
        rig.run(np.zeros(IN.shape, np.float32))
        for call in (
            lambda: rt.mem_unregister(rig.device, rig.reg_in),
            lambda: rt.unload_module(rig.module),
            lambda: rt.destroy_device(rig.device),
        ):
            with pytest.raises(cudla.CudlaError) as info:
                call()
            assert status_of(info) == 1
        rt.close()

    def test_destroy_with_attachments(self, rt: EmulatedRuntime) -> None:
        device = rt.create_device(0)
        module = rt.load_module(device, model())
        with pytest.raises(cudla.CudlaError):
            rt.destroy_device(device)
        rt.unload_module(module)
        rt.destroy_device(device)
        with pytest.raises(cudla.CudlaError) as info:
            rt.destroy_device(device)
        assert status_of(info) == 8  # cudlaErrorInvalidDevice

    def test_cuda_misuse(self, rt: EmulatedRuntime) -> None:
        stream = rt.create_stream()
        host = rt.host_alloc(64)
        ptr = rt.malloc(64)
        with pytest.raises(CudaCallError, match="cudaErrorInvalidValue"):
            rt.copy_to_device(ptr, host, 128, stream)  # beyond the host buffer
        with pytest.raises(CudaCallError):
            rt.copy_to_host(host, ptr + 32, 64, stream)  # beyond the allocation
        with pytest.raises(CudaCallError):
            rt.copy_to_device(ptr, host, 64, 12345)  # not a stream
        with pytest.raises(CudaCallError):
            rt.malloc(0)
        for release in (rt.free, rt.destroy_stream, rt.destroy_event):
            with pytest.raises(CudaCallError):
                release(999)
        rt.free(ptr)
        rt.host_free(host)
        with pytest.raises(CudaCallError):
            rt.host_free(host)
        rt.destroy_stream(stream)

    def test_free_while_registered(self, rt: EmulatedRuntime) -> None:
        device = rt.create_device(0)
        ptr = rt.malloc(64)
        reg = rt.mem_register(device, ptr, 64)
        with pytest.raises(CudaCallError):
            rt.free(ptr)
        rt.mem_unregister(device, reg)
        rt.free(ptr)
        rt.destroy_device(device)

    @pytest.mark.parametrize("ms", [0, 1_000_001])
    def test_task_timeout_range(self, rt: EmulatedRuntime, ms: int) -> None:
        device = rt.create_device(0)
        with pytest.raises(cudla.CudlaError):
            rt.set_task_timeout(device, ms)

    def test_task_pointers_must_be_python_ints(self, rt: EmulatedRuntime) -> None:
        rig = Rig(rt)
        with pytest.raises(TypeError, match="Python ints"):
            rt.make_task(rig.module, [np.uint64(rig.reg_in)], [rig.reg_out])  # type: ignore[list-item]
        rig.close()


class TestFaults:
    def test_fail_next_task(self, rt: EmulatedRuntime) -> None:
        rig = Rig(rt)
        rt.fail_next_task(0, 0x40000001)
        rig.run(np.ones(IN.shape, np.float32))
        rt.synchronize_stream(rig.stream)
        assert rt.get_last_error(rig.device) == 0x40000001
        assert rt.get_last_error(rig.device) == 0  # read once
        np.testing.assert_array_equal(rig.result(), 0)  # outputs not written
        rig.run(np.ones(IN.shape, np.float32))
        rt.synchronize_stream(rig.stream)
        assert rt.get_last_error(rig.device) == 0
        np.testing.assert_array_equal(rig.result(), 4)
        rig.close()

    def test_hung_core_ends_at_the_task_timeout(self, rt: EmulatedRuntime) -> None:
        rig = Rig(rt, latency=0.001)
        rt.set_task_timeout(rig.device, 50)
        rt.hang_core(0)
        began = time.monotonic()
        rig.run(np.ones(IN.shape, np.float32))
        rt.synchronize_stream(rig.stream)
        assert time.monotonic() - began >= 0.05
        assert rt.get_last_error(rig.device) == 0x40000006  # engine timeout
        rt.hang_core(0, False)
        rig.run(np.ones(IN.shape, np.float32))
        rt.synchronize_stream(rig.stream)
        assert rt.get_last_error(rig.device) == 0
        rig.close()

    def test_gate_holds_tasks_until_released(self, rt: EmulatedRuntime) -> None:
        rig = Rig(rt)
        gate = rt.hold(0)
        assert rt.hold(0) is gate
        rig.run(np.ones(IN.shape, np.float32))
        assert gate.wait_for_held(1, timeout=1)
        assert not rt.query_event(rig.event)
        gate.release()
        assert rt.query_event(rig.event)
        assert rt.hold(0) is not gate  # a released gate is gone
        rt.hold(0).release()
        rig.close()

    def test_synchronize_waits_for_a_gate(self, rt: EmulatedRuntime) -> None:
        import threading

        rig = Rig(rt)
        gate = rt.hold(0)
        rig.run(np.ones(IN.shape, np.float32))
        threading.Timer(0.05, gate.release).start()
        began = time.monotonic()
        rt.synchronize_stream(rig.stream)
        assert time.monotonic() - began >= 0.04
        rig.close()

    def test_poison_makes_every_cuda_call_fail(self, rt: EmulatedRuntime) -> None:
        rig = Rig(rt)
        rt.poison()
        for call in (
            lambda: rt.query_event(rig.event),
            rt.create_stream,
            lambda: rt.record_event(rig.event, rig.stream),
            lambda: rt.synchronize_stream(rig.stream),
        ):
            with pytest.raises(CudaCallError) as info:
                call()
            assert info.value.sticky and info.value.code == 911
        with pytest.raises(cudla.CudlaError) as cinfo:
            rt.submit_task(rig.device, rig.task, rig.stream)
        assert status_of(cinfo) == 6  # cudlaErrorCuda

    def test_fail_call_once_after_n(self, rt: EmulatedRuntime) -> None:
        rt.fail_call("malloc", 2, after=2)
        rt.malloc(8)
        rt.malloc(8)
        with pytest.raises(CudaCallError, match="cudaErrorMemoryAllocation"):
            rt.malloc(8)
        rt.malloc(8)  # once only
        rt.fail_call("load_module", 7, core=1)
        device0, device1 = rt.create_device(0), rt.create_device(1)
        rt.load_module(device0, model())
        with pytest.raises(cudla.CudlaError) as info:
            rt.load_module(device1, model())
        assert status_of(info) == 7

    def test_fail_call_needs_a_method(self, rt: EmulatedRuntime) -> None:
        with pytest.raises(ConfigurationError, match="not a runtime method"):
            rt.fail_call("nope", 1)

    @pytest.mark.parametrize("cores", [0, -1, "2", True])
    def test_bad_core_count(self, cores: object) -> None:
        with pytest.raises(ConfigurationError, match="cores="):
            EmulatedRuntime(cores=cores)  # type: ignore[arg-type]

    def test_bad_bandwidth(self) -> None:
        with pytest.raises(ConfigurationError, match="copy_bandwidth"):
            EmulatedRuntime(copy_bandwidth=0)

    def test_controls_check_the_core(self, rt: EmulatedRuntime) -> None:
        with pytest.raises(ConfigurationError, match="core=5"):
            rt.hold(5)
