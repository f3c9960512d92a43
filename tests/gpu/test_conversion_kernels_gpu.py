"""The NVRTC conversion kernels on the GPU, byte for byte against ``TensorSpec.pack`` /
``unpack`` (numpy): every (format, dtype, direction) pair, every source and result
dtype, strided sources, padded layouts, and the values where conversions differ:
ties, saturation, infinities, float16 subnormals and overflow, NaN payloads, -0.0."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodla import _descriptors
from aiodla._tensors import TensorSpec

cp = pytest.importorskip("cupy")

from aiodla.runtime._conversion_kernels import ConversionKernels  # noqa: E402

# One NVRTC program holds every case's kernels (about a thousand): its compile can
# take a minute, inside the first test's time.
pytestmark = pytest.mark.timeout(300)

FORMATS = ("nchw", "nhwc", "chw16", "chw32", "hwc4")
PAIRS = [(f, d) for f in FORMATS for d in sorted(_descriptors._ACCEPTED_DTYPES[f])]
SOURCES = (
    "float64",
    "float32",
    "float16",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "bool",
)


def make_spec(fmt: str, dtype: str, padded: bool, scale: float) -> TensorSpec:
    n, c, h, w = 2, (4 if fmt == "hwc4" else 19), 5, 7
    esize = np.dtype(dtype).itemsize
    quantized = np.dtype(dtype).kind in "iu"
    if not padded:
        return TensorSpec("t", (n, c, h, w), dtype, fmt, scale=scale if quantized else None)
    lanes = {"nchw": 1, "chw16": 16, "chw32": 32, "hwc4": 4}.get(fmt, c + 3)
    pixel, groups = lanes * esize, -(-c // lanes)
    line = w * pixel + 6 * esize
    surface = h * line + 10 * esize
    batch = groups * surface + 32
    extent = (n - 1) * batch + (groups - 1) * surface + (h - 1) * line + w * pixel
    return TensorSpec(
        "t",
        (n, c, h, w),
        dtype,
        fmt,
        strides=(pixel, line, surface, batch),
        nbytes=extent + 13,
        scale=scale if quantized else None,
    )


CASES = [
    (fmt, dtype, padded, scale)
    for fmt, dtype in PAIRS
    for padded in (False, True)
    for scale in ((0.0123, 2.0**-4) if np.dtype(dtype).kind in "iu" else (1.0,))
]


def sources(spec: TensorSpec) -> list[np.dtype[Any]]:
    if spec.is_integer:
        return [
            np.dtype(d) for d in SOURCES if np.dtype(d).kind == "f" or np.can_cast(d, spec.dtype)
        ]
    return [np.dtype(d) for d in SOURCES]


def results(spec: TensorSpec) -> list[np.dtype[Any]]:
    extra = ("float16", "float32", "float64") if spec.is_integer else ("float32", "float64")
    return [spec.numpy_dtype] + [
        np.dtype(d)
        for d in extra
        if np.dtype(d) != spec.numpy_dtype and (spec.is_integer or np.can_cast(spec.numpy_dtype, d))
    ]


def values(
    spec: TensorSpec, dtype: np.dtype[Any], rng: np.random.Generator
) -> np.ndarray[Any, Any]:
    count = int(np.prod(spec.shape))
    if dtype.kind == "f":
        scale = spec.scale or 1.0
        ties = (np.arange(-140, 140) + 0.5) * scale  # x.5 / scale: ties to even, saturation
        specials = [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            65504.0,
            65505.0,
            65519.99,
            65520.0,
            -65520.0,
            1e5,
            2.0**-24,
            2.0**-25,
            2.0**-25 * 1.5,
            -(2.0**-24) * 3.5,
            6.1e-5,
            1e-40,
            1e-310,
            1e39,
            -1e39,
            300.0 * scale,
            -300.0 * scale,
            127.5 * scale,
            -128.5 * scale,
        ]
        data = np.concatenate([specials, ties, rng.standard_normal(count) * 100 * scale])[:count]
        rng.shuffle(data)
        with np.errstate(over="ignore"):
            array = data.astype(dtype)
        if not spec.is_integer:  # NaN with payloads, quiet and signaling, both signs
            raw = array.view(f"u{dtype.itemsize}")
            nans = {
                2: [0x7C01, 0xFE01, 0x7D55, 0x7E00],
                4: [0x7F800001, 0xFFA00000, 0x7FC12345, 0x7F802000],
                8: [0x7FF0000000000001, 0xFFF4000000000000, 0x7FF8123456789ABC, 0x7FF0000020000000],
            }
            raw[:4] = nans[dtype.itemsize]
        return array.reshape(spec.shape)
    if dtype == np.bool_:
        return (rng.integers(0, 2, count) == 1).reshape(spec.shape)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, count, endpoint=True).astype(dtype).reshape(spec.shape)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> ConversionKernels:
    packs, unpacks = [], []
    for case in CASES:
        spec = make_spec(*case)
        packs += [(spec, d) for d in sources(spec)]
        unpacks += [(spec, d) for d in results(spec)]
    cache = tmp_path_factory.mktemp("kernels")
    first = ConversionKernels.compile(packs, unpacks, cache_dir=cache)
    assert not first.compiled_from_cache
    second = ConversionKernels.compile(packs, unpacks, cache_dir=cache)
    assert second.compiled_from_cache
    return second


def strided(array: np.ndarray[Any, Any], kind: int) -> Any:
    """The same logical array on the device, as a contiguous, transposed or sliced view."""
    if kind == 0:
        return cp.asarray(array)
    if kind == 1:  # NHWC storage seen as NCHW, channels reversed
        base = cp.asarray(np.ascontiguousarray(array[:, ::-1].transpose(0, 2, 3, 1)))
        return base.transpose(0, 3, 1, 2)[:, ::-1]
    # every other column and row of a larger array
    n, c, h, w = array.shape
    big = np.zeros((n, c + 1, 2 * h, 3 * w), array.dtype)
    big[:, 1:, ::2, ::3] = array
    return cp.asarray(big)[:, 1:, ::2, ::3]


@pytest.mark.usefixtures("real_gpu")
@pytest.mark.parametrize(("fmt", "dtype", "padded", "scale"), CASES)
def test_pack_and_unpack_match_numpy(
    kernels: ConversionKernels, fmt: str, dtype: str, padded: bool, scale: float
) -> None:
    spec = make_spec(fmt, dtype, padded, scale)
    rng = np.random.default_rng(len(fmt) * 100 + np.dtype(dtype).itemsize * 10 + padded)
    stream = cp.cuda.Stream(non_blocking=True)
    # Every fill, copy and launch on the kernel's own stream: cupy's default
    # stream does not order itself with a non-blocking stream, so a fill made
    # there could land after the kernel's stores (as it did under the sanitizer).
    with stream:
        for source in sources(spec):
            array = values(spec, source, rng)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected = spec.pack(array, validate=False).tobytes()
            for kind in range(3):
                view = strided(array, kind)
                assert cp.asnumpy(view).tobytes() == array.tobytes()
                steps = tuple(s // source.itemsize for s in view.strides)
                for offset in (0, spec.numpy_dtype.itemsize):  # vector and element stores
                    out = cp.full(spec.size + 64, 0xAB, cp.uint8)
                    kernels.pack(
                        spec, source, view.data.ptr, steps, out.data.ptr + offset, stream.ptr
                    )
                    stream.synchronize()
                    got = cp.asnumpy(out)
                    assert got[:offset].tolist() == [0xAB] * offset
                    assert got[offset + spec.size :].tolist() == [0xAB] * (64 - offset)
                    assert got[offset : offset + spec.size].tobytes() == expected, (
                        source,
                        kind,
                        offset,
                    )
        raw = np.frombuffer(rng.bytes(spec.size), np.uint8)
        device_raw = cp.asarray(raw)
        for result in results(spec):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                expected_array = spec.unpack(raw, dequantize=result.kind == "f", dtype=result)
            out = cp.zeros(spec.shape, result)
            kernels.unpack(spec, result, device_raw.data.ptr, out.data.ptr, stream.ptr)
            stream.synchronize()
            assert cp.asnumpy(out).tobytes() == expected_array.tobytes(), result


@pytest.mark.usefixtures("real_gpu")
def test_big_tensors_and_fast_paths(tmp_path: Path) -> None:
    """The benchmark's shapes, whose tiles and grids differ from the tiny cases."""
    image = TensorSpec("images", (1, 3, 640, 640), "float16", "chw16")
    head = TensorSpec("head", (1, 255, 80, 80), "float16", "chw16")
    q = TensorSpec("q", (1, 64, 40, 40), "int8", "chw32", scale=0.02)
    packs = [(image, np.dtype("float32")), (image, np.dtype("uint8")), (q, np.dtype("float32"))]
    unpacks = [(head, np.dtype("float16")), (head, np.dtype("float32")), (q, np.dtype("float32"))]
    kernels = ConversionKernels.compile(packs, unpacks, cache_dir=tmp_path)
    rng = np.random.default_rng(3)
    stream = cp.cuda.Stream(non_blocking=True)
    # Every fill, copy and launch on the kernel's own stream: cupy's default
    # stream does not order itself with a non-blocking stream, so a fill made
    # there could land after the kernel's stores (as it did under the sanitizer).
    with stream:
        for spec, source in packs:
            array = values(spec, source, rng)
            device = cp.asarray(array)
            out = cp.full(spec.size, 0xAB, cp.uint8)
            steps = tuple(s // source.itemsize for s in device.strides)
            kernels.pack(spec, source, device.data.ptr, steps, out.data.ptr, stream.ptr)
            stream.synchronize()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert cp.asnumpy(out).tobytes() == spec.pack(array, validate=False).tobytes()
        for spec, result in unpacks:
            raw = np.frombuffer(rng.bytes(spec.size), np.uint8)
            out = cp.zeros(spec.shape, result)
            kernels.unpack(spec, result, cp.asarray(raw).data.ptr, out.data.ptr, stream.ptr)
            stream.synchronize()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert cp.asnumpy(out).tobytes() == spec.unpack(raw, dtype=result).tobytes()
