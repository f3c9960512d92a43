"""The fused pre-processing kernels on the GPU, byte for byte against
``spec.pack(pre.apply(frame, spec))`` (numpy): the CPU tests' cases (every source
format (nv12 and i420 included), both orders, letterbox/stretch/None, float16 chw16, float32 nchw, int8 chw32,
uint8 hwc4, float16 nhwc; downscales, odd sizes, upscales) with frames in device memory
whose rows are pitched, and the detector's 1920x1080 BGR, nv12 and i420 into 640x640
FP16 CHW16."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodla import ImagePreprocess
from aiodla._tensors import TensorSpec

cp = pytest.importorskip("cupy")

from aiodla.runtime._preprocess_kernels import PreprocessKernels  # noqa: E402

# The case table and frame maker are the CPU tests' own, so both paths check the same.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from test_preprocess_kernels import CASES, frame_for  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("real_gpu")]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> PreprocessKernels:
    targets = [(spec, pre) for spec, pre, _ in CASES]
    cache = tmp_path_factory.mktemp("kernels")
    first = PreprocessKernels.compile(targets, cache_dir=cache)
    assert not first.compiled_from_cache
    second = PreprocessKernels.compile(targets, cache_dir=cache)
    assert second.compiled_from_cache
    return second


def run_device(
    kernels: PreprocessKernels,
    spec: TensorSpec,
    frame: Any,
    size: tuple[int, int],
    offset: int,
    stream: Any,
) -> bytes:
    """The kernel's bytes at ``offset`` into a poisoned device buffer; the frame goes to
    the device with its row pitch kept (the view's rows are further apart than a row)."""
    base = frame.base if frame.base is not None else frame
    while base.base is not None:
        base = base.base
    device = cp.asarray(base)  # the whole pitched allocation
    pitch = device.strides[0]
    # (numpy gives a one-row view the stride of its row's bytes: the pitch is moot there)
    assert pitch == frame.strides[0] or frame.shape[0] == 1
    out = cp.full(spec.size + 64, 0xAB, cp.uint8)  # cupy allocations are 256-byte aligned
    kernels.launch(spec, device.data.ptr, *size, pitch, out.data.ptr + offset, stream.ptr)
    stream.synchronize()
    got = cp.asnumpy(out)
    assert (got[:offset] == 0xAB).all() and (got[offset + spec.size :] == 0xAB).all()
    return got[offset : offset + spec.size].tobytes()


@pytest.mark.parametrize("case", range(len(CASES)), ids=[spec.name for spec, _, _ in CASES])
def test_matches_numpy(kernels: PreprocessKernels, case: int) -> None:
    spec, pre, sizes = CASES[case]
    rng = np.random.default_rng(case)
    stream = cp.cuda.Stream(non_blocking=True)
    # Every fill, copy and launch on the kernel's own stream: cupy's default
    # stream does not order itself with a non-blocking stream, so a fill made
    # there could land after the kernel's stores (as it did under the sanitizer).
    with stream:
        for size in sizes:
            frame = frame_for(pre, size, rng)
            expected = spec.pack(pre.apply(frame, spec)).tobytes()
            for offset in (0, spec.numpy_dtype.itemsize):  # vector and element stores
                assert run_device(kernels, spec, frame, size, offset, stream) == expected, (
                    size,
                    offset,
                )


@pytest.mark.parametrize("source", ["bgr", "nv12", "i420"])
def test_full_hd_into_a_640_detector(tmp_path: Path, source: Any) -> None:
    """A 1920x1080 camera frame as each decoder gives it (OpenCV's BGR, NVDEC's nv12,
    FFmpeg's i420) into the detector's 640x640 FP16 CHW16."""
    spec = TensorSpec("images", (1, 3, 640, 640), "float16", "chw16")
    pre = ImagePreprocess(
        source=source, order="rgb", resize="letterbox", mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
    )  # fmt: skip
    kernels = PreprocessKernels.compile([(spec, pre)], cache_dir=tmp_path)
    rng = np.random.default_rng(1080)
    shape = (1080, 1920, 3) if source == "bgr" else (1620, 1920)
    frame = rng.integers(0, 256, shape, np.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    # Every fill, copy and launch on the kernel's own stream: cupy's default
    # stream does not order itself with a non-blocking stream, so a fill made
    # there could land after the kernel's stores (as it did under the sanitizer).
    with stream:
        device = cp.asarray(frame)
        out = cp.full(spec.size, 0xAB, cp.uint8)
        pitch = frame.strides[0]
        kernels.launch(spec, device.data.ptr, 1080, 1920, pitch, out.data.ptr, stream.ptr)
        stream.synchronize()
        assert cp.asnumpy(out).tobytes() == spec.pack(pre.apply(frame, spec)).tobytes()
