"""Device arrays (aiodla._device_arrays): DLPack and CUDA-array-interface inputs, and
DeviceTensor outputs, on the CPU.

The "device" memory here is host memory: a producer hands out numpy's own DLPack
capsules with the device set to CUDA, so numpy writes the structs that this module
reads, and a DeviceTensor over a numpy array's address exports capsules that the
import reads back. Whether a capsule's deleter ran shows in the exported array's
lifetime (its manager_ctx holds it), and the release callback's in the tensor's.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aiodla._device_arrays import DeviceSource, DeviceTensor, import_device_array, is_device_array
from aiodla._dlpack import (
    _dl_tensor,
    _DLDataType,
    _DLDevice,
    _DLManagedTensor,
    _DLManagedTensorVersioned,
    _DLTensor,
    _unused_capsule,
)
from aiodla._errors import InputTypeError, InputValueError

SHAPE = (2, 3, 4)
F16 = np.dtype(np.float16)
STREAM = 0x5EED


def accept_all(dtype: np.dtype[Any]) -> None:
    pass


def take(value: object, shape: tuple[int, ...] = SHAPE, **options: Any) -> DeviceSource:
    arguments: dict[str, Any] = {"accepts": accept_all, "device": 0, "stream": STREAM}
    return import_device_array(value, name="x", shape=shape, **(arguments | options))


class Producer:
    """A DLPack producer over a numpy array, reporting CUDA memory: its capsules are
    numpy's, with the device set to (``capsule_device``) and ``patch`` applied."""

    def __init__(
        self,
        array: np.ndarray[Any, Any],
        *,
        device: tuple[int, int] = (2, 0),
        capsule_device: tuple[int, int] | None = None,
        patch: Callable[[_DLTensor, int, bool], None] | None = None,
        legacy_only: bool = False,
        fail: BaseException | None = None,
    ) -> None:
        self.array = array
        self.device = device
        self.capsule_device = capsule_device or device
        self.patch = patch
        self.legacy_only = legacy_only
        self.fail = fail
        self.calls: list[tuple[Any, Any]] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None) -> object:
        self.calls.append((stream, max_version))
        if self.fail is not None:
            raise self.fail
        if self.legacy_only and max_version is not None:
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        if max_version is None:
            capsule = self.array.__dlpack__()
        else:
            capsule = self.array.__dlpack__(max_version=max_version)
        found = _unused_capsule(capsule)
        assert found is not None
        tensor = _dl_tensor(*found)
        tensor.device.device_type, tensor.device.device_id = self.capsule_device
        if self.patch is not None:
            self.patch(tensor, *found)
        return capsule


def producer_of(array: np.ndarray[Any, Any], **options: Any) -> tuple[Producer, weakref.ref[Any]]:
    """A producer that holds the only reference to ``array``, and a weak one to it: it
    dies once the producer is gone and the capsule's deleter has run."""
    return Producer(array, **options), weakref.ref(array)


def gone(ref: weakref.ref[Any]) -> bool:
    gc.collect()
    return ref() is None


class Interface:
    """An object with only __cuda_array_interface__."""

    def __init__(self, **interface: Any) -> None:
        self.interface = {"shape": SHAPE, "typestr": "<f4", "data": (0x10000, False)}
        self.interface |= {"version": 3, "strides": None} | interface

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self.interface


def tensor_over(
    array: np.ndarray[Any, Any], released: list[str], *, device: int | None = 0
) -> DeviceTensor:
    """A DeviceTensor whose "device" memory is ``array``'s host memory."""

    def copy_out(out: np.ndarray[Any, Any]) -> None:
        out[...] = array

    return DeviceTensor(
        pointer=array.ctypes.data,
        shape=array.shape,
        dtype=array.dtype,
        device=device,
        release=lambda: released.append("released"),
        to_host=copy_out if device is not None else None,
        host_array=array if device is None else None,
    )


class TestStructs:
    def test_layouts_are_dlpack_h(self) -> None:
        assert ctypes.sizeof(_DLDevice) == 8 and ctypes.sizeof(_DLDataType) == 4
        assert ctypes.sizeof(_DLTensor) == 48
        assert [getattr(_DLTensor, f).offset for f in ("device", "ndim", "dtype")] == [8, 16, 20]
        assert [getattr(_DLTensor, f).offset for f in ("shape", "strides", "byte_offset")] == [
            24,
            32,
            40,
        ]
        assert ctypes.sizeof(_DLManagedTensor) == 64
        assert (_DLManagedTensor.manager_ctx.offset, _DLManagedTensor.deleter.offset) == (48, 56)
        versioned = _DLManagedTensorVersioned
        assert ctypes.sizeof(versioned) == 80
        offsets = [getattr(versioned, f).offset for f in ("manager_ctx", "deleter", "flags")]
        assert [*offsets, versioned.dl_tensor.offset] == [8, 16, 24, 32]


class TestIsDeviceArray:
    def test_cheap_predicate(self) -> None:
        cuda = Producer(np.zeros(1))
        assert is_device_array(cuda)
        assert is_device_array(Producer(np.zeros(1), device=(13, 0)))  # CUDA managed
        assert is_device_array(Interface())
        assert not is_device_array(np.zeros(3))
        assert not is_device_array(Producer(np.zeros(1), device=(1, 0)))
        assert not is_device_array(Producer(np.zeros(1), device=(3, 0)))  # pinned host
        assert not is_device_array([1.0, 2.0])
        assert not is_device_array(3.0)
        assert cuda.calls == []  # nothing exported to find out

    def test_device_tensors_by_where_they_live(self) -> None:
        released: list[str] = []
        array = np.zeros(SHAPE, np.float32)
        assert is_device_array(tensor_over(array, released))
        assert not is_device_array(tensor_over(array, released, device=None))

    def test_a_failing_dlpack_device_goes_to_the_import_to_be_named(self) -> None:
        class Broken:
            def __dlpack__(self) -> None: ...

            def __dlpack_device__(self) -> None:
                raise RuntimeError("no device")

        assert is_device_array(Broken())
        with pytest.raises(InputTypeError, match=r"'x'.*__dlpack_device__\(\) failed") as info:
            take(Broken())
        assert isinstance(info.value.__cause__, RuntimeError)


class TestDLPackImport:
    @pytest.mark.parametrize("legacy_only", [False, True], ids=["versioned", "legacy"])
    def test_numpy_capsules_read_back(self, legacy_only: bool) -> None:
        array = np.arange(24, dtype=np.float16).reshape(SHAPE)
        address = array.ctypes.data
        producer, ref = producer_of(array, legacy_only=legacy_only)
        del array
        source = take(producer)
        assert (source.pointer, source.shape, source.strides) == (address, SHAPE, (12, 4, 1))
        assert (source.dtype, source.device, source.wait_stream) == (F16, 0, None)
        if legacy_only:  # refused the keyword, then the legacy call, as the spec says
            assert producer.calls == [(STREAM, (1, 0)), (STREAM, None)]
        else:
            assert producer.calls == [(STREAM, (1, 0))]
        del producer
        assert not gone(ref), "the imported tensor must keep the producer's memory"
        source.release()
        assert gone(ref), "release() must call the producer's deleter"
        source.release()  # idempotent

    def test_the_legacy_default_stream_is_passed_as_1(self) -> None:
        producer = Producer(np.zeros(SHAPE, np.float32))
        take(producer, stream=0).release()
        assert producer.calls == [(1, (1, 0))]

    def test_strided_views_keep_their_strides(self) -> None:
        base = np.arange(2 * 3 * 8, dtype=np.int32).reshape(2, 3, 8)
        view = base[:, 1:, ::2]
        source = take(Producer(view), shape=(2, 2, 4))
        assert source.pointer == view.ctypes.data == base.ctypes.data + 8 * 4
        assert source.strides == (24, 8, 2)
        assert (source.shape, source.dtype) == ((2, 2, 4), np.dtype(np.int32))
        source.release()

    def test_byte_offset_is_applied(self) -> None:
        array = np.arange(24, dtype=np.float32).reshape(SHAPE)

        def shift(tensor: _DLTensor, managed: int, versioned: bool) -> None:
            tensor.data -= 16
            tensor.byte_offset = 16

        source = take(Producer(array, patch=shift))
        assert source.pointer == array.ctypes.data
        source.release()

    def test_null_strides_mean_row_major(self) -> None:
        array = np.zeros((2, 0, 5, 3), np.uint8)[:, :, ::-1]  # numpy's strides: nonsense

        def drop_strides(tensor: _DLTensor, managed: int, versioned: bool) -> None:
            tensor.strides = None

        source = take(Producer(array, patch=drop_strides), shape=(2, 0, 5, 3))
        assert source.strides == (15, 15, 3, 1)
        source.release()

    @pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "float16", "float32", "bool"])
    def test_dtypes(self, dtype: str) -> None:
        source = take(Producer(np.zeros(SHAPE, dtype)))
        assert source.dtype == np.dtype(dtype)
        source.release()

    def test_dlpack_comes_before_the_interface(self) -> None:
        class Both(Producer):
            @property
            def __cuda_array_interface__(self) -> dict[str, Any]:
                raise AssertionError("DLPack was present")

        producer = Both(np.zeros(SHAPE, np.float32))
        take(producer).release()
        assert len(producer.calls) == 1


def patched(field: str, value: Any) -> Callable[[_DLTensor, int, bool], None]:
    def patch(tensor: _DLTensor, managed: int, versioned: bool) -> None:
        target: Any = tensor
        *path, last = field.split(".")
        for part in path:
            target = getattr(target, part)
        setattr(target, last, value)

    return patch


class TestDLPackErrors:
    """Every refusal names the input, and the capsule's deleter has run."""

    @pytest.mark.parametrize(
        ("options", "shape", "error", "message"),
        [
            ({"capsule_device": (2, 1)}, SHAPE, InputValueError, "CUDA device 1, not 0"),
            ({"capsule_device": (1, 0)}, SHAPE, InputTypeError, "CPU memory, expected CUDA"),
            ({}, (2, 3, 5), InputValueError, r"expected shape \(2, 3, 5\), got \(2, 3, 4\)"),
            ({}, (1, 2, 3, 4), InputValueError, "expected 4 dimensions"),
            ({"patch": patched("dtype.lanes", 4)}, SHAPE, InputTypeError, "4 lanes"),
            ({"patch": patched("dtype.code", 4)}, SHAPE, InputTypeError, "bfloat16"),
            ({"patch": patched("dtype.code", 5)}, SHAPE, InputTypeError, "complex"),
            ({"patch": patched("dtype.code", 9)}, SHAPE, InputTypeError, "type code 9"),
            ({"patch": patched("dtype.bits", 8)}, SHAPE, InputTypeError, "8-bit DLPack type"),
        ],
        ids=[
            "other-gpu",
            "capsule-on-cpu",
            "shape",
            "ndim",
            "lanes",
            "bf16",
            "complex",
            "fp8",
            "bits",
        ],
    )
    def test_refused_and_given_back(
        self, options: dict[str, Any], shape: tuple[int, ...], error: type, message: str
    ) -> None:
        producer, ref = producer_of(np.zeros(SHAPE, np.float32), **options)
        with pytest.raises(error, match=rf"input 'x': .*{message}"):
            take(producer, shape=shape)
        assert producer.calls, "the refusal needed the capsule"
        del producer
        assert gone(ref), "the deleter must run on the error path"

    @pytest.mark.parametrize("ndim", [64, 100_000, 2**31 - 1, -1, 0])
    def test_a_bad_ndim_is_refused_before_the_shape_is_read(self, ndim: int) -> None:
        # The shape array holds 3 entries: reading ndim of them would read the heap.
        producer, ref = producer_of(np.zeros(SHAPE, np.float32), patch=patched("ndim", ndim))
        with pytest.raises(
            InputValueError, match=rf"input 'x': expected 3 dimensions .*capsule has ndim {ndim}$"
        ):
            take(producer)
        del producer
        assert gone(ref)

    def test_a_null_shape_is_refused(self) -> None:
        producer, ref = producer_of(np.zeros(SHAPE, np.float32), patch=patched("shape", None))
        with pytest.raises(InputValueError, match=r"input 'x': .*capsule has ndim 3 and no shape"):
            take(producer)
        del producer
        assert gone(ref)

    def test_complex_arrays_as_numpy_exports_them(self) -> None:
        producer, ref = producer_of(np.zeros(SHAPE, np.complex64))
        with pytest.raises(InputTypeError, match="complex"):
            take(producer)
        del producer
        assert gone(ref)

    def test_a_newer_major_version_is_refused(self) -> None:
        def bump(tensor: _DLTensor, managed: int, versioned: bool) -> None:
            _DLManagedTensorVersioned.from_address(managed).version.major = 2

        producer, ref = producer_of(np.zeros(SHAPE, np.float32), patch=bump)
        with pytest.raises(InputTypeError, match=r"'x'.*version 2\.0"):
            take(producer)
        del producer
        assert gone(ref)

    def test_accepts_raises_its_own_error(self) -> None:
        refusal = InputTypeError("input 'x': float32 cannot be cast safely to int8")

        def refuse(dtype: np.dtype[Any]) -> None:
            assert dtype == np.float32
            raise refusal

        producer, ref = producer_of(np.zeros(SHAPE, np.float32))
        with pytest.raises(InputTypeError) as info:
            take(producer, accepts=refuse)
        assert info.value is refusal
        refusal.__traceback__ = None  # its frames hold the producer too
        del producer, info
        assert gone(ref)

    @pytest.mark.parametrize(
        ("device", "error", "message"),
        [
            ((1, 0), InputTypeError, "CPU memory"),
            ((3, 0), InputTypeError, "CUDA pinned host memory"),
            ((4, 0), InputTypeError, "DLPack device type 4"),
            ((2, 1), InputValueError, "CUDA device 1, not 0"),
        ],
    )
    def test_the_device_is_checked_before_exporting(
        self, device: tuple[int, int], error: type, message: str
    ) -> None:
        producer = Producer(np.zeros(SHAPE, np.float32), device=device)
        with pytest.raises(error, match=rf"input 'x': .*{message}"):
            take(producer)
        assert producer.calls == []

    def test_an_export_that_raises_is_wrapped(self) -> None:
        failure = BufferError("cannot export a conjugated tensor")
        producer = Producer(np.zeros(SHAPE, np.float32), fail=failure)
        with pytest.raises(InputTypeError, match=r"input 'x': exporting .* conjugated") as info:
            take(producer)
        assert info.value.__cause__ is failure

    def test_a_producer_that_returns_no_capsule(self) -> None:
        class Liar(Producer):
            def __dlpack__(self, *, stream: Any = None, max_version: Any = None) -> object:
                return b"not a capsule"

        with pytest.raises(InputTypeError, match=r"'x': __dlpack__\(\) returned bytes"):
            take(Liar(np.zeros(1)))

    def test_not_an_array(self) -> None:
        with pytest.raises(InputTypeError, match=r"'x': expected a CUDA array .* got object"):
            take(object())


class TestInterfaceImport:
    def test_contiguous(self) -> None:
        source = take(Interface(typestr="<f2"))
        assert (source.pointer, source.shape, source.strides) == (0x10000, SHAPE, (12, 4, 1))
        assert (source.dtype, source.device, source.wait_stream) == (F16, 0, None)
        source.release()

    def test_byte_strides_become_element_strides(self) -> None:
        source = take(Interface(typestr="<f4", strides=(4, 64, 8)))
        assert source.strides == (1, 16, 2)
        source.release()

    @pytest.mark.parametrize(("stream", "wait"), [(None, None), (1, 1), (2, 2), (0xBEEF, 0xBEEF)])
    def test_stream_field(self, stream: int | None, wait: int | None) -> None:
        source = take(Interface(stream=stream))
        assert source.wait_stream == wait
        source.release()

    def test_the_object_is_held_until_release(self) -> None:
        producer = Interface()
        ref = weakref.ref(producer)
        source = take(producer)
        del producer
        assert not gone(ref)
        source.release()
        assert gone(ref)
        source.release()

    def test_locate_checks_the_pointers_device(self) -> None:
        seen: list[int] = []

        def on_device(ordinal: int) -> Callable[[int], int]:
            def locate(pointer: int) -> int:
                seen.append(pointer)
                return ordinal

            return locate

        take(Interface(), locate=on_device(0)).release()
        assert seen == [0x10000]
        with pytest.raises(InputValueError, match="'x': the array is on CUDA device 1, not 0"):
            take(Interface(), locate=on_device(1))

        def not_cuda(pointer: int) -> int:
            raise RuntimeError("cudaErrorInvalidValue")

        with pytest.raises(InputTypeError, match="'x': its data pointer 0x10000 is not CUDA"):
            take(Interface(), locate=not_cuda)

    @pytest.mark.parametrize(
        ("interface", "error", "message"),
        [
            ({"typestr": "<c8"}, InputTypeError, r"dtype '<c8' \(complex64\) is not supported"),
            ({"typestr": "<f16"}, InputTypeError, "is not supported"),
            ({"typestr": "|V2"}, InputTypeError, "is not supported"),
            ({"typestr": ">f4"}, InputTypeError, "not in native byte order"),
            ({"typestr": "fish"}, InputTypeError, "malformed .* typestr 'fish'"),
            ({"typestr": 4}, InputTypeError, "malformed .* typestr 4 is not a string"),
            ({"mask": (0x2000, False)}, InputTypeError, "mask would be ignored"),
            ({"stream": 0}, InputValueError, "stream 0, which the interface forbids"),
            ({"stream": -5}, InputTypeError, "malformed .* stream -5"),
            ({"stream": True}, InputTypeError, "malformed .* stream True"),
            ({"strides": (48, 16, 6)}, InputValueError, "not multiples of the float32 item size"),
            ({"strides": (48, 16)}, InputTypeError, "malformed .* 2 strides for 3 dimensions"),
            ({"strides": "C"}, InputTypeError, "malformed .* strides 'C'"),
            ({"shape": (2, 3, 5)}, InputValueError, r"expected shape \(2, 3, 4\), got \(2, 3, 5\)"),
            ({"shape": (24,)}, InputValueError, "expected 3 dimensions"),
            ({"shape": (2, -3, 4)}, InputTypeError, "malformed .* shape"),
            ({"data": 0x10000}, InputTypeError, "malformed .* data"),
            ({"version": "3"}, InputTypeError, "malformed .* version"),
        ],
    )
    def test_refusals(self, interface: dict[str, Any], error: type, message: str) -> None:
        producer = Interface(**interface)
        ref = weakref.ref(producer)
        with pytest.raises(error, match=rf"input 'x': .*{message}"):
            take(producer)
        del producer
        assert gone(ref), "nothing may be held after a refusal"

    def test_missing_keys_are_named(self) -> None:
        producer = Interface()
        del producer.interface["typestr"], producer.interface["version"]
        with pytest.raises(InputTypeError, match=r"malformed .* no 'typestr', 'version'"):
            take(producer)
        producer.interface = [1, 2]  # type: ignore[assignment]
        with pytest.raises(InputTypeError, match=r"malformed .* a list, expected a dict"):
            take(producer)

    def test_reading_the_interface_fails(self) -> None:
        class Broken:
            @property
            def __cuda_array_interface__(self) -> dict[str, Any]:
                raise RuntimeError("context destroyed")

        assert is_device_array(Broken()), "the import names the failure"
        with pytest.raises(InputTypeError, match="'x': reading __cuda_array") as info:
            take(Broken())
        assert isinstance(info.value.__cause__, RuntimeError)

    def test_accepts_raises_its_own_error(self) -> None:
        refusal = InputTypeError("input 'x': no")

        def refuse(dtype: np.dtype[Any]) -> None:
            raise refusal

        with pytest.raises(InputTypeError) as info:
            take(Interface(), accepts=refuse)
        assert info.value is refusal


class TestDeviceTensorExport:
    @pytest.mark.parametrize("max_version", [None, (1, 0), (1, 3)])
    def test_round_trip_through_the_import(self, max_version: tuple[int, int] | None) -> None:
        array = np.arange(24, dtype=np.float32).reshape(SHAPE)
        released: list[str] = []
        tensor = tensor_over(array, released)
        capsule = tensor.__dlpack__(max_version=max_version)
        found = _unused_capsule(capsule)
        assert found is not None and found[1] is (max_version is not None)
        managed, versioned = found
        dl = _dl_tensor(managed, versioned)
        assert (dl.device.device_type, dl.device.device_id, dl.ndim) == (2, 0, 3)
        assert dl.data == array.ctypes.data
        assert [dl.shape[axis] for axis in range(3)] == list(SHAPE)
        del capsule, dl
        assert not released

        producer = Producer(np.zeros(1))
        producer.__dlpack__ = tensor.__dlpack__  # type: ignore[method-assign]
        source = take(producer)
        assert (source.pointer, source.shape, source.strides) == (
            array.ctypes.data,
            SHAPE,
            (12, 4, 1),
        )
        assert (source.dtype, source.device) == (np.dtype(np.float32), 0)
        del tensor, producer
        gc.collect()
        assert released == [], "the imported capsule still holds the tensor"
        source.release()
        gc.collect()
        assert released == ["released"]

    def test_release_runs_once_after_the_tensor_and_every_capsule(self) -> None:
        released: list[str] = []
        tensor = tensor_over(np.ones(SHAPE, np.float16), released)
        unconsumed = tensor.__dlpack__(max_version=(1, 0))
        legacy = tensor.__dlpack__()
        forwarder = Producer(np.zeros(1))
        forwarder.__dlpack__ = tensor.__dlpack__  # type: ignore[method-assign]
        source = take(forwarder)
        del tensor, forwarder
        for holder in ("unconsumed", "legacy"):
            gc.collect()
            assert released == [], f"released while {holder} is alive"
            if holder == "unconsumed":
                del unconsumed  # a capsule never consumed: its destructor calls the deleter
            else:
                del legacy
        gc.collect()
        assert released == []
        # A consumer may call the deleter from any thread.
        worker = threading.Thread(target=source.release)
        worker.start()
        worker.join()
        gc.collect()
        assert released == ["released"]
        source.release()
        gc.collect()
        assert released == ["released"]

    def test_an_exception_unwinding_past_a_capsule_stays_intact(self) -> None:
        # A capsule freed while an exception is in flight: a destructor written as a
        # ctypes callback would replace the KeyError with a SystemError.
        released: list[str] = []
        tensor = tensor_over(np.ones(4, np.float32), released)

        def export_then_fail(tensor: DeviceTensor) -> Any:
            yield tensor.__dlpack__(max_version=(1, 0))
            raise KeyError("the original error")

        with pytest.raises(KeyError, match="the original error"):
            list(export_then_fail(tensor))
        del tensor
        gc.collect()
        assert released == ["released"]

    def test_device_tensor_surface(self) -> None:
        array = np.arange(24, dtype=np.float16).reshape(SHAPE)
        released: list[str] = []
        tensor = tensor_over(array, released)
        assert (tensor.shape, tensor.dtype, tensor.ndim, tensor.nbytes) == (
            SHAPE,
            array.dtype,
            3,
            48,
        )
        assert tensor.device == 0 and tensor.__dlpack_device__() == (2, 0)
        assert repr(tensor) == "<DeviceTensor shape=(2, 3, 4) dtype=float16 device=cuda:0>"
        assert tensor.__cuda_array_interface__ == {
            "shape": SHAPE,
            "typestr": "<f2",
            "data": (array.ctypes.data, False),
            "strides": None,
            "version": 3,
            "stream": None,
        }
        host = tensor.to_host()
        assert np.array_equal(host, array) and not np.shares_memory(host, array)
        assert np.array_equal(np.asarray(tensor), array)
        assert np.asarray(tensor, np.float32).dtype == np.float32
        with pytest.raises(ValueError, match="without a copy"):
            np.asarray(tensor, copy=False)
        # A host copy through DLPack, flagged as a copy.
        copied = np.from_dlpack(tensor, device="cpu")
        assert np.array_equal(copied, array) and not np.shares_memory(copied, array)
        capsule = tensor.__dlpack__(max_version=(1, 0), dl_device=(1, 0))
        found = _unused_capsule(capsule)
        assert found is not None and found[1]
        assert _DLManagedTensorVersioned.from_address(found[0]).flags & 2
        with pytest.raises(BufferError, match="copy=False"):
            tensor.__dlpack__(dl_device=(1, 0), copy=False)
        with pytest.raises(BufferError, match=r"device \(2, 1\)"):
            tensor.__dlpack__(dl_device=(2, 1))
        with pytest.raises(BufferError, match=r"device \(2, 0\) with copy=True"):
            tensor.__dlpack__(copy=True)

    def test_zero_size_tensors_export_address_0(self) -> None:
        tensor = DeviceTensor(
            pointer=0xDEAD00, shape=(0, 3), dtype=np.dtype(np.int8), device=0, to_host=print
        )
        assert tensor.__cuda_array_interface__["data"] == (0, False)
        assert tensor.nbytes == 0 and tensor.to_host().shape == (0, 3)

    def test_constructor_checks(self) -> None:
        with pytest.raises(ValueError, match="needs to_host"):
            DeviceTensor(pointer=1, shape=(1,), dtype=np.dtype(np.int8), device=0)
        with pytest.raises(ValueError, match="needs host_array"):
            DeviceTensor(pointer=1, shape=(1,), dtype=np.dtype(np.int8), device=None)
        with pytest.raises(ValueError, match="needs host_array"):
            DeviceTensor(
                pointer=1,
                shape=(2,),
                dtype=np.dtype(np.int8),
                device=None,
                host_array=np.zeros(2, np.uint8),
            )


class TestHostBackedTensor:
    @pytest.mark.parametrize("max_version", [None, (1, 0)])
    def test_numpy_takes_it_without_a_copy(self, max_version: tuple[int, int] | None) -> None:
        array = np.arange(24, dtype=np.int16).reshape(SHAPE)
        released: list[str] = []
        tensor = tensor_over(array, released, device=None)
        capsule = tensor.__dlpack__(max_version=max_version)
        found = _unused_capsule(capsule)
        assert found is not None and found[1] is (max_version is not None)
        dl = _dl_tensor(*found)
        assert (dl.device.device_type, dl.data) == (1, array.ctypes.data)
        del capsule, dl
        view = np.from_dlpack(tensor)
        assert view.ctypes.data == array.ctypes.data and np.array_equal(view, array)
        del tensor
        gc.collect()
        assert released == [], "numpy's array made from it holds it"
        del view
        gc.collect()
        assert released == ["released"]

    def test_surface(self) -> None:
        array = np.arange(6, dtype=np.float32).reshape(2, 3)
        tensor = tensor_over(array, [], device=None)
        assert tensor.device is None and tensor.__dlpack_device__() == (1, 0)
        assert not hasattr(tensor, "__cuda_array_interface__")
        assert repr(tensor) == "<DeviceTensor shape=(2, 3) dtype=float32 device=host>"
        assert np.shares_memory(np.asarray(tensor), array)
        assert not np.shares_memory(np.array(tensor), array)
        assert not np.shares_memory(tensor.to_host(), array)
        assert np.array_equal(tensor.to_host(), array)
        copied = np.from_dlpack(tensor, copy=True)
        assert np.array_equal(copied, array) and not np.shares_memory(copied, array)
        with pytest.raises(ValueError, match="without a copy"):
            np.asarray(tensor, np.float64, copy=False)
        with pytest.raises(BufferError, match=r"device \(2, 0\)"):
            tensor.__dlpack__(dl_device=(2, 0))
