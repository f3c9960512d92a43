"""Device arrays on a GPU (aiodla._device_arrays): torch and CuPy arrays in, DeviceTensor
out, with no copy either way.

"No copy" is checked by address: an import's pointer is the framework's own
(``data_ptr()``, ``data.ptr``), and a framework's array made from a DeviceTensor starts
at the memory the test allocated with cudaMalloc, where a write through one framework is
read through the other. torch and CuPy are imported in fixtures, after the session
fixture has loaded the stand-in, and skip cleanly where they are missing.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiodla._device_arrays import DeviceSource, DeviceTensor, import_device_array, is_device_array
from aiodla._errors import InputTypeError, InputValueError

pytestmark = pytest.mark.usefixtures("real_gpu")


def accept_all(dtype: np.dtype[Any]) -> None:
    pass


def take(value: object, shape: tuple[int, ...], **options: Any) -> DeviceSource:
    arguments: dict[str, Any] = {"accepts": accept_all, "device": 0, "stream": 0}
    return import_device_array(value, name="x", shape=shape, **(arguments | options))


def checked(result: Any) -> Any:
    """cuda-bindings' (error, value...) tuples: the value, after checking the error."""
    error, *values = result
    assert int(error) == 0, error
    return values[0] if values else None


def framework(name: str) -> Any:
    with warnings.catch_warnings():
        # A framework's own import-time warnings are not what these tests check.
        warnings.simplefilter("ignore")
        return pytest.importorskip(name)


@pytest.fixture(scope="module")
def torch(gpu_session: Any) -> Any:
    module = framework("torch")
    if not module.cuda.is_available():
        pytest.skip("torch was built without CUDA or sees no GPU")
    return module


@pytest.fixture(scope="module")
def cupy(gpu_session: Any) -> Any:
    return framework("cupy")


class InterfaceOnly:
    """Another array's __cuda_array_interface__, without its DLPack methods."""

    def __init__(self, array: Any) -> None:
        self.array = array
        self.__cuda_array_interface__ = array.__cuda_array_interface__


class TestTorchIn:
    def test_contiguous_and_strided(self, torch: Any) -> None:
        tensor = torch.arange(24, dtype=torch.float16, device="cuda").reshape(2, 3, 4)
        stream = torch.cuda.Stream()
        assert is_device_array(tensor) and not is_device_array(tensor.cpu())
        source = take(tensor, (2, 3, 4), stream=stream.cuda_stream)
        assert (source.pointer, source.strides) == (tensor.data_ptr(), (12, 4, 1))
        assert (source.dtype, source.device, source.wait_stream) == (np.dtype(np.float16), 0, None)
        source.release()
        source.release()
        view = tensor[:, 1:, ::2]  # no extent of 1, whose stride a producer may rewrite
        assert view.data_ptr() == tensor.data_ptr() + 4 * 2
        source = take(view, (2, 2, 2), stream=stream.cuda_stream)
        assert (source.pointer, source.strides) == (view.data_ptr(), tuple(view.stride()))
        assert source.strides == (12, 4, 2)
        source.release()

    def test_the_interface_alone(self, torch: Any, cuda_rt: Any) -> None:
        tensor = torch.ones((2, 3), dtype=torch.int32, device="cuda")[:, 1:]

        def locate(pointer: int) -> int:
            return int(checked(cuda_rt.cudaPointerGetAttributes(pointer)).device)

        source = take(InterfaceOnly(tensor), (2, 2), locate=locate)
        assert (source.pointer, source.strides) == (tensor.data_ptr(), (3, 1))
        assert source.dtype == np.int32
        source.release()

    def test_refusals(self, torch: Any) -> None:
        tensor = torch.zeros((2, 3), device="cuda")
        with pytest.raises(InputValueError, match="'x': the array is on CUDA device 0, not 1"):
            take(tensor, (2, 3), device=1)
        with pytest.raises(InputValueError, match=r"'x': expected shape \(3, 2\)"):
            take(tensor, (3, 2))
        with pytest.raises(InputTypeError, match="'x': dtype bfloat16"):
            take(tensor.to(torch.bfloat16), (2, 3))
        with pytest.raises(InputTypeError, match="'x': dtype complex"):
            take(tensor.to(torch.complex64), (2, 3))
        with pytest.raises(InputTypeError, match="'x': the array is in CPU memory"):
            take(tensor.cpu(), (2, 3))
        # torch refuses to export a tensor that requires grad: named, with torch's reason.
        with pytest.raises(InputTypeError, match="'x': exporting the array") as info:
            take(tensor.requires_grad_(), (2, 3))
        assert info.value.__cause__ is not None


class TestCupyIn:
    def test_contiguous_and_strided(self, cupy: Any) -> None:
        array = cupy.arange(40, dtype=cupy.float32).reshape(2, 4, 5)
        assert is_device_array(array)
        source = take(array, (2, 4, 5))
        assert (source.pointer, source.strides) == (array.data.ptr, (20, 5, 1))
        source.release()
        view = array[:, ::2, 1:]
        source = take(view, (2, 2, 4))
        assert source.pointer == view.data.ptr == array.data.ptr + 4
        assert source.strides == tuple(s // 4 for s in view.strides) == (20, 10, 1)
        source.release()

    def test_the_interface_names_the_producers_stream(self, cupy: Any) -> None:
        array = cupy.arange(6, dtype=cupy.uint8).reshape(2, 3)
        with cupy.cuda.Stream(non_blocking=True) as stream:
            only = InterfaceOnly(array)
        source = take(only, (2, 3))
        assert (source.pointer, source.dtype) == (array.data.ptr, np.dtype(np.uint8))
        assert source.wait_stream == stream.ptr != 0
        source.release()


VALUES = np.arange(24, dtype=np.float32).reshape(2, 3, 4)


class Allocations:
    """DeviceTensors over cudaMalloc'd memory holding VALUES; ``released`` lists the
    pointers their release callbacks freed."""

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.allocated: list[int] = []
        self.released: list[int] = []

    def tensor(self) -> DeviceTensor:
        rt = self.rt
        pointer = int(checked(rt.cudaMalloc(VALUES.nbytes)))
        self.allocated.append(pointer)
        to_device = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        checked(rt.cudaMemcpy(pointer, VALUES.ctypes.data, VALUES.nbytes, to_device))

        def release() -> None:
            checked(rt.cudaFree(pointer))
            self.released.append(pointer)

        def to_host(out: np.ndarray[Any, Any]) -> None:
            kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
            checked(rt.cudaMemcpy(out.ctypes.data, pointer, out.nbytes, kind))

        return DeviceTensor(
            pointer=pointer,
            shape=VALUES.shape,
            dtype=VALUES.dtype,
            device=0,
            release=release,
            to_host=to_host,
        )


@pytest.fixture
def allocations(cuda_rt: Any) -> Iterator[Allocations]:
    made = Allocations(cuda_rt)
    yield made
    gc.collect()
    assert made.released == made.allocated, "each release runs once, after all holders"


class TestDeviceTensorOut:
    def test_torch_and_cupy_share_the_memory(
        self, torch: Any, cupy: Any, allocations: Allocations
    ) -> None:
        tensor = allocations.tensor()
        pointer = tensor.__cuda_array_interface__["data"][0]
        assert pointer == allocations.allocated[0]
        through_torch = torch.from_dlpack(tensor)
        through_capsule = torch.utils.dlpack.from_dlpack(tensor.__dlpack__())  # legacy
        through_cupy = cupy.from_dlpack(tensor)
        through_interface = cupy.asarray(tensor)
        assert through_torch.data_ptr() == through_capsule.data_ptr() == pointer
        assert through_torch.device == torch.device("cuda", 0)
        assert tuple(through_torch.shape) == (2, 3, 4) and through_torch.dtype == torch.float32
        assert through_cupy.data.ptr == through_interface.data.ptr == pointer
        assert np.array_equal(through_torch.cpu().numpy(), VALUES)
        assert np.array_equal(cupy.asnumpy(through_cupy), VALUES)
        # One memory: a write through torch is read through CuPy and by to_host().
        through_torch.add_(1)
        torch.cuda.synchronize()
        assert np.array_equal(cupy.asnumpy(through_interface), VALUES + 1)
        assert np.array_equal(tensor.to_host(), VALUES + 1)
        assert np.array_equal(np.asarray(tensor), VALUES + 1)
        del tensor
        gc.collect()
        assert allocations.released == []
        del through_torch, through_capsule
        gc.collect()
        assert allocations.released == [], "CuPy's arrays still hold the memory"
        del through_cupy
        gc.collect()
        assert allocations.released == [], "cupy.asarray's array holds the tensor"
        del through_interface
        gc.collect()
        assert allocations.released == [pointer]

    def test_imported_back(self, allocations: Allocations) -> None:
        tensor = allocations.tensor()
        source = take(tensor, (2, 3, 4))
        assert (source.pointer, source.strides) == (allocations.allocated[0], (12, 4, 1))
        assert source.dtype == np.float32
        del tensor
        gc.collect()
        assert allocations.released == []
        source.release()
        gc.collect()
        assert allocations.released == allocations.allocated

    def test_an_unconsumed_capsule_gives_it_back(self, allocations: Allocations) -> None:
        tensor = allocations.tensor()
        capsules = [tensor.__dlpack__(max_version=(1, 0)), tensor.__dlpack__()]
        del tensor
        gc.collect()
        assert allocations.released == []
        capsules.clear()
        gc.collect()
        assert allocations.released == allocations.allocated
