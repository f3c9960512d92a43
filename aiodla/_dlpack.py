"""DLPack's C side, read and written with ctypes: the structs of dlpack.h (1.x), the
capsule calls of Python's C API, and a producer's deleter. What the fields mean for an
input or an output is :mod:`aiodla._device_arrays`'s business; this module only reaches
them, so no array library has to be imported for it."""

from __future__ import annotations

import ctypes
from typing import Any

__all__: list[str] = []

_void_p = ctypes.c_void_p


class _DLDevice(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class _DLDataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class _DLTensor(ctypes.Structure):
    _fields_ = (
        ("data", _void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


class _DLManagedTensor(ctypes.Structure):
    _fields_ = (("dl_tensor", _DLTensor), ("manager_ctx", _void_p), ("deleter", _void_p))


class _DLPackVersion(ctypes.Structure):
    _fields_ = (("major", ctypes.c_uint32), ("minor", ctypes.c_uint32))


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = (
        ("version", _DLPackVersion),
        ("manager_ctx", _void_p),
        ("deleter", _void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    )


def _capi(name: str, restype: Any, *argtypes: Any) -> Any:
    # Private function objects (argtypes set on ctypes.pythonapi.<name> would change them
    # for the whole process); PYFUNCTYPE keeps the GIL and raises the error a call sets.
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_capsule_is_valid = _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
_capsule_pointer = _capi("PyCapsule_GetPointer", _void_p, ctypes.py_object, ctypes.c_char_p)
_capsule_set_name = _capi("PyCapsule_SetName", ctypes.c_int, ctypes.py_object, _void_p)
_raw_malloc = _capi("PyMem_RawMalloc", _void_p, ctypes.c_size_t)
# A producer's deleter, called with the GIL held: correct both for deleters that take
# the GIL themselves (as the spec asks) and for older ones that assume it.
_Deleter = ctypes.PYFUNCTYPE(None, _void_p)


def _static_name(name: bytes) -> int:
    """A C string never freed: PyCapsule_SetName keeps the pointer, not a copy, and a
    renamed capsule's destructor compares its name even at interpreter exit."""
    address = _raw_malloc(len(name) + 1)
    if not address:
        raise MemoryError("PyMem_RawMalloc failed for a capsule name")
    return int(ctypes.memmove(address, name + b"\0", len(name) + 1))


_LEGACY, _VERSIONED = b"dltensor", b"dltensor_versioned"
_USED = {name: _static_name(b"used_" + name) for name in (_LEGACY, _VERSIONED)}
_VERSIONED_TENSOR_OFFSET: int = _DLManagedTensorVersioned.dl_tensor.offset


def _unused_capsule(capsule: object) -> tuple[int, bool] | None:
    """(address of the DLManagedTensor[Versioned], versioned) of an unconsumed capsule."""
    for name, versioned in ((_VERSIONED, True), (_LEGACY, False)):
        if _capsule_is_valid(capsule, name):
            return int(_capsule_pointer(capsule, name)), versioned
    return None


def _dl_tensor(managed: int, versioned: bool) -> _DLTensor:
    return _DLTensor.from_address(managed + (_VERSIONED_TENSOR_OFFSET if versioned else 0))


def _call_deleter(deleter: int, managed: int) -> None:
    if deleter:  # the spec allows a NULL deleter: nothing to free
        _Deleter(deleter)(managed)
