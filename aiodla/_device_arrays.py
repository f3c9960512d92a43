"""Device arrays in and out, by protocol: DLPack and the CUDA array interface.

:func:`import_device_array` turns a CUDA array (torch, CuPy, numba...: anything with
DLPack or ``__cuda_array_interface__``) into a :class:`DeviceSource`, which the device
layer reads in place; ``infer(x, output="device")`` returns :class:`DeviceTensor`
objects, which export both protocols, so torch and CuPy take them without a copy.

No array library is imported: the DLPack structs (dlpack.h, 1.x) are read and written
with ctypes (:mod:`aiodla._dlpack`). Exported capsules are made by numpy's ``__dlpack__``
over a view of the tensor's memory, with the device then set: numpy's capsule destructor
and deleter are C code that keeps an in-flight exception intact, which a ctypes callback
cannot do (a capsule freed while an exception unwinds would turn it into a SystemError).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ._dlpack import (
    _LEGACY,
    _USED,
    _VERSIONED,
    _call_deleter,
    _capsule_set_name,
    _dl_tensor,
    _DLManagedTensor,
    _DLManagedTensorVersioned,
    _DLTensor,
    _unused_capsule,
)
from ._errors import InputTypeError, InputValueError

if TYPE_CHECKING:
    from typing_extensions import CapsuleType

__all__ = ["DeviceSource", "DeviceTensor", "ShapeRule", "import_device_array", "is_device_array"]

_Array = np.ndarray[Any, Any]

# DLDeviceType (dlpack.h). kDLCUDAManaged memory is addressable from the device too.
_CPU, _CUDA, _CUDA_MANAGED = 1, 2, 13
_CUDA_TYPES = (_CUDA, _CUDA_MANAGED)
_DEVICE_TYPE_NAMES = {1: "CPU", 3: "CUDA pinned host", 10: "ROCm", 11: "ROCm pinned host"}
# DLDataTypeCode (dlpack.h) -> numpy kind, and the widths numpy stores of each kind.
_DTYPE_KINDS = {0: "i", 1: "u", 2: "f", 6: "b"}
_WIDTHS = {"i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8), "b": (1,)}
_UNSUPPORTED_CODES = {3: "opaque handle", 4: "bfloat16", 5: "complex"}
_NOT_REAL = (
    "is not supported; expected a real dtype (int8/16/32/64, uint8/16/32/64, float16/32/64 or bool)"
)
_IS_COPIED = 1 << 1  # DLPACK_FLAG_BITMASK_IS_COPIED
_CONSUMER_VERSION = (1, 0)
_Accepts = Callable[[np.dtype[Any]], None]
_Shape = tuple[int, ...]
#: What a device array's shape must be: one shape, or a check that raises the
#: InputValueError for a shape it refuses (a camera frame's size is the caller's choice).
ShapeRule = _Shape | Callable[[_Shape], object]
#: Dimensions read from a capsule whose shape is checked by a rule: a frame has two or
#: three, and a bound keeps a bogus ndim from walking its shape array out of bounds.
_MAX_RULED_NDIM = 4
_Malformed = Callable[[str], InputTypeError]


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides in elements (what DLPack's strides=NULL means)."""
    strides: list[int] = []
    step = 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


# -- in -------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class DeviceSource:
    """One validated device input: where its first element is and how it is laid out.

    The producer's memory stays valid until :meth:`release` or collection: a DLPack
    import owns its DLManagedTensor, an interface import holds the array object.
    """

    name: str
    pointer: int  # address of element (0, ..., 0), byte_offset applied
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    device: int  # CUDA device ordinal
    # A CUDA stream handle to order the read after (1 and 2 are cudaStreamLegacy and
    # cudaStreamPerThread, handles to the CUDA runtime too), or None. Always None for
    # DLPack: the producer ordered its work before the stream passed to __dlpack__.
    wait_stream: int | None
    _finalizer: weakref.finalize[Any, Any] | None = dataclasses.field(default=None, repr=False)

    def release(self) -> None:
        """Give the array back (DLPack: call the producer's deleter). Idempotent, and safe
        from any thread: weakref.finalize runs its callback at most once."""
        if self._finalizer is not None:
            self._finalizer()


def is_device_array(value: object) -> bool:
    """Whether ``value`` is a CUDA array that :func:`import_device_array` takes.

    Cheap (called per input per request). True when ``__dlpack_device__()`` says CUDA or
    CUDA managed memory or, without DLPack, when ``__cuda_array_interface__`` is there;
    also when either raises, so that the import reports the error, naming the input.
    """
    if isinstance(value, np.ndarray):
        return False
    dlpack_device = getattr(value, "__dlpack_device__", None)
    try:
        if dlpack_device is not None:
            return int(dlpack_device()[0]) in _CUDA_TYPES
        return hasattr(value, "__cuda_array_interface__")
    except Exception:
        return True


def import_device_array(
    value: object,
    *,
    name: str,
    shape: ShapeRule,
    accepts: Callable[[np.dtype[Any]], None],
    device: int,
    stream: int,
    locate: Callable[[int], int] | None = None,
) -> DeviceSource:
    """Validate a CUDA array for the input ``name`` and describe it, without a copy.

    ``shape`` is the shape the array must have, or a callable that raises the
    InputValueError for a shape it refuses (a camera frame, whose size may vary).

    DLPack first, when the object has it: ``__dlpack__(stream=stream)``, so the producer
    orders its pending work before ``stream`` (the consumer's); else the CUDA array
    interface v3, whose ``stream`` field becomes :attr:`DeviceSource.wait_stream`.
    ``accepts(dtype)`` raises the InputError for a dtype the tensor cannot take.
    ``locate(pointer)`` returns the device ordinal owning an address (the interface does
    not carry one; without ``locate`` the array is taken to be on ``device``).

    Every error is an InputTypeError or InputValueError naming the input and what was
    expected, raised with nothing held: a DLPack tensor taken is given back first.
    """
    if hasattr(value, "__dlpack__") and hasattr(value, "__dlpack_device__"):
        return _from_dlpack(value, name, shape, accepts, device, stream)
    return _from_interface(value, name, shape, accepts, device, locate)


def _check_device(name: str, kind: int, ordinal: int, device: int) -> None:
    if kind not in _CUDA_TYPES:
        where = _DEVICE_TYPE_NAMES.get(kind, f"DLPack device type {kind}")
        raise InputTypeError(f"input {name!r}: the array is in {where} memory, expected CUDA")
    if ordinal != device:
        raise InputValueError(
            f"input {name!r}: the array is on CUDA device {ordinal}, not {device}"
        )


def _check_layout(name: str, got: tuple[int, ...], shape: ShapeRule) -> None:
    if callable(shape):
        shape(got)
        return
    if len(got) != len(shape):
        raise InputValueError(
            f"input {name!r}: expected {len(shape)} dimensions (shape {shape}), got "
            f"{len(got)} (shape {got})"
        )
    if got != shape:
        raise InputValueError(f"input {name!r}: expected shape {shape}, got {got}")


def _from_dlpack(
    value: Any, name: str, shape: ShapeRule, accepts: _Accepts, device: int, stream: int
) -> DeviceSource:
    try:
        kind, ordinal = (int(part) for part in value.__dlpack_device__())
    except Exception as exc:
        raise InputTypeError(f"input {name!r}: __dlpack_device__() failed: {exc!r}") from exc
    _check_device(name, kind, ordinal, device)
    # DLPack reserves 0 as ambiguous; the CUDA runtime's handle 0, the legacy default
    # stream, is spelled 1 there.
    consumer_stream = 1 if stream == 0 else stream
    try:
        try:
            capsule = value.__dlpack__(stream=consumer_stream, max_version=_CONSUMER_VERSION)
        except TypeError:
            # Producers from before DLPack 1.0 refuse the keyword; the spec's fallback.
            capsule = value.__dlpack__(stream=consumer_stream)
    except Exception as exc:
        raise InputTypeError(
            f"input {name!r}: exporting the array through DLPack failed: {exc!r}"
        ) from exc
    found = _unused_capsule(capsule)
    if found is None:
        raise InputTypeError(
            f"input {name!r}: __dlpack__() returned {type(capsule).__name__}, not an unused "
            "DLPack capsule"
        )
    managed, versioned = found
    # Renaming takes ownership, as the spec requires: from here the producer's capsule
    # destructor leaves the tensor alone, and its deleter is ours to call, once.
    _capsule_set_name(capsule, _USED[_VERSIONED if versioned else _LEGACY])
    header = (_DLManagedTensorVersioned if versioned else _DLManagedTensor).from_address(managed)
    deleter = int(header.deleter or 0)
    try:
        if versioned and header.version.major > _CONSUMER_VERSION[0]:
            raise InputTypeError(
                f"input {name!r}: its DLPack capsule has version {header.version.major}."
                f"{header.version.minor}, this consumer reads {_CONSUMER_VERSION[0]}.x"
            )
        source = _describe_dlpack(_dl_tensor(managed, versioned), name, shape, accepts, device)
    except BaseException:
        _call_deleter(deleter, managed)
        raise
    source._finalizer = weakref.finalize(source, _call_deleter, deleter, managed)
    source._finalizer.atexit = False
    return source


def _describe_dlpack(
    tensor: _DLTensor, name: str, shape: ShapeRule, accepts: _Accepts, device: int
) -> DeviceSource:
    # The capsule's own device, too: __dlpack_device__ and the export may disagree.
    _check_device(name, int(tensor.device.device_type), int(tensor.device.device_id), device)
    dtype = _dlpack_dtype(name, int(tensor.dtype.code), int(tensor.dtype.bits), tensor.dtype.lanes)
    ndim = int(tensor.ndim)
    fits = 1 <= ndim <= _MAX_RULED_NDIM if callable(shape) else ndim == len(shape)
    if not fits or (ndim and not tensor.shape):
        # ndim is the length of the shape and strides arrays: checked before they are read
        wanted = (
            f"1 to {_MAX_RULED_NDIM} dimensions"
            if callable(shape)
            else f"{len(shape)} dimensions (shape {shape})"
        )
        raise InputValueError(
            f"input {name!r}: expected {wanted}, its DLPack capsule has ndim "
            f"{ndim}{'' if tensor.shape else ' and no shape'}"
        )
    got = tuple(int(tensor.shape[axis]) for axis in range(ndim))
    _check_layout(name, got, shape)
    if tensor.strides:
        strides = tuple(int(tensor.strides[axis]) for axis in range(ndim))
    else:  # NULL: row-major, compact
        strides = _c_strides(got)
    accepts(dtype)
    pointer = int(tensor.data or 0) + int(tensor.byte_offset)
    return DeviceSource(name, pointer, dtype, got, strides, device, wait_stream=None)


def _dlpack_dtype(name: str, code: int, bits: int, lanes: int) -> np.dtype[Any]:
    kind = _DTYPE_KINDS.get(code)
    if lanes != 1:
        problem = f"a vector type of {lanes} lanes"
    elif kind is None:
        problem = _UNSUPPORTED_CODES.get(code, f"DLPack type code {code}")
    elif bits % 8 or bits // 8 not in _WIDTHS[kind]:
        problem = f"{bits}-bit DLPack type code {code}"
    else:
        return np.dtype(f"{kind}{bits // 8}")
    raise InputTypeError(f"input {name!r}: dtype {problem} {_NOT_REAL}")


def _from_interface(
    value: Any,
    name: str,
    shape: ShapeRule,
    accepts: _Accepts,
    device: int,
    locate: Callable[[int], int] | None,
) -> DeviceSource:
    try:
        interface = value.__cuda_array_interface__
    except AttributeError:
        of_shape = "" if callable(shape) else f" of shape {shape}"
        raise InputTypeError(
            f"input {name!r}: expected a CUDA array (DLPack or __cuda_array_interface__)"
            f"{of_shape}, got {type(value).__name__}"
        ) from None
    except Exception as exc:
        raise InputTypeError(
            f"input {name!r}: reading __cuda_array_interface__ failed: {exc!r}"
        ) from exc

    def malformed(what: str) -> InputTypeError:
        return InputTypeError(f"input {name!r}: malformed __cuda_array_interface__: {what}")

    if not isinstance(interface, dict):
        raise malformed(f"a {type(interface).__name__}, expected a dict")
    missing = [key for key in ("shape", "typestr", "data", "version") if key not in interface]
    if missing:
        raise malformed(f"no {', '.join(repr(key) for key in missing)}")
    if interface.get("mask") is not None:
        raise InputTypeError(
            f"input {name!r}: a masked array's mask would be ignored (the DLA reads every "
            "element); pass the array with masked elements filled"
        )
    if not _is_int(interface["version"]):
        raise malformed(f"version {interface['version']!r} is not an integer")
    got = interface["shape"]
    if not isinstance(got, (tuple, list)) or not all(_is_int(e) and e >= 0 for e in got):
        raise malformed(f"shape {got!r} is not a tuple of sizes")
    got = tuple(int(extent) for extent in got)
    dtype = _interface_dtype(name, interface["typestr"], malformed)
    data = interface["data"]
    if not (isinstance(data, (tuple, list)) and len(data) == 2 and _is_int(data[0])):
        raise malformed(f"data {data!r} is not a (pointer, read_only) pair")
    pointer = int(data[0])
    strides = _interface_strides(name, interface.get("strides"), got, dtype, malformed)
    wait_stream = interface.get("stream")
    if wait_stream is not None:
        if not _is_int(wait_stream) or wait_stream < 0:
            raise malformed(f"stream {wait_stream!r} is not a stream handle")
        if wait_stream == 0:
            raise InputValueError(
                f"input {name!r}: __cuda_array_interface__ names stream 0, which the "
                "interface forbids as ambiguous (1: legacy default, 2: per-thread default)"
            )
        wait_stream = int(wait_stream)
    if locate is not None and pointer:
        try:
            ordinal = int(locate(pointer))
        except Exception as exc:
            raise InputTypeError(
                f"input {name!r}: its data pointer {pointer:#x} is not CUDA memory ({exc})"
            ) from exc
        _check_device(name, _CUDA, ordinal, device)
    _check_layout(name, got, shape)
    accepts(dtype)
    source = DeviceSource(name, pointer, dtype, got, strides, device, wait_stream)
    # Holding the producer's object keeps its memory alive until release() drops it.
    source._finalizer = weakref.finalize(source, _drop, value)
    source._finalizer.atexit = False
    return source


def _drop(owner: object) -> None:  # the finalizer's arguments hold owner until called
    pass


def _interface_dtype(name: str, typestr: object, malformed: _Malformed) -> np.dtype[Any]:
    if not isinstance(typestr, str):
        raise malformed(f"typestr {typestr!r} is not a string")
    try:
        dtype = np.dtype(typestr)
    except TypeError:
        raise malformed(f"typestr {typestr!r} is not an array-interface type") from None
    if dtype.kind not in _WIDTHS or dtype.itemsize not in _WIDTHS[dtype.kind]:
        raise InputTypeError(f"input {name!r}: dtype {typestr!r} ({dtype}) {_NOT_REAL}")
    if not dtype.isnative:
        raise InputTypeError(f"input {name!r}: typestr {typestr!r} is not in native byte order")
    return dtype


def _interface_strides(
    name: str, strides: object, shape: _Shape, dtype: np.dtype[Any], malformed: _Malformed
) -> _Shape:
    if strides is None:  # the interface's spelling of row-major and compact
        return _c_strides(shape)
    if not isinstance(strides, (tuple, list)) or not all(_is_int(s) for s in strides):
        raise malformed(f"strides {strides!r} are not a tuple of integers")
    if len(strides) != len(shape):
        raise malformed(f"{len(strides)} strides for {len(shape)} dimensions")
    if any(int(stride) % dtype.itemsize for stride in strides):
        raise InputValueError(
            f"input {name!r}: byte strides {tuple(strides)} are not multiples of the "
            f"{dtype} item size ({dtype.itemsize}); pass an array with aligned elements"
        )
    return tuple(int(stride) // dtype.itemsize for stride in strides)


# -- out ------------------------------------------------------------------------------


class _Keeper:
    """The base of numpy's view over exported memory, which is the capsule's manager_ctx:
    the capsule's deleter lets the view, this object and the tensor it holds go."""

    def __init__(self, interface: dict[str, Any], owner: object) -> None:
        self.__array_interface__, self.owner = interface, owner


def _numpy_capsule(array: _Array, max_version: tuple[int, int] | None) -> CapsuleType:
    try:
        if max_version is not None and max_version[0] >= 1:
            return array.__dlpack__(max_version=max_version)
    except TypeError:
        pass  # numpy < 2.1: only legacy capsules, which the spec lets a producer return
    return array.__dlpack__()


class DeviceTensor:
    """An inference output in device memory (or, on a runtime without GPU memory, host
    memory behind the same interface).

    Exports DLPack and, in device memory, the CUDA array interface v3:
    ``torch.from_dlpack(y)``, ``cupy.from_dlpack(y)``, ``cupy.asarray(y)`` and numba take
    it without a copy; :meth:`to_host` copies it into a fresh numpy array. The memory goes
    back to the engine once this tensor and every array made from it without a copy are
    gone, on whichever thread lets the last one go.
    """

    def __init__(
        self,
        *,
        pointer: int,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        device: int | None,
        release: Callable[[], None] | None = None,
        to_host: Callable[[_Array], None] | None = None,
        host_array: _Array | None = None,
    ) -> None:
        self._pointer = int(pointer)  # for host-backed: the runtime's handle, not exported
        self._shape = tuple(int(extent) for extent in shape)
        self._dtype = np.dtype(dtype)
        self._device = device
        self._to_host = to_host
        self._host = host_array
        layout = None if host_array is None else (host_array.shape, host_array.dtype)
        if device is None and layout != (self._shape, self._dtype):
            raise ValueError("a host-backed DeviceTensor needs host_array of its shape and dtype")
        if device is not None and to_host is None:
            raise ValueError("a DeviceTensor in device memory needs to_host")
        self._finalizer: weakref.finalize[Any, Any] | None = None
        if release is not None:
            # Runs once, when the last holder goes: this object, or a capsule's view
            # (_Keeper). Not at interpreter exit: the runtime owning the memory may be
            # gone by then, and the memory goes with the process.
            self._finalizer = weakref.finalize(self, release)
            self._finalizer.atexit = False

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self._shape) * self._dtype.itemsize

    @property
    def device(self) -> int | None:
        """The CUDA device ordinal; None for a host-backed tensor."""
        return self._device

    def __repr__(self) -> str:
        where = "host" if self._device is None else f"cuda:{self._device}"
        return f"<DeviceTensor shape={self._shape} dtype={self._dtype} device={where}>"

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_CPU, 0) if self._device is None else (_CUDA, self._device)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> CapsuleType:
        """A DLPack capsule (versioned when ``max_version`` >= (1, 0)) over this tensor.

        ``stream`` needs no synchronization: the engine hands a tensor out only after the
        GPU work that wrote it completed, so its data is ready for any stream's work.
        ``dl_device=(kDLCPU, 0)`` or ``copy=True`` export a host copy.
        """
        del stream  # see the docstring: nothing to order
        here = self.__dlpack_device__()
        target = here if dl_device is None else (int(dl_device[0]), int(dl_device[1]))
        if target == here and not copy:
            return self._export(max_version)
        if target == (_CPU, 0) and copy is not False:
            host = self._host.copy() if self._host is not None else self.to_host()
            capsule = _numpy_capsule(host, max_version)
            found = _unused_capsule(capsule)
            if found is not None and found[1]:
                _DLManagedTensorVersioned.from_address(found[0]).flags |= _IS_COPIED
            return capsule
        raise BufferError(
            f"{self!r} cannot be exported to DLPack device {target} with copy={copy}: it "
            f"lives on {here}; copies are made to the host only (kDLCPU, 0)"
        )

    def _export(self, max_version: tuple[int, int] | None) -> CapsuleType:
        interface = self._interface() if self._host is None else self._host.__array_interface__
        # numpy wraps the address without reading it; this view is never handed out.
        view: _Array = np.asarray(_Keeper(interface, self))
        capsule = _numpy_capsule(view, max_version)
        found = _unused_capsule(capsule)
        if found is None:  # numpy always returns a fresh, unused capsule
            raise BufferError(f"numpy returned no DLPack capsule for {self!r}")
        if self._device is not None:
            device = _dl_tensor(*found).device
            device.device_type, device.device_id = _CUDA, self._device
        return capsule

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if self._device is None:
            # AttributeError, so that hasattr() is False and consumers try DLPack.
            raise AttributeError(f"{self!r} is in host memory: it has no __cuda_array_interface__")
        return self._interface()

    def _interface(self) -> dict[str, Any]:
        # stream None: ready when handed out (see __dlpack__), nothing to wait for. A
        # zero-size array's address may be anything; the interfaces take 0 there.
        data = (self._pointer if self.nbytes else 0, False)
        interface = {"shape": self._shape, "typestr": self._dtype.str, "data": data}
        return interface | {"strides": None, "version": 3, "stream": None}

    def to_host(self) -> _Array:
        """A fresh numpy array with this tensor's values."""
        out: _Array = np.empty(self._shape, self._dtype)
        if self._to_host is not None:
            self._to_host(out)
        else:
            out[...] = self._host
        return out

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> _Array:
        # numpy 2's protocol: copy=False must fail where a copy cannot be avoided.
        converts = dtype is not None and np.dtype(dtype) != self._dtype
        if copy is False and (self._host is None or converts):
            raise ValueError(f"{self!r} cannot become a numpy array of {dtype} without a copy")
        array = self._host if self._host is not None and not copy else self.to_host()
        return np.asarray(array, dtype) if converts else array
