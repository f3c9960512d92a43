"""Shared test vectors: emulator loadables and inputs that every runtime must agree on.

Plain deterministic Python (a SplitMix64 generator, no numpy randomness), so the same
bytes come out on every machine and numpy version. Each :class:`Vector` is a loadable
and a few requests; a request is one raw input buffer per input tensor, in the tensor's
DLA layout, with *garbage in every padding byte* (a runtime must read elements only).

Coverage: every op (affine, mean_hw, mix); several inputs and outputs per model (for mix
in other counts and shapes than the inputs'); the formats
nchw, nhwc (padded lanes), chw16, chw32 and hwc4; padded line, surface and batch strides
and padded buffer tails; float32, float16, int8, uint8, int16 and uint16; float16 ties,
subnormals and overflow to inf; integer ties, saturation, and NaN stored as 0; for mix,
NaN and inf inputs, float outputs clamped to the finite range, integer ties.

NaN never reaches a *float* output: a NaN's sign and payload after arithmetic differ
between x86 and NVIDIA GPUs, and the format does not pin them down.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any

import numpy as np

from aiodla._tensors import TensorSpec
from aiodla.emulator._format import EmulatorModel, make_loadable, parse_loadable

__all__ = ["Vector", "element_mask", "make_request", "vectors"]


class SplitMix64:
    """A tiny, fully specified 64-bit generator (Steele, Lea and Flood's SplitMix64)."""

    def __init__(self, seed: int) -> None:
        self.state = seed & 0xFFFFFFFFFFFFFFFF

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)

    def below(self, bound: int) -> int:
        return self.next() % bound

    def uniform(self, low: float, high: float) -> float:
        return low + (high - low) * ((self.next() >> 11) / float(1 << 53))

    def raw(self, count: int) -> bytes:
        return bytes(self.next() & 0xFF for _ in range(count))


def element_mask(spec: TensorSpec) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """True for every byte of the buffer that belongs to an element (not padding)."""
    assert spec.strides is not None
    n, c, h, w = spec.shape
    pixel, line, surface, batch = spec.strides
    lanes, esize = spec.lanes, spec.numpy_dtype.itemsize
    nn, cc, hh, ww = np.meshgrid(
        np.arange(n), np.arange(c), np.arange(h), np.arange(w), indexing="ij"
    )
    offsets = nn * batch + (cc // lanes) * surface + hh * line + ww * pixel + (cc % lanes) * esize
    mask = np.zeros(spec.size, dtype=bool)
    for byte in range(esize):
        mask[offsets.ravel() + byte] = True
    return mask


# -- values ------------------------------------------------------------------------------

_FLOAT_SPECIALS = (0.0, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5, 127.5, -128.5, 1e-30, 65504.0, 65520.0)


def _half_from_bits(bits: int) -> float:
    return float(np.frombuffer(struct.pack("<H", bits), dtype=np.float16)[0])


def _float_values(rng: SplitMix64, count: int, dtype: str, *, nan: bool, inf: bool) -> list[float]:
    values: list[float] = []
    while len(values) < count:
        kind = rng.below(10)
        if kind == 0:
            value = _FLOAT_SPECIALS[rng.below(len(_FLOAT_SPECIALS))]
        elif kind == 1 and dtype == "float16":
            value = _half_from_bits(rng.below(0x400) | (rng.below(2) << 15))  # subnormals
        elif kind == 2 and dtype == "float32":
            # exactly halfway between two neighbouring float16 values: a rounding tie
            base = rng.below(0x7BFF) | (rng.below(2) << 15)
            low, high = _half_from_bits(base), _half_from_bits(base + 1)
            value = float(np.float32((low + high) / 2))
        elif kind == 3 and inf:
            value = math.inf if rng.below(2) else -math.inf
        elif kind == 4 and nan:
            value = math.nan
        elif kind == 5 and dtype == "float16":
            bits = rng.below(0x7C00) | (rng.below(2) << 15)  # any finite half
            value = _half_from_bits(bits)
        else:
            value = rng.uniform(-300.0, 300.0)
        values.append(value)
    return values


def _stored_array(
    rng: SplitMix64, spec: TensorSpec, *, nan: bool = False, inf: bool = False
) -> np.ndarray[Any, Any]:
    count = math.prod(spec.shape)
    dtype = spec.numpy_dtype
    if dtype.kind == "f":
        values = _float_values(rng, count, dtype.name, nan=nan, inf=inf)
        with np.errstate(over="ignore"):  # 65520 and beyond become inf in float16, on purpose
            return np.array(values, dtype=np.float64).astype(dtype).reshape(spec.shape)
    info = np.iinfo(dtype)
    span = int(info.max) - int(info.min) + 1
    ints = [int(info.min) + rng.below(span) for _ in range(count)]
    for index in range(min(count, 4)):  # both extremes appear in every request
        ints[index * max(count // 4, 1)] = int(info.min) if index % 2 == 0 else int(info.max)
    return np.array(ints, dtype=dtype).reshape(spec.shape)


def make_request(
    rng: SplitMix64,
    model: EmulatorModel,
    *,
    nan_inputs: frozenset[str],
    inf_inputs: frozenset[str],
    bands: int = 0,
) -> tuple[tuple[np.ndarray[Any, Any], ...], tuple[bytes, ...]]:
    """Logical arrays for every input, and the raw buffers with garbage padding; with
    ``bands``, input 0's first and last ``bands`` rows take the colour of its pixel
    (0, 0), as a letterbox's padding."""
    arrays: list[np.ndarray[Any, Any]] = []
    buffers: list[bytes] = []
    for index, spec in enumerate(model.inputs):
        array = _stored_array(rng, spec, nan=spec.name in nan_inputs, inf=spec.name in inf_inputs)
        if bands and index == 0:
            array[:, :, :bands] = array[:, :, :1, :1]
            array[:, :, array.shape[2] - bands :] = array[:, :, :1, :1]
        packed = np.array(spec.pack(array), dtype=np.uint8, copy=True)
        garbage = np.frombuffer(rng.raw(spec.size), dtype=np.uint8)
        padding = ~element_mask(spec)
        packed[padding] = garbage[padding]
        arrays.append(array)
        buffers.append(packed.tobytes())
    return tuple(arrays), tuple(buffers)


# -- the vectors -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Vector:
    """One loadable and the requests every runtime must answer with the same bytes."""

    name: str
    loadable: bytes
    model: EmulatorModel
    arrays: tuple[tuple[np.ndarray[Any, Any], ...], ...]  # per request, per input (stored dtype)
    buffers: tuple[tuple[bytes, ...], ...]  # per request, per input (DLA layout, padding garbage)

    def __repr__(self) -> str:
        return f"Vector({self.name!r}, {len(self.buffers)} requests)"


def _spec(
    name: str,
    shape: tuple[int, int, int, int],
    dtype: str,
    fmt: str,
    pad: tuple[int, int, int, int] | None = None,
) -> TensorSpec:
    """A spec whose line, surface and batch strides and tail are padded by ``pad`` bytes
    (pixel padding means extra lanes, for nhwc only)."""
    dense = TensorSpec(name, shape, dtype, fmt)
    if pad is None:
        return dense
    assert dense.strides is not None
    lanes_pad, line_pad, surface_pad, tail = pad
    esize = np.dtype(dtype).itemsize
    n, c, h, w = shape
    pixel = dense.strides[0] + lanes_pad * esize
    line = w * pixel + line_pad
    surface = h * line + surface_pad
    groups = math.ceil(c / (pixel // esize))
    batch = groups * surface + surface_pad
    extent = (n - 1) * batch + (groups - 1) * surface + (h - 1) * line + w * pixel
    return TensorSpec(
        name, shape, dtype, fmt, strides=(pixel, line, surface, batch), nbytes=extent + tail
    )


def _affine_half() -> Any:
    inputs = [_spec("x", (2, 20, 3, 5), "float16", "chw16", (0, 64, 32, 96))]
    outputs = [_spec("y", (2, 20, 3, 5), "float16", "nchw", (0, 6, 8, 10))]
    return inputs, outputs, "affine", 0.37, -1.25, frozenset(), frozenset({"x"})


def _affine_three_pairs() -> Any:
    inputs = [
        _spec("a", (1, 3, 4, 6), "float32", "nchw", (0, 8, 4, 12)),
        _spec("b", (1, 40, 2, 3), "int8", "chw32", (0, 32, 64, 7)),
        _spec("c", (1, 3, 5, 7), "uint8", "hwc4", (0, 4, 0, 3)),
    ]
    outputs = [
        _spec("a_out", (1, 3, 4, 6), "int8", "nhwc", (5, 4, 0, 1)),
        _spec("b_out", (1, 40, 2, 3), "float16", "nhwc", (8, 0, 16, 2)),
        _spec("c_out", (1, 3, 5, 7), "int16", "nchw"),
    ]
    # scale -0.5 makes every odd integer input an exact rounding tie
    return inputs, outputs, "affine", -0.5, 0.0, frozenset({"a"}), frozenset({"a"})


def _mean_four_pairs() -> Any:
    inputs = [
        _spec("p", (2, 5, 4, 6), "float16", "nhwc", (3, 2, 0, 4)),
        _spec("q", (1, 3, 7, 9), "int16", "nchw", (0, 2, 6, 0)),
        _spec("r", (1, 33, 3, 3), "int8", "chw32"),
        _spec("s", (1, 2, 3, 3), "uint16", "nhwc"),
    ]
    outputs = [
        _spec("p_mean", (2, 5, 1, 1), "float32", "nchw", (0, 4, 8, 16)),
        _spec("q_mean", (1, 3, 1, 1), "uint8", "hwc4"),
        _spec("r_mean", (1, 33, 1, 1), "float16", "chw16", (0, 0, 32, 5)),
        _spec("s_mean", (1, 2, 1, 1), "uint16", "nchw"),
    ]
    return inputs, outputs, "mean_hw", 1.7, 0.1, frozenset(), frozenset()


def _affine_saturate() -> Any:
    inputs = [
        _spec("f", (1, 4, 8, 8), "float32", "nchw"),
        _spec("g", (1, 4, 8, 8), "float16", "nchw", (0, 2, 0, 0)),
        _spec("k", (2, 3, 2, 2), "uint16", "nchw"),
    ]
    outputs = [
        _spec("f_out", (1, 4, 8, 8), "int16", "nhwc", (2, 0, 0, 8)),
        _spec("g_out", (1, 4, 8, 8), "float16", "chw16"),
        _spec("k_out", (2, 3, 2, 2), "int8", "nchw", (0, 1, 1, 1)),
    ]
    return inputs, outputs, "affine", 1e5, -3.0, frozenset({"f"}), frozenset({"f", "g"})


def _affine_ties_to_half() -> Any:
    inputs = [
        _spec("t", (1, 1, 16, 16), "float32", "nchw", (0, 4, 0, 0)),
        _spec("u", (1, 4, 3, 3), "uint8", "nhwc"),
    ]
    outputs = [
        _spec("t_out", (1, 1, 16, 16), "float16", "nchw"),
        _spec("u_out", (1, 4, 3, 3), "float32", "nhwc", (4, 0, 0, 0)),
    ]
    return inputs, outputs, "affine", 1.0, 0.0, frozenset(), frozenset()


def _mean_wide() -> Any:
    inputs = [_spec("img", (1, 4, 32, 24), "uint8", "hwc4", (0, 32, 0, 0))]
    outputs = [_spec("avg", (1, 4, 1, 1), "float16", "nhwc", (12, 0, 0, 0))]
    return inputs, outputs, "mean_hw", 1.0 / 255.0, -0.5, frozenset(), frozenset()


def _mix_heads() -> Any:
    """A detector's shape: one image in, three heads of different sizes out."""
    inputs = [_spec("image", (1, 3, 8, 10), "float16", "chw16", (0, 32, 64, 16))]
    outputs = [
        _spec("head_8", (1, 21, 4, 5), "float16", "chw16", (0, 32, 0, 8)),
        _spec("head_16", (1, 21, 2, 3), "float16", "chw16"),
        _spec("head_32", (1, 21, 1, 2), "float16", "nchw", (0, 2, 4, 6)),
    ]
    return inputs, outputs, "mix", 1.0, 0.0, frozenset(), frozenset({"image"})


def _detect_heads() -> Any:
    """Op detect: raw heads of three anchors, a sparse one (objects in a few cells)
    padded in float16 chw16, a dense one in float32 nchw (most cells hold one)."""
    inputs = [_spec("image", (1, 3, 16, 20), "float16", "chw16")]
    outputs = [
        _spec("p8", (1, 21, 8, 10), "float16", "chw16", (0, 32, 0, 8)),
        _spec("p16", (1, 24, 2, 3), "float32", "nchw", (0, 4, 8, 12)),
    ]
    return inputs, outputs, "detect", 1.0, 0.0, frozenset(), frozenset({"image"})


def _detect_letterboxed() -> Any:
    """Op detect over an image whose top and bottom rows are uniform, as a letterbox's
    padding (``_BANDS``): no object in the cells there; chw16 input and heads."""
    inputs = [_spec("image", (1, 3, 32, 24), "float16", "chw16")]
    outputs = [
        _spec("p4", (1, 21, 8, 6), "float16", "chw16"),
        _spec("p8", (1, 24, 4, 3), "float32", "nchw"),
    ]
    return inputs, outputs, "detect", 1.0, 0.0, frozenset(), frozenset()


def _detect_inputs() -> Any:
    """Op detect with two inputs, heights and widths no multiple of the digest's 8-grid,
    two images in input 1 and padded strides: the digest's grid and its indices ``j``
    (the element's index in the whole tensor) across inputs, channels and images."""
    inputs = [
        _spec("image", (1, 3, 17, 12), "float16", "chw16", (0, 32, 64, 16)),
        _spec("extra", (2, 5, 9, 11), "uint8", "nchw", (0, 4, 8, 3)),
    ]
    outputs = [_spec("p4", (1, 21, 5, 3), "float32", "nhwc", (2, 0, 0, 0))]
    return inputs, outputs, "detect", 1.0, 0.0, frozenset(), frozenset()


# Vectors whose input 0 is letterboxed: rows of padding at its top and bottom.
_BANDS = {"detect_letterboxed": 9}


def _mix_every_type() -> Any:
    """Six inputs of the six types in every format, NaN and inf among the floats (mix
    reads bits, never arithmetic on them), into outputs of every type."""
    inputs = [
        _spec("f32", (1, 3, 4, 5), "float32", "nchw", (0, 8, 4, 12)),
        _spec("f16", (2, 5, 3, 2), "float16", "nhwc", (3, 2, 0, 4)),
        _spec("i16", (1, 2, 3, 7), "int16", "nchw"),
        _spec("i8", (1, 40, 2, 3), "int8", "chw32", (0, 32, 64, 7)),
        _spec("u8", (1, 3, 5, 7), "uint8", "hwc4", (0, 4, 0, 3)),
        _spec("u16", (1, 2, 3, 3), "uint16", "nhwc"),
    ]
    outputs = [
        _spec("o_f32", (1, 7, 1, 1), "float32", "nhwc", (4, 0, 0, 0)),
        _spec("o_f16", (1, 33, 2, 2), "float16", "chw16", (0, 0, 32, 5)),
        _spec("o_i8", (1, 33, 3, 1), "int8", "chw32"),
        _spec("o_u8", (1, 4, 3, 3), "uint8", "hwc4", (0, 4, 0, 0)),
        _spec("o_i16", (2, 3, 2, 2), "int16", "nhwc", (2, 0, 0, 8)),
        _spec("o_u16", (1, 1, 5, 5), "uint16", "nchw", (0, 2, 2, 2)),
        _spec("o_f16b", (1, 1000, 1, 1), "float16", "nchw"),
    ]
    return inputs, outputs, "mix", 1.0, 0.0, frozenset({"f32", "f16"}), frozenset({"f32", "f16"})


def _mix_ties_and_saturation() -> Any:
    """scale -2.5, bias 0.5: every even integer draw is a rounding tie, int8 and uint8
    saturate at both ends, float16 rounds to nearest even."""
    inputs = [
        _spec("a", (1, 2, 3, 3), "int8", "nchw"),
        _spec("b", (1, 3, 2, 2), "float32", "nhwc", (1, 0, 0, 0)),
    ]
    outputs = [
        _spec("t_i8", (1, 6, 5, 5), "int8", "nchw"),
        _spec("t_u8", (1, 6, 5, 5), "uint8", "nhwc"),
        _spec("t_i16", (1, 2, 9, 9), "int16", "nchw"),
        _spec("t_u16", (1, 2, 9, 9), "uint16", "nchw"),
        _spec("t_f16", (1, 16, 4, 4), "float16", "chw16"),
    ]
    return inputs, outputs, "mix", -2.5, 0.5, frozenset(), frozenset()


def _mix_clamped() -> Any:
    """scale 1e5: float16 outputs clamp to +-65504 (never inf), integers saturate."""
    inputs = [_spec("x", (1, 4, 4, 4), "uint16", "nchw")]
    outputs = [
        _spec("c_f16", (1, 4, 6, 6), "float16", "nchw"),
        _spec("c_f32", (1, 4, 6, 6), "float32", "nchw"),
        _spec("c_i16", (1, 4, 6, 6), "int16", "nchw"),
    ]
    return inputs, outputs, "mix", 1e5, -3.0, frozenset(), frozenset()


_BUILDERS: tuple[tuple[str, Any], ...] = (
    ("affine_half_chw16", _affine_half),
    ("affine_three_pairs", _affine_three_pairs),
    ("mean_hw_four_pairs", _mean_four_pairs),
    ("affine_saturate", _affine_saturate),
    ("affine_ties_to_half", _affine_ties_to_half),
    ("mean_hw_wide_image", _mean_wide),
    ("mix_detector_heads", _mix_heads),
    ("mix_every_type", _mix_every_type),
    ("mix_ties_and_saturation", _mix_ties_and_saturation),
    ("mix_clamped", _mix_clamped),
    ("detect_heads", _detect_heads),
    ("detect_letterboxed", _detect_letterboxed),
    ("detect_inputs", _detect_inputs),
)


def vectors(requests: int = 3, latency: float = 0.0) -> list[Vector]:
    """Every vector, with ``requests`` requests each; ``latency`` is the model's service time."""
    result: list[Vector] = []
    for index, (name, builder) in enumerate(_BUILDERS):
        inputs, outputs, op, scale, bias, nan_inputs, inf_inputs = builder()
        loadable = make_loadable(inputs, outputs, op, latency, scale=scale, bias=bias)
        model = parse_loadable(loadable)
        rng = SplitMix64(0xA10D1A00 + index)
        arrays, buffers = [], []
        for _ in range(requests):
            request_arrays, request_buffers = make_request(
                rng, model, nan_inputs=nan_inputs, inf_inputs=inf_inputs, bands=_BANDS.get(name, 0)
            )
            arrays.append(request_arrays)
            buffers.append(request_buffers)
        result.append(Vector(name, loadable, model, tuple(arrays), tuple(buffers)))
    return result
