"""The KServe v2 tensor codec and error statuses, shared by the HTTP and gRPC fronts.

A tensor on the wire is a name, a KServe datatype (``FP32``, ``INT8``, ...), a shape
and its values: JSON numbers (HTTP), typed repeated fields (gRPC ``contents``) or raw
little-endian bytes in row-major order (HTTP's binary tensor data extension, gRPC's
``raw_input_contents``). This module turns them into numpy arrays checked against the
model's :class:`~aiodla.TensorSpec`, turns the engine's outputs back, and maps every
error to the protocol's status: an HTTP code and a gRPC status code name.

Datatypes follow Triton strictly: an input must arrive in its tensor's datatype, with
its logical shape. One leniency: an integer input with a quantization scale
(``Engine(scales=...)``) also takes FP16, FP32 or FP64 values, which aiodla quantizes,
as ``Engine.infer`` does. Outputs go out in the type ``Engine.infer`` returns them:
FP32 for an integer output with a scale.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import (
    AiodlaError,
    EngineClosedError,
    EngineDeadError,
    InputError,
    QueueFullError,
    RequestTimeoutError,
)
from .._tensors import TensorSpec, refuse_overflow

__all__ = [
    "DATATYPES",
    "ProtocolError",
    "Status",
    "WireTensor",
    "decode_json",
    "decode_raw",
    "error_of",
    "input_datatypes",
    "output_datatype",
    "raw_bytes",
    "request_limit",
    "wire_input",
    "wire_output",
]

_Array = np.ndarray[Any, Any]

#: KServe datatype name → numpy dtype (BYTES, strings, has no DLA tensor).
DATATYPES: Mapping[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
_NAMES = {dtype: name for name, dtype in DATATYPES.items()}
_FLOATS = ("FP16", "FP32", "FP64")


class Status(enum.Enum):
    """A protocol status: (HTTP code, gRPC status code name)."""

    INVALID_ARGUMENT = (400, "INVALID_ARGUMENT")
    NOT_FOUND = (404, "NOT_FOUND")
    #: A request larger than any the served models take.
    RESOURCE_EXHAUSTED = (413, "RESOURCE_EXHAUSTED")
    #: A request body that did not arrive in time (HTTP only).
    REQUEST_TIMEOUT = (408, "DEADLINE_EXCEEDED")
    #: The client went away (nginx's 499: no one reads the answer).
    CANCELLED = (499, "CANCELLED")
    UNAVAILABLE = (503, "UNAVAILABLE")
    # Triton has no HTTP code of its own for a request's timeout; 504 is the HTTP word
    # for "no answer in time" and tritonclient reads any code with the message.
    DEADLINE_EXCEEDED = (504, "DEADLINE_EXCEEDED")
    INTERNAL = (500, "INTERNAL")

    @property
    def http(self) -> int:
        return self.value[0]

    @property
    def grpc(self) -> str:
        return self.value[1]


class ProtocolError(Exception):
    """A request the server answers with an error status and this message."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_of(exc: BaseException) -> ProtocolError:
    """The status and message a failed request is answered with.

    aiodla's message goes out unchanged: it names the tensor, the shape, the queue.
    """
    if isinstance(exc, ProtocolError):
        return exc
    message = str(exc) or type(exc).__name__
    code = getattr(exc, "status_code", None)  # an HTTP error of aiohttp's keeps its meaning
    if isinstance(code, int) and 400 <= code < 500:
        status = next((s for s in Status if s.http == code), Status.INVALID_ARGUMENT)
        return ProtocolError(status, message)
    if isinstance(exc, InputError):
        return ProtocolError(Status.INVALID_ARGUMENT, message)
    if isinstance(exc, RequestTimeoutError):
        return ProtocolError(Status.DEADLINE_EXCEEDED, message)
    # A full queue, a closing engine and a dead one are all "try elsewhere or later": the
    # protocol's UNAVAILABLE, which load balancers and clients retry.
    if isinstance(exc, (QueueFullError, EngineClosedError, EngineDeadError)):
        return ProtocolError(Status.UNAVAILABLE, message)
    if isinstance(exc, AiodlaError):
        return ProtocolError(Status.INTERNAL, message)
    return ProtocolError(Status.INTERNAL, f"internal error: {type(exc).__name__}: {message}")


# -- metadata -------------------------------------------------------------------------------


def datatype_of(dtype: np.dtype[Any]) -> str:
    return _NAMES[np.dtype(dtype)]


def input_datatypes(spec: TensorSpec) -> tuple[str, ...]:
    """The datatypes an input takes, the tensor's own first."""
    own = datatype_of(spec.numpy_dtype)
    if spec.is_integer and spec.scale is not None:
        return (own, *_FLOATS)
    return (own,)


def output_datatype(spec: TensorSpec) -> str:
    """The datatype an output goes out in: what ``Engine.infer`` returns."""
    return datatype_of(spec.result_dtype)


@dataclasses.dataclass(frozen=True)
class WireTensor:
    """A tensor as the protocol carries it: its name, the datatypes it takes (its own
    first), its shape (-1: any size in that dimension) and the most elements it may
    hold. ``spec`` is the engine's tensor when the wire carries that tensor as is (its
    values are range-checked and quantized as ``Engine.infer`` does); None for a camera
    frame or a detection output, which have no tensor of the model's."""

    name: str
    datatypes: tuple[str, ...]
    shape: tuple[int, ...]
    max_elements: int
    spec: TensorSpec | None = None

    @property
    def datatype(self) -> str:
        return self.datatypes[0]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def wire_input(spec: TensorSpec) -> WireTensor:
    """A model input taken as it is: its logical shape, its datatype (and floats too
    for an integer input with a scale)."""
    return WireTensor(spec.name, input_datatypes(spec), tuple(spec.shape), _count(spec), spec)


def wire_output(spec: TensorSpec) -> WireTensor:
    """A model output, in the type ``Engine.infer`` returns it."""
    return WireTensor(spec.name, (output_datatype(spec),), tuple(spec.shape), _count(spec), spec)


def _count(spec: TensorSpec) -> int:
    return math.prod(spec.shape)


#: JSON bytes per tensor element a request may spend: a float's 17 significant digits,
#: sign, point and exponent ("-1.2345678901234567e-05") and tritonclient's ", " make 25;
#: nested lists, indentation and the integer inputs' typed gRPC fields (10 bytes for a
#: negative varint) stay within 32.
JSON_BYTES_PER_ELEMENT = 32
#: Room for the request's JSON around the tensors' values (names, shapes, parameters).
HEADER_SLACK = 64 * 1024
#: The least request size taken, whatever the models.
MIN_REQUEST_BYTES = 1024 * 1024


#: JSON bytes per element of a one-byte integer datatype (a camera frame's UINT8): at
#: most "-128" and a separator, nesting and indentation within 12.
JSON_BYTES_PER_BYTE_ELEMENT = 12


def request_limit(models: Sequence[Sequence[WireTensor]]) -> int:
    """The largest request body (HTTP) or message (gRPC) taken, in bytes: the inputs of
    the model whose inputs take the most, written as JSON, plus slack."""
    largest = max((sum(map(_json_bytes, inputs)) for inputs in models), default=0)
    return max(MIN_REQUEST_BYTES, largest + HEADER_SLACK)


def _json_bytes(tensor: WireTensor) -> int:
    if all(DATATYPES[d].itemsize == 1 and d != "BOOL" for d in tensor.datatypes):
        return tensor.max_elements * JSON_BYTES_PER_BYTE_ELEMENT
    return tensor.max_elements * JSON_BYTES_PER_ELEMENT


# -- inputs -------------------------------------------------------------------------------------


def _checked_header(
    tensor: WireTensor, datatype: object, shape: object
) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """The dtype and shape of an input's values, after checking its datatype and its
    shape against the tensor's (-1: any size >= 1 there)."""
    allowed = tensor.datatypes
    if datatype not in allowed:
        expected = allowed[0] if len(allowed) == 1 else f"one of {', '.join(allowed)}"
        raise ProtocolError(
            Status.INVALID_ARGUMENT,
            f"input {tensor.name!r}: datatype {datatype!r}, expected {expected}",
        )
    if (
        not isinstance(shape, Sequence)
        or isinstance(shape, (str, bytes))
        or not all(type(d) is int for d in shape)
        or len(shape) != len(tensor.shape)
        or not all(d == w or (w == -1 and d >= 1) for d, w in zip(shape, tensor.shape, strict=True))
    ):
        raise ProtocolError(
            Status.INVALID_ARGUMENT,
            f"input {tensor.name!r}: shape {_shown(shape)}, expected {list(tensor.shape)}"
            + (" (-1: any size)" if -1 in tensor.shape else ""),
        )
    return DATATYPES[str(datatype)], tuple(shape)


def _shown(shape: object) -> str:
    return str(list(shape)) if isinstance(shape, (list, tuple)) else repr(shape)


def decode_json(tensor: WireTensor, datatype: object, shape: object, data: object) -> _Array:
    """An input from JSON values (nested lists or one flat list, row-major) or a gRPC
    ``contents`` field's values."""
    dtype, shape = _checked_header(tensor, datatype, shape)
    if isinstance(data, (str, bytes, Mapping)) or data is None:
        raise ProtocolError(
            Status.INVALID_ARGUMENT, f"input {tensor.name!r}: 'data' must be a list of numbers"
        )
    spec = tensor.spec
    try:
        # The values' own types first (ints, floats, bools, strings), then the datatype's.
        array = _typed(np.asarray(data), dtype, data, spec)
    except InputError as exc:  # the engine's own rule, its message naming the input
        raise ProtocolError(Status.INVALID_ARGUMENT, str(exc)) from None
    except (ValueError, TypeError, OverflowError) as exc:
        # Ragged lists, values of the wrong kind or out of the datatype's range.
        raise ProtocolError(
            Status.INVALID_ARGUMENT, f"input {tensor.name!r}: bad {datatype} data: {exc}"
        ) from None
    count = math.prod(shape)
    if array.size != count:
        raise ProtocolError(
            Status.INVALID_ARGUMENT,
            f"input {tensor.name!r}: {array.size} values, shape {list(shape)} holds {count}",
        )
    return array.reshape(shape)


def _typed(
    values: _Array, dtype: np.dtype[Any], data: object = (), spec: TensorSpec | None = None
) -> _Array:
    """JSON values as the datatype takes them, as Triton does: integers for an integer
    datatype (not 1.7, 2.0 or "5"), in its range; booleans for BOOL; numbers for a float
    datatype (integers too), each within its range by ``Engine.infer``'s rule (else an
    InputValueError naming ``spec``: a value beyond it would become infinity). ``data``:
    the values as they came, if not ``values``."""
    kind = values.dtype.kind
    if values.size == 0:
        return values.astype(dtype)
    if dtype.kind == "b":
        if kind != "b":
            raise ValueError(f"the values must be JSON true or false, got {_first(values)}")
        return values
    if kind in "iuf" and _has_bool(data):  # numpy took true and false for 1 and 0
        raise ValueError("the values must be JSON numbers, got booleans")
    if kind == "O" and dtype.kind == "f" and all(type(v) in (int, float) for v in values.flat):
        values = values.astype(np.float64)  # integers beyond int64 for a float input
        kind = "f"
    if dtype.kind in "iu":
        if kind == "O" and all(type(v) is int for v in values.flat):
            raise ValueError("a value is out of the datatype's range")
        if kind not in "iu":
            raise ValueError(f"the values must be JSON integers, got {_first(values)}")
        info = np.iinfo(dtype)
        low, high = values.min(), values.max()
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise ValueError(f"{bad} is out of the datatype's range [{info.min}, {info.max}]")
    elif kind not in "iuf":
        raise ValueError(f"the values must be JSON numbers, got {_first(values)}")
    elif spec is not None:
        if values.size == math.prod(spec.shape):
            values = values.reshape(spec.shape)  # the message gives the tensor's index
        refuse_overflow(spec.name, values, dtype)
    return values.astype(dtype, copy=False)


def _has_bool(data: object, piece: int = 65536) -> bool:
    """Whether nested lists hold a boolean (a slice at a time: no long C call)."""
    if not isinstance(data, list):
        return False
    for start in range(0, len(data), piece):
        part = data[start : start + piece]
        kinds = set(map(type, part))
        if bool in kinds or (list in kinds and any(_has_bool(v) for v in part)):
            return True
    return False


def _first(values: _Array) -> str:
    """A value that does not fit, as the message shows it."""
    kind = values.dtype.kind
    if kind in "US":
        return "strings"
    if kind == "b":
        return "booleans"
    if kind == "f":
        fractional = np.flatnonzero(values != np.round(values))
        return repr(values.flat[fractional[0] if fractional.size else 0].item())
    first = values.flat[0]
    return repr(first.item() if isinstance(first, np.generic) else first)


def decode_raw(
    tensor: WireTensor, datatype: object, shape: object, raw: bytes | memoryview
) -> _Array:
    """An input from raw little-endian bytes, row-major."""
    dtype, shape = _checked_header(tensor, datatype, shape)
    count = math.prod(shape)
    if len(raw) != count * dtype.itemsize:
        raise ProtocolError(
            Status.INVALID_ARGUMENT,
            f"input {tensor.name!r}: {len(raw)} bytes of {datatype}, shape "
            f"{list(shape)} needs {count * dtype.itemsize}",
        )
    # A read-only view of the request's bytes: the engine copies it into staging and
    # never writes into an input.
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(shape)


# -- outputs ------------------------------------------------------------------------------------


def raw_bytes(array: _Array) -> bytes:
    """An output's values as the protocol's raw bytes: little-endian, row-major."""
    little = array.dtype.newbyteorder("<")
    return np.ascontiguousarray(array, dtype=little).tobytes()
