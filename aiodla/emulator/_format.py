"""The emulator loadable: a small binary model format for machines without a DLA.

Both the emulated runtime and the GPU stand-in ``libcudla.so.1`` read it, byte for
byte the same. Everything is little-endian; offsets are in bytes from the start.

Header (64 bytes)::

    offset  type      field
    0       char[8]   magic, the ASCII bytes "AIODLAEM" (no terminator)
    8       uint32    version, 1
    12      uint32    header_size, 64 (bytes before the parameters)
    16      uint32    num_inputs,  1..64
    20      uint32    num_outputs, 1..64; affine and mean_hw: equal to num_inputs
    24      uint32    op: 1 = affine, 2 = mean_hw, 3 = mix, 4 = detect
    28      uint32    param_count, 2
    32      float64   latency: seconds one task occupies one DLA core, 0 <= latency <= 3600
    40      uint64    total_size: the exact length of the whole loadable
    48      uint64    compute_size: bytes of the compute reference at the end, 0 for none
    56      uint64    reserved, 0

Then ``param_count`` float64 parameters at offset ``header_size``: ``scale``, ``bias``.

Then ``num_inputs + num_outputs`` tensor records of 168 bytes each, inputs first, at
offset ``header_size + 8 * param_count``. A record is C's
``cudlaModuleTensorDescriptor`` exactly (natural alignment, no packing pragma)::

    0    char[81]     name, NUL-terminated inside the 81 bytes, non-empty,
                      printable ASCII, unique among all tensors of the loadable
    88   uint64       size   (bytes of the tensor's buffer)
    96   uint64       n
    104  uint64       c
    112  uint64       h
    120  uint64       w
    128  uint8        dataFormat   (NCHW 1, NHWC 2, NCxHWx 3)
    129  uint8        dataType     (FLOAT 1, HALF 2, INT16 3, INT8 4, UINT8 5, UINT16 6)
    130  uint8        dataCategory (IMAGE 0, FEATURE 2)
    131  uint8        pixelFormat
    132  uint8        pixelMapping (pitch linear 0)
    136  uint32[8]    stride: pixel, line, surface, batch strides in bytes, then 4 zeros

Bytes 81..87 and 133..135 are padding and are written as zero.
``total_size == header_size + 8 * param_count + 168 * (num_inputs + num_outputs)
+ compute_size``.

The compute piece (optional, the last ``compute_size`` bytes) is either a compute
reference, 1..1024 bytes of ASCII text ``module:function`` naming a Python callable
that computes the outputs instead of the op (``aiodla emulate --compute``), or an
ONNX network: the five bytes ``\0ONNX`` then the serialized ModelProto (at most 1 GiB
in all), which onnxruntime runs instead of the op (``aiodla compile --emulate``; see
``aiodla.emulator._onnx``). An ONNX network is data that onnxruntime interprets, so it
needs no trust, but it must hold its weights (no external data files). Only the
emulated runtime runs a compute piece. It imports a reference's callable when it loads
the module (see ``aiodla.emulator._compute``), and only when the user trusts the file
(``trust_compute=True``): a loadable is data, and importing a module runs its code, so
an untrusted one is refused. The GPU stand-in, written for loadables without one,
refuses a loadable that has one.
Element addressing inside a tensor's buffer is the one formula of ``aiodla._tensors``::

    offset(n, c, h, w) = n*stride[3] + (c / L)*stride[2] + h*stride[1] + w*stride[0]
                         + (c % L)*E      where E = element size, L = stride[0] / E

Operations are defined on *logical* elements (the layout's padding is never read) and
on the *stored* values (integer tensors are not dequantized; the DLA knows no scales).
Arithmetic is IEEE binary64 with no fused multiply-add. ``affine`` and ``mean_hw`` pair
input i with output i:

- ``affine``: ``y = (scale * x) + bias`` elementwise; output shape == input shape.
- ``mean_hw``: ``s`` = the sum of ``x[n, c]`` over h then w, in row-major order,
  sequentially: the first element, then each next one added to the running sum;
  ``m = s / (h * w)``; ``y = (scale * m) + bias``; output shape ``(n, c, 1, 1)``.

``mix`` takes any number of inputs and outputs of any shapes: every output element
depends on every input element's bits and on its own position. All integers below are
uint64 with wrapping arithmetic (mod 2**64); ``G = 0x9E3779B97F4A7C15`` and
``F(z)`` is SplitMix64's finalizer::

    F(z):  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
           z = (z ^ (z >> 27)) * 0x94D049BB133111EB
           return z ^ (z >> 31)

1. For input ``t`` (0-based), ``j`` runs over its elements in row-major ``(n, c, h,
   w)`` order from 0; ``b[t, j]`` is the element's stored bits as an unsigned integer
   of the element's width (float32: its 32 bits; float16: 16 bits; int8 and int16: two's
   complement, so -1 is 0xFF and 0xFFFF); ``s[t] = F(0x41494F444C41 + t)`` and the weight
   ``w[t, j] = F(s[t] + (j + 1) * G) | 1`` (odd). ``S[t] = sum over j of b[t, j] * w[t,
   j]``, an order-free sum: one changed element changes ``S[t]``, as its weight is odd.
2. The digest: ``D = 0``; for ``t = 0, 1, ...``: ``D = F(D + S[t] + G)``.
3. For output ``o`` (0-based), ``K[o] = F(D + (o + 1) * 0xD1B54A32D192ED03)``; element
   ``i`` (row-major, from 0) draws ``r = F(K[o] + (i + 1) * G)``, keeps its top 16
   bits ``k = r >> 48`` and takes ``v``: float types ``v = k * 2**-15 - 1`` (exact, in
   [-1, 1)); int8 ``(k >> 8) - 128``; uint8 ``k >> 8``; int16 ``k - 32768``; uint16 ``k``.
4. ``y = (scale * v) + bias``; for float outputs ``y`` is then clamped to the type's
   finite range ([-65504, 65504] for float16, +-FLT_MAX for float32), so ``mix``
   outputs are never inf or NaN.

With the defaults ``scale = 1, bias = 0``, float outputs lie in [-1, 1) and integer
outputs cover their type's range. One changed input bit changes ``D`` and so every
output's draws; equal outputs are then chance (about 1 in 256 for 8-bit types).

``y`` is then stored in the output's type: float types round to nearest even (directly
from binary64); integer types round half to even, saturate to the type's range, and
store 0 for NaN. Every output depends on its own request's inputs only.

``detect`` (any inputs; outputs of shape (1, 3*(5+k), H, W), float) draws as ``mix``
does, one draw per cell of three anchors, and writes raw YOLOv5-style heads with a few
objects each, none in cells that input 0 shows as letterbox padding
(``aiodla.emulator._detector`` gives the arithmetic). Its digest reads the inputs on a
grid: in step 1, ``S[t]`` sums only over the elements whose ``h`` and ``w`` are both
multiples of 8 (``j`` still the element's index in the whole tensor, so the weights
are mix's), one element in 64 of an image, which is what keeps an emulated detector's
task cheap for the host. A frame changed only between the grid's points keeps its
objects. ``scale`` and ``bias`` are unused. The GPU stand-in runs it too, byte for byte.
"""

from __future__ import annotations

import dataclasses
import math
import re
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._descriptors import NAME_MAX_BYTES, TensorDescriptor
from .._errors import LoadableFormatError, ModelError
from .._tensors import TensorSpec, specs_by_name
from ._detect_heads import check_detect_outputs

__all__ = [
    "AUTO",
    "DESCRIPTOR_DTYPE",
    "HEADER_SIZE",
    "MAGIC",
    "OPS",
    "RECORD_SIZE",
    "EmulatorModel",
    "fitting_op",
    "is_emulator_loadable",
    "make_loadable",
    "parse_loadable",
]

MAGIC = b"AIODLAEM"
VERSION = 1
HEADER_SIZE = 64
RECORD_SIZE = 168
MAX_TENSORS = 64
MAX_LATENCY = 3600.0
OPS = {"affine": 1, "mean_hw": 2, "mix": 3, "detect": 4}
# make_loadable's default: affine or mean_hw when the shapes fit, else mix.
AUTO = "auto"
_OP_NAMES = {code: name for name, code in OPS.items()}
_PARAM_NAMES = ("scale", "bias")

_HEADER = struct.Struct("<8sIIIIIIdQQQ")
assert _HEADER.size == HEADER_SIZE

# The record as numpy sees it: identical to cuda.bindings.cudla.module_tensor_descriptor_dtype.
DESCRIPTOR_DTYPE: np.dtype[Any] = np.dtype(
    {  # type: ignore[call-overload,unused-ignore]  # numpy >= 2.5's stubs refuse the dict form
        "names": [
            "name",
            "size_",
            "n",
            "c",
            "h",
            "w",
            "data_format",
            "data_type",
            "data_category",
            "pixel_format",
            "pixel_mapping",
            "stride",
        ],
        "formats": [
            ("i1", (81,)),
            "<u8",
            "<u8",
            "<u8",
            "<u8",
            "<u8",
            "u1",
            "u1",
            "u1",
            "u1",
            "u1",
            ("<u4", (8,)),
        ],
        "offsets": [0, 88, 96, 104, 112, 120, 128, 129, 130, 131, 132, 136],
        "itemsize": RECORD_SIZE,
    }
)


@dataclasses.dataclass(frozen=True)
class EmulatorModel:
    """A parsed emulator loadable."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    op: str
    latency: float
    scale: float = 1.0
    bias: float = 0.0
    compute: str | None = None  # the compute reference, "module:function"
    onnx: bytes | None = dataclasses.field(default=None, repr=False)  # an ONNX network

    @property
    def descriptors(self) -> tuple[tuple[TensorDescriptor, ...], tuple[TensorDescriptor, ...]]:
        return (
            tuple(spec.to_descriptor() for spec in self.inputs),
            tuple(spec.to_descriptor() for spec in self.outputs),
        )


def is_emulator_loadable(data: bytes | bytearray | memoryview) -> bool:
    """True when ``data`` starts with the emulator loadable's magic."""
    return bytes(data[: len(MAGIC)]) == MAGIC


def stated_latency(data: bytes | bytearray | memoryview) -> float | None:
    """The seconds per task an emulator loadable states; None for any other loadable
    (a real DLA loadable states none: its service time is learned by running it)."""
    return parse_loadable(data).latency if is_emulator_loadable(data) else None


def _check_op(op: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> None:
    if op not in OPS:
        raise ModelError(f"op {op!r} is unknown; expected one of {sorted(OPS)}")
    if not inputs or not outputs:
        raise ModelError(f"op {op!r} needs at least one input and one output")
    if len(inputs) > MAX_TENSORS or len(outputs) > MAX_TENSORS:
        raise ModelError(f"at most {MAX_TENSORS} inputs and {MAX_TENSORS} outputs")
    specs_by_name([*inputs, *outputs])
    if op == "mix":
        return  # any counts, any shapes
    if op == "detect":
        check_detect_outputs(outputs)
        return
    if len(inputs) != len(outputs):
        raise ModelError(
            f"op {op!r} pairs input i with output i: got {len(inputs)} inputs and "
            f"{len(outputs)} outputs"
        )
    for source, target in zip(inputs, outputs, strict=True):
        expected = _paired_shape(op, source)
        if target.shape != expected:
            raise ModelError(
                f"op {op!r}: output {target.name!r} must have shape {expected} for input "
                f"{source.name!r} of shape {source.shape}, got {target.shape}"
            )


def _paired_shape(op: str, source: TensorSpec) -> tuple[int, ...]:
    return source.shape if op == "affine" else (*source.shape[:2], 1, 1)


def fitting_op(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> str:
    """The op ``op="auto"`` picks: ``affine`` when every output has its input's shape,
    ``mean_hw`` when every output is its input's NxCx1x1, else ``mix`` (any I/O)."""
    if len(inputs) == len(outputs):
        for op in ("affine", "mean_hw"):
            if all(y.shape == _paired_shape(op, x) for x, y in zip(inputs, outputs, strict=True)):
                return op
    return "mix"


def make_loadable(
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    op: str = AUTO,
    latency: float = 0.001,
    *,
    scale: float = 1.0,
    bias: float = 0.0,
    compute: str | None = None,
    onnx: bytes | None = None,
) -> bytes:
    """Build emulator loadable bytes (see the module docstring for the format).

    ``inputs`` and ``outputs`` are TensorSpecs; ``op`` is ``"affine"`` or ``"mean_hw"``
    (output i from input i), ``"mix"`` (any I/O), or ``"auto"``: the first of those the
    shapes fit (:func:`fitting_op`). ``latency`` is the seconds one task occupies one
    core; ``scale`` and ``bias`` parametrize the op. ``compute`` (``"module:function"``)
    is a compute reference: the emulated runtime imports that callable and lets it
    compute the outputs (the op is then unused); ``onnx`` (a serialized ONNX model)
    instead makes onnxruntime compute them.
    """
    inputs, outputs = tuple(inputs), tuple(outputs)
    for spec in (*inputs, *outputs):
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"inputs and outputs must be TensorSpec, got {type(spec).__name__}")
    if op == AUTO:
        op = fitting_op(inputs, outputs)
    _check_op(op, inputs, outputs)
    latency = float(latency)
    if not (math.isfinite(latency) and 0 <= latency <= MAX_LATENCY):
        raise ModelError(f"latency={latency!r} must be seconds in [0, {MAX_LATENCY}]")
    params = (float(scale), float(bias))
    for name, value in zip(_PARAM_NAMES, params, strict=True):
        if not math.isfinite(value):
            raise ModelError(f"{name}={value!r} must be finite")
    count = len(inputs) + len(outputs)
    if compute is not None and onnx is not None:
        raise ModelError("a loadable carries a compute reference or an ONNX network, not both")
    reference = _compute_piece(compute) if onnx is None else _onnx_piece(onnx)
    total = HEADER_SIZE + 8 * len(params) + RECORD_SIZE * count + len(reference)
    header = _HEADER.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        len(inputs),
        len(outputs),
        OPS[op],
        len(params),
        latency,
        total,
        len(reference),
        0,
    )
    records = np.zeros(count, dtype=DESCRIPTOR_DTYPE)
    for record, spec in zip(records, (*inputs, *outputs), strict=True):
        desc = spec.to_descriptor()
        _check_fits_record(desc)
        encoded = desc.name.encode("ascii")
        record["name"][: len(encoded)] = np.frombuffer(encoded, dtype=np.int8)
        record["size_"] = desc.size
        record["n"], record["c"], record["h"], record["w"] = desc.n, desc.c, desc.h, desc.w
        record["data_format"] = desc.data_format
        record["data_type"] = desc.data_type
        record["data_category"] = desc.data_category
        record["pixel_format"] = desc.pixel_format
        record["pixel_mapping"] = desc.pixel_mapping
        record["stride"] = desc.stride
    data = header + struct.pack(f"<{len(params)}d", *params) + records.tobytes() + reference
    assert len(data) == total
    return data


def _check_fits_record(desc: TensorDescriptor) -> None:
    """Every number of ``desc`` fits its field of the C record (a large tensor's strides
    outgrow uint32); numpy would otherwise raise a bare OverflowError."""
    for field in DESCRIPTOR_DTYPE.names[1:]:  # type: ignore[index]
        kind = DESCRIPTOR_DTYPE.fields[field][0].base  # type: ignore[index]
        value = getattr(desc, "size" if field == "size_" else field)
        values = enumerate(value) if field == "stride" else [(None, value)]
        for index, number in values:
            if not 0 <= number <= np.iinfo(kind).max:
                where = field if index is None else f"{field}[{index}]"
                raise ModelError(
                    f"tensor {desc.name!r}: {where} = {number} does not fit the emulator "
                    f"loadable's {kind.name} field (at most {np.iinfo(kind).max}); the tensor "
                    "is too large for the format"
                )


def _fail(problem: str) -> LoadableFormatError:
    return LoadableFormatError(f"not a valid emulator loadable: {problem}")


def _read_record(raw: np.void, index: int) -> TensorDescriptor:
    name_bytes = raw["name"].tobytes()
    end = name_bytes.find(b"\0")
    if end < 0:
        raise _fail(f"tensor record {index}: name is not NUL-terminated within 81 bytes")
    name = name_bytes[:end]
    if not name or end > NAME_MAX_BYTES or not all(0x20 < b < 0x7F for b in name):
        raise _fail(f"tensor record {index}: name {name!r} must be 1-80 printable ASCII bytes")
    return TensorDescriptor(
        name=name.decode("ascii"),
        size=int(raw["size_"]),
        n=int(raw["n"]),
        c=int(raw["c"]),
        h=int(raw["h"]),
        w=int(raw["w"]),
        data_format=int(raw["data_format"]),
        data_type=int(raw["data_type"]),
        data_category=int(raw["data_category"]),
        pixel_format=int(raw["pixel_format"]),
        pixel_mapping=int(raw["pixel_mapping"]),
        stride=tuple(int(s) for s in raw["stride"]),
    )


# Shapes larger than this cannot be real DLA tensors (the DLA caps c, h, w at 8192).
_MAX_DIM = 1 << 16
_MAX_TENSOR_BYTES = 1 << 34


def parse_loadable(data: bytes | bytearray | memoryview) -> EmulatorModel:
    """Parse emulator loadable bytes; malformed or hostile bytes raise LoadableFormatError.

    Every size is checked against ``len(data)`` before it is used, so no read goes out
    of bounds whatever the header claims.
    """
    data = bytes(data)
    if len(data) < HEADER_SIZE:
        raise _fail(f"{len(data)} bytes is shorter than the {HEADER_SIZE}-byte header")
    (
        magic,
        version,
        header_size,
        num_inputs,
        num_outputs,
        op_code,
        param_count,
        latency,
        total_size,
        compute_size,
        reserved1,
    ) = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise _fail(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise _fail(f"version {version} is not supported (this aiodla reads version {VERSION})")
    if header_size != HEADER_SIZE:
        raise _fail(f"header_size {header_size}, expected {HEADER_SIZE}")
    if reserved1:
        raise _fail("reserved header fields must be zero")
    if compute_size > MAX_ONNX_PIECE:
        raise _fail(f"compute_size {compute_size} is beyond {MAX_ONNX_PIECE} bytes")
    if not (1 <= num_inputs <= MAX_TENSORS and 1 <= num_outputs <= MAX_TENSORS):
        raise _fail(
            f"tensor counts {num_inputs} inputs / {num_outputs} outputs must each be "
            f"1..{MAX_TENSORS}"
        )
    if op_code not in _OP_NAMES:
        raise _fail(f"op code {op_code} is unknown; expected one of {sorted(_OP_NAMES)}")
    if param_count != len(_PARAM_NAMES):
        raise _fail(f"param_count {param_count}, expected {len(_PARAM_NAMES)}")
    if not (math.isfinite(latency) and 0 <= latency <= MAX_LATENCY):
        raise _fail(f"latency {latency!r} must be seconds in [0, {MAX_LATENCY}]")
    records_at = header_size + 8 * param_count
    records_end = records_at + RECORD_SIZE * (num_inputs + num_outputs)
    expected = records_end + compute_size
    if total_size != expected:
        raise _fail(f"total_size {total_size} does not match the {expected} bytes its counts need")
    if len(data) != expected:
        raise _fail(f"{len(data)} bytes, but its header describes {expected} (truncated or padded)")
    scale, bias = struct.unpack_from("<2d", data, header_size)
    if not (math.isfinite(scale) and math.isfinite(bias)):
        raise _fail(f"parameters scale={scale!r} bias={bias!r} must be finite")
    records = np.frombuffer(
        data, dtype=DESCRIPTOR_DTYPE, count=num_inputs + num_outputs, offset=records_at
    )
    descriptors = [_read_record(records[i], i) for i in range(len(records))]
    for desc in descriptors:
        if max(desc.n, desc.c, desc.h, desc.w) > _MAX_DIM or desc.size > _MAX_TENSOR_BYTES:
            raise _fail(f"tensor {desc.name!r}: dimensions or size beyond any DLA tensor")
    try:
        specs = [TensorSpec.from_descriptor(desc) for desc in descriptors]
    except ModelError as exc:
        raise _fail(str(exc)) from None
    inputs, outputs = tuple(specs[:num_inputs]), tuple(specs[num_inputs:])
    op = _OP_NAMES[op_code]
    try:
        _check_op(op, inputs, outputs)
    except ModelError as exc:
        raise _fail(str(exc)) from None
    piece = data[records_end:]
    compute = network = None
    if piece.startswith(ONNX_MARK):
        network = piece[len(ONNX_MARK) :]
        if not network:
            raise _fail("the ONNX piece is empty")
    elif compute_size:
        if compute_size > MAX_COMPUTE_REFERENCE:
            raise _fail(
                f"compute reference of {compute_size} bytes is beyond {MAX_COMPUTE_REFERENCE}"
            )
        compute = _read_compute(piece)
    return EmulatorModel(
        inputs, outputs, op, float(latency), float(scale), float(bias), compute=compute,
        onnx=network,
    )  # fmt: skip


# -- the compute reference: the loadable's one optional trailing piece -----------------------

MAX_COMPUTE_REFERENCE = 1024
ONNX_MARK = b"\0ONNX"  # a reference is printable ASCII: it never starts with NUL
MAX_ONNX_PIECE = 1 << 30


def _onnx_piece(network: bytes) -> bytes:
    """The trailing bytes that carry an ONNX network."""
    if not isinstance(network, (bytes, bytearray)) or not network:
        raise ModelError("onnx= must be the non-empty bytes of a serialized ONNX model")
    if len(ONNX_MARK) + len(network) > MAX_ONNX_PIECE:
        raise ModelError(f"an ONNX network of {len(network)} bytes is beyond the format's 1 GiB")
    return ONNX_MARK + bytes(network)


def _compute_piece(compute: str | None) -> bytes:
    """The trailing bytes that carry a compute reference (none for None)."""
    if compute is None:
        return b""
    if not isinstance(compute, str) or not is_compute_reference(compute):
        raise ModelError(
            f"compute={compute!r} must be a reference 'module:function' (ASCII, dotted "
            f"names, at most {MAX_COMPUTE_REFERENCE} bytes)"
        )
    return compute.encode("ascii")


def _read_compute(piece: bytes) -> str:
    try:
        text = piece.decode("ascii")
    except UnicodeDecodeError:
        raise _fail("the compute reference is not ASCII") from None
    if not is_compute_reference(text):
        raise _fail(f"compute reference {text!r} is not 'module:function'")
    return text


_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_REFERENCE = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*")


def is_compute_reference(text: str) -> bool:
    """Whether ``text`` is a compute reference ``module:function`` (dotted names)."""
    return len(text) <= MAX_COMPUTE_REFERENCE and _REFERENCE.fullmatch(text) is not None
