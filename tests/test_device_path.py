"""Device conversion (``Engine(convert="device")``) on the emulated runtime: the same
path the CUDA runtime takes (staging of the caller's bytes, conversions on the slot's
stream, device arrays read in place, device outputs), checked against host conversion.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
from typing import Any

import numpy as np
import pytest

from aiodla import (
    ConfigurationError,
    DeviceError,
    DeviceTensor,
    Engine,
    EngineDeadError,
    InputTypeError,
    InputValueError,
    RuntimeUnavailableError,
    TensorSpec,
)
from aiodla import _data_path as data_path
from aiodla.emulator import make_loadable
from aiodla.runtime import EmulatedRuntime

from support import X, affine_model, all_idle, counts_add_up, expected_affine, two_pair_model

pytestmark = pytest.mark.asyncio

QUANTIZED_IN = TensorSpec("q", (1, 5, 4, 6), "int8", "chw32")
QUANTIZED_OUT = TensorSpec("r", (1, 5, 4, 6), "int8", "nchw")
IMAGE_IN = TensorSpec("img", (1, 3, 4, 5), "uint8", "hwc4")
IMAGE_OUT = TensorSpec("img_out", (1, 3, 4, 5), "uint8", "nhwc")


def quantized_model() -> bytes:
    return make_loadable([QUANTIZED_IN], [QUANTIZED_OUT], "affine", 0.001, scale=1.0, bias=0.0)


def image_model() -> bytes:
    return make_loadable([IMAGE_IN], [IMAGE_OUT], "affine", 0.001, scale=1.0, bias=0.0)


class FakeCudaArray:
    """An array in the emulated runtime's device memory, shown through
    ``__cuda_array_interface__`` as a CuPy array would be."""

    def __init__(
        self, runtime: EmulatedRuntime, values: np.ndarray[Any, Any], *, stream: int | None = None
    ) -> None:
        base = np.ascontiguousarray(values)
        self.pointer = runtime.malloc(max(base.nbytes, 1))
        staging = runtime.host_alloc(base.nbytes)
        staging.array[:] = base.reshape(-1).view(np.uint8)
        copy_stream = runtime.create_stream()
        runtime.copy_to_device(self.pointer, staging, base.nbytes, copy_stream)
        runtime.synchronize_stream(copy_stream)
        runtime.destroy_stream(copy_stream)
        runtime.host_free(staging)
        self.runtime = runtime
        self.interface: dict[str, Any] = {
            "shape": base.shape,
            "typestr": base.dtype.str,
            "data": (self.pointer, False),
            "strides": None,
            "version": 3,
            "stream": stream,
        }

    @classmethod
    def strided(cls, runtime: EmulatedRuntime, values: np.ndarray[Any, Any]) -> FakeCudaArray:
        """``values`` stored as NHWC, shown as an NCHW view of it (non-contiguous)."""
        stored = np.ascontiguousarray(values.transpose(0, 2, 3, 1))
        array = cls(runtime, stored)
        n, h, w, c = stored.shape
        item = stored.itemsize
        array.interface["shape"] = (n, c, h, w)
        array.interface["strides"] = (h * w * c * item, item, w * c * item, c * item)
        return array

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self.interface

    def free(self) -> None:
        self.runtime.free(self.pointer)


def frame(seed: int = 0, spec: TensorSpec = X, dtype: Any = np.float32) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    values = rng.normal(0, 4, size=spec.shape)
    return values.astype(dtype)


async def results(model: bytes, inputs: list[Any], **options: Any) -> list[Any]:
    async with Engine(model, runtime="emulated", **options) as engine:
        return [await engine.infer(x) for x in inputs]


class TestSameResultsAsHostConversion:
    async def test_float_frames_of_every_source_type(self) -> None:
        inputs = [frame(i, dtype=t) for i, t in enumerate((np.float32, np.float16, np.float64))]
        host = await results(affine_model(), inputs, convert="host")
        device = await results(affine_model(), inputs, convert="device")
        for got, want, x in zip(device, host, inputs, strict=True):
            assert got.dtype == want.dtype
            assert got.tobytes() == want.tobytes()
            np.testing.assert_array_equal(got, expected_affine(x))

    async def test_quantized_tensors_with_ties_and_saturation(self) -> None:
        scale = 0.5
        values = np.array([0.25, 0.75, -0.25, 1e9, -1e9, np.inf, -np.inf, 63.75, -64.25])
        x = np.resize(values, QUANTIZED_IN.shape)
        options = {"scales": {"q": scale, "r": scale}}
        host = await results(quantized_model(), [x], convert="host", **options)
        device = await results(quantized_model(), [x], convert="device", **options)
        assert device[0].dtype == np.float32
        assert device[0].tobytes() == host[0].tobytes()

    async def test_image_layout_and_integer_inputs(self) -> None:
        x = np.random.default_rng(3).integers(0, 256, IMAGE_IN.shape).astype(np.uint8)
        host = await results(image_model(), [x], convert="host")
        device = await results(image_model(), [x], convert="device")
        assert device[0].tobytes() == host[0].tobytes()

    async def test_several_inputs_and_outputs(self) -> None:
        rng = np.random.default_rng(5)
        inputs = [
            {"a": rng.normal(size=(1, 4, 6, 6)), "b": rng.normal(size=(2, 3, 5, 7))}
            for _ in range(3)
        ]
        host = await results(two_pair_model(), inputs, convert="host")
        device = await results(two_pair_model(), inputs, convert="device", zero_copy=True)
        for got, want in zip(device, host, strict=True):
            assert set(got) == set(want) == {"mean_a", "mean_b"}
            for name in got:
                assert got[name].tobytes() == want[name].tobytes()

    async def test_many_concurrent_requests_keep_their_own_results(self) -> None:
        inputs = [frame(i) for i in range(40)]
        async with Engine(
            affine_model(0.0005), runtime="emulated", convert="device", streams_per_core=3
        ) as engine:
            outputs = await asyncio.gather(*(engine.infer(x) for x in inputs))
            for x, y in zip(inputs, outputs, strict=True):
                np.testing.assert_array_equal(y, expected_affine(x))
            assert counts_add_up(engine.statistics())


class TestCopiesAndAllocations:
    async def test_the_host_copies_only_the_callers_bytes(self) -> None:
        runtime = EmulatedRuntime()
        x = frame(1)  # float32: 4 bytes an element, where the CHW16 buffer holds 16 lanes
        async with Engine(affine_model(), runtime=runtime, convert="device") as engine:
            before = dataclasses_copy(runtime.counts)
            await engine.infer(x)
            counts = runtime.counts
            assert counts.copies_to_device - before.copies_to_device == 1
            assert counts.bytes_to_device - before.bytes_to_device == x.nbytes
            assert counts.bytes_to_host - before.bytes_to_host == x.size * 4  # float32 out
            assert counts.conversions - before.conversions == 2  # one pack, one unpack

    async def test_host_conversion_copies_the_dla_layout(self) -> None:
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime, convert="host") as engine:
            before = dataclasses_copy(runtime.counts)
            await engine.infer(frame(1))
            assert runtime.counts.bytes_to_device - before.bytes_to_device == X.size
            assert runtime.counts.conversions == before.conversions == 0

    async def test_zero_copy_enqueues_no_copy(self) -> None:
        runtime = EmulatedRuntime()
        x = frame(2)
        async with Engine(affine_model(), runtime=runtime, convert="device", zero_copy=True) as e:
            before = dataclasses_copy(runtime.counts)
            y = await e.infer(x)
            assert runtime.counts.copies_to_device == before.copies_to_device
            assert runtime.counts.copies_to_host == before.copies_to_host
        np.testing.assert_array_equal(y, expected_affine(x))

    @pytest.mark.parametrize("convert", ["host", "device"])
    async def test_no_allocation_on_the_request_path(self, convert: str) -> None:
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime, convert=convert) as engine:
            opened = runtime.counts.allocations
            await asyncio.gather(*(engine.infer(frame(i)) for i in range(30)))
            assert runtime.counts.allocations == opened
            assert runtime.counts.pool_allocations == 0

    async def test_close_releases_every_handle(self) -> None:
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime, convert="device") as engine:
            await engine.infer(frame(0))
        assert set(runtime.live_handles().values()) == {0}
        assert runtime.invalid_releases == 0


def dataclasses_copy(counts: Any) -> Any:
    import dataclasses

    return dataclasses.replace(counts)


class TestStagingCopies:
    """The host's copies of a request's bytes (into staging, out of it): a small dense
    array is copied keeping the GIL (copy_small), anything else by numpy."""

    async def test_copy_small_copies_a_small_dense_array_only(self) -> None:
        x = np.arange(24, dtype=np.float16).reshape(1, 2, 3, 4)
        into = np.zeros_like(x)
        assert data_path.copy_small(into.data.cast("B"), x)
        assert into.tobytes() == x.tobytes()
        strided = np.arange(48, dtype=np.float16).reshape(1, 2, 3, 8)[..., ::2]
        into[:] = 0
        assert not data_path.copy_small(into.data.cast("B"), strided)
        assert not into.any()  # refused: nothing copied
        big = np.zeros(data_path.GIL_HELD_COPY // 2 + 1, np.float16)
        assert not data_path.copy_small(np.ones_like(big).data.cast("B"), big)

    @pytest.mark.parametrize("limit", [0, data_path.GIL_HELD_COPY])
    async def test_each_kind_of_input_gives_the_right_result(
        self, monkeypatch: pytest.MonkeyPatch, limit: int
    ) -> None:
        monkeypatch.setattr(data_path, "GIL_HELD_COPY", limit)  # 0: numpy copies all
        base = frame(3, dtype=np.float32)
        inputs = [
            base,
            np.asfortranarray(base),
            np.ascontiguousarray(base[..., ::-1]),
            np.flip(base, axis=3),  # strided
            base.astype(np.float16),
        ]
        for got, x in zip(await results(affine_model(), inputs, convert="device"), inputs):
            np.testing.assert_array_equal(got, expected_affine(x))

    async def test_a_request_copies_its_input_and_output_keeping_the_gil(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        kept: list[bool] = []
        copy = data_path.copy_small

        def counted(destination: memoryview, array: Any) -> bool:
            kept.append(copy(destination, array))
            return kept[-1]

        monkeypatch.setattr(data_path, "copy_small", counted)
        x = frame(4)
        for got in await results(affine_model(), [x, x], convert="device"):
            np.testing.assert_array_equal(got, expected_affine(x))
        assert kept == [True] * 4  # each request: its input in, its output out


class TestDeviceArraysIn:
    async def test_a_device_array_is_read_where_it_lies(self) -> None:
        runtime = EmulatedRuntime()
        x = frame(4)
        async with Engine(affine_model(), runtime=runtime, convert="device") as engine:
            array = FakeCudaArray(runtime, x)
            before = dataclasses_copy(runtime.counts)
            y = await engine.infer(array)
            assert runtime.counts.copies_to_device == before.copies_to_device  # no host trip
            array.free()
        np.testing.assert_array_equal(y, expected_affine(x))

    async def test_a_strided_device_array(self) -> None:
        runtime = EmulatedRuntime()
        x = frame(5)
        async with Engine(affine_model(), runtime=runtime, convert="device") as engine:
            array = FakeCudaArray.strided(runtime, x)
            y = await engine.infer(array)
            array.free()
        np.testing.assert_array_equal(y, expected_affine(x))

    async def test_the_producers_stream_is_waited_for(self) -> None:
        runtime = EmulatedRuntime()
        x = frame(6)
        async with Engine(affine_model(), runtime=runtime, convert="device") as engine:
            producer = runtime.create_stream()
            array = FakeCudaArray(runtime, x, stream=producer)
            y = await engine.infer(array)
            array.free()
            runtime.destroy_stream(producer)
        np.testing.assert_array_equal(y, expected_affine(x))

    async def test_host_conversion_refuses_device_arrays(self) -> None:
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime, convert="host") as engine:
            array = FakeCudaArray(runtime, frame(0))
            with pytest.raises(InputTypeError, match="device conversion"):
                await engine.infer(array)
            array.free()
            assert engine.statistics().submitted == 0

    @pytest.mark.parametrize(
        ("change", "error", "words"),
        [
            ({"shape": (1, 3, 8, 9)}, InputValueError, "shape"),
            ({"typestr": "<i8"}, InputTypeError, "int64"),
            ({"stream": 0}, InputValueError, "stream"),
            ({"data": (0x1000, False)}, InputTypeError, "not CUDA memory"),
        ],
    )
    async def test_bad_device_arrays_are_refused_before_queueing(
        self, change: dict[str, Any], error: type[Exception], words: str
    ) -> None:
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime, convert="device") as engine:
            array = FakeCudaArray(runtime, frame(0))
            array.interface.update(change)
            with pytest.raises(error, match=words):
                await engine.infer(array)
            stats = engine.statistics()
            assert stats.submitted == 0 and counts_add_up(stats)
            array.free()
            y = await engine.infer(frame(1))  # nothing harmed
        np.testing.assert_array_equal(y, expected_affine(frame(1)))


class TestDeviceOutputs:
    async def test_host_backed_on_a_runtime_without_gpu_memory(self) -> None:
        x = frame(7)
        async with Engine(affine_model(), runtime="emulated", convert="device") as engine:
            y = await engine.infer(x, output="device")
        assert isinstance(y, DeviceTensor)
        assert y.device is None
        assert not hasattr(y, "__cuda_array_interface__")
        np.testing.assert_array_equal(np.from_dlpack(y), expected_affine(x))
        np.testing.assert_array_equal(y.to_host(), expected_affine(x))

    async def test_infer_nowait_takes_output_too(self) -> None:
        x = frame(8)
        async with Engine(affine_model(), runtime="emulated") as engine:
            y = await engine.infer_nowait(x, output="device")
        assert isinstance(y, DeviceTensor)
        np.testing.assert_array_equal(np.asarray(y), expected_affine(x))

    async def test_an_unknown_output_is_refused(self) -> None:
        async with Engine(affine_model(), runtime="emulated") as engine:
            with pytest.raises(ConfigurationError, match="'host' or 'device'"):
                await engine.infer(frame(0), output="gpu")
            assert engine.statistics().submitted == 0

    async def test_device_outputs_need_device_conversion_on_a_gpu(self) -> None:
        runtime = GpuLikeRuntime()
        async with Engine(affine_model(), runtime=runtime, convert="host") as engine:
            with pytest.raises(ConfigurationError, match="device conversion"):
                await engine.infer(frame(0), output="device")

    async def test_pool_memory_of_device_outputs_goes_back(self) -> None:
        runtime = GpuLikeRuntime()
        x = frame(9)
        async with Engine(affine_model(), runtime=runtime, convert="device") as engine:
            opened = runtime.live_handles()["device_memory"]
            y = await engine.infer(x, output="device")
            assert runtime.counts.pool_allocations == 1
            np.testing.assert_array_equal(y.to_host(), expected_affine(x))
            assert runtime.live_handles()["device_memory"] == opened + 1
            del y
            await asyncio.sleep(0)  # the loop's handle that woke this task lets go too
            gc.collect()
            assert runtime.live_handles()["device_memory"] == opened


class GpuLikeRuntime(EmulatedRuntime):
    """The emulated runtime, claiming GPU memory: device outputs come from its pool."""

    has_device_memory = True


class NoKernelsRuntime(GpuLikeRuntime):
    def prepare_conversions(self, packs: Any, unpacks: Any) -> None:
        raise RuntimeUnavailableError("NVRTC is not installed (pip install cuda-core)")


class TestChoosingThePath:
    async def test_auto_converts_on_the_host_without_gpu_memory(self) -> None:
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime) as engine:
            await engine.infer(frame(0))
        assert runtime.counts.conversions == 0

    async def test_auto_converts_on_the_device_with_gpu_memory(self) -> None:
        runtime = GpuLikeRuntime()
        async with Engine(affine_model(), runtime=runtime) as engine:
            await engine.infer(frame(0))
        assert runtime.counts.conversions == 2

    async def test_device_without_kernels_fails_to_open_and_leaks_nothing(self) -> None:
        runtime = NoKernelsRuntime()
        engine = Engine(affine_model(), runtime=runtime, convert="device")
        with pytest.raises(RuntimeUnavailableError, match="NVRTC"):
            await engine.open()
        assert set(runtime.live_handles().values()) == {0}

    async def test_auto_without_kernels_converts_on_the_host_and_says_so(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        runtime = NoKernelsRuntime()
        with caplog.at_level(logging.WARNING, logger="aiodla"):
            async with Engine(affine_model(), runtime=runtime) as engine:
                y = await engine.infer(frame(1))
        assert "converting on the host" in caplog.text and "NVRTC" in caplog.text
        np.testing.assert_array_equal(y, expected_affine(frame(1)))

    @pytest.mark.parametrize(
        ("option", "words"), [({"convert": "gpu"}, "convert="), ({"zero_copy": 1}, "zero_copy=")]
    )
    async def test_bad_options(self, option: dict[str, Any], words: str) -> None:
        with pytest.raises(ConfigurationError, match=words):
            Engine(affine_model(), runtime="emulated", **option)


class TestFailures:
    @pytest.mark.parametrize("call", ["pack", "unpack"])
    async def test_a_failed_conversion_fails_that_request_only(self, call: str) -> None:
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime, convert="device") as engine:
            runtime.fail_call(call, 1)  # cudaErrorInvalidValue, once
            with pytest.raises(DeviceError, match=call):
                await engine.infer(frame(0))
            y = await engine.infer(frame(1))
            await asyncio.sleep(0.01)
            assert all_idle(engine) and counts_add_up(engine.statistics())
        np.testing.assert_array_equal(y, expected_affine(frame(1)))
        assert set(runtime.live_handles().values()) == {0}

    async def test_a_sticky_error_in_a_conversion_kills_the_engine(self) -> None:
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime, convert="device") as engine:
            runtime.fail_call("pack", 700)  # cudaErrorIllegalAddress: the context is lost
            with pytest.raises(EngineDeadError):
                await engine.infer(frame(0))
            assert engine.dead


class TestDeviceArraysAreReleased:
    """A device array is given back once no kernel can read it, exactly once."""

    async def test_after_the_request_completes(self) -> None:
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime, convert="device") as engine:
            array = CountingDlpack(runtime, frame(3))
            y = await engine.infer(array)
            assert array.released == 1
            array.free()
        np.testing.assert_array_equal(y, expected_affine(frame(3)))

    async def test_a_cancelled_in_flight_request_keeps_it_until_the_task_ends(self) -> None:
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime, convert="device", cores=[0]) as engine:
            array = CountingDlpack(runtime, frame(3))
            with runtime.hold(0) as gate:
                task = asyncio.ensure_future(engine.infer(array))
                await asyncio.get_running_loop().run_in_executor(None, gate.wait_for_held)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert array.released == 0  # the task may still read it
            await wait_idle(engine)
            assert array.released == 1
            array.free()

    async def test_a_request_cancelled_while_queued(self) -> None:
        runtime = EmulatedRuntime()
        async with Engine(
            affine_model(), runtime=runtime, convert="device", cores=[0], streams_per_core=1
        ) as engine:
            array = CountingDlpack(runtime, frame(3))
            with runtime.hold(0):
                first = asyncio.ensure_future(engine.infer(frame(0)))
                queued = asyncio.ensure_future(engine.infer(array))
                await asyncio.sleep(0.01)
                queued.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await queued
                assert array.released == 1
            await first
            array.free()

    async def test_an_input_error_in_another_input_releases_it(self) -> None:
        runtime = EmulatedRuntime()
        async with Engine(two_pair_model(), runtime=runtime, convert="device") as engine:
            a = CountingDlpack(runtime, np.zeros((1, 4, 6, 6), np.float32))
            with pytest.raises(InputValueError, match="'b'"):
                await engine.infer({"a": a, "b": np.zeros((2, 3, 5, 8))})
            assert a.released == 1
            a.free()


async def wait_idle(engine: Engine) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while not all_idle(engine):
        assert loop.time() < deadline
        await asyncio.sleep(0.001)


class CountingDlpack(FakeCudaArray):
    """A DLPack producer on the emulated "GPU" that counts how often its export was
    given back (the deleter of the capsule it handed out)."""

    def __init__(self, runtime: EmulatedRuntime, values: np.ndarray[Any, Any]) -> None:
        super().__init__(runtime, values)
        self.released = 0
        self.values = np.ascontiguousarray(values)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)  # kDLCUDA, device 0

    def __dlpack__(self, **kwargs: Any) -> Any:
        from aiodla._device_arrays import DeviceTensor as Exporter

        def counted() -> None:
            self.released += 1

        exporter = Exporter(
            pointer=self.pointer,
            shape=self.values.shape,
            dtype=self.values.dtype,
            device=0,
            release=counted,
            to_host=functools.partial(self.runtime.read_device, self.pointer),
            host_array=None,
        )
        return exporter.__dlpack__(**kwargs)


class TestDevicePointers:
    """Pointers a kernel could not read are refused before queueing (on a GPU, reading
    them would be a sticky error that ends the engine)."""

    @pytest.mark.parametrize(("offset", "words"), [(None, "null"), (2, "not aligned")])
    async def test_null_or_misaligned(self, offset: int | None, words: str) -> None:
        runtime = EmulatedRuntime()
        async with Engine(affine_model(), runtime=runtime, convert="device") as engine:
            array = FakeCudaArray(runtime, frame(0))
            pointer = 0 if offset is None else array.pointer + offset
            array.interface["data"] = (pointer, False)
            with pytest.raises(InputValueError, match=words):
                await engine.infer(array)
            assert engine.statistics().submitted == 0
            array.free()

    async def test_negative_strides_a_flipped_view(self) -> None:
        runtime = EmulatedRuntime()
        x = frame(17)
        async with Engine(affine_model(), runtime=runtime, convert="device") as engine:
            stored = FakeCudaArray(runtime, x[..., ::-1])  # stored flipped along W
            _, c, h, w = x.shape
            item = x.itemsize
            last = stored.pointer + (w - 1) * item
            stored.interface["data"] = (last, False)
            stored.interface["strides"] = (c * h * w * item, h * w * item, w * item, -item)
            y = await engine.infer(stored)
            stored.free()
        np.testing.assert_array_equal(y, expected_affine(x))


class TestOffloading:
    """Large tensors are packed and unpacked in a worker thread; device arrays and pool
    outputs have nothing to pack or unpack there, and the results stay right."""

    async def test_device_arrays_and_outputs_with_offloading(self) -> None:
        runtime = GpuLikeRuntime()
        x = frame(21)
        async with Engine(
            affine_model(), runtime=runtime, convert="device", offload_bytes=0
        ) as engine:
            array = FakeCudaArray(runtime, x)
            y_host = await engine.infer(x)
            y_device_in = await engine.infer(array)
            y_device_out = await engine.infer(x, output="device")
            np.testing.assert_array_equal(y_device_out.to_host(), expected_affine(x))
            del y_device_out
            array.free()
            assert counts_add_up(engine.statistics())
        for y in (y_host, y_device_in):
            np.testing.assert_array_equal(y, expected_affine(x))


class TestNanIntoIntegerTensors:
    async def test_a_device_array_with_nan_stores_zero(self) -> None:
        # Device arrays' values are never read on the host: NaN into an integer tensor
        # stores 0 (the kernels' rule, and the emulated path's), where a host array with
        # NaN is refused.
        runtime = EmulatedRuntime()
        x = np.resize(np.array([np.nan, 1.5, -2.0, np.nan, 3.25]), QUANTIZED_IN.shape)
        options = {"scales": {"q": 0.5, "r": 0.5}}
        async with Engine(quantized_model(), runtime=runtime, convert="device", **options) as e:
            array = FakeCudaArray(runtime, x.astype(np.float32))
            got = await e.infer(array)
            array.free()
            with pytest.raises(InputValueError, match="NaN"):
                await e.infer(x)
            want = await e.infer(np.nan_to_num(x, nan=0.0))
        assert got.tobytes() == want.tobytes()
