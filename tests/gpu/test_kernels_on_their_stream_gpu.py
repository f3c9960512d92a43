"""aiodla's GPU kernels run on the stream they are given, after that stream's earlier work.

In hybrid mode the DLA task reads the packed input on the slot's stream: a pack kernel
launched on another stream, or returning before its work is ordered on the given one,
would let the task read half-packed bytes. Each test here puts a kernel ahead of the
launch, on the given stream, that waits 50 ms and only then writes the input, then waits
for the given stream alone; a kernel of aiodla's that ran anywhere but after it reads
the input's earlier bytes (zeros), and its output differs from what numpy makes of the
late bytes.

Every kernel is launched once beforehand (``warm_up``): with CUDA's lazy module loading
(the default since CUDA 12.2) a function's first launch loads it, and loading may wait
for the kernels already running on the device, so a first launch on a wrong stream
would still start after the 50 ms kernel and the test could not fail. Without that
warm-up, an H100 showed no overlap at all. Each test then checks that this GPU runs a
warmed kernel on a second stream beside the waiting one (``require_overlap``), and
skips, saying so, where it does not (a time-sliced virtual GPU, say).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiodla import ImagePreprocess
from aiodla._tensors import TensorSpec

cp = pytest.importorskip("cupy")

from aiodla.runtime._conversion_kernels import ConversionKernels  # noqa: E402
from aiodla.runtime._preprocess_kernels import PreprocessKernels  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("real_gpu")]

LATE_NS = 50_000_000  # far longer than any launch's own latency
LATE_BYTE = 0x3C  # float16 0x3C3C = 1.0586, a normal number that every path keeps

_LATE_FILL = r"""
extern "C" __global__ void late_fill(unsigned char* data, unsigned long long n,
                                     unsigned long long wait_ns, unsigned char value) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < wait_ns);
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) data[i] = value;
}
"""


@pytest.fixture(scope="module")
def late_fill() -> Any:
    return cp.RawKernel(_LATE_FILL, "late_fill")


def fill_late(kernel: Any, buffer: Any) -> None:
    """Enqueue on the current cupy stream: wait LATE_NS, then set every byte of
    ``buffer`` to LATE_BYTE."""
    kernel(
        (1,), (256,), (buffer, np.uint64(buffer.nbytes), np.uint64(LATE_NS), np.uint8(LATE_BYTE))
    )


def require_overlap(kernel: Any, kernels: ConversionKernels, spec: TensorSpec) -> None:
    """Skip unless this GPU runs a warmed conversion launched on a second non-blocking
    stream while LATE_NS of late_fill runs on the first: it must read the early bytes.
    Where streams do not overlap, a kernel on the wrong stream would still read the late
    bytes, and these tests could not fail."""
    half = np.dtype("float16")
    first, second = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with first:
        logical = cp.zeros(spec.shape, cp.float16)
        packed = cp.full(spec.size, 0xAB, cp.uint8)
        first.synchronize()
        fill_late(kernel, logical.view(cp.uint8))
    steps = tuple(s // half.itemsize for s in logical.strides)
    kernels.pack(spec, half, logical.data.ptr, steps, packed.data.ptr, second.ptr)
    second.synchronize()
    first.synchronize()
    early = spec.pack(np.zeros(spec.shape, np.float16)).tobytes()
    if cp.asnumpy(packed).tobytes() != early:
        pytest.skip("kernels on two streams did not overlap on this GPU: stream order unseen")


def warm_up(kernel: Any, *launches: Any) -> None:
    """Launch late_fill and each of ``launches`` (callables taking a stream pointer) once,
    and wait: every function is loaded before the tests time anything."""
    scratch = cp.cuda.Stream(non_blocking=True)
    with scratch:
        buffer = cp.zeros(16, cp.uint8)
        kernel((1,), (32,), (buffer, np.uint64(16), np.uint64(0), np.uint8(LATE_BYTE)))
    for launch in launches:
        launch(scratch.ptr)
    scratch.synchronize()


def late_bytes(shape: tuple[int, ...], dtype: Any) -> np.ndarray[Any, Any]:
    count = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(bytes([LATE_BYTE]) * count, np.uint8).view(dtype).reshape(shape)


def test_pack_and_unpack_follow_their_stream(late_fill: Any, tmp_path: Path) -> None:
    spec = TensorSpec("t", (1, 19, 5, 7), "float16", "chw16")
    half = np.dtype("float16")
    kernels = ConversionKernels.compile([(spec, half)], [(spec, half)], cache_dir=tmp_path)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        logical = cp.zeros(spec.shape, cp.float16)
        packed = cp.zeros(spec.size, cp.uint8)
        raw = cp.zeros(spec.size, cp.uint8)
        unpacked = cp.zeros(spec.shape, cp.float16)
        stream.synchronize()
    steps = tuple(s // half.itemsize for s in logical.strides)
    warm_up(
        late_fill,
        lambda on: kernels.pack(spec, half, logical.data.ptr, steps, packed.data.ptr, on),
        lambda on: kernels.unpack(spec, half, raw.data.ptr, unpacked.data.ptr, on),
    )
    require_overlap(late_fill, kernels, spec)
    with stream:
        fill_late(late_fill, logical.view(cp.uint8))
        kernels.pack(spec, half, logical.data.ptr, steps, packed.data.ptr, stream.ptr)
        fill_late(late_fill, raw)
        kernels.unpack(spec, half, raw.data.ptr, unpacked.data.ptr, stream.ptr)
        stream.synchronize()
    expected_packed = spec.pack(late_bytes(spec.shape, half), validate=False).tobytes()
    assert cp.asnumpy(packed).tobytes() == expected_packed
    expected_unpacked = spec.unpack(late_bytes((spec.size,), np.uint8), dtype=half).tobytes()
    assert cp.asnumpy(unpacked).tobytes() == expected_unpacked


def test_preprocess_follows_its_stream(late_fill: Any, tmp_path: Path) -> None:
    spec = TensorSpec("images", (1, 3, 32, 32), "float16", "chw16")
    pre = ImagePreprocess(source="bgr", order="rgb", resize="letterbox")
    kernels = PreprocessKernels.compile([(spec, pre)], cache_dir=tmp_path)
    height, width = 18, 32
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        frame = cp.zeros((height, width, 3), cp.uint8)
        out = cp.zeros(spec.size, cp.uint8)
        stream.synchronize()
    warm_up(
        late_fill,
        lambda on: kernels.launch(spec, frame.data.ptr, height, width, width * 3, out.data.ptr, on),
    )
    probe = TensorSpec("probe", (1, 16, 1, 8), "float16", "chw16")
    half = np.dtype("float16")
    conversions = ConversionKernels.compile([(probe, half)], [], cache_dir=tmp_path / "probe")
    with stream:
        logical = cp.zeros(probe.shape, cp.float16)
        packed = cp.zeros(probe.size, cp.uint8)
        stream.synchronize()
    steps = tuple(s // half.itemsize for s in logical.strides)
    warm_up(
        late_fill,
        lambda on: conversions.pack(probe, half, logical.data.ptr, steps, packed.data.ptr, on),
    )
    require_overlap(late_fill, conversions, probe)
    with stream:
        fill_late(late_fill, frame)
        kernels.launch(spec, frame.data.ptr, height, width, width * 3, out.data.ptr, stream.ptr)
        stream.synchronize()
    late_frame = late_bytes((height, width, 3), np.uint8)
    assert cp.asnumpy(out).tobytes() == spec.pack(pre.apply(late_frame, spec)).tobytes()
